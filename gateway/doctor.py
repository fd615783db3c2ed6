"""`hermes-gateway doctor`: check each moving part and say precisely what is wrong."""

from __future__ import annotations

import asyncio
import os
import tempfile

import httpx

from agent.fileio import private_mkdir
from agent.vault import KEY_FILE, Keyring, open_keyring
from core.settings import Config


def _line(ok: bool | None, what: str, detail: str) -> str:
    return f"[{'warn' if ok is None else 'ok' if ok else 'FAIL'}] {what}: {detail}"


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
    """GET {base_url}/models (reachable, key accepted, path right), then a real one-token
    chat completion, so a wrong path or model name is caught here rather than in a chat."""
    headers = {}
    key = cfg.llm.api_key()
    if cfg.llm.api_key_env and not key:
        return False, f"environment variable {cfg.llm.api_key_env} (llm.api_key_env) is not set"
    if key:
        headers["Authorization"] = f"Bearer {key}"
    base = cfg.llm.base_url.rstrip("/")
    try:
        async with httpx.AsyncClient(timeout=10) as client:
            resp = await client.get(base + "/models", headers=headers)
    except httpx.HTTPError as err:
        return False, f"cannot reach {base} ({type(err).__name__}); is the server running? (llm.base_url)"
    if resp.status_code in (401, 403):
        return False, f"{base} rejected the API key (HTTP {resp.status_code})"
    ok, detail = await _check_completion(cfg)
    if resp.status_code == 404:  # both 404: the path is wrong; chat works: it just lists no models
        if not ok and "HTTP 404" in detail:
            return False, (
                f"{base}/models and {base}/chat/completions answered HTTP 404: llm.base_url has "
                f"the wrong path (OpenAI-compatible servers usually end in /v1, "
                f"e.g. http://127.0.0.1:11434/v1)"
            )
        if ok:
            detail += " (it lists no models at /models)"
    return ok, detail


async def _check_completion(cfg: Config) -> tuple[bool, str]:
    from agent.llm import LLMClient, LLMError

    client = LLMClient.from_config(cfg.llm.model_copy(update={"max_retries": 0}))
    ping = [{"role": "user", "content": "Say OK."}]
    try:
        try:
            await client.chat(ping, max_tokens=1)
        except LLMError as err:
            if err.status != 400 or "max_tokens" not in err.detail:
                raise
            await client.chat(ping)  # e.g. OpenAI's reasoning models refuse max_tokens
    except LLMError as err:
        if err.status == 404:
            return False, (
                f"{err.detail}; check llm.model ({cfg.llm.model!r}) and llm.base_url (usually ending in /v1)"
            )
        return False, f"a one-token chat completion failed: {err.detail}"
    finally:
        await client.aclose()
    return True, f"{cfg.llm.base_url} answered a one-token chat completion with model {cfg.llm.model}"


def check_tokens() -> tuple[bool, str]:
    from agent.tokens import TokenCounter

    counter = TokenCounter.create()
    if counter.exact:
        return True, "cl100k_base encoding loaded offline"
    return False, "no tokenizer encoding; token counts fall back to chars/4"


def check_encryption(cfg: Config, keyring: Keyring | None) -> tuple[bool, str]:
    """What storage.encryption does here: off, or how many profiles are encrypted and where the keyring is."""
    from gateway.tenants import scan_profiles

    profiles = scan_profiles(cfg.data_dir)
    sealed = sum(1 for info in profiles if (info.path / KEY_FILE).exists())
    if keyring is None:
        if sealed:
            return False, (
                f"storage.encryption is off, but {sealed} profile(s) are encrypted and will not open: "
                "set it to per_tenant with their master key"
            )
        return True, "off: profiles are plain files on disk (docs/privacy.md)"
    plain = len(profiles) - sealed
    detail = f"per_tenant: {sealed} of {len(profiles)} profile(s) encrypted, keyring {keyring.directory} opens with the master key"
    if plain:
        return False, f"{detail}; {plain} plain profile(s) made before encryption was on will not open"
    return True, detail


async def run_doctor(cfg: Config, *, deep: bool = False) -> int:
    """Print one line per check ([ok], [warn] or [FAIL]); exit status 1 if any failed.
    `deep` runs SQLite's integrity_check on every profile's state.db. A missing or wrong
    master key refuses at once in one sentence (VaultError), as `run` does."""
    from gateway.tenants import check_profiles

    results: list[tuple[bool | None, str, str]] = [(True, "config", "valid")]
    ok, detail = check_data_dir(cfg)
    results.append((ok, "data directory", detail))
    keyring = open_keyring(
        cfg.data_dir, cfg.storage.encryption, cfg.storage.master_key_env, cfg.storage.master_key_file
    )
    ok, detail = check_encryption(cfg, keyring)
    results.append((ok, "encryption", detail))
    ok, detail = await asyncio.to_thread(check_profiles, cfg, deep=deep, keyring=keyring)
    results.append((ok, "profiles", detail))
    ok, detail = check_tokens()
    results.append((ok, "tokenizer", detail))
    ok, detail = await check_llm(cfg)
    results.append((ok, "model endpoint", detail))
    for name in cfg.llm.models:  # every offered model, as a tenant that chose it would call it
        offer = cfg.model_copy(update={"llm": cfg.llm.for_offer(name)})
        ok, detail = await check_llm(offer)
        results.append((ok, f"model {name}", detail))
        if offer.llm.vision:
            from gateway.media_checks import check_vision

            ok, detail = await check_vision(offer)
            results.append((ok, f"model {name} vision", detail))
    if cfg.llm.vision or cfg.transcription.base_url:  # media checks live in gateway/media_checks.py
        from gateway.media_checks import check_transcription, check_vision

        if cfg.llm.vision:
            ok, detail = await check_vision(cfg)
            results.append((ok, "vision", detail))
        if cfg.transcription.base_url:
            ok, detail = await check_transcription(cfg)
            results.append((ok, "transcription", detail))
    if cfg.tools.web_search.provider is not None or cfg.tools.mcp.servers:  # gateway/tool_checks.py
        from gateway.tool_checks import check_mcp_servers, check_web_search

        if cfg.tools.web_search.provider is not None:
            ok, detail = await check_web_search(cfg)
            results.append((ok, "web search", detail))
        results.extend(await check_mcp_servers(cfg))
    if cfg.platforms.telegram.enabled:
        from adapters.telegram import doctor as telegram_doctor

        ok, detail = await telegram_doctor(cfg.platforms.telegram)
        results.append((ok, "telegram", detail))
    if cfg.platforms.discord.enabled:
        from adapters.discord_bot import doctor as discord_doctor

        ok, detail = await discord_doctor(cfg.platforms.discord)
        results.append((ok, "discord", detail))
    if not (cfg.platforms.telegram.enabled or cfg.platforms.discord.enabled):
        results.append(
            (
                None,
                "platforms",
                "none enabled: `run` will refuse to start until you set "
                "platforms.telegram.enabled or platforms.discord.enabled "
                "(the console `chat` works without one)",
            )
        )
    for status, what, detail in results:
        print(_line(status, what, detail))
    failed = [r for r in results if r[0] is False]
    warned = [r for r in results if r[0] is None]
    if failed:
        print("1 check failed." if len(failed) == 1 else f"{len(failed)} checks failed.")
    elif warned:
        print(
            "All checks passed, with 1 warning."
            if len(warned) == 1
            else f"All checks passed, with {len(warned)} warnings."
        )
    else:
        print("All checks passed.")
    return 0 if not failed else 1
