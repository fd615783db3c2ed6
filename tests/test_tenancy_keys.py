"""Session keys, lanes, tenant ids, tenant directories and identity links (tenancy/)."""

from __future__ import annotations

import dataclasses
import json
import os
import re
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from core.lanes import Lane
from core.messages import InboundMessage
from core.settings import TenancyConfig
from tenancy.identity import IdentityLinks
from tenancy.keys import (
    chat_tenant_id,
    escape_key_component,
    link_tenant_id,
    person_tenant_id,
    resolve_lane,
    session_key,
    tenant_dir,
    tenant_dir_name,
)

# --- helpers ----------------------------------------------------------------------------


def msg(
    chat_type: str = "dm",
    chat_id: str = "111",
    user_id: str = "111",
    thread_id: str | None = None,
    platform: str = "telegram",
) -> InboundMessage:
    return InboundMessage(
        platform=platform,
        chat_id=chat_id,
        chat_type=chat_type,
        thread_id=thread_id,
        user_id=user_id,
        message_id="1",
        text="hi",
    )


def cfg(**kw) -> TenancyConfig:
    return TenancyConfig(**kw)


NO_LINKS = IdentityLinks({})

CONFIGS = [
    cfg(),
    cfg(group_sessions_per_user=False),
    cfg(thread_sessions_per_user=True),
    cfg(group_sessions_per_user=False, thread_sessions_per_user=True),
]

# --- the key table ----------------------------------------------------------------------

KEY_TABLE = [
    # (id, message, config, expected key)
    ("dm", msg("dm", "111", "111"), cfg(), "agent:main:telegram:dm:111"),
    (
        "dm-discord",
        msg("dm", "900", "222", platform="discord"),
        cfg(),
        "agent:main:discord:dm:900",
    ),
    (
        "group-per-user-default",
        msg("group", "-100123", "111"),
        cfg(),
        "agent:main:telegram:group:-100123:111",
    ),
    (
        "group-shared",
        msg("group", "-100123", "111"),
        cfg(group_sessions_per_user=False),
        "agent:main:telegram:group:-100123",
    ),
    (
        "channel-like-group-per-user",
        msg("channel", "-100999", "111"),
        cfg(),
        "agent:main:telegram:group:-100999:111",
    ),
    (
        "channel-like-group-shared",
        msg("channel", "-100999", "111"),
        cfg(group_sessions_per_user=False),
        "agent:main:telegram:group:-100999",
    ),
    (
        "telegram-topic-shared-default",
        msg("thread", "-100123", "111", thread_id="42"),
        cfg(),
        "agent:main:telegram:group:-100123:42",
    ),
    (
        "telegram-topic-per-user",
        msg("thread", "-100123", "111", thread_id="42"),
        cfg(thread_sessions_per_user=True),
        "agent:main:telegram:group:-100123:42:111",
    ),
    (
        "discord-thread-shared",
        msg("thread", "1100000000000000001", "222", thread_id="1200000000000000002", platform="discord"),
        cfg(),
        "agent:main:discord:group:1100000000000000001:1200000000000000002",
    ),
    (
        "discord-thread-per-user",
        msg("thread", "1100000000000000001", "222", thread_id="1200000000000000002", platform="discord"),
        cfg(thread_sessions_per_user=True),
        "agent:main:discord:group:1100000000000000001:1200000000000000002:222",
    ),
    (
        "thread-shared-even-when-groups-shared",
        msg("thread", "-100123", "111", thread_id="42"),
        cfg(group_sessions_per_user=False),
        "agent:main:telegram:group:-100123:42",
    ),
    (
        "discord-guild-channel-per-user",
        msg("group", "1100000000000000001", "222", platform="discord"),
        cfg(),
        "agent:main:discord:group:1100000000000000001:222",
    ),
]


@pytest.mark.parametrize("m,c,expected", [r[1:] for r in KEY_TABLE], ids=[r[0] for r in KEY_TABLE])
def test_session_key_table(m, c, expected):
    assert session_key(m, c) == expected
    assert resolve_lane(m, c, NO_LINKS).session_key == expected


def test_dm_key_ignores_thread_id():
    assert session_key(msg("dm", "111", "111", thread_id="7"), cfg()) == "agent:main:telegram:dm:111"


