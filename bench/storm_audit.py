"""What the storms (bench/killstorm.py, bench/cluster_storm.py) share: the fake model that
names in its answer every message token a turn answers, and the audits that do not depend
on how the gateway was run (per-lane order, journals equal SQLite, integrity_check).

Every input carries a token (`tk<n>x<i>`: the n-th message overall, the i-th of that person
in that chat); an answer names the tokens it answers, so the audit can tell lost,
duplicated and reordered answers apart.
"""

from __future__ import annotations

import asyncio
import itertools
import random
import re
import sqlite3
from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import replace
from pathlib import Path
from typing import Any

from tests.fakes.llm import last_user_text, reply, tool_call

TOKEN_RE = re.compile(r"\b([td]k\d+x\d+)\b")
STREAM_TAIL = "and that is all there is to say about it for now, written slowly."  # streamed after the tokens
CHUNK = 6  # characters per streamed chunk
# "remind in 4s as rm3": the fake model sets a reminder "ping rm3" due in 4 s (the storms' --reminders)
REMIND_RE = re.compile(r"remind in (\d+(?:\.\d+)?)s as (rm\d+)")
REMINDER_TOKEN_RE = re.compile(r"\b(rm\d+)\b")


def responder(
    rng: random.Random,
    *,
    max_latency_s: float = 0.15,
    slow: dict[str, float] | None = None,
    on_answer: Callable[[list[str]], None] | None = None,
    stream_s: float = 0.0,
):
    """A fake model with random latency (up to `max_latency_s`) that answers
    "ok: <tokens>", sometimes writes memory (when asked to "remember") and sets a reminder
    when asked to "remind in <s>s as rm<n>". `slow` maps a
    word to an extra delay for requests whose last user text contains it; `on_answer` is
    told the tokens of every final answer as it is sent (a storm aims kills with it).
    `stream_s`: a streamed answer is written over about that many seconds (it goes on after
    the tokens), so a gateway that streams shows drafts of it."""

    async def respond(request: dict[str, Any]):
        text = last_user_text(request)
        extra = max((s for word, s in (slow or {}).items() if word in text), default=0.0)
        await asyncio.sleep(rng.random() * max_latency_s + extra)
        messages = request.get("messages") or []
        # a turn may answer several messages at once (busy_mode: collect, a replayed batch):
        # the client merges their user turns into one, and the answer names every token in it
        tokens = TOKEN_RE.findall(text)
        token = " ".join(dict.fromkeys(tokens)) if tokens else "none"
        offered = {t.get("function", {}).get("name") for t in request.get("tools") or []}
        if messages and messages[-1].get("role") == "tool":
            answer = f"ok: {token} (noted)"
        elif (remind := REMIND_RE.search(text)) and "reminders" in offered:
            minutes = float(remind.group(1)) / 60
            return tool_call(
                "reminders", {"action": "create", "text": f"ping {remind.group(2)}", "in_minutes": minutes}
            )
        elif "remember" in text and "memory" in offered:
            return tool_call("memory", {"action": "add", "target": "memory", "content": f"note {token}"})
        else:
            answer = f"ok: {token}"
        if on_answer is not None:
            on_answer(tokens)
        if stream_s > 0:
            text = f"{answer}; {STREAM_TAIL}"
            return replace(reply(text), chunk_chars=CHUNK, chunk_delay_s=stream_s * CHUNK / len(text))
        return reply(answer)

    return respond


def order_violations(
    answered_tokens: Iterable[str], pushed: dict[str, tuple[str, str, str, int]]
) -> tuple[int, list[str]]:
    """Per person and chat, the first answers must follow the inputs' order. `answered_tokens`
    in send order; `pushed[token] = (platform, chat key, sender, index in that person's chat)`."""
    firsts: dict[tuple[str, str], list[int]] = defaultdict(list)
    seen: set[str] = set()
    for token in answered_tokens:
        if token in seen or token not in pushed:
            continue
        seen.add(token)
        _, key, sender, idx = pushed[token]
        firsts[(key, sender)].append(idx)
    count, details = 0, []
    for key, idxs in firsts.items():
        bad = sum(1 for a, b in itertools.pairwise(idxs) if b < a)
        if bad:
            count += bad
            details.append(f"order: {key} answered {idxs}")
    return count, details


def profile_problems(data: Path) -> tuple[int, int, list[str]]:
    """(journal/SQLite mismatches, failed integrity_checks, details) over a data dir."""
    from tests.test_crash_recovery import db_messages, journal_uids

    mismatches, failures, details = 0, 0, []
    profiles = sorted((data / "profiles").iterdir()) if (data / "profiles").is_dir() else []
    for profile in profiles:
        if not (profile / "state.db").exists():
            continue
        journal, db = journal_uids(profile), set(db_messages(profile))
        if journal != db:
            mismatches += 1
            details.append(
                f"journal and SQLite differ in {profile.name}: only in the journal {sorted(journal - db)[:3]}, "
                f"only in SQLite {sorted(db - journal)[:3]}"
            )
    for path in data.rglob("*.db"):
        con = sqlite3.connect(path)
        try:
            if con.execute("PRAGMA integrity_check").fetchone()[0] != "ok":
                failures += 1
                details.append(f"integrity_check failed: {path}")
        finally:
            con.close()
    return mismatches, failures, details


def reminder_records(data: Path) -> dict[str, str]:
    """Every reminder occurrence the profiles' sessions keep: its message id
    (`reminder:<owner>:<id>:<due>`) -> the text delivered (the lane keeps each once, as an
    assistant message with meta.reminder; gateway/reminders.py `delivered_message`)."""
    from tests.statedb import open_state_db

    out: dict[str, str] = {}
    for db in sorted(data.glob("profiles/*/state.db")):
        con = open_state_db(db)
        try:
            rows = con.execute(
                """SELECT json_extract(meta, '$.reminder'), content FROM messages
                   WHERE json_valid(meta) AND json_extract(meta, '$.reminder') IS NOT NULL"""
            ).fetchall()
        finally:
            con.close()
        out.update((str(mid), content or "") for mid, content in rows)
    return out


def reminder_due(message_id: str) -> float:
    """The due time an occurrence's id carries (`reminder:<owner>:<id>:<due>`, gateway/reminders.py)."""
    return float(message_id.rsplit(":", 1)[1])


def spread(values: list[float]) -> str:
    if not values:
        return "-"
    v = sorted(values)
    return f"min {v[0]}, median {v[len(v) // 2]}, max {v[-1]} (n={len(v)})"
