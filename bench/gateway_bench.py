#!/usr/bin/env python3
"""Gateway throughput benchmark: N tenants x M messages through the real GatewayApp.

    python bench/gateway_bench.py --tenants 1000 --messages 5 --fsync batch --concurrency 64

What runs
---------
* A minimal OpenAI-compatible LLM (aiohttp) in a *separate process*, answering every chat
  request at once with a fixed reply and a usage block. It is a separate process because a
  real model is remote: its CPU is not the gateway's cost.
* The real `GatewayApp` (inbox, access, limits, lanes, ProfileManager, Agent, SessionStore
  dual write, delivery) over a fresh temp data dir, with an in-memory `BenchAdapter`
  (platform "bench", one DM chat per tenant). Defaults are the shipped defaults
  (`storage.memory_budget_mib: 272`, memory on, compression config untouched) except the
  per-person rate limit, raised so the bench's own bursts are not refused.
* Closed loop: `--concurrency` conversations in flight at once. A conversation sends one
  message, waits for the reply, and only then does that tenant send its next message.
  `--order interleaved` (default) walks rounds: message 1 of every tenant, then message 2
  of every tenant...; with more tenants than `max_open_profiles` every round reopens every
  profile (the realistic many-people case and the worst case for LRU churn).
  `--order grouped` sends each tenant's M messages back to back.

What is measured
----------------
* turn wall time: from the moment the adapter hands the message to the gateway's sink
  (`handle_inbound`, which first commits it to the inbox) to the moment the gateway
  calls `BenchAdapter.send` with the reply. (The inbox `finish` after delivery is outside
  the per-turn latency but inside the throughput figure.)
* LLM time: the wall time of `LLMClient.chat` for that turn (timed by a thin subclass),
  i.e. request JSON encoding + HTTP round trip on loopback + response parsing. The fake
  server also reports its own handling time (`server side`): ~0.02 ms when idle, a few ms
  when the two cores are saturated.
* gateway overhead per turn = turn wall time - LLM time. Under concurrency both parts
  include waiting for the busy event loop (the response may sit ready while other turns
  run), so the loaded figure is mostly queueing (Little's law: about concurrency / turns/s).
  The unloaded probes after the load (`--probe`, default 200 turns each) run one
  conversation at a time: `warm` on recently used tenants (profile open), `cold` (only
  when tenants > max_open) on the least recently used ones, whose profiles the LRU closed,
  so the turn reopens one. That is the overhead one person sees.
* messages/s = 2 x turns/s (a turn stores the user message and the assistant message; the
  system prompt stored at a session's first turn is not counted), over the wall time from
  the first message pushed to the last turn drained.
* raw ceiling: the same number of messages (2 per turn, user then assistant, same tenants,
  same order, same concurrency), each one: a JSON line appended to
  `profiles/<t>/sessions/<sid>.jsonl` (os.write on an O_APPEND fd; fsync per
  `--fsync`: always = fsync each line + SQLite synchronous=FULL, batch = dirty journals
  fsynced every 50 ms + synchronous=NORMAL, never = no fsync + NORMAL) and then one INSERT
  into `profiles/<t>/state.db` (the real schema from agent/sessions/db.py, FTS trigger
  included, WAL) in its own transaction. One sqlite3 connection and fd per tenant kept
  open (no churn), the work done in asyncio.to_thread. share = gateway msg/s / raw msg/s.
* peak RSS: `resource.getrusage(RUSAGE_SELF).ru_maxrss` (KiB) read right after the gateway
  phase (the raw phase runs later in the same process, so it is not included); also the
  RSS right before the gateway phase, the peak thread count and the peak open fds.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import logging
import os
import platform
import resource
import shutil
import sqlite3
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import apsw

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from adapters.loopback import LoopbackAdapter  # noqa: E402
from agent.llm import LLMClient  # noqa: E402
from core.messages import InboundMessage, OutboundMessage  # noqa: E402

PLATFORM = "bench"

# --------------------------------------------------------------------------- fake LLM

# Runs in its own interpreter: `python -c FAKE_LLM_SERVER`. Prints its base URL, then serves
# until stdin closes. Answers every chat completion at once.
FAKE_LLM_SERVER = r"""
import asyncio, json, sys, time
from aiohttp import web