def test_thread_without_thread_id_falls_back_to_group_rules():
    m = msg("thread", "-100123", "111", thread_id=None)
    assert session_key(m, cfg()) == "agent:main:telegram:group:-100123:111"
    assert session_key(m, cfg(group_sessions_per_user=False)) == "agent:main:telegram:group:-100123"


def test_hostile_ids_are_percent_encoded_in_keys():
    # chat "a:b" + user "c" must not collide with chat "a" + user "b:c"
    k1 = session_key(msg("group", "a:b", "c"), cfg())
    k2 = session_key(msg("group", "a", "b:c"), cfg())
    assert k1 != k2
    assert k1 == "agent:main:telegram:group:a%3Ab:c"
    assert k2 == "agent:main:telegram:group:a:b%3Ac"
    assert session_key(msg("dm", "50%", "1"), cfg()) == "agent:main:telegram:dm:50%25"
    assert session_key(msg("dm", "a\nb", "1"), cfg()) == "agent:main:telegram:dm:a%0Ab"
    assert escape_key_component("-100123") == "-100123"
    assert escape_key_component("Ünïcode name") == "Ünïcode name"


def test_group_per_user_and_thread_shared_differ_by_tenant():
    # The table gives the same shape to group:<chat>:<user> and group:<chat>:<thread>; the
    # lane (tenant, key) pair still tells them apart.
    c = cfg()
    a = resolve_lane(msg("group", "-100123", "5"), c, NO_LINKS)
    b = resolve_lane(msg("thread", "-100123", "9", thread_id="5"), c, NO_LINKS)
    assert a.session_key == b.session_key
    assert (a.tenant_id, a.session_key) != (b.tenant_id, b.session_key)


# --- tenants ----------------------------------------------------------------------------


def test_tenant_id_builders():
    assert person_tenant_id("telegram", "111") == "telegram-111"
    assert chat_tenant_id("telegram", "-100123") == "telegram-chat--100123"
    assert link_tenant_id("alice") == "link-alice"
    assert person_tenant_id("discord", "222") == "discord-222"


def test_tenant_dm():
    lane = resolve_lane(msg("dm", "111", "111"), cfg(), NO_LINKS)
    assert lane == Lane(
        session_key="agent:main:telegram:dm:111",
        tenant_id="telegram-111",
        kind="person",
        principal="telegram:111",
        personal_memory="full",
    )


def test_tenant_group_per_user():
    lane = resolve_lane(msg("group", "-100123", "111"), cfg(), NO_LINKS)
    assert lane.tenant_id == "telegram-111"
    assert lane.kind == "person"
    assert lane.principal == "telegram:111"
    assert lane.personal_memory == "full"


def test_tenant_group_shared():
    c = cfg(group_sessions_per_user=False)
    a = resolve_lane(msg("group", "-100123", "111"), c, NO_LINKS)
    b = resolve_lane(msg("group", "-100123", "333"), c, NO_LINKS)
    assert a.tenant_id == b.tenant_id == "telegram-chat--100123"
    assert a.session_key == b.session_key
    assert a.kind == "chat"
    assert a.principal == "telegram:111" and b.principal == "telegram:333"
    assert a.personal_memory == "full"  # the chat's own memory


def test_tenant_thread_shared_and_per_user_discord():
    m = msg("thread", "1100000000000000001", "222", thread_id="1200000000000000002", platform="discord")
    shared = resolve_lane(m, cfg(), NO_LINKS)
    assert shared.kind == "chat"
    # the chat tenant is the parent channel
    assert shared.tenant_id == "discord-chat-1100000000000000001"
    per_user = resolve_lane(m, cfg(thread_sessions_per_user=True), NO_LINKS)
    assert per_user.kind == "person"
    assert per_user.tenant_id == "discord-222"


def test_shared_lane_never_uses_links():
    links = IdentityLinks({"alice": ["telegram:111"]})
    lane = resolve_lane(msg("group", "-100123", "111"), cfg(group_sessions_per_user=False), links)
    assert lane.tenant_id == "telegram-chat--100123"
    assert lane.kind == "chat"


