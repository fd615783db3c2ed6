"""`hermes-gateway doctor`: check each moving part and say precisely what is wrong."""

from __future__ import annotations

import os
import tempfile

import httpx

from agent.fileio import private_mkdir
from gateway.config import Config


def _line(ok: bool, what: str, detail: str) -> str:
    return f"[{'ok' if ok else 'FAIL'}] {what}: {detail}"


def check_data_dir(cfg: Config) -> tuple[bool, str]:
    try:
        private_mkdir(cfg.data_dir)
        with tempfile.NamedTemporaryFile(dir=cfg.data_dir, prefix=".doctor-", delete=True) as fh:
            fh.write(b"ok")
            fh.flush()
            os.fsync(fh.fileno())
        return True, f"{cfg.data_dir} is writable"
    except OSError as err:
        return False, f"{cfg.data_dir} is not writable ({err.strerror or err})"


async def check_llm(cfg: Config) -> tuple[bool, str]:
    """GET {base_url}/models: reachable, and the key accepted."""
    headers = {}
    key = cfg.llm.api_key()
    if cfg.llm.api_key_env and not key:
        return False, f"environment variable {cfg.llm.api_key_env} (llm.api_key_env) is not set"
    if key:
        headers["Authorization"] = f"Bearer {key}"
    url = cfg.llm.base_url.rstrip("/") + "/models"
    try:
        async with httpx.AsyncClient(timeout=10) as client:
            resp = await client.get(url, headers=headers)
    except httpx.HTTPError as err:
        return False, f"cannot reach {cfg.llm.base_url} ({type(err).__name__}); is the server running?"
    if resp.status_code in (401, 403):
        return False, f"{cfg.llm.base_url} rejected the API key (HTTP {resp.status_code})"
    if resp.status_code >= 400:
        return True, f"{cfg.llm.base_url} answered HTTP {resp.status_code} to /models (it may not list models)"
    return True, f"{cfg.llm.base_url} is reachable (model {cfg.llm.model})"


def check_tokens() -> tuple[bool, str]:
    from agent.tokens import TokenCounter

    counter = TokenCounter.create()
    if counter.exact:
        return True, "cl100k_base encoding loaded offline"
    return False, "no tokenizer encoding; token counts fall back to chars/4"


async def run_doctor(cfg: Config) -> int:
    results: list[tuple[bool, str, str]] = [(True, "config", "valid")]
    ok, detail = check_data_dir(cfg)
    results.append((ok, "data directory", detail))
    ok, detail = check_tokens()
    results.append((ok, "tokenizer", detail))
    ok, detail = await check_llm(cfg)
    results.append((ok, "model endpoint", detail))
    if cfg.platforms.telegram.enabled:
        from adapters.telegram import doctor as telegram_doctor
        ok, detail = await telegram_doctor(cfg.platforms.telegram)
        results.append((ok, "telegram", detail))
    if cfg.platforms.discord.enabled:
        from adapters.discord_bot import doctor as discord_doctor
        ok, detail = await discord_doctor(cfg.platforms.discord)
        results.append((ok, "discord", detail))
    for ok, what, detail in results:
        print(_line(ok, what, detail))
    failed = [r for r in results if not r[0]]
    print("All checks passed." if not failed else f"{len(failed)} check(s) failed.")
    return 0 if not failed else 1