async def chat(request):
    t0 = time.perf_counter()
    body = await request.read()
    n = len(body)
    out = {
        "id": "chatcmpl-bench", "object": "chat.completion", "created": int(time.time()),
        "model": "bench-model",
        "choices": [{"index": 0, "finish_reason": "stop",
                     "message": {"role": "assistant", "content": "ok, noted."}}],
        "usage": {"prompt_tokens": n // 4, "completion_tokens": 3, "total_tokens": n // 4 + 3},
    }
    out["x_server_s"] = time.perf_counter() - t0
    return web.Response(body=json.dumps(out).encode(), content_type="application/json")

async def main():
    app = web.Application(client_max_size=64 * 1024 * 1024)
    app.router.add_post("/v1/chat/completions", chat)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    host, port = runner.addresses[0][:2]
    print(f"http://{host}:{port}/v1", flush=True)
    loop = asyncio.get_running_loop()
    await loop.run_in_executor(None, sys.stdin.read)
    await runner.cleanup()

asyncio.run(main())
"""


class FakeLLMProcess:
    def __init__(self) -> None:
        self.proc: subprocess.Popen[str] | None = None
        self.base_url = ""

    def __enter__(self) -> FakeLLMProcess:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", FAKE_LLM_SERVER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        assert self.proc.stdout is not None
        self.base_url = self.proc.stdout.readline().strip()
        if not self.base_url.startswith("http"):
            self.proc.kill()
            raise RuntimeError("fake LLM server did not start")
        return self

    def __exit__(self, *exc: object) -> None:
        if self.proc is not None:
            assert self.proc.stdin is not None
            self.proc.stdin.close()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


class TimedLLM(LLMClient):
    """LLMClient that records each call's wall time under the bench message id found in the
    last user message (the bench puts `[<message_id>]` at the end of every text)."""

    def __init__(self, *a: Any, **kw: Any) -> None:
        super().__init__(*a, **kw)
        self.times: dict[str, float] = {}
        self.server: dict[str, float] = {}

    async def chat(self, messages: list[dict[str, Any]], **kw: Any):  # type: ignore[override]
        t0 = time.perf_counter()
        result = await super().chat(messages, **kw)
        dt = time.perf_counter() - t0
        key = _bench_id(messages)
        if key is not None:
            self.times[key] = self.times.get(key, 0.0) + dt
            self.server[key] = self.server.get(key, 0.0) + float(result.raw.get("x_server_s") or 0.0)
        return result


def _bench_id(messages: list[dict[str, Any]]) -> str | None:
    for m in reversed(messages):
        if m.get("role") == "user" and isinstance(m.get("content"), str):
            text = m["content"]
            if text.endswith("]") and "[" in text:
                return text[text.rindex("[") + 1 : -1]
            return None
    return None


# --------------------------------------------------------------------------- adapter


class BenchAdapter(LoopbackAdapter):
    """The loopback adapter, not recording: the bench pushes messages into the sink and
    awaits the reply future; a reply resolves it with the time the gateway handed it over."""

    def __init__(self) -> None:
        super().__init__(PLATFORM, record=False, on_send=self._replied)
        self.waiting: dict[str, asyncio.Future[float]] = {}
        self.kinds: Counter[str] = Counter()

    def _replied(self, message: OutboundMessage) -> None:
        now = time.perf_counter()
        self.kinds[message.kind] += 1
        fut = self.waiting.pop(message.reply_to_message_id or "", None)
        if fut is not None and not fut.done():
            fut.set_result(now)


# --------------------------------------------------------------------------- helpers


def rss_kib() -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


def peak_rss_kib() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    k = max(0, min(len(s) - 1, round(q / 100 * (len(s) - 1))))
    return s[k]


def ms(v: float) -> float:
    return round(v * 1000, 3)


def schedule(tenants: int, messages: int, order: str) -> list[tuple[int, int]]:
    if order == "grouped":
        return [(t, i) for t in range(tenants) for i in range(messages)]
    return [(t, i) for i in range(messages) for t in range(tenants)]


def tenant_user(t: int) -> str:
    return f"u{t:06d}"


class Sampler:
    """Peak thread count and open fds while a phase runs (sampled every 250 ms)."""

    def __init__(self) -> None:
        self.threads = threading.active_count()
        self.fds = open_fds()
        self._task: asyncio.Task[None] | None = None

    async def _run(self) -> None:
        while True:
            self.threads = max(self.threads, threading.active_count())
            self.fds = max(self.fds, open_fds())
            await asyncio.sleep(0.25)

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass


class WarnCounter(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.records: Counter[str] = Counter()

    def emit(self, record: logging.LogRecord) -> None:
        self.records[f"{record.levelname} {record.name}: {record.getMessage()[:160]}"] += 1


# --------------------------------------------------------------------------- gateway phase


def encryption(args: argparse.Namespace) -> dict[str, str]:
    """storage.encryption per_tenant with a fresh master key in this process's environment."""
    if not args.encryption:
        return {}
    from agent.vault import new_master_key

    os.environ.setdefault("HERMES_BENCH_MASTER_KEY", new_master_key())
    return {"encryption": "per_tenant", "master_key_env": "HERMES_BENCH_MASTER_KEY"}


async def run_gateway(args: argparse.Namespace, data_dir: Path, base_url: str) -> dict[str, Any]:
    from core.settings import parse_config
    from gateway.build import build_gateway
    from tenancy import profiles as profiles_mod

    cfg = parse_config(
        {
            "data_dir": str(data_dir),
            "llm": {"base_url": base_url, "model": "bench-model", "max_retries": 0, "timeout_s": 60},
            "storage": {"fsync": args.fsync, "io_threads": args.io_threads, **encryption(args)},
            "tenancy": {} if args.max_open is None else {"max_open_profiles": args.max_open},
            "limits": {"rate_limit_per_minute": 1_000_000},
        }
    )
    llm = TimedLLM(base_url, "bench-model", timeout_s=60, max_retries=0)
    adapter = BenchAdapter()
    app = build_gateway(cfg, [adapter], llm=llm)
    args.max_open = app.profiles.max_open  # what the budget, the fd limit and --max-open allow

    # Instrumentation (bench process only): count and time profile opens and closes. Skipped
    # quietly if the core renames these, so the bench keeps running.
    churn = {"opens": 0, "open_s": 0.0, "closes": 0, "close_s": 0.0}
    pm = app.profiles
    orig_open = getattr(pm, "_open_profile", None)
    orig_close = getattr(getattr(profiles_mod, "Profile", None), "close", None)
    if orig_open is not None:

        async def timed_open(*a: Any, **kw: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return await orig_open(*a, **kw)
            finally:
                churn["opens"] += 1
                churn["open_s"] += time.perf_counter() - t0

        pm._open_profile = timed_open  # type: ignore[method-assign]
    if orig_close is not None:

        async def timed_close(self: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return await orig_close(self)
            finally:
                churn["closes"] += 1
                churn["close_s"] += time.perf_counter() - t0

        profiles_mod.Profile.close = timed_close  # type: ignore[method-assign]

    msg_ids = itertools.count(1)
    failures: Counter[str] = Counter()
    locks = [asyncio.Lock() for _ in range(args.tenants)]

    class Run:
        """Per-turn records of one driven workload: message id -> (round, start, end)."""

        def __init__(self) -> None:
            self.turns: dict[str, tuple[int, float, float]] = {}

        def overheads(self, keys: list[str] | None = None) -> list[float]:
            keys = list(self.turns) if keys is None else keys
            return [self.turns[k][2] - self.turns[k][1] - llm.times.get(k, 0.0) for k in keys]

    async def one(run: Run, t: int, i: int) -> None:
        user = tenant_user(t)
        mid = f"m{next(msg_ids)}"
        msg = InboundMessage(
            platform=PLATFORM,
            chat_id=f"dm-{user}",
            chat_type="dm",
            user_id=user,
            user_name=f"User {t}",
            message_id=mid,
            text=f"Hello, this is message {i + 1} from tenant {t}. How are you? [{mid}]",
        )
        fut: asyncio.Future[float] = asyncio.get_running_loop().create_future()
        adapter.waiting[mid] = fut
        assert adapter.sink is not None
        t0 = time.perf_counter()
        await adapter.sink(msg)
        try:
            t1 = await asyncio.wait_for(fut, 120)
        except TimeoutError:
            failures["timeout"] += 1
            adapter.waiting.pop(mid, None)
            return
        run.turns[mid] = (i, t0, t1)

    async def drive(work: list[tuple[int, int]], concurrency: int) -> Run:
        run = Run()
        it = iter(work)

        async def worker() -> None:
            for t, i in it:
                async with locks[t]:  # one message in flight per tenant, in order
                    await one(run, t, i)

        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return run

    sampler = Sampler()
    rss_before = rss_kib()
    fds_before = open_fds()
    await app.start()
    try:  # a failing turn must not leave the app (and its non-daemon threads) running
        sampler.start()
        work = schedule(args.tenants, args.messages, args.order)
        pool = getattr(app, "storage_pool", None)
        calls0 = getattr(pool, "calls", 0)
        storage_cpu0 = getattr(pool, "cpu_s", 0.0)
        cpu0 = time.process_time()
        t_start = time.perf_counter()
        load = await drive(work, args.concurrency)
        drained = await app.drain(120)
        elapsed = time.perf_counter() - t_start
        cpu = time.process_time() - cpu0
        storage_calls = getattr(pool, "calls", 0) - calls0
        storage_cpu = getattr(pool, "cpu_s", 0.0) - storage_cpu0
        peak_rss = peak_rss_kib()
        open_after_load = pm.open_count
        churn_load = dict(churn)

        # Unloaded probes, one conversation at a time. Warm: the most recently used tenants,
        # whose profiles are open. Cold (only when tenants > max_open): the least recently used
        # tenants, whose profiles were closed by the LRU, so each turn reopens one (and closes one).
        probes: dict[str, dict[str, float]] = {}
        if args.probe > 0:
            n_warm = min(args.tenants, args.max_open, 32)
            warm = list(range(args.tenants - n_warm, args.tenants))
            plans = {"warm": [(warm[k % n_warm], args.messages + k // n_warm) for k in range(args.probe)]}
            if args.tenants > args.max_open:
                n_cold = min(args.probe, args.tenants - args.max_open)
                plans["cold"] = [(t, args.messages) for t in range(n_cold)]
            for name, plan in plans.items():
                before = dict(churn)
                calls_before = getattr(pool, "calls", 0)
                run = await drive(plan, 1)
                await app.drain(60)
                over = run.overheads()
                probes[name] = {
                    "turns": len(over),
                    "overhead_p50_ms": ms(pct(over, 50)),
                    "overhead_p99_ms": ms(pct(over, 99)),
                    "llm_p50_ms": ms(pct([llm.times.get(k, 0.0) for k in run.turns], 50)),
                    "profile_opens": churn["opens"] - before["opens"],
                    "storage_calls_per_turn": round((getattr(pool, "calls", 0) - calls_before) / max(len(over), 1), 2),
                }

    finally:
        await sampler.stop()
        await app.stop()
        await llm.aclose()
    if orig_close is not None:
        profiles_mod.Profile.close = orig_close  # type: ignore[method-assign]

    turns = len(load.turns)
    keys = list(load.turns)
    over_all = load.overheads()
    over_first = load.overheads([k for k in keys if load.turns[k][0] == 0])
    over_rest = load.overheads([k for k in keys if load.turns[k][0] > 0])
    walls = [e - s for _, s, e in load.turns.values()]
    rounds: dict[str, float] = {}
    if args.order == "interleaved" and args.messages > 1 and turns:
        r1 = [(s, e) for r, s, e in load.turns.values() if r == 0]
        rn = [(s, e) for r, s, e in load.turns.values() if r > 0]
        if r1 and rn:
            rounds = {
                "first_round_turns_per_s": round(len(r1) / (max(e for _, e in r1) - min(s for s, _ in r1)), 1),
                "later_rounds_turns_per_s": round(len(rn) / (max(e for _, e in rn) - min(s for s, _ in rn)), 1),
            }
    leftovers = {
        "lanes_queues": len(getattr(app.lanes, "_queues", ())),
        "lanes_workers": len(getattr(app.lanes, "_workers", ())),
        "profiles_opening": len(getattr(pm, "_opening", ())),
        "profiles_open_after_stop": pm.open_count,
        "adapter_waiting": len(adapter.waiting),
        "fds_delta_after_stop": open_fds() - fds_before,
    }
    return {
        "turns": turns,
        "elapsed_s": round(elapsed, 3),
        "turns_per_s": round(turns / elapsed, 1),
        "messages_per_s": round(2 * turns / elapsed, 1),
        **rounds,
        "cpu_s": round(cpu, 2),
        "cpu_ms_per_turn": round(1000 * cpu / max(turns, 1), 3),
        "storage_calls_per_turn": round(storage_calls / max(turns, 1), 2),
        "storage_cpu_ms_per_turn": round(1000 * storage_cpu / max(turns, 1), 3),
        "overhead_p50_ms": ms(pct(over_all, 50)),
        "overhead_p90_ms": ms(pct(over_all, 90)),
        "overhead_p99_ms": ms(pct(over_all, 99)),
        "overhead_first_turn_p50_ms": ms(pct(over_first, 50)),
        "overhead_later_turns_p50_ms": ms(pct(over_rest, 50)),
        "wall_p50_ms": ms(pct(walls, 50)),
        "wall_p99_ms": ms(pct(walls, 99)),
        "llm_p50_ms": ms(pct([llm.times.get(k, 0.0) for k in keys], 50)),
        "llm_server_p50_ms": ms(pct([llm.server.get(k, 0.0) for k in keys], 50)),
        "probes": probes,
        "rss_before_kib": rss_before,
        "peak_rss_kib": peak_rss,
        "peak_threads": sampler.threads,
        "peak_fds": sampler.fds,
        "profile_opens": churn_load["opens"],
        "profile_closes": churn_load["closes"],
        "profile_open_ms_mean": round(1000 * churn_load["open_s"] / max(churn_load["opens"], 1), 3),
        "profile_close_ms_mean": round(1000 * churn_load["close_s"] / max(churn_load["closes"], 1), 3),
        "open_profiles_after_load": open_after_load,
        "drained": drained,
        "failures": dict(failures),
        "missing_llm_timings": sum(1 for k in keys if k not in llm.times),
        "reply_kinds": dict(adapter.kinds),
        "leftovers": leftovers,
    }


# --------------------------------------------------------------------------- raw ceiling


def fsync_and_close(fds: list[int]) -> None:
    """Fsync then close descriptors duplicated for the batch syncer."""
    for fd in fds:
        os.fsync(fd)
        os.close(fd)


class RawTenant:
    """One tenant's storage done raw: an O_APPEND journal fd and a sqlite3 connection."""

    __slots__ = ("db", "dirty", "fd", "sid")

    def __init__(self, root: Path, t: int, fsync: str, schema: str) -> None:
        prof = root / "profiles" / tenant_user(t)
        (prof / "sessions").mkdir(parents=True, exist_ok=True)
        self.sid = f"20250101_000000_{t:08x}"
        self.fd = os.open(prof / "sessions" / f"{self.sid}.jsonl", os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        self.db = sqlite3.connect(prof / "state.db", isolation_level=None, check_same_thread=False)
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute(f"PRAGMA synchronous={'FULL' if fsync == 'always' else 'NORMAL'}")
        self.db.executescript(schema)
        self.dirty = False

    def store(self, uid: str, role: str, content: str, fsync: str) -> None:
        ts = time.time()
        line = {
            "type": "message",
            "uid": uid,
            "session_id": self.sid,
            "role": role,
            "content": content,
            "timestamp": ts,
            "meta": {},
        }
        os.write(self.fd, (json.dumps(line, ensure_ascii=False, separators=(",", ":")) + "\n").encode())
        if fsync == "always":
            os.fsync(self.fd)
        else:
            self.dirty = True
        self.db.execute("BEGIN IMMEDIATE")
        self.db.execute(
            "INSERT INTO messages(uid, session_id, role, content, timestamp, token_count, active, compacted, meta)"
            " VALUES (?, ?, ?, ?, ?, ?, 1, 0, '{}')",
            (uid, self.sid, role, content, ts, len(content) // 4),
        )
        self.db.execute("COMMIT")

    def close(self) -> None:
        os.close(self.fd)
        self.db.close()


async def run_raw(args: argparse.Namespace, root: Path) -> dict[str, Any]:
    from agent.sessions import SCHEMA as _SCHEMA

    tenants: dict[int, RawTenant] = {}
    seen: set[int] = set()
    locks = [asyncio.Lock() for _ in range(args.tenants)]
    work = schedule(args.tenants, args.messages, args.order)
    it = iter(work)
    stop = asyncio.Event()
    counter = itertools.count(1)

    table = threading.Lock()  # the tenants dict, against the syncer and concurrent turns

    def fsync_dirty() -> None:
        with table:  # duplicates, so an eviction cannot close a descriptor under the fsync
            fds = []
            for rt in tenants.values():
                if rt.dirty:
                    rt.dirty = False
                    fds.append(os.dup(rt.fd))
        fsync_and_close(fds)

    async def batch_syncer() -> None:
        while not stop.is_set():
            await asyncio.sleep(0.05)
            await asyncio.to_thread(fsync_dirty)

    # Each open tenant holds 4 descriptors (journal, db, -wal, -shm); beyond what the fd
    # limit allows, the least recently used tenant is closed (only at ~5,000+ tenants).
    soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    max_open = max(64, (soft - open_fds() - 256) // 4)
    reopened = 0

    def turn(t: int, i: int) -> None:
        nonlocal reopened
        with table:
            rt = tenants.pop(t, None)
        if rt is None:
            rt = RawTenant(root, t, args.fsync, _SCHEMA)
            with table:
                reopened += t in seen
                seen.add(t)
                while len(tenants) >= max_open:
                    old = tenants.pop(next(iter(tenants)))
                    if old.dirty:
                        os.fsync(old.fd)
                    old.close()
        with table:
            tenants[t] = rt  # most recently used last
        n = next(counter)
        rt.store(f"in-{n}", "user", f"Hello, this is message {i + 1} from tenant {t}. How are you? [m{n}]", args.fsync)
        rt.store(f"out-{n}", "assistant", "ok, noted.", args.fsync)

    async def worker() -> None:
        for t, i in it:
            async with locks[t]:
                await asyncio.to_thread(turn, t, i)

    syncer = asyncio.get_running_loop().create_task(batch_syncer()) if args.fsync == "batch" else None
    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(args.concurrency)))
    elapsed = time.perf_counter() - t0
    stop.set()
    if syncer is not None:
        await syncer
    if args.fsync != "never":
        fsync_dirty()
    for rt in tenants.values():
        rt.close()
    turns = len(work)
    return {
        "turns": turns,
        "messages": 2 * turns,
        "elapsed_s": round(elapsed, 3),
        "messages_per_s": round(2 * turns / elapsed, 1),
        "max_open": max_open,
        "reopened": reopened,
    }


# --------------------------------------------------------------------------- machine


def machine_info() -> dict[str, Any]:
    cpu = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem = ""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal"):
                mem = f"{int(line.split()[1]) // 1024} MiB"
                break
    except OSError:
        pass
    return {
        "nproc": os.cpu_count(),
        "cpu": cpu,
        "memory": mem,
        "python": platform.python_version(),
        # profiles run on APSW's bundled SQLite, gateway.db on the stdlib's (docs/concepts.md#session-storage)
        "sqlite": f"{apsw.sqlite_lib_version()} (APSW, state.db), {sqlite3.sqlite_version} (stdlib, gateway.db)",
        "loadavg_start": os.getloadavg(),
        "git": git_state(),
    }


def disk_info(path: Path) -> str:
    """Filesystem type and block device of `path` (longest mount prefix in /proc/mounts)."""
    try:
        best = ("", "", "")
        real = str(path.resolve())
        for line in Path("/proc/mounts").read_text().splitlines():
            dev, mnt, fstype = line.split()[:3]
            if (real == mnt or real.startswith(mnt.rstrip("/") + "/")) and len(mnt) >= len(best[1]):
                best = (dev, mnt, fstype)
        dev, mnt, fstype = best
        kind = ""
        name = Path(dev).name
        for cand in (name, name.rstrip("0123456789"), name.split("p")[0]):
            rot = Path(f"/sys/block/{cand}/queue/rotational")
            if cand and rot.exists():
                kind = ", rotational" if rot.read_text().strip() == "1" else ", non-rotational"
                break
        return f"{fstype} on {dev} (mounted at {mnt}{kind})"
    except (OSError, ValueError):
        return "unknown"


def git_state() -> str:
    if os.environ.get("HERMES_BENCH_CODE"):  # a copy of the tree outside git (see run_suite.py)
        return os.environ["HERMES_BENCH_CODE"]
    try:
        head = subprocess.run(
            ["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=5
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", str(REPO), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            timeout=5,
        ).stdout.split("\n")
        n = sum(1 for line in dirty if line.strip())
        return f"{head}{f' + {n} modified file(s)' if n else ''}" if head else "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


# --------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--tenants", type=int, default=1000)
    p.add_argument("--messages", type=int, default=5, help="messages per tenant")
    p.add_argument("--fsync", choices=("always", "batch", "never"), default="batch")
    p.add_argument("--concurrency", type=int, default=64, help="conversations in flight at once")
    p.add_argument(
        "--max-open",
        type=int,
        default=None,
        help="tenancy.max_open_profiles (default: unset, the memory budget decides)",
    )
    p.add_argument("--order", choices=("interleaved", "grouped"), default="interleaved")
    p.add_argument(
        "--probe",
        type=int,
        default=200,
        help="turns of the unloaded (concurrency 1) overhead probe after the load; 0 = skip",
    )
    p.add_argument("--io-threads", type=int, default=4, help="storage.io_threads (default: shipped 4)")
    p.add_argument("--no-raw", action="store_true", help="skip the raw storage ceiling")
    p.add_argument(
        "--encryption", action="store_true", help="storage.encryption: per_tenant (docs/privacy.md#encryption-at-rest)"
    )
    p.add_argument(
        "--data-dir",
        type=Path,
        default=None,
        help="parent dir for the temp data dirs (default: system temp); removed afterwards",
    )
    p.add_argument("--keep", action="store_true", help="keep the data dirs")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the report")
    p.add_argument(
        "--profile", type=Path, default=None, help="write a cProfile of the gateway phase to this file (slows it down)"
    )
    return p.parse_args(argv)


def report(res: dict[str, Any]) -> str:
    a, g, r, m = res["args"], res["gateway"], res.get("raw"), res["machine"]
    lines = [
        f"hermes-gateway bench: {a['tenants']} tenants x {a['messages']} messages, fsync={a['fsync']}, "
        f"concurrency={a['concurrency']}, max_open_profiles={a['max_open']}, order={a['order']}, io_threads={a.get('io_threads', 4)}",
        f"machine: {m['nproc']} cpu ({m['cpu']}), {m['memory']}, Python {m['python']}, SQLite {m['sqlite']}, "
        f"disk {res.get('disk', '?')}, load avg at start {m['loadavg_start'][0]:.2f}, code {m['git']}",
        "",
        f"gateway  : {g['turns']} turns in {g['elapsed_s']:.2f} s = {g['turns_per_s']:.0f} turns/s = "
        f"{g['messages_per_s']:.0f} messages/s  (CPU {g['cpu_ms_per_turn']:.2f} ms/turn, all threads; "
        f"{g.get('storage_calls_per_turn', 0):.2f} storage pool calls/turn incl. profile opens and closes, "
        f"{g.get('storage_cpu_ms_per_turn', 0):.2f} ms CPU/turn in them)",
        f"overhead : p50 {g['overhead_p50_ms']:.2f} ms, p90 {g['overhead_p90_ms']:.2f} ms, "
        f"p99 {g['overhead_p99_ms']:.2f} ms per turn at concurrency {a['concurrency']} "
        f"(first turn of a tenant p50 {g['overhead_first_turn_p50_ms']:.2f} ms, later turns p50 "
        f"{g['overhead_later_turns_p50_ms']:.2f} ms)",
        f"llm      : p50 {g['llm_p50_ms']:.2f} ms per call at the client (server side {g['llm_server_p50_ms']:.3f} ms); "
        f"turn wall p50 {g['wall_p50_ms']:.2f} ms, p99 {g['wall_p99_ms']:.2f} ms",
    ]
    if "later_rounds_turns_per_s" in g:
        lines.append(
            f"rounds   : first round (every tenant's profile created) {g['first_round_turns_per_s']:.0f} turns/s, "
            f"later rounds {g['later_rounds_turns_per_s']:.0f} turns/s"
        )
    for name, pr in g["probes"].items():
        what = (
            "warm: profile open"
            if name == "warm"
            else "cold: profile closed by the LRU, reopened (and another closed) in the turn"
        )
        lines.append(
            f"unloaded : p50 {pr['overhead_p50_ms']:.2f} ms, p99 {pr['overhead_p99_ms']:.2f} ms overhead per turn "
            f"({pr['turns']} turns at concurrency 1, {what}; llm p50 {pr['llm_p50_ms']:.2f} ms)"
        )
    lines += [
        f"profiles : {g['profile_opens']} opens ({g['profile_open_ms_mean']:.2f} ms mean), {g['profile_closes']} "
        f"closes ({g['profile_close_ms_mean']:.2f} ms mean) during the load; {g['open_profiles_after_load']} open after it",
        f"memory   : peak RSS {g['peak_rss_kib'] / 1024:.1f} MiB (before start {g['rss_before_kib'] / 1024:.1f} MiB), "
        f"peak threads {g['peak_threads']}, peak fds {g['peak_fds']}",
    ]
    if r:
        lines.append(
            f"raw      : {r['messages']} messages in {r['elapsed_s']:.2f} s = {r['messages_per_s']:.0f} "
            f"messages/s (journal append + 1 SQLite insert per message, same fsync, same concurrency)"
        )
        lines.append(f"share    : gateway reaches {100 * res['share_of_raw']:.1f}% of the raw ceiling")
    problems = []
    if g["failures"]:
        problems.append(f"failures {g['failures']}")
    if not g["drained"]:
        problems.append("gateway did not drain")
    if g["missing_llm_timings"]:
        problems.append(f"{g['missing_llm_timings']} turns without an LLM timing")
    if set(g["reply_kinds"]) - {"reply"}:
        problems.append(f"reply kinds {g['reply_kinds']}")
    left = {k: v for k, v in g["leftovers"].items() if v}
    if left:
        problems.append(f"left over after stop: {left}")
    if res.get("warnings"):
        problems.append(
            f"{sum(res['warnings'].values())} warning/error log records: " + "; ".join(list(res["warnings"])[:3])
        )
    lines.append("problems : " + ("; ".join(problems) if problems else "none"))
    return "\n".join(lines)


async def amain(args: argparse.Namespace) -> dict[str, Any]:
    result: dict[str, Any] = {
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "machine": machine_info(),
    }
    warn = WarnCounter()
    logging.getLogger().addHandler(warn)
    logging.getLogger().setLevel(logging.WARNING)
    parent = args.data_dir
    if parent is not None:
        parent.mkdir(parents=True, exist_ok=True)
    root = Path(tempfile.mkdtemp(prefix="hermes-bench-", dir=parent))
    result["disk"] = disk_info(root)
    try:
        with FakeLLMProcess() as fake:
            if args.profile is not None:
                import cProfile

                prof = cProfile.Profile()
                prof.enable()
                result["gateway"] = await run_gateway(args, root / "gateway", fake.base_url)
                prof.disable()
                prof.dump_stats(str(args.profile))
            else:
                result["gateway"] = await run_gateway(args, root / "gateway", fake.base_url)
            result["args"]["max_open"] = args.max_open  # the effective cache size, set by run_gateway
        if not args.no_raw:
            result["raw"] = await run_raw(args, root / "raw")
            result["share_of_raw"] = round(result["gateway"]["messages_per_s"] / result["raw"]["messages_per_s"], 4)
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
        else:
            result["data_dir"] = str(root)
    result["warnings"] = dict(warn.records)
    return result


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.tenants < 1 or args.messages < 1 or args.concurrency < 1:
        raise SystemExit("--tenants, --messages and --concurrency must be >= 1")
    res = asyncio.run(amain(args))
    print(json.dumps(res, indent=2) if args.json else report(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
