"""Discord attachments and reply context end to end: fake Discord (REST, gateway, CDN
attachment URLs) <- real discord.py client in the DiscordAdapter <- the real GatewayApp ->
fake model."""

from __future__ import annotations

import base64
from typing import Any

import pytest

from adapters.discord_bot import DiscordAdapter
from gateway.build import build_gateway
from gateway.runtime import GatewayApp
from tenancy.keys import tenant_dir
from tests.fakes.discord_api import FakeDiscord
from tests.fakes.llm import image_urls, last_user_text
from tests.media_files import pdf, png


@pytest.fixture
async def fake():
    async with FakeDiscord() as f:
        f.guild = f.add_guild("Hermes Lab")
        f.general = f.channel_named(f.guild, "general")
        f.alice = f.add_user("alice")
        f.bob = f.add_user("bob")
        yield f


@pytest.fixture
async def rig(fake, config_for):
    apps: list[GatewayApp] = []

    async def build(**sections: Any) -> GatewayApp:
        cfg = config_for(
            platforms={"discord": {"enabled": True, "api_base": fake.api_base, "gateway_url": fake.gateway_url}},
            **sections,
        )
        adapter = DiscordAdapter(cfg.platforms.discord, fake.token, ready_timeout=10, guild_ready_timeout=0.05)
        app = build_gateway(cfg, [adapter])
        await app.start()
        apps.append(app)
        return app

    yield build
    for app in apps:
        await app.stop(drain_timeout=5)


async def replies(fake: FakeDiscord, app: GatewayApp, channel_id: str, n: int) -> list[dict]:
    await fake.wait_until(lambda: len(fake.sent_messages(channel_id)) >= n, 20)
    assert await app.drain(20)
    return fake.sent_messages(channel_id)


async def test_discord_image_attachment_reaches_the_model_as_an_image_part(rig, fake, fake_llm):
    app = await rig(llm={"vision": True})
    image = png(5, 5, (10, 200, 10))
    channel = fake.dm_channel(fake.alice)
    fake.push_dm(
        fake.alice, "what is in this picture?", attachments=[fake.attachment(channel, "cat.png", image, "image/png")]
    )
    await replies(fake, app, channel, 1)
    [request] = fake_llm.requests
    [url] = image_urls(request)
    assert base64.b64decode(url.split(",", 1)[1]) == image
    assert fake.attachment_downloads and all(d["authorization"] is None for d in fake.attachment_downloads)
    media = tenant_dir(app.cfg.data_dir, f"discord-{fake.alice}") / "media"
    assert [p.read_bytes() for p in media.iterdir() if not p.name.startswith(".")] == [image]


async def test_discord_pdf_text_reaches_the_model(rig, fake, fake_llm):
    app = await rig()
    channel = fake.dm_channel(fake.alice)
    fake.push_dm(
        fake.alice, "", attachments=[fake.attachment(channel, "notes.pdf", pdf("Gate code 8812"), "application/pdf")]
    )
    await replies(fake, app, channel, 1)
    assert "Gate code 8812" in last_user_text(fake_llm.requests[-1])


async def test_discord_over_limit_attachment_is_refused_without_download(rig, fake, fake_llm):
    app = await rig(limits={"max_attachment_bytes": 100})
    channel = fake.dm_channel(fake.alice)
    fake.push_dm(fake.alice, "", attachments=[fake.attachment(channel, "huge.txt", b"x" * 500, "text/plain")])
    [answer] = await replies(fake, app, channel, 1)
    assert "huge.txt" in answer["content"] and "too large" in answer["content"]
    assert not fake.attachment_downloads and not fake_llm.requests


async def test_discord_reply_to_another_member_carries_the_quoted_text(rig, fake, fake_llm):
    app = await rig()
    theirs = fake.push_guild_message(fake.general, fake.bob, "launch is on the 14th")  # not for the bot
    fake.push_guild_message(fake.general, fake.alice, "is that still true?", mention_bot=True, reply_to=theirs["id"])
    await replies(fake, app, fake.general, 1)
    text = last_user_text(fake_llm.requests[-1])
    assert '[In reply to Bob: "launch is on the 14th"]' in text and text.endswith("is that still true?")