def test_linked_identity_shares_a_tenant_across_platforms():
    c = cfg(identity_links={"alice": ["telegram:111", "discord:222"]})
    links = IdentityLinks.from_config(c)
    tg_dm = resolve_lane(msg("dm", "111", "111"), c, links)
    dc_dm = resolve_lane(msg("dm", "900", "222", platform="discord"), c, links)
    tg_group = resolve_lane(msg("group", "-100123", "111"), c, links)
    dc_thread = resolve_lane(
        msg("thread", "1100", "222", thread_id="1200", platform="discord"),
        c.model_copy(update={"thread_sessions_per_user": True}),
        links,
    )
    assert {tg_dm.tenant_id, dc_dm.tenant_id, tg_group.tenant_id, dc_thread.tenant_id} == {"link-alice"}
    # keys (conversations) still differ; only the profile is shared
    assert len({tg_dm.session_key, dc_dm.session_key, tg_group.session_key}) == 3
    assert tg_dm.principal == "telegram:111" and dc_dm.principal == "discord:222"
    # someone else is not affected
    assert resolve_lane(msg("dm", "333", "333"), c, links).tenant_id == "telegram-333"


@pytest.mark.parametrize("mode", ["full", "read", "off"])
def test_personal_memory_modes(mode):
    c = cfg(personal_memory_in_groups=mode)
    assert resolve_lane(msg("dm", "111", "111"), c, NO_LINKS).personal_memory == "full"
    group = resolve_lane(msg("group", "-100123", "111"), c, NO_LINKS)
    assert group.personal_memory == mode
    assert group.tenant_id == "telegram-111"  # history still lives with the person
    per_user_thread = resolve_lane(
        msg("thread", "-100123", "111", thread_id="42"),
        c.model_copy(update={"thread_sessions_per_user": True}),
        NO_LINKS,
    )
    assert per_user_thread.personal_memory == mode
    shared = resolve_lane(
        msg("group", "-100123", "111"),
        c.model_copy(update={"group_sessions_per_user": False}),
        NO_LINKS,
    )
    assert shared.kind == "chat" and shared.personal_memory == "full"
    shared_thread = resolve_lane(msg("thread", "-100123", "111", thread_id="42"), c, NO_LINKS)
    assert shared_thread.kind == "chat" and shared_thread.personal_memory == "full"


def test_lane_is_frozen():
    lane = resolve_lane(msg(), cfg(), NO_LINKS)
    with pytest.raises(dataclasses.FrozenInstanceError):
        lane.tenant_id = "other"  # type: ignore[misc]


def test_tenant_ids_never_collide_across_kinds():
    # a hostile user id cannot impersonate a chat tenant, and no platform can fake a link
    assert person_tenant_id("console", "chat-5") != chat_tenant_id("console", "5")
    assert person_tenant_id("link", "alice") != link_tenant_id("alice")
    assert person_tenant_id("a-b", "c") != person_tenant_id("a", "b-c")
    assert person_tenant_id("telegram", "chat") == "telegram-chat"  # only "chat-" is special


# --- tenant directory names -------------------------------------------------------------


def test_dir_names_examples():
    assert tenant_dir_name("alice") == "alice"
    assert tenant_dir_name("a" * 64) == "a" * 64
    assert tenant_dir_name("telegram-111") == "x-telegram-111"
    assert tenant_dir_name("telegram-chat--100123") == "x-telegram-chat--100123"
    assert tenant_dir_name("link-alice") == "x-link-alice"
    assert tenant_dir_name("Telegram-1") != tenant_dir_name("telegram-1")
    assert tenant_dir_name("Telegram-1").lower() != tenant_dir_name("telegram-1").lower()
    for bad in ["", ".", "..", "/", "\\", "\x00", "../etc", "a/b", "-rf", ".hidden", "a" * 65]:
        name = tenant_dir_name(bad)
        assert re.fullmatch(r"[a-z0-9_][a-z0-9_-]*", name), (bad, name)
    long = tenant_dir_name("telegram-" + "9" * 500)
    assert long.startswith("h-") and len(long) <= 200


def test_dir_name_rejects_non_strings():
    with pytest.raises(TypeError):
        tenant_dir_name(None)  # type: ignore[arg-type]


