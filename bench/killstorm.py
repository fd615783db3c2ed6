"""Kill storm: the real `hermes-gateway run` under steady traffic, SIGKILLed at random
moments and restarted, then audited.

    python -m bench.killstorm [--cycles 100] [--people 24] [--seed 1] [--aim 0.5] [--json out.json]

Telegram (fake Bot API, polling), Discord (fake REST + gateway websocket) and the model
(fake OpenAI-compatible server, slow, sometimes writing memory) run in this process; the
gateway is a subprocess, in the default `busy_mode: collect` (messages that arrive during a
turn, and a replayed backlog, are answered together). People send steadily from DMs and two
Telegram groups. A share of the kills (`--aim`) is aimed at the answer window: after the new
process's first model answer (mostly its replay's), a watcher thread spins on that person's
session journal and kills the process as the answer is written there, up to `--aim-ms` later,
so before the outbox records it: replays meet answers stored but never sent, again and again. After the last cycle the
gateway runs until everything is answered, then the audit counts:

- lost: inputs the gateway took in (every Telegram update; Discord messages it recorded)
  whose answer never reached the platform (the fake model names in each answer the
  messages it answers, so an answer lost in a replay shows here);
- duplicated answers, split into "window" (the copies come from different process lives:
  the platform accepted the send and the process died before marking it sent) and "other";
- per-chat order violations (per person and chat: answers in the order of the inputs);
- journal/SQLite mismatches per profile and failed `PRAGMA integrity_check`s.

Discord messages sent while the gateway is down or mid-crash before they were recorded
are reported as "missed": Discord does not redeliver gateway events (any bot misses them).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import os
import random
import signal
import sqlite3
import sys
import tempfile
import time
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.storm_audit import TOKEN_RE, order_violations, profile_problems, responder, spread  # noqa: E402
from tenancy.keys import person_tenant_id, tenant_dir  # noqa: E402
from tests.fakes.discord_api import FakeDiscord  # noqa: E402
from tests.fakes.llm import FakeLLM  # noqa: E402
from tests.fakes.telegram_api import FakeTelegram  # noqa: E402

TG_TOKEN = "123456:AAEkillstormFAKEtoken_-storm"
BOT = "hermes_storm_bot"
BIN = Path(sys.executable).parent / "hermes-gateway"


#: every this many kills, one process is left up on both platforms (not aimed) and gets a
#: Discord message, so every storm covers Discord across kills
SERVING_EVERY = 6


@dataclass
class StormResult:
    cycles: int = 0
    aimed_kills: int = 0  # kills that landed just after the model answered
    people: int = 0
    inputs: int = 0
    inputs_telegram: int = 0
    inputs_discord: int = 0
    discord_missed: int = 0
    answers: int = 0
    answered_again: int = 0  # inputs the model answered more than once (a replay asked again)
    lost: int = 0
    dup_window_telegram: int = 0
    dup_window_discord: int = 0
    dup_other: int = 0
    order_violations: int = 0
    journal_mismatches: int = 0
    integrity_failures: int = 0
    window_ms: list[float] = field(default_factory=list)  # first copy accepted -> SIGKILL
    restart_s: list[float] = field(default_factory=list)  # spawn -> first getUpdates
    seconds: float = 0.0
    details: list[str] = field(default_factory=list)

    def targets_met(self) -> bool:
        return (
            self.lost == 0
            and self.dup_other == 0
            and self.dup_window_discord == 0
            and self.order_violations == 0
            and self.journal_mismatches == 0
            and self.integrity_failures == 0
        )


def _config(path: Path, data: Path, llm: FakeLLM, tg: FakeTelegram, dc: FakeDiscord) -> None:
    path.write_text(
        json.dumps(
            {
                "data_dir": str(data),
                "llm": {"base_url": llm.base_url, "model": "fake", "timeout_s": 10, "max_retries": 2},
                "storage": {"fsync": "batch"},
                "limits": {"rate_limit_per_minute": 10_000, "max_queued_turns": 1000, "busy_mode": "collect"},
                "delivery": {"retry_initial_s": 0.2, "retry_max_s": 1.0},
                "logging": {"level": "WARNING"},
                "platforms": {
                    "telegram": {
                        "enabled": True,
                        "token_env": "HERMES_STORM_TG",
                        "base_url": tg.base_url,
                        "poll_timeout_s": 1,
                    },
                    "discord": {
                        "enabled": True,
                        "token_env": "HERMES_STORM_DC",
                        "api_base": dc.api_base,
                        "gateway_url": dc.gateway_url,
                        "sync_slash_commands": False,
                    },
                },
            }
        )
    )  # JSON is YAML


class Storm:
    def __init__(
        self,
        workdir: Path,
        *,
        cycles: int,
        people: int,
        seed: int,
        min_up: float,
        max_up: float,
        interval: float,
        aim: float = 0.0,
        aim_ms: float = 2.0,
        say=print,
    ) -> None:
        self.workdir, self.cycles, self.people, self.seed = workdir, cycles, people, seed
        self.min_up, self.max_up, self.interval, self.say = min_up, max_up, interval, say
        self.aim, self.aim_ms = aim, aim_ms
        self._answered: asyncio.Event | None = None  # armed by an aimed kill: the model just answered
        self._journals: tuple[Path, dict[Path, int]] | None = None  # the answered person's, before the answer
        self.model_answers: dict[str, int] = defaultdict(int)  # token -> final answers the model gave
        self.rng = random.Random(seed)
        # a serving cycle asks the traffic for one Discord message while the bot is connected:
        # most kills land before Discord's login (~2 s), so chance alone may leave it untested
        self._dm_wanted = False
        self._restart_timers: set[asyncio.Task] = set()  # referenced until done
        self.result = StormResult(cycles=cycles, people=people)
        # token -> (platform, chat key, sender, index in that person's chat)
        self.pushed: dict[str, tuple[str, str, str, int]] = {}
        self.discord_pushed: dict[str, str] = {}  # discord message id -> token
        self.kills: list[float] = []  # monotonic time of each SIGKILL
        self.tg_bounds: list[int] = []  # len(tg.sent) at each kill
        self.dc_bounds: list[int] = []
        self.sending = True

    async def run(self) -> StormResult:
        started = time.monotonic()
        data, config = self.workdir / "data", self.workdir / "gw.yaml"
        async with FakeLLM() as llm, FakeTelegram(token=TG_TOKEN, bot_username=BOT) as tg, FakeDiscord() as dc:
            llm.responder = responder(random.Random(self.seed + 1), on_answer=self._model_answered)
            _config(config, data, llm, tg, dc)
            env = dict(os.environ, HERMES_STORM_TG=TG_TOKEN, HERMES_STORM_DC=dc.token, PYTHONPATH=str(ROOT))
            self.tg, self.dc = tg, dc
            n_dc = max(2, self.people // 3)
            n_tg = self.people - n_dc
            self.tg_users = [5000 + i for i in range(n_tg)]
            self.groups = [-1002000000001, -1002000000002]
            self.group_members = {g: self.tg_users[i :: len(self.groups)][:4] for i, g in enumerate(self.groups)}
            self.dc_users = [dc.add_user(f"storm{i}") for i in range(n_dc)]
            traffic = asyncio.create_task(self._traffic())
            log = open(self.workdir / "gateway.log", "ab")  # noqa: ASYNC230, SIM115 (the children's log for the whole storm; closed below)
            try:
                for cycle in range(self.cycles):
                    serving = cycle % SERVING_EVERY == 0  # up on both platforms, a Discord message in
                    aimed = not serving and self.rng.random() < self.aim
                    proc = await self._spawn(env, config, log)
                    if aimed:
                        self.result.aimed_kills += await self._kill_as_an_answer_is_stored(proc)
                    else:
                        if (
                            serving or self.rng.random() < 0.9
                        ):  # mostly while serving, sometimes mid-start or mid-replay
                            await self._wait_up(proc)
                        self._dm_wanted = serving
                        await asyncio.sleep(self.rng.uniform(self.min_up, self.max_up))
                        self._dm_wanted = False
                    if proc.returncode is None:  # an aimed kill may have come already
                        with contextlib.suppress(ProcessLookupError):
                            proc.send_signal(signal.SIGKILL)
                    await proc.wait()
                    self.kills.append(time.monotonic())
                    self.tg_bounds.append(len(tg.sent))
                    self.dc_bounds.append(len(self._dc_bot_messages()))
                    if (cycle + 1) % 10 == 0:
                        self.say(f"  {cycle + 1}/{self.cycles} kills, {len(self.pushed)} inputs so far")
                self.sending = False
                await traffic
                proc = await self._spawn(env, config, log)
                await self._settle(data)
                proc.send_signal(signal.SIGTERM)
                try:
                    await asyncio.wait_for(proc.wait(), 60)
                except TimeoutError:
                    proc.kill()
                    await proc.wait()
                    self.result.details.append("the final gateway did not stop on SIGTERM within 60 s")
            finally:
                self.sending = False
                if not traffic.done():
                    traffic.cancel()
                log.close()
            self._audit(data)
        self.result.seconds = round(time.monotonic() - started, 1)
        return self.result

    def _model_answered(self, tokens: list[str]) -> None:
        for token in dict.fromkeys(tokens):
            self.model_answers[token] += 1
        known = [t for t in tokens if t in self.pushed]
        if self._answered is not None and known:
            # measured now, while the answer is not yet sent, so its journal line comes after
            platform, _key, sender, _idx = self.pushed[known[0]]
            tenant = person_tenant_id("telegram" if platform == "tg" else "discord", sender)
            sessions = tenant_dir(self.workdir / "data", tenant) / "sessions"
            self._journals = (sessions, _journal_sizes(sessions))
            self._answered.set()

    async def _kill_as_an_answer_is_stored(self, proc: asyncio.subprocess.Process) -> int:
        """Wait (bounded) for this process's next model answer to a person, then SIGKILL it
        as that answer reaches the person's session journal (plus 0..aim_ms): the profile
        holds it, the outbox may not. 1 when the kill was aimed so (else it is left to the
        caller's kill)."""
        # armed while the new process starts (about a second), after the killed one's last
        # requests are answered (up to the model's latency): its first answer is mostly a replay's
        await asyncio.sleep(0.3)
        self._answered = answered = asyncio.Event()
        try:
            await asyncio.wait_for(answered.wait(), self.max_up + 5)
        except TimeoutError:
            return 0
        finally:
            self._answered = None
        assert self._journals is not None
        sessions, before = self._journals
        delay = self.rng.uniform(0, self.aim_ms / 1000)
        interval = sys.getswitchinterval()
        sys.setswitchinterval(0.0002)  # the watcher gets the GIL within the window, not 5 ms later
        try:
            return int(await asyncio.to_thread(_kill_when_written, sessions, before, proc.pid, delay, 2.0))
        finally:
            sys.setswitchinterval(interval)

    async def _spawn(self, env: dict[str, str], config: Path, log) -> asyncio.subprocess.Process:
        t0, calls = time.monotonic(), len(self.tg.calls)
        self._polling = asyncio.Event()
        proc = await asyncio.create_subprocess_exec(
            str(BIN), "run", "-c", str(config), env=env, stdout=log, stderr=log, cwd=str(self.workdir)
        )
        self._restart_timers.add(task := asyncio.create_task(self._time_restart(t0, calls)))
        task.add_done_callback(self._restart_timers.discard)
        return proc

    async def _wait_up(self, proc: asyncio.subprocess.Process) -> None:
        """Until the new process polls Telegram and its Discord session is up (bounded)."""
        t0 = time.monotonic()
        while time.monotonic() - t0 < 30 and proc.returncode is None:
            if self._polling.is_set() and self.dc.connected:
                return
            await asyncio.sleep(0.02)

    async def _time_restart(self, t0: float, calls: int) -> None:
        while time.monotonic() - t0 < 30:
            if any(m == "getUpdates" for m, _ in self.tg.calls[calls:]):
                self.result.restart_s.append(round(time.monotonic() - t0, 2))
                self._polling.set()
                return
            await asyncio.sleep(0.02)

    async def _traffic(self) -> None:
        """Steady messages from everyone, whether the gateway is up or not (Telegram queues
        them; Discord only delivers to a connected bot)."""
        counters: dict[tuple[str, str], int] = defaultdict(int)
        n = 0
        while self.sending:
            await asyncio.sleep(self.interval)
            n += 1
            kind = self.rng.random()
            if self._dm_wanted and self.dc.connected:
                kind, self._dm_wanted = 0.9, False
            remember = self.rng.random() < 0.1
            if kind < 0.55:
                user = self.rng.choice(self.tg_users)
                chat, key = user, f"tg:{user}"
            elif kind < 0.75:
                chat = self.rng.choice(self.groups)
                user = self.rng.choice(self.group_members[chat])
                key = f"tg:{chat}"
            else:
                if not self.dc.connected:
                    continue
                user = self.rng.choice(self.dc_users)
                chat, key = user, f"dc:{user}"
            idx = counters[(key, str(user))]
            counters[(key, str(user))] += 1
            token = f"{'t' if key.startswith('tg') else 'd'}k{n}x{idx}"
            text = f"please remember {token}" if remember else f"hello {token}"
            if key.startswith("dc"):
                try:
                    msg = self.dc.push_dm(user, text)
                except RuntimeError:
                    continue
                self.discord_pushed[msg["id"]] = token
            elif chat in self.groups:
                self.tg.push_group(chat, user, f"@{BOT} {text}")
            else:
                self.tg.push_private(user, text)
            self.pushed[token] = (key[:2], key, str(user), idx)

    def _dc_bot_messages(self) -> list[dict[str, Any]]:
        return self.dc.sent_messages()

    def _answers(self) -> list[tuple[str, str, int, float | None]]:
        """(platform, token, process life, accepted at) of every answer, in send order."""
        out = []
        for i, m in enumerate(self.tg.sent):
            life = sum(1 for b in self.tg_bounds if b <= i)
            for token in TOKEN_RE.findall(m.get("text", "")):
                out.append(("tg", token, life, m.get("_at")))
        for i, m in enumerate(self._dc_bot_messages()):
            life = sum(1 for b in self.dc_bounds if b <= i)
            for token in TOKEN_RE.findall(m.get("content", "")):
                out.append(("dc", token, life, None))
        return out

    def _taken_discord(self, data: Path) -> set[str]:
        """Discord inputs the gateway recorded (the others it never saw)."""
        con = sqlite3.connect(data / "gateway.db")
        try:
            ids = {mid for (mid,) in con.execute("SELECT message_id FROM inbound WHERE platform='discord'")}
        finally:
            con.close()
        return {tok for mid, tok in self.discord_pushed.items() if mid in ids}

    async def _settle(self, data: Path) -> None:
        """Let the last gateway answer everything it took in (no progress for 70 s: stop;
        longer than Telegram's per-group window, which the adapter paces a backlog by)."""
        last, since = -1, time.monotonic()
        while time.monotonic() - since < 70:
            await asyncio.sleep(0.5)
            if not (data / "gateway.db").exists():
                continue
            try:
                taken = self._taken_discord(data)
            except sqlite3.Error:
                continue
            answered = {t for _, t, _, _ in self._answers()}
            want = {t for t, (p, *_rest) in self.pushed.items() if p == "tg"} | taken
            if want <= answered and not self.tg.updates:
                return
            if len(answered) != last:
                last, since = len(answered), time.monotonic()

    def _audit(self, data: Path) -> None:

        r = self.result
        taken_dc = self._taken_discord(data)
        tg_inputs = {t for t, (p, *_rest) in self.pushed.items() if p == "tg"}
        r.inputs_telegram, r.inputs_discord = len(tg_inputs), len(taken_dc)
        r.discord_missed = len(self.discord_pushed) - len(taken_dc)
        r.inputs = r.inputs_telegram + r.inputs_discord
        answers = self._answers()
        r.answers = len(answers)
        r.answered_again = sum(1 for n in self.model_answers.values() if n > 1)
        copies: dict[str, list[tuple[str, int, float | None]]] = defaultdict(list)
        for platform, token, life, at in answers:
            copies[token].append((platform, life, at))
        lost = (tg_inputs | taken_dc) - set(copies)
        r.lost = len(lost)
        r.details += [f"lost: {t} {self.pushed.get(t)}" for t in sorted(lost)[:20]]
        for token, seen in copies.items():
            for (platform, life, at), (_, life2, _) in itertools.pairwise(seen):
                if life2 > life:  # a kill between the two copies: the documented window
                    if platform == "tg":
                        r.dup_window_telegram += 1
                        kill = self.kills[life] if life < len(self.kills) else None
                        if at is not None and kill is not None:
                            r.window_ms.append(round((kill - at) * 1000, 1))
                    else:
                        r.dup_window_discord += 1
                else:
                    r.dup_other += 1
                    r.details.append(f"duplicate within one process life: {token}")
        # order: per person and chat, first answers follow the inputs
        bad, details = order_violations((token for _, token, _, _ in answers), self.pushed)
        r.order_violations += bad
        r.details += details
        r.journal_mismatches, r.integrity_failures, details = profile_problems(data)
        r.details += details


async def storm(
    workdir: Path,
    *,
    cycles: int = 100,
    people: int = 24,
    seed: int = 1,
    min_up: float = 0.4,
    max_up: float = 2.5,
    interval: float = 0.15,
    aim: float = 0.5,
    aim_ms: float = 2.0,
    say=print,
) -> StormResult:
    return await Storm(
        workdir,
        cycles=cycles,
        people=people,
        seed=seed,
        min_up=min_up,
        max_up=max_up,
        interval=interval,
        aim=aim,
        aim_ms=aim_ms,
        say=say,
    ).run()


def _journal_sizes(sessions: Path) -> dict[Path, int]:
    try:
        return {p: p.stat().st_size for p in sessions.glob("*.jsonl")}
    except OSError:
        return {}


def _kill_when_written(sessions: Path, before: dict[Path, int], pid: int, delay: float, timeout: float) -> bool:
    """Spin until a journal in `sessions` differs from `before`, then SIGKILL `pid` `delay`
    seconds later (busy-waited: sleeps are too coarse for a window of about a millisecond)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if _journal_sizes(sessions) != before:
            until = time.perf_counter() + delay
            while time.perf_counter() < until:
                pass
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                return False
            return True
    return False


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cycles", type=int, default=100)
    ap.add_argument("--people", type=int, default=24)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--interval", type=float, default=0.15, help="seconds between two messages (all people)")
    ap.add_argument("--aim", type=float, default=0.5, help="share of the kills aimed just after a model answer")
    ap.add_argument("--aim-ms", type=float, default=2.0, help="aimed kills land 0..this many ms after the answer")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    import logging

    logging.getLogger("aiohttp.server").setLevel(logging.CRITICAL)  # a killed gateway's half requests
    with tempfile.TemporaryDirectory(prefix="killstorm-") as tmp:
        r = asyncio.run(
            storm(
                Path(tmp),
                cycles=args.cycles,
                people=args.people,
                seed=args.seed,
                interval=args.interval,
                aim=args.aim,
                aim_ms=args.aim_ms,
            )
        )
    print(
        f"kills {r.cycles} ({r.aimed_kills} aimed after a model answer), people {r.people}, inputs {r.inputs} (telegram {r.inputs_telegram}, discord "
        f"{r.inputs_discord}; discord missed while down {r.discord_missed}), answers {r.answers}, "
        f"answered by the model more than once {r.answered_again}, {r.seconds} s"
    )
    print(
        f"lost {r.lost}; duplicated: window telegram {r.dup_window_telegram}, window discord "
        f"{r.dup_window_discord}, other {r.dup_other}; order violations {r.order_violations}; "
        f"journal/SQLite mismatches {r.journal_mismatches}; integrity_check failures {r.integrity_failures}"
    )
    print(f"telegram window (accepted -> SIGKILL) ms: {spread(r.window_ms)}")
    print(f"restart (spawn -> polling) s: {spread(r.restart_s)}")
    for line in r.details[:30]:
        print("  " + line)
    if args.json:
        args.json.write_text(json.dumps(asdict(r), indent=2))
    return 0 if r.targets_met() else 1


if __name__ == "__main__":
    sys.exit(main())