def test_tenant_dir_layout_and_escape_check(tmp_path):
    assert tenant_dir(tmp_path, "telegram-111") == tmp_path / "profiles" / "x-telegram-111"
    assert tenant_dir(tmp_path, "alice") == tmp_path / "profiles" / "alice"
    # a profile directory that is a symlink out of profiles/ is refused
    (tmp_path / "profiles").mkdir()
    (tmp_path / "elsewhere").mkdir()
    os.symlink(tmp_path / "elsewhere", tmp_path / "profiles" / "evil")
    with pytest.raises(ValueError):
        tenant_dir(tmp_path, "evil")


# --- hypothesis: hostile ids ------------------------------------------------------------

HOSTILE_CHARS = "./\\\x00-_:%aAzZ09é\u202e\u200b \n~ßİı" + "\ud800"
hostile_text = st.one_of(
    st.text(max_size=80),
    st.text(alphabet=HOSTILE_CHARS, max_size=40),
    st.text(alphabet=HOSTILE_CHARS, min_size=100, max_size=400),
    st.text(alphabet=st.characters(), min_size=60, max_size=300),
    st.sampled_from(["", ".", "..", "/", "\\", "\x00", "../..", "CON", "nul", "-", "--", "x-", "h-"]),
    st.from_regex(r"[a-z0-9_]{1,70}", fullmatch=True),
    st.from_regex(r"(telegram|discord|link)-(chat-)?-?[0-9]{1,20}", fullmatch=True),
    st.from_regex(r"x-[a-z0-9_-]{0,30}", fullmatch=True),
)

PROP = settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@PROP
@given(hostile_text, hostile_text)
def test_dir_name_injective_pairs(a, b):
    if a != b:
        assert tenant_dir_name(a) != tenant_dir_name(b)
        # and on a case-insensitive filesystem
        assert tenant_dir_name(a).casefold() != tenant_dir_name(b).casefold()


@PROP
@given(st.sets(hostile_text, min_size=1, max_size=60))
def test_dir_name_injective_sets(ids):
    names = {tenant_dir_name(i) for i in ids}
    assert len(names) == len(ids)
    assert len({n.casefold() for n in names}) == len(ids)


@PROP
@given(hostile_text)
def test_dir_name_is_path_safe(tid):
    name = tenant_dir_name(tid)
    assert name not in ("", ".", "..")
    assert not name.startswith((".", "-"))
    assert "/" not in name and "\\" not in name and "\x00" not in name
    assert len(name.encode()) <= 200
    assert re.fullmatch(r"[a-z0-9_-]+", name)


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("data")


@PROP
@given(tid=hostile_text)
def test_tenant_dir_never_leaves_profiles(data_dir, tid):
    d = tenant_dir(data_dir, tid)
    profiles = (data_dir / "profiles").resolve()
    assert d.resolve().parent == profiles
    assert d.parent == data_dir / "profiles"


@PROP
@given(st.from_regex(r"[a-z0-9_]{1,64}", fullmatch=True))
def test_plain_ids_map_to_themselves(tid):
    assert tenant_dir_name(tid) == tid


def test_hostile_directories_created_for_real(tmp_path):
    ids = [
        "",
        ".",
        "..",
        "/",
        "\\",
        "\x00",
        "../../etc/passwd",
        "a/../..",
        "telegram-111",
        "Telegram-111",
        "TELEGRAM-111",
        "telegram_111",
        "telegram-chat--100123",
        "telegram--chat--100123",
        "link-alice",
        "link-Alice",
        "x-telegram-111",
        "x-_54elegram-111",
        "h-abc",
        "é",
        "e\u0301",
        "İ",
        "i̇",
        "ß",
        "ss",
        "SS",
        "a" * 64,
        "a" * 65,
        "a" * 300,
        "a" * 300 + "-",
        "-" * 300,
        "\ud800",
        "\u202e",
        " ",
        "con",
        "CON",
        "alice",
        "bob_",
        "_",
        "x",
        "x-",
        "h-",
        "%2F",
        "a%2Fb",
        "a:b",
    ]
    assert len(set(ids)) == len(ids)
    profiles = tmp_path / "profiles"
    profiles.mkdir()
    made = set()
    for tid in ids:
        d = tenant_dir(tmp_path, tid)
        d.mkdir()  # would fail if two ids shared a directory
        (d / "tenant.json").write_text(json.dumps({"tenant_id": tid}, ensure_ascii=True))
        assert d.resolve().parent == profiles.resolve()
        made.add(d.name)
    assert len(made) == len(ids)
    assert sorted(p.name for p in profiles.iterdir()) == sorted(made)
    assert len({n.casefold() for n in made}) == len(ids)
    # nothing was created outside profiles/
    assert sorted(p.name for p in tmp_path.iterdir()) == ["profiles"]
    for tid in ids:
        stored = json.loads((tenant_dir(tmp_path, tid) / "tenant.json").read_text())
        assert stored["tenant_id"] == tid


# --- hypothesis: session keys and tenant ids are injective ------------------------------

ids = st.one_of(
    st.text(max_size=12),
    st.text(alphabet=":%ab1-\x00\n/", max_size=8),
    st.from_regex(r"-?[0-9]{1,4}", fullmatch=True),
)
platforms = st.one_of(st.sampled_from(["telegram", "discord", "console"]), st.text(alphabet=":%a-L", max_size=4))


@st.composite
def messages(draw):
    chat_type = draw(st.sampled_from(["dm", "group", "thread", "channel"]))
    thread_id = draw(ids) if chat_type == "thread" else draw(st.one_of(st.none(), ids))
    return msg(
        chat_type,
        draw(ids),
        draw(ids),
        thread_id=thread_id,
        platform=draw(platforms),
    )


def key_identity(m: InboundMessage, c: TenancyConfig) -> tuple:
    """What the session key encodes, per the table (channel == group; DMs keyed by chat)."""
    if m.chat_type == "dm":
        return ("dm", m.platform, m.chat_id)
    if m.chat_type == "thread" and m.thread_id is not None:
        return ("thread", m.platform, m.chat_id, m.thread_id, m.user_id if c.thread_sessions_per_user else None)
    return ("group", m.platform, m.chat_id, m.user_id if c.group_sessions_per_user else None)


def lane_identity(m: InboundMessage, c: TenancyConfig) -> tuple:
    """What makes a lane: the key's identity plus, in a DM, the person it belongs to."""
    ident = key_identity(m, c)
    return (*ident, m.user_id) if ident[0] == "dm" else ident


def key_shape(ident: tuple) -> tuple:
    """Lanes of one shape in the table; group-per-user and thread-shared share a shape."""
    if ident[0] == "dm":
        return ("dm",)
    n = sum(x is not None for x in ident[3:])
    return ("group", n)


@PROP
@given(st.sampled_from(CONFIGS), st.lists(messages(), min_size=1, max_size=40))
def test_session_key_injective(c, batch):
    seen: dict[str, tuple] = {}
    for m in batch:
        ident = key_identity(m, c)
        key = session_key(m, c)
        if key in seen and seen[key] != ident:
            # only the table's own shape overlap may coincide, never within a shape
            assert key_shape(seen[key]) == key_shape(ident)
            assert {seen[key][0], ident[0]} == {"group", "thread"}, (seen[key], ident, key)
        seen.setdefault(key, ident)
    # the lane pair (tenant, key) is injective across all shapes
    pairs: dict[tuple[str, str], tuple] = {}
    for m in batch:
        lane = resolve_lane(m, c, NO_LINKS)
        ident = lane_identity(m, c)
        assert pairs.setdefault((lane.tenant_id, lane.session_key), ident) == ident


@PROP
@given(st.sampled_from(CONFIGS), messages(), messages())
def test_session_key_injective_pairs(c, a, b):
    ia, ib = key_identity(a, c), key_identity(b, c)
    ka, kb = session_key(a, c), session_key(b, c)
    if ia == ib:
        assert ka == kb
    elif not ({ia[0], ib[0]} == {"group", "thread"} and key_shape(ia) == key_shape(ib)):
        assert ka != kb  # everything but the table's own group/thread shape overlap
    ia, ib = lane_identity(a, c), lane_identity(b, c)
    la, lb = resolve_lane(a, c, NO_LINKS), resolve_lane(b, c, NO_LINKS)
    assert ((la.tenant_id, la.session_key) == (lb.tenant_id, lb.session_key)) == (ia == ib)


@PROP
@given(
    st.lists(
        st.one_of(
            st.tuples(st.just("person"), platforms, ids),
            st.tuples(st.just("chat"), platforms, ids),
            st.tuples(st.just("link"), ids),
        ),
        max_size=40,
    )
)
def test_tenant_ids_injective(specs):
    build = {"person": person_tenant_id, "chat": chat_tenant_id, "link": link_tenant_id}
    seen: dict[str, tuple] = {}
    dirs: dict[str, tuple] = {}
    for spec in specs:
        tid = build[spec[0]](*spec[1:])
        assert seen.setdefault(tid, spec) == spec
        assert dirs.setdefault(tenant_dir_name(tid), spec) == spec


def test_plain_ids_unchanged_by_key_escaping():
    for s in ["111", "-100123", "1100000000000000001", "alice", "Alice Smith", "ünï"]:
        assert escape_key_component(s) == s


# --- identity links ---------------------------------------------------------------------


def test_links_from_config():
    c = cfg(identity_links={"alice": ["telegram:111", "discord:222"]})
    links = IdentityLinks.from_config(c)
    assert links.tenant_for("telegram:111") == "link-alice"
    assert links.tenant_for("discord:222") == "link-alice"
    assert links.tenant_for("telegram:333") is None
    assert links.principals_of("alice") == ["telegram:111", "discord:222"]
    assert links.principals_of("nobody") == []
    assert links.is_pinned("telegram:111")


def test_runtime_link_and_unlink():
    links = IdentityLinks({})
    assert links.link("bob", "telegram:5") is True
    assert links.link("bob", "telegram:5") is False
    assert links.link("bob", "discord:6") is True
    assert links.tenant_for("discord:6") == "link-bob"
    with pytest.raises(ValueError):
        links.link("carol", "telegram:5")  # already linked elsewhere
    with pytest.raises(ValueError):
        links.link("bob", "no-colon")
    with pytest.raises(ValueError):
        links.link("", "telegram:7")
    assert links.unlink("telegram:5") == "bob"
    assert links.unlink("telegram:5") is None
    assert links.tenant_for("telegram:5") is None
    assert links.principals_of("bob") == ["discord:6"]
    assert links.unlink("discord:6") == "bob"
    assert links.names() == []


def test_config_links_cannot_be_unlinked_at_runtime():
    links = IdentityLinks.from_config(cfg(identity_links={"alice": ["telegram:111"]}))
    with pytest.raises(ValueError):
        links.unlink("telegram:111")
    assert links.tenant_for("telegram:111") == "link-alice"


def test_conflicting_constructor_links_rejected():
    with pytest.raises(ValueError):
        IdentityLinks({"a": ["telegram:1"], "b": ["telegram:1"]})


def test_instances_do_not_share_state():
    a, b = IdentityLinks({}), IdentityLinks({})
    a.link("x", "telegram:1")
    assert b.tenant_for("telegram:1") is None


def test_save_and_load_merge_with_config(tmp_path):
    path = tmp_path / "state" / "links.json"
    c = cfg(identity_links={"alice": ["telegram:111"]})
    links = IdentityLinks.load(path, c)  # no file yet
    assert links.path == path
    links.link("alice", "discord:222")  # runtime addition to a config link
    links.link("bob", "telegram:5")
    links.save()
    data = json.loads(path.read_text())
    assert data["version"] == 1
    # only runtime links are written; the config stays the source of its own links
    assert data["links"] == {"alice": ["discord:222"], "bob": ["telegram:5"]}
    assert [p.name for p in path.parent.iterdir()] == ["links.json"]  # no temp files left

    again = IdentityLinks.load(path, c)
    assert again.tenant_for("telegram:111") == "link-alice"
    assert again.tenant_for("discord:222") == "link-alice"
    assert again.tenant_for("telegram:5") == "link-bob"
    assert set(again.principals_of("alice")) == {"telegram:111", "discord:222"}
    assert again.is_pinned("telegram:111") and not again.is_pinned("discord:222")

    # the config wins over the file for a principal it links elsewhere
    c2 = cfg(identity_links={"carol": ["telegram:5"]})
    third = IdentityLinks.load(path, c2)
    assert third.tenant_for("telegram:5") == "link-carol"


def test_load_refuses_corrupt_file(tmp_path):
    path = tmp_path / "links.json"
    path.write_text("{not json")
    with pytest.raises(ValueError):
        IdentityLinks.load(path, cfg())
    path.write_text("[]")
    with pytest.raises(ValueError):
        IdentityLinks.load(path, cfg())


def test_save_without_path_refused():
    with pytest.raises(ValueError):
        IdentityLinks({}).save()
