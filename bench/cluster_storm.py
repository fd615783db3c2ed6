"""Cluster storm: three `hermes-gateway run` nodes over one shared data dir and one
PostgreSQL schema, fed by a load balancer that spreads Telegram webhooks round-robin,
while a random node is SIGKILLed and restarted every few seconds; then audited.

    python -m bench.cluster_storm --messages 2000 --people 200 [--nodes 3] [--kill-every 2.5 4]
        [--pause] [--pg-restart] [--streaming] [--lease-ttl 3] [--seed 1] [--json out.json]
        [--write BENCHMARKS.md]

The fake Telegram Bot API and the fake model (random latency) run in this process; each
node gets its own config (same `data_dir`, same cluster DSN variable, its own `node_id`,
webhook port, observability port, JSON logs to one file per process life). This process
plays the load balancer: every update is POSTed to the next node in turn and, when that
fails (refused, reset, timeout, non-200), to the next one, until one node acknowledges it,
as a real load balancer with retries does; per chat, updates go out one at a time, in order.

The audit (after everything is answered and the nodes stopped):
- lost: a message acknowledged at ingress that was never answered;
- duplicated answers, by what separates the two copies: the first sender was SIGKILLed
  (`window_kill`) or SIGSTOPped (`window_pause`) between them, PostgreSQL was restarting
  between them (`window_pg`), or nothing (`other`, a bug);
- per person and chat, answers in the order of the messages;
- journals equal SQLite in every profile, `PRAGMA integrity_check` on every database;
- the nodes' audit log (`profile_open` / `profile_close` records with tenant, epoch, node):
  per tenant, no two process lives ever had the profile open at once. A killed process's
  open profiles count as closed at its kill. A process frozen by SIGSTOP cannot close
  anything, so an overlap with a frozen holder is counted apart (`overlaps_paused`) and
  must end with that holder closing the profile within 2 s of its SIGCONT; any other
  overlap is a violation.

`--pause`: mid-run, the node running a deliberately slow turn is SIGSTOPped for
2 x lease_ttl + 2 s and resumed; its late writes must be refused (its log says it was
fenced out) and that message answered once. `--pg-restart`: mid-run, the local
PostgreSQL is restarted (`pg_ctlcluster ... restart`); nodes must wait and lose nothing.
Every run uses a fresh schema (dropped at the end).

`--streaming`: the nodes stream every answer (`delivery.streaming: all`) and the model
writes each answer over about `--stream-s` seconds (default 2.5), so kills land mid-stream.
A message still showing a draft (text ending in "…") is not an answer: the audit counts
final answers only, lost and doubled (`finals_lost`, `finals_doubled`), and apart from them
the drafts left stale above a final answer (`stale_drafts`: the send window of a draft's
first message) and the streams a SIGKILLed node started that another node finished
(`streams_taken_over`: the final text is an edit by another process life of the draft the
killed one sent, or a new message under its stale draft).
`--reminders N`: N of the messages ask the model to set a reminder ("remind in <s>s as rm<k>",
due `--reminder-due` s later), and one reminder 10 minutes overdue is in a person's
reminders.json before the nodes start (found when that person's profile opens). Audited:
every reminder whose setting message was answered is delivered (`reminders_lost`), each
occurrence once (a copy beyond the occurrences PostgreSQL recorded is a duplicate, classified
like answers; a turn re-run after a kill may set a reminder twice, counted apart as
`reminders_set_again`), and a delivery says it is late exactly when it is (more than 2
minutes). A done inbox row keeps no text, so an occurrence (`reminder:<owner>:<id>:<due>`, its
due time in its id) is matched to its rm token by the copy its lane keeps in the person's
session (state.db, meta.reminder); one answered yet in no session is `reminders_unrecorded`.
`--reminder-takeover`: mid-run, the node that ran a reminder-setting turn is
SIGKILLed right after answering, the reminder due half a lease later; another node must
deliver it once, and its lateness is reported (`takeover_late_s`).

Discord (`--discord-share`, default 0.2 of the messages; `--shards`, default 3): the nodes
also run the fake Discord with `platforms.discord.shard_count` shards, which the ingress
election spreads over them; people write DMs (shard 0) and mention the bot in guilds chosen
to cover every shard. Discord does not redeliver gateway events, so a message sent while
no node holds its shard is "missed" (counted apart, as bench/killstorm.py does); every
message a node recorded (in the PostgreSQL inbox) must be answered, by REST from whichever
node ran the turn. Audited besides (from the fake's view, `FakeDiscord.shard_sessions`):
no shard connection taken over while another node still held it open (`shard_preempted`),
and every shard a SIGKILLed node held taken over by another node, with a message of that
shard sent after the takeover answered (`takeovers_unproven` counts those without).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
import zlib
from collections import defaultdict
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import asdict, dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, TextIO
from urllib.parse import quote

import aiohttp

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from agent.reminders import ReminderChat, ReminderStore  # noqa: E402
from bench.storm_audit import (  # noqa: E402
    REMINDER_TOKEN_RE,
    TOKEN_RE,
    order_violations,
    profile_problems,
    reminder_due,
    reminder_records,
    responder,
    spread,
)
from tenancy.keys import tenant_dir  # noqa: E402
from tests.fakes.discord_api import FakeDiscord  # noqa: E402
from tests.fakes.llm import FakeLLM  # noqa: E402
from tests.fakes.telegram_api import FakeTelegram, Pushed  # noqa: E402

TG_TOKEN = "123456:AAEclusterstormFAKEtoken_-storm"
DC_TOKEN = "fake-discord-cluster-storm-token.abc123"
SECRET = "cluster-storm-webhook-secret"
BOT = "hermes_cluster_bot"
BIN = Path(sys.executable).parent / "hermes-gateway"
BASE_DSN = os.environ.get("HERMES_TEST_PG_DSN", "postgresql://postgres@127.0.0.1:5432/test")
SLOW_WORD = "slowpoke"  # the model holds turns with this word (the --pause scenario)
TAKEOVER_REMINDER = "rm9000"  # the reminder of the takeover scenario (--reminder-takeover)
OVERDUE_REMINDER = "rm8999"  # in a profile's file, 10 minutes overdue, before the nodes start
LATE_AFTER_S = 120.0  # gateway/reminders.py: later than this, a delivery says it is late
FENCED_HINTS = ("fenced", "lease_lost")  # in a log record: a write refused, a profile closed for a lost lease


# --------------------------------------------------------------------------- PostgreSQL


def pg_reachable(dsn: str = BASE_DSN) -> str | None:
    """None when PostgreSQL answers, else the first line of why not."""
    import psycopg

    try:
        psycopg.connect(dsn, connect_timeout=3).close()
    except psycopg.Error as err:
        return str(err).strip().splitlines()[0]
    return None


def pg_cluster() -> list[str] | None:
    """`[version, "main"]` for pg_ctlcluster, or None where it cannot restart the server."""
    if shutil.which("pg_ctlcluster") is None or not Path("/etc/postgresql").is_dir():
        return None
    versions = sorted(os.listdir("/etc/postgresql"))
    return [versions[-1], "main"] if versions else None


def ensure_pg_running() -> None:
    cluster = pg_cluster()
    if cluster is None or pg_reachable() is None:
        return
    subprocess.run(["pg_ctlcluster", "--skip-systemctl-redirect", *cluster, "start"], check=False, capture_output=True)


@contextlib.contextmanager
def fresh_schema(base_dsn: str = BASE_DSN) -> Iterator[str]:
    """A new schema for one run; yields the DSN whose search_path is that schema."""
    import psycopg

    name = f"hermes_storm_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(base_dsn, autocommit=True) as conn:
        conn.execute(f'CREATE SCHEMA "{name}"')
    sep = "&" if "?" in base_dsn else "?"
    try:
        yield f"{base_dsn}{sep}options={quote(f'-csearch_path={name}')}"
    finally:
        ensure_pg_running()
        for _ in range(30):
            try:
                with psycopg.connect(base_dsn, autocommit=True, connect_timeout=3) as conn:
                    conn.execute(f'DROP SCHEMA "{name}" CASCADE')
                break
            except psycopg.OperationalError:
                time.sleep(1)


# --------------------------------------------------------------------------- the audit (pure)


@dataclass
class Life:
    """One process life of a node: from spawn to SIGKILL or exit."""

    node: str
    index: int
    log: Path
    started: float  # wall clock
    ended: float | None = None  # wall clock of the SIGKILL or of the exit
    killed: bool = False
    stops: list[tuple[float, float]] = field(default_factory=list)  # (SIGSTOP, SIGCONT), wall clock


@dataclass
class Interval:
    tenant: str
    node: str
    life: int
    epoch: Any
    start: float
    end: float
    ended_by: str  # "close", "kill", "exit" (open when the process ended)
    reason: str = ""  # the close record's reason, if any


def parse_ts(value: Any) -> float | None:
    """A log record's time: epoch seconds, or ISO 8601 as the JSON formatter writes it."""
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, str):
        try:
            return datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()
        except ValueError:
            return None
    return None


def read_records(path: Path) -> list[dict[str, Any]]:
    """The JSON records of a log file (other lines, e.g. a dying process's half line, skipped)."""
    out = []
    if not path.exists():
        return out
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        line = line.strip()
        if not line.startswith("{"):
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(rec, dict):
            out.append(rec)
    return out


def profile_intervals(lives: list[Life]) -> tuple[list[Interval], list[str]]:
    """Open/close intervals per process life from its audit records; anomalies besides."""
    intervals, anomalies = [], []
    for life in lives:
        open_now: dict[str, tuple[float, Any]] = {}
        for rec in read_records(life.log):
            event = rec.get("event")
            if event not in ("profile_open", "profile_close"):
                continue
            tenant, ts = str(rec.get("tenant")), parse_ts(rec.get("ts"))
            if ts is None:
                anomalies.append(f"{life.node}#{life.index}: {event} without a readable ts: {rec}")
                continue
            if event == "profile_open":
                if tenant in open_now:
                    anomalies.append(f"{life.node}#{life.index}: {tenant} opened again while open")
                open_now[tenant] = (ts, rec.get("epoch"))
            elif tenant in open_now:
                start, epoch = open_now.pop(tenant)
                reason = str(rec.get("reason") or "")
                intervals.append(Interval(tenant, life.node, life.index, epoch, start, ts, "close", reason))
            else:
                anomalies.append(f"{life.node}#{life.index}: {tenant} closed but never opened")
        end = life.ended if life.ended is not None else time.time()
        for tenant, (start, epoch) in open_now.items():
            intervals.append(
                Interval(tenant, life.node, life.index, epoch, start, end, "kill" if life.killed else "exit")
            )
    return intervals, anomalies


WINDOW_MAX_S = 2.0  # the send window is one HTTP answer and one commit: far less than this
RESUME_GRACE_S = 2.0  # a resumed process must have closed what it held within this after SIGCONT


def frozen_holder(lives: list[Life], first: Interval, overlap_end: float) -> tuple[float, float] | None:
    """The SIGSTOP..SIGCONT that explains `first` still being open during an overlap ending at
    `overlap_end`: it froze the holder while it held the profile, before the overlap ended,
    and the holder closed the profile (or died) within RESUME_GRACE_S of its SIGCONT."""
    for life in lives:
        if life.node == first.node and life.index == first.life:
            for a, b in life.stops:
                if first.start <= b and a <= overlap_end and first.end - b <= RESUME_GRACE_S:
                    return a, b
    return None


def find_overlaps(intervals: list[Interval], lives: list[Life]) -> tuple[list[str], list[str]]:
    """(overlaps, overlaps with a frozen holder): pairs of intervals of one tenant, from two
    process lives, that intersect. An overlap explained by the earlier holder having been
    frozen (SIGSTOP) while it held the profile, and closing it within RESUME_GRACE_S of its
    SIGCONT, is counted apart; the text says how long after SIGCONT it closed."""
    by_tenant: dict[str, list[Interval]] = defaultdict(list)
    for iv in intervals:
        by_tenant[iv.tenant].append(iv)
    bad, paused = [], []
    for tenant, ivs in by_tenant.items():
        ivs.sort(key=lambda iv: iv.start)
        for a, b in itertools.combinations(ivs, 2):
            if (a.node, a.life) == (b.node, b.life) or not (a.start < b.end and b.start < a.end):
                continue
            first, second = (a, b) if a.start <= b.start else (b, a)
            text = (
                f"{tenant}: {first.node}#{first.life} epoch {first.epoch} open {first.start:.3f}-{first.end:.3f} "
                f"({first.ended_by}{' ' + first.reason if first.reason else ''}) and {second.node}#{second.life} epoch {second.epoch} open "
                f"{second.start:.3f}-{second.end:.3f} ({second.ended_by})"
            )
            frozen = frozen_holder(lives, first, min(first.end, second.end))
            if frozen is not None:
                paused.append(
                    f"{text}; {first.node}#{first.life} frozen {frozen[0]:.3f}-{frozen[1]:.3f}, closed "
                    f"{first.end - frozen[1]:.3f} s after SIGCONT"
                )
            else:
                bad.append(text)
    return bad, paused


@dataclass
class Copy:
    via: str | None  # the sending process life, "<node>-<life>"
    at: float  # monotonic, when the fake Telegram accepted it

    @property
    def node(self) -> str:
        return (self.via or "?").rsplit("-", 1)[0]


def copies_by_token(answers: list[tuple[str, Copy]]) -> tuple[dict[str, list[Copy]], dict[str, int]]:
    """Every copy of each answer (by its message token), and how many copies each node sent."""
    copies: dict[str, list[Copy]] = defaultdict(list)
    by_node: dict[str, int] = defaultdict(int)
    for token, copy in answers:
        copies[token].append(copy)
        by_node[copy.node] += 1
    return copies, by_node


@dataclass
class DupCounts:
    window_kill: int = 0
    window_pause: int = 0
    window_pg: int = 0
    other: int = 0
    window_ms: list[float] = field(default_factory=list)  # first copy accepted -> its sender's SIGKILL (>= 0)
    details: list[str] = field(default_factory=list)


def classify_duplicates(
    copies: dict[str, list[Copy]],
    kills: dict[str, float],
    stops: dict[str, list[float]],
    pg_outages: list[tuple[float, float]],
) -> DupCounts:
    """Each later copy of an answer, by what lies between it and the copy before: the end of
    the first copy's sending process (SIGKILL) or its freezing (SIGSTOP), a PostgreSQL
    restart, or nothing. Times are monotonic; `kills` and `stops` are keyed by process life
    ("<node>-<life>", as in `Copy.via`). A killed life cannot send after its kill, so a copy
    the fake recorded a few ms after the kill (the request was already on its way) still
    counts as sent before it. A kill more than WINDOW_MAX_S after the first copy does not
    explain a resend (the sender had all that time to mark it sent)."""
    out = DupCounts()
    for token, seen in copies.items():
        for c1, c2 in itertools.pairwise(seen):
            life = c1.via or "?"
            kill = kills.get(life)
            if kill is not None and kill <= c2.at and kill - c1.at <= WINDOW_MAX_S:
                out.window_kill += 1
                out.window_ms.append(max(0.0, round((kill - c1.at) * 1000, 1)))
            elif any(c1.at <= s <= c2.at for s in stops.get(life, [])):
                out.window_pause += 1
                out.details.append(f"duplicate across a SIGSTOP of {life}: {token} ({c1.via} then {c2.via})")
            elif any(c1.at <= b and a <= c2.at for a, b in pg_outages):
                out.window_pg += 1
                out.details.append(f"duplicate across a PostgreSQL restart: {token} ({c1.via} then {c2.via})")
            else:
                out.other += 1
                frozen = [s for s in stops.get(c2.via or "?", []) if s <= c2.at]
                late = (
                    f"; the second sender {c2.via} had been frozen (SIGSTOP) {c2.at - frozen[-1]:.1f} s before it sent"
                    if frozen
                    else ""
                )
                out.details.append(
                    f"duplicate with nothing between: {token} by {c1.via} then {c2.via}, "
                    f"{(c2.at - c1.at) * 1000:.0f} ms apart{late}"
                )
    return out


# --------------------------------------------------------------------------- the storm


@dataclass
class ClusterResult:
    nodes: int = 0
    messages: int = 0
    people: int = 0
    lease_ttl_s: float = 0.0
    kills: int = 0
    pauses: int = 0
    pg_restarts: int = 0
    inputs: int = 0
    ingress_retries: int = 0
    ingress_failed: int = 0
    answers: int = 0
    answers_by_node: dict[str, int] = field(default_factory=dict)
    lost: int = 0
    dup_window_kill: int = 0
    dup_window_pause: int = 0
    dup_window_pg: int = 0
    dup_other: int = 0
    order_violations: int = 0
    journal_mismatches: int = 0
    integrity_failures: int = 0
    audit_records: int = 0
    audit_tenants: int = 0
    overlaps: int = 0
    overlaps_paused: int = 0
    audit_anomalies: int = 0
    paused_fenced_records: int = 0  # the paused node's log records about being fenced, after SIGCONT
    paused_fenced_metric: float = 0.0
    paused_turns_fenced: int = 0  # its "turn_fenced" records after SIGCONT: the held turn was stopped
    paused_message_answers: int = -1  # copies of the answer to the message held during the pause
    paused_node: str = ""
    paused_message_by: list[str] = field(default_factory=list)  # who sent those copies
    pg_outage_s: list[float] = field(default_factory=list)
    window_ms: list[float] = field(default_factory=list)
    # Discord (zero when the storm runs without it)
    shards: int = 0
    dc_sent: int = 0  # messages people sent on Discord
    dc_recorded: int = 0  # ... that a node took in (in the PostgreSQL inbox)
    dc_missed: int = 0  # ... sent while no node held their shard (Discord does not redeliver)
    dc_answers: int = 0
    dc_answers_by_node: dict[str, int] = field(default_factory=dict)
    dc_lost: int = 0
    dc_dup_window_kill: int = 0
    dc_dup_other: int = 0
    dc_nonce_replays: int = 0  # resends the fake answered with the first message (the window closed)
    dc_order_violations: int = 0
    shard_sessions: int = 0
    shard_preempted: int = 0  # a shard connection taken over while another node held it open
    shard_preempted_paused: int = 0  # ... whose holder was frozen by SIGSTOP (counted apart)
    shard_takeovers: int = 0  # shards of a SIGKILLed node later held by another node
    takeovers_unproven: int = 0  # ... with no message of that shard answered after the takeover
    dm_takeovers_answered: int = 0  # takeovers of shard 0 followed by an answered DM
    # streaming (zero when the storm runs without it)
    streaming: bool = False
    streamed_finals: int = 0  # final answers that replaced a draft (the message was edited)
    finals_lost: int = 0  # messages taken in (Telegram and Discord) without a final answer
    finals_doubled: int = 0  # messages with more than one final answer (any cause)
    stale_drafts: int = 0  # messages left showing a draft
    stale_drafts_by_killed: int = 0  # ... sent by a process life that was then SIGKILLed
    streams_taken_over: int = 0  # answers whose draft a killed life sent and another life finished
    restart_s: list[float] = field(default_factory=list)  # spawn -> webhook answering
    # reminders (zero when the storm runs without them)
    reminders_set: int = 0  # reminder-setting messages answered (the tool ran)
    reminders_delivered: int = 0  # reminders (rm tokens) delivered at least once
    reminders_lost: int = 0
    reminder_occurrences: int = 0  # recorded in the PostgreSQL inbox
    reminders_set_again: int = 0  # ... beyond one per rm token: a turn run again after a kill set it again
    reminders_dup_window_kill: int = 0
    reminders_dup_other: int = 0
    reminders_late_wrong: int = 0  # said late when it was not, or not when it was
    reminders_unrecorded: int = 0  # occurrences answered in the inbox but kept in no session
    reminder_lateness_s: list[float] = field(default_factory=list)
    overdue_said_late: bool = False
    takeover_killed: str = ""  # the process life killed while its reminder was due
    takeover_fired_by: list[str] = field(default_factory=list)
    takeover_late_s: float = -1.0  # delivered minus due
    nodes_crashed: list[str] = field(default_factory=list)  # exits the harness did not cause
    seconds: float = 0.0
    details: list[str] = field(default_factory=list)

    def targets_met(self) -> bool:
        return (
            self.lost == 0
            and self.ingress_failed == 0
            and self.dup_other == 0
            and self.order_violations == 0
            and self.journal_mismatches == 0
            and self.integrity_failures == 0
            and self.overlaps == 0
            and self.audit_records > 0
            and not self.nodes_crashed
            and (self.pauses == 0 or self.paused_turns_fenced > 0)
            and (self.pauses == 0 or self.paused_message_answers == 1)
            and self.paused_node not in self.paused_message_by
            and self.dc_lost == 0
            and self.dc_dup_other == 0
            and self.shard_preempted == 0
            and self.takeovers_unproven == 0
            and (not self.streaming or (self.finals_lost == 0 and self.finals_doubled == 0))
            and self.reminders_lost == 0
            and self.reminders_dup_other == 0
            and self.reminders_late_wrong == 0
            and self.reminders_unrecorded == 0
        )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Node:
    name: str
    config: Path
    webhook_port: int
    obs_port: int
    proc: asyncio.subprocess.Process | None = None
    life: Life | None = None
    lives: int = 0
    log_file: TextIO | None = None
    restarting: bool = False

    @property
    def webhook_url(self) -> str:
        return f"http://127.0.0.1:{self.webhook_port}/telegram"

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.returncode is None


def node_config(
    path: Path,
    *,
    name: str,
    data: Path,
    llm: FakeLLM,
    tg: FakeTelegram,
    webhook_port: int,
    obs_port: int,
    lease_ttl_s: float,
    label: str | None = None,
    dc: FakeDiscord | None = None,
    shards: int = 1,
    streaming: bool = False,
    reminders: bool = False,
) -> None:
    """One node's config: everything shared but its id, its ports and its label at the fake
    Telegram and the fake Discord (`label`, default the node id: whom the fakes record as
    the sender). With `dc`, Discord too, in `shards` shards; `streaming`: every answer streamed."""
    platforms: dict[str, Any] = {}
    if dc is not None:
        platforms["discord"] = {
            "enabled": True,
            "token_env": "HERMES_STORM_DC",
            "api_base": dc.api_base_for(label or name),
            "gateway_url": dc.gateway_url_for(label or name),
            "sync_slash_commands": False,
            "shard_count": shards,
        }
    path.write_text(
        json.dumps(
            {
                "data_dir": str(data),
                "llm": {
                    "base_url": llm.base_url,
                    "model": "fake",
                    "timeout_s": 10,
                    "max_retries": 2,
                    "api_key_env": "HERMES_STORM_LLM_KEY",  # the node's name: the model sees who asks
                },
                "storage": {"fsync": "batch"},
                "limits": {"rate_limit_per_minute": 10_000, "max_queued_turns": 1000},
                "delivery": {
                    "streaming": "all" if streaming else "off",
                    "stream_edit_interval_s": 1.0,  # the default: about the platforms' edit pace
                    "retry_initial_s": 0.2,
                    "retry_max_s": 1.0,
                },
                "logging": {"level": "INFO", "format": "json"},
                "observability": {"listen": f"127.0.0.1:{obs_port}"},
                "cluster": {"postgres_dsn_env": "HERMES_STORM_PG", "node_id": name, "lease_ttl_s": lease_ttl_s},
                "reminders": {"enabled": reminders},
                "platforms": {
                    "telegram": {
                        "enabled": True,
                        "token_env": "HERMES_STORM_TG",
                        "base_url": tg.base_url_for(label or name),
                        "mode": "webhook",
                        "webhook": {
                            "listen": "127.0.0.1",
                            "port": webhook_port,
                            "path": "/telegram",
                            "secret_token_env": "HERMES_STORM_SECRET",
                        },
                    },
                    **platforms,
                },
            }
        )
    )  # JSON is YAML


class ClusterStorm:
    def __init__(
        self,
        workdir: Path,
        dsn: str,
        *,
        nodes: int = 3,
        messages: int = 2000,
        people: int = 200,
        seed: int = 1,
        interval: float = 0.04,
        kill_every: tuple[float, float] | None = (2.5, 4.0),
        down_for: tuple[float, float] = (0.3, 1.5),
        pause: bool = False,
        pg_restart: bool = False,
        lease_ttl_s: float = 3.0,
        lb_workers: int = 4,
        model_latency_s: float = 0.15,
        group_share: float = 0.1,
        settle_s: float = 60.0,
        discord_share: float = 0.0,
        shards: int = 3,
        streaming: bool = False,
        stream_s: float = 2.5,
        reminders: int = 0,
        reminder_due_s: float = 4.0,
        reminder_takeover: bool = False,
        say: Callable[[str], None] = print,
    ) -> None:
        self.workdir, self.dsn, self.n_nodes = workdir, dsn, nodes
        self.streaming, self.stream_s = streaming, stream_s
        self.messages, self.people, self.seed, self.interval = messages, people, seed, interval
        self.kill_every, self.down_for = kill_every, down_for
        self.pause, self.pg_restart, self.lease_ttl_s = pause, pg_restart, lease_ttl_s
        self.lb_workers, self.settle_s, self.say = lb_workers, settle_s, say
        self.model_latency_s, self.group_share = model_latency_s, group_share
        self.discord_share, self.shards = discord_share, shards
        self.reminders, self.reminder_due_s, self.reminder_takeover = reminders, reminder_due_s, reminder_takeover
        self.rm_pushed: dict[str, str] = {}  # rm token -> the token of the message that set it
        self.takeover_task: asyncio.Task | None = None
        self.wall_minus_mono = time.time() - time.monotonic()  # the fake's send times are monotonic
        self.dc: FakeDiscord | None = None
        # Discord token -> (message id or None when no session took it, shard, monotonic push time)
        self.dc_pushed: dict[str, tuple[str | None, int, float]] = {}
        self.dc_recorded: set[str] = set()  # Discord message ids seen in the PostgreSQL inbox
        self.queues: list[asyncio.Queue] = []
        self._workers: list[asyncio.Task] = []
        self.rng = random.Random(seed)
        self.result = ClusterResult(
            nodes=nodes,
            messages=messages,
            people=people,
            lease_ttl_s=lease_ttl_s,
            shards=shards if discord_share else 0,
            streaming=streaming,
        )
        self.nodes: list[Node] = []
        self.lives: list[Life] = []
        # token -> (platform, chat key, sender, index in that person's chat)
        self.pushed: dict[str, tuple[str, str, str, int]] = {}
        self.acked: set[str] = set()
        self.acked_by: dict[str, str] = {}  # token -> "n2#3 at <wall time>": who acknowledged it
        self.kills_mono: dict[str, float] = {}  # process life "<node>-<life>" -> its SIGKILL
        self.stops_mono: dict[str, list[float]] = defaultdict(list)  # process life -> its SIGSTOPs
        self.pg_outages_mono: list[tuple[float, float]] = []
        self.sending = True
        self.stopping = False  # the harness is stopping the nodes: exits are expected
        self._pause_task: asyncio.Task | None = None
        self.paused_token: str | None = None
        self.paused_node: Node | None = None
        self._rr = itertools.count()
        self._tasks: set[asyncio.Task] = set()

    # ----------------------------------------------------------------- processes

    def _event(self, what: str, **fields: Any) -> None:
        """One line in logs/harness.log (kills, spawns, pauses, restarts): the evidence's timeline."""
        with open(self.workdir / "logs" / "harness.log", "a", encoding="utf-8") as f:
            f.write(json.dumps({"ts": time.time(), "mono": time.monotonic(), "event": what, **fields}) + "\n")

    def _env(self, node: Node) -> dict[str, str]:
        return dict(
            os.environ,
            HERMES_STORM_TG=TG_TOKEN,
            HERMES_STORM_DC=DC_TOKEN,
            HERMES_STORM_SECRET=SECRET,
            HERMES_STORM_PG=self.dsn,
            HERMES_STORM_LLM_KEY=node.name,
            PYTHONPATH=str(ROOT),
        )

    def _write_config(self, node: Node, label: str) -> None:
        node_config(
            node.config,
            name=node.name,
            data=self.workdir / "data",
            llm=self.llm,
            tg=self.tg,
            webhook_port=node.webhook_port,
            obs_port=node.obs_port,
            lease_ttl_s=self.lease_ttl_s,
            label=label,
            dc=self.dc if self.discord_share else None,
            shards=self.shards,
            streaming=self.streaming,
            reminders=bool(self.reminders or self.reminder_takeover),
        )

    async def _spawn(self, node: Node) -> None:
        node.lives += 1
        self._write_config(node, f"{node.name}-{node.lives}")  # its sends are labelled with this life
        log_path = self.workdir / "logs" / f"{node.name}.{node.lives}.log"
        life = Life(node.name, node.lives, log_path, started=time.time())
        self.lives.append(life)
        node.life = life
        if node.log_file is not None:
            node.log_file.close()
        self._event("spawn", node=node.name, life=node.lives)
        node.log_file = open(log_path, "ab")  # noqa: ASYNC230, SIM115 (this life's log; closed at the next spawn or the end)
        t0 = time.monotonic()
        node.proc = await asyncio.create_subprocess_exec(
            str(BIN),
            "-c",
            str(node.config),
            "run",
            env=self._env(node),
            stdout=node.log_file,
            stderr=node.log_file,
            cwd=str(self.workdir),
        )
        self._spawn_task(self._time_start(node, node.proc, t0))
        self._spawn_task(self._watch_exit(node, node.proc, life))

    async def _time_start(self, node: Node, proc: asyncio.subprocess.Process, t0: float) -> None:
        if await self._wait_up(node, proc, timeout=60):
            self.result.restart_s.append(round(time.monotonic() - t0, 2))

    async def _wait_up(self, node: Node, proc: asyncio.subprocess.Process, timeout: float = 60) -> bool:
        """Until the node's webhook answers something but 503 "starting" (an empty POST
        without the secret gets 403 from a ready node)."""
        deadline = time.monotonic() + timeout
        async with aiohttp.ClientSession() as session:
            while time.monotonic() < deadline and proc.returncode is None:
                try:
                    async with session.post(node.webhook_url, json={}, timeout=aiohttp.ClientTimeout(total=2)) as r:
                        if r.status != 503:
                            return True
                except (aiohttp.ClientError, TimeoutError, OSError):
                    pass
                await asyncio.sleep(0.05)
        return False

    async def _watch_exit(self, node: Node, proc: asyncio.subprocess.Process, life: Life) -> None:
        code = await proc.wait()
        if life.ended is None:
            life.ended = time.time()
        if not life.killed and not self.stopping:
            self.result.nodes_crashed.append(f"{node.name}#{life.index} exited with {code} on its own")

    def _kill(self, node: Node) -> None:
        assert node.proc is not None and node.life is not None
        node.life.killed = True
        node.life.ended = time.time()
        self.kills_mono[f"{node.name}-{node.life.index}"] = time.monotonic()
        node.proc.send_signal(signal.SIGKILL)
        self._event("SIGKILL", node=node.name, life=node.life.index)
        self.result.kills += 1

    def _spawn_task(self, coro) -> asyncio.Task:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    # ----------------------------------------------------------------- the load balancer

    async def _lb_worker(self, queue: asyncio.Queue, session: aiohttp.ClientSession) -> None:
        """Deliver this worker's updates one at a time, each to the next node in turn,
        retrying on the others until one acknowledges it."""
        while True:
            item = await queue.get()
            if item is None:
                return
            token, pushed = item
            attempts, since = 0, time.monotonic()
            while True:
                node = self.nodes[next(self._rr) % len(self.nodes)]
                status = None
                try:
                    async with session.post(
                        node.webhook_url,
                        json=pushed.update,
                        headers={"X-Telegram-Bot-Api-Secret-Token": SECRET},
                        timeout=aiohttp.ClientTimeout(total=2.0),
                    ) as resp:
                        await resp.read()
                        status = resp.status
                except (aiohttp.ClientError, TimeoutError, OSError):
                    status = None
                if status == 200:
                    self.acked.add(token)
                    life = node.life.index if node.life else 0
                    self.acked_by[token] = f"{node.name}#{life} at {time.time():.3f}"
                    break
                attempts += 1
                self.result.ingress_retries += 1
                if attempts % len(self.nodes) == 0:
                    await asyncio.sleep(min(0.05 * 2 ** (attempts // len(self.nodes)), 1.0))
                if time.monotonic() - since > 120:
                    self.result.ingress_failed += 1
                    self.result.details.append(f"ingress gave up on {token} after {attempts} attempts in 120 s")
                    break

    # ----------------------------------------------------------------- traffic

    def _people(self) -> None:
        n_groups = max(1, self.people // 10)
        self.groups = [-1003000000000 - i for i in range(n_groups)]
        self.users = [7000 + i for i in range(self.people)]
        self.group_members = {g: self.users[i::n_groups][:4] for i, g in enumerate(self.groups)}

    def _discord_people(self, dc: FakeDiscord) -> None:
        """Discord users, and one guild channel per shard (guild ids picked to cover them all)."""
        self.dc_users = [dc.add_user(f"p{i}") for i in range(max(2, self.people // 4))]
        self.dc_channels: dict[int, str] = {}  # shard -> a guild channel on it
        deadline = time.monotonic() + 5
        while len(self.dc_channels) < self.shards and time.monotonic() < deadline:
            gid = dc.add_guild(f"g{len(dc.guilds)}")
            shard = (int(gid) >> 22) % self.shards
            self.dc_channels.setdefault(shard, dc.channel_named(gid, "general"))
            time.sleep(0.003)  # the next guild's snowflake in another millisecond
        self.dc_members = {
            c: self.dc_users[i :: len(self.dc_channels)][:4] for i, c in enumerate(self.dc_channels.values())
        }

    def _next_discord(self, n: int, counters: dict[tuple[str, str], int]) -> None:
        """One Discord message, straight onto the fake's gateway (no load balancer: Discord
        pushes to whoever holds the shard, or to nobody)."""
        assert self.dc is not None
        if self.rng.random() < 0.5:
            user = self.rng.choice(self.dc_users)
            channel, key = None, f"dc:{user}"
        else:
            channel = self.rng.choice(list(self.dc_channels.values()))
            user = self.rng.choice(self.dc_members[channel])
            key = f"dc:{channel}"
        idx = counters[(key, user)]
        counters[(key, user)] += 1
        token = f"dk{n}x{idx}"
        text = f"{'please remember' if self.rng.random() < 0.1 else 'hello'} {token}"
        shard = (int(self.dc.channels[channel]["guild_id"]) >> 22) % self.shards if channel else 0
        try:
            msg = (
                self.dc.push_guild_message(channel, user, text, mention_bot=True)
                if channel
                else self.dc.push_dm(user, text)
            )
        except RuntimeError:  # that shard never had a session: nobody hears it
            msg = None
        self.dc_pushed[token] = (msg["id"] if msg else None, shard, time.monotonic())
        self.pushed[token] = ("dc", key, user, idx)

    def _next_message(
        self, n: int, counters: dict[tuple[str, str], int], *, word: str = "hello", dm_from: int | None = None
    ):
        if dm_from is not None:
            user = dm_from
            chat, key = user, f"tg:{user}"
        elif self.rng.random() >= self.group_share:
            user = self.rng.choice(self.users)
            chat, key = user, f"tg:{user}"
        else:
            chat = self.rng.choice(self.groups)
            user = self.rng.choice(self.group_members[chat])
            key = f"tg:{chat}"
        idx = counters[(key, str(user))]
        counters[(key, str(user))] += 1
        token = f"tk{n}x{idx}"
        if word == "hello" and self.rng.random() < 0.1:
            word = "please remember"
        text = f"{word} {token}"
        pushed = (
            self.tg.push_group(chat, user, f"@{BOT} {text}")
            if chat in self.groups
            else self.tg.push_private(user, text)
        )
        self.pushed[token] = ("tg", key, str(user), idx)
        return token, pushed, key

    async def _traffic(self) -> None:
        counters: dict[tuple[str, str], int] = defaultdict(int)
        step = self.messages // (self.reminders + 1) if self.reminders else 0
        for n in range(1, self.messages + 1):
            await asyncio.sleep(self.interval)
            if self.reminder_takeover and n == self.messages // 2 and self.takeover_task is None:
                self.takeover_task = self._spawn_task(self._reminder_takeover(counters))
            if n == 1 and self.reminders:  # its profile opens: the overdue reminder is found
                token, pushed, key = self._next_message(n, counters, dm_from=self.users[0])
                self.send(token, pushed, key)
                continue
            if step and n % step == 0 and n // step <= self.reminders:
                rm = f"rm{n // step}"
                token, pushed, key = self._next_message(n, counters, word=f"remind in {self.reminder_due_s:g}s as {rm}")
                self.rm_pushed[rm] = token
                self.send(token, pushed, key)
                continue
            if self.discord_share and self.rng.random() < self.discord_share:
                self._next_discord(n, counters)
                continue
            token, pushed, key = self._next_message(n, counters)
            self.send(token, pushed, key)
            if n % 250 == 0:
                self.say(f"  {n}/{self.messages} messages, {self.result.kills} kills")
            if self.pause and n == self.messages // 3 and self.paused_node is None:
                self._pause_task = self._spawn_task(self._pause_scenario(counters))
            if self.pg_restart and n == (2 * self.messages) // 3:
                self._spawn_task(self._restart_pg())

    async def _chaos(self) -> None:
        assert self.kill_every is not None
        while self.sending:
            await asyncio.sleep(self.rng.uniform(*self.kill_every))
            if not self.sending:
                return
            candidates = [n for n in self.nodes if n.alive and not n.restarting and n is not self.paused_node]
            if not candidates:
                continue
            node = self.rng.choice(candidates)
            self._kill(node)
            node.restarting = True
            self._spawn_task(self._restart_later(node, self.rng.uniform(*self.down_for)))

    async def _restart_later(self, node: Node, delay: float) -> None:
        assert node.proc is not None
        await node.proc.wait()
        await asyncio.sleep(delay)
        await self._spawn(node)
        node.restarting = False

    async def _reminder_takeover(self, counters: dict[tuple[str, str], int]) -> None:
        """Set a reminder due half a lease later; once its turn's answer is recorded (so the
        turn is not run again) and before the reminder fires, SIGKILL the node holding its
        tenant's lease (the node that would fire it) and keep it down past the due time."""
        import psycopg

        due_s = self.lease_ttl_s / 2
        user = self.users[1]
        token, pushed, key = self._next_message(
            self.messages + 2, counters, word=f"remind in {due_s:g}s as {TAKEOVER_REMINDER}", dm_from=user
        )
        self.rm_pushed[TAKEOVER_REMINDER] = token
        self.send(token, pushed, key)

        # found by its ids: an answered message keeps no text in the inbox (docs/cluster.md#the-postgresql-layer)
        chat_id, message_id = str(pushed.chat_id), str(pushed.message_id)

        def holder() -> str | None:
            """The tenant's live lease holder once the answer is recorded and the reminder not fired."""
            with psycopg.connect(self.dsn, connect_timeout=5) as conn:
                ready = conn.execute(
                    """SELECT 1 FROM inbox WHERE platform = 'telegram' AND chat_id = %s AND message_id = %s
                       AND answered_at IS NOT NULL
                       AND EXISTS (SELECT 1 FROM reminder_due WHERE tenant = %s AND fired_at IS NULL)""",
                    (chat_id, message_id, f"telegram-{user}"),
                ).fetchone()
                if ready is None:
                    return None
                row = conn.execute(
                    "SELECT holder FROM tenant_leases WHERE tenant = %s AND expires_at > now()", (f"telegram-{user}",)
                ).fetchone()
                return row[0] if row else None

        deadline = time.monotonic() + 30
        name = None
        while time.monotonic() < deadline and name is None:
            with contextlib.suppress(psycopg.Error):
                name = await asyncio.to_thread(holder)
            await asyncio.sleep(0.01)
        node = next((x for x in self.nodes if x.name == name), None)
        if node is None or not node.alive or node.restarting or node is self.paused_node or node.life is None:
            self.result.details.append(
                f"reminder takeover: no running holder of the tenant was found ({name}); skipped"
            )
            return
        node.restarting = True  # the chaos loop leaves it alone
        label = f"{node.name}-{node.life.index}"
        self._kill(node)
        self.result.takeover_killed = label
        self.say(f"  killed {label}, which holds the tenant of {TAKEOVER_REMINDER} (due in {due_s:g} s)")
        self._spawn_task(self._restart_later(node, due_s + 2 * self.lease_ttl_s + 2))

    async def _pause_scenario(self, counters: dict[tuple[str, str], int]) -> None:
        """Hold one turn at the model, freeze the node running it past its lease, resume it."""
        n = self.messages + 1
        token, pushed, key = self._next_message(n, counters, word=SLOW_WORD)
        self.paused_token = token
        self.send(token, pushed, key)
        deadline = time.monotonic() + 30
        node = None
        while time.monotonic() < deadline and node is None:
            for i, req in reversed(list(enumerate(self.llm.requests))):  # the latest turn on it first
                if token in json.dumps(req.get("messages", [])):
                    auth = self.llm.request_headers[i].get("Authorization", "")
                    node = next((x for x in self.nodes if auth == f"Bearer {x.name}" and x.alive), None)
                    if node is not None:
                        break
            await asyncio.sleep(0.01)
        if node is None or node.proc is None or node.life is None:
            self.result.details.append("pause: no node picked up the held turn within 30 s; pause skipped")
            return
        self.paused_node = node
        self.result.paused_node = node.name
        life = node.life
        t_stop = time.time()
        self.stops_mono[f"{node.name}-{life.index}"].append(time.monotonic())
        node.proc.send_signal(signal.SIGSTOP)
        self._event("SIGSTOP", node=node.name, life=life.index, token=token)
        self.result.pauses += 1
        await asyncio.sleep(2 * self.lease_ttl_s + 2)
        node.proc.send_signal(signal.SIGCONT)
        t_cont = time.time()
        self._event("SIGCONT", node=node.name, life=life.index)
        life.stops.append((t_stop, t_cont))
        self.say(f"  paused {node.name} for {t_cont - t_stop:.1f} s")
        await asyncio.sleep(self.lease_ttl_s + 2)  # let it notice and log
        self.result.paused_fenced_metric = await self._fenced_metric(node)
        self.paused_node = None

    async def _fenced_metric(self, node: Node) -> float:
        total = 0.0
        try:
            async with (
                aiohttp.ClientSession() as session,
                session.get(f"http://127.0.0.1:{node.obs_port}/metrics", timeout=aiohttp.ClientTimeout(total=3)) as r,
            ):
                text = await r.text()
        except (aiohttp.ClientError, TimeoutError, OSError):
            return 0.0
        for line in text.splitlines():
            if line.startswith("#") or "fenc" not in line.split(" ")[0].lower():
                continue
            with contextlib.suppress(ValueError, IndexError):
                total += float(line.rsplit(" ", 1)[1])
        return total

    async def _restart_pg(self) -> None:
        cluster = pg_cluster()
        if cluster is None:
            self.result.details.append("pg restart: pg_ctlcluster not available; skipped")
            return
        t0 = time.monotonic()
        self._event("pg restart begins")
        proc = await asyncio.create_subprocess_exec(
            "pg_ctlcluster",
            "--skip-systemctl-redirect",
            *cluster,
            "restart",
            "-m",
            "fast",
            stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.PIPE,
        )
        _, err = await proc.communicate()
        t1 = time.monotonic()
        self._event("pg restart done", rc=proc.returncode)
        self.pg_outages_mono.append((t0, t1))
        self.result.pg_restarts += 1
        self.result.pg_outage_s.append(round(t1 - t0, 2))
        if proc.returncode != 0:
            self.result.details.append(f"pg restart failed: {err.decode(errors='replace').strip()[:200]}")
        self.say(f"  PostgreSQL restarted ({t1 - t0:.1f} s)")

    # ----------------------------------------------------------------- run

    @contextlib.asynccontextmanager
    async def up(self) -> AsyncIterator[None]:
        """The fakes, the nodes (migrated, started, answering) and the load balancer; on exit
        the nodes are stopped (SIGTERM) and their last lives closed."""
        (self.workdir / "logs").mkdir(parents=True, exist_ok=True)
        async with (
            FakeLLM() as llm,
            FakeTelegram(token=TG_TOKEN, bot_username=BOT) as tg,
            FakeDiscord(token=DC_TOKEN) as dc,
        ):
            self.llm, self.tg, self.dc = llm, tg, dc
            if self.discord_share:  # before the nodes connect: their READY lists the guilds
                self._discord_people(dc)
            llm.responder = responder(
                random.Random(self.seed + 1),
                max_latency_s=self.model_latency_s,
                slow={SLOW_WORD: 1.0},
                stream_s=self.stream_s if self.streaming else 0.0,
            )
            for i in range(self.n_nodes):
                name = f"n{i + 1}"
                node = Node(name, self.workdir / f"{name}.yaml", free_port(), free_port())
                self._write_config(node, f"{name}-0")
                self.nodes.append(node)
            await self._migrate(self.nodes[0])
            if self.reminders:
                await self._overdue_reminder()
            for node in self.nodes:
                await self._spawn(node)
            for node in self.nodes:
                assert node.proc is not None
                if not await self._wait_up(node, node.proc):
                    await self._stop_all()
                    tail = node.life.log.read_text(errors="replace").strip().splitlines()[-3:] if node.life else []
                    raise RuntimeError(f"node {node.name} did not start: {' | '.join(tail)}")
            self._people()
            self.queues = [asyncio.Queue() for _ in range(self.lb_workers)]
            async with aiohttp.ClientSession() as session:
                self._workers = [asyncio.create_task(self._lb_worker(q, session)) for q in self.queues]
                try:
                    yield
                finally:
                    self.sending = False
                    for t in self._workers:
                        t.cancel()
                    await self._stop_all()

    async def _overdue_reminder(self) -> None:
        """A reminder 10 minutes overdue in the first person's reminders.json, as a cluster that
        was down when it was due leaves it (its index row is rebuilt when the profile opens)."""
        user = 7000  # `_people()`'s first person, who writes first
        self.tg.add_chat(user, "private")
        chat = ReminderChat(
            "telegram", str(user), "dm", None, str(user), f"User{user}", lane=f"agent:main:telegram:dm:{user}"
        )
        store = ReminderStore(tenant_dir(self.workdir / "data", f"telegram-{user}"))
        now = time.time()
        await store.add(f"ping {OVERDUE_REMINDER}", now - 600, chat, tz=None, repeat=None, cap=50, now=now - 900)
        self.rm_pushed[OVERDUE_REMINDER] = ""

    def send(self, token: str, pushed: Pushed, key: str) -> None:
        """Hand an update to the load balancer (one worker per chat: per chat, in order)."""
        self.tg.updates.clear()  # delivered by webhook, never polled
        self.queues[zlib.crc32(key.encode()) % len(self.queues)].put_nowait((token, pushed))

    async def close_ingress(self) -> None:
        """Until every update handed to the load balancer was acknowledged by a node."""
        for q in self.queues:
            q.put_nowait(None)
        await asyncio.gather(*self._workers)

    async def run(self) -> ClusterResult:
        started = time.monotonic()
        async with self.up():
            chaos = asyncio.create_task(self._chaos()) if self.kill_every else None
            try:
                await self._traffic()
                if self._pause_task is not None:
                    await self._pause_task
                if self.takeover_task is not None:
                    await self.takeover_task
                self.sending = False
                if chaos is not None:
                    await chaos
                await self.close_ingress()
                self.say(f"  traffic done ({time.monotonic() - started:.1f} s), waiting for the answers")
                await self._all_up()
                await self._settle()
                self.say(f"  settled ({time.monotonic() - started:.1f} s)")
            finally:
                if chaos is not None:
                    chaos.cancel()
        self._audit(self.workdir / "data")
        self.result.seconds = round(time.monotonic() - started, 1)
        return self.result

    async def _migrate(self, node: Node) -> None:
        proc = await asyncio.create_subprocess_exec(
            str(BIN),
            "-c",
            str(node.config),
            "cluster",
            "migrate",
            env=self._env(node),
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
        )
        out, _ = await proc.communicate()
        if proc.returncode != 0:
            raise RuntimeError(f"cluster migrate failed: {out.decode(errors='replace').strip()}")

    async def _all_up(self) -> None:
        for node in self.nodes:
            while node.restarting:  # noqa: ASYNC110 (a restart in flight finishes on its own)
                await asyncio.sleep(0.1)
            if not node.alive:
                await self._spawn(node)

    def _answers(self) -> list[tuple[str, Copy]]:
        """Telegram answers in send order (a message still showing a draft is none)."""
        out = []
        for m in self.tg.sent:
            if is_draft(m.get("text", "")):
                continue
            for token in TOKEN_RE.findall(m.get("text", "")):
                out.append((token, Copy(m.get("_via"), m.get("_at", 0.0))))
        return out

    def _reminder_deliveries(self) -> list[tuple[str, Copy, str]]:
        """Reminders delivered on Telegram, in send order: (rm token, the copy, its text)."""
        out = []
        for m in self.tg.sent:
            text = m.get("text") or ""
            if text.startswith("⏰ Reminder"):
                for rm in REMINDER_TOKEN_RE.findall(text):
                    out.append((rm, Copy(m.get("_via"), m.get("_at", 0.0)), text))
        return out

    def _dc_answers(self) -> list[tuple[str, Copy]]:
        """Discord answers in send order, each with the process life whose REST call made it."""
        out = []
        for m in self.dc.sent_messages() if self.dc is not None else []:
            if is_draft(m.get("content", "")):
                continue
            for token in TOKEN_RE.findall(m.get("content", "")):
                out.append((token, Copy(m.get("sender"), m.get("at", 0.0))))
        return out

    def _dc_took(self) -> set[str]:
        """Discord tokens some node took in: their message is in the PostgreSQL inbox (read
        now and remembered: done rows may be pruned later) or was answered."""
        ids = {mid: tok for tok, (mid, _, _) in self.dc_pushed.items() if mid is not None}
        if ids:
            import psycopg

            with contextlib.suppress(psycopg.Error), psycopg.connect(self.dsn, connect_timeout=5) as conn:
                rows = conn.execute("SELECT message_id FROM inbox WHERE platform = 'discord'").fetchall()
                self.dc_recorded |= {str(mid) for (mid,) in rows}
        return {ids[mid] for mid in self.dc_recorded if mid in ids} | {t for t, _ in self._dc_answers()}

    async def _settle(self) -> None:
        """Until every acknowledged message is answered (no progress for settle_s: stop)."""
        last, since = -1, time.monotonic()
        while time.monotonic() - since < self.settle_s:
            await asyncio.sleep(0.5)
            answered = {t for t, _ in self._answers()} | {t for t, _ in self._dc_answers()}
            delivered = {rm for rm, _, _ in self._reminder_deliveries()}
            expecting = {rm for rm, t in self.rm_pushed.items() if not t or t in answered}
            if (self.acked | self._dc_took()) <= answered and expecting <= delivered:
                await asyncio.sleep(1.0)  # a late duplicate would show up now
                return
            if len(answered) + len(delivered) != last:
                last, since = len(answered) + len(delivered), time.monotonic()

    async def _stop_all(self) -> None:
        self.stopping = True
        for node in self.nodes:
            if node.alive and node.proc is not None:
                node.proc.send_signal(signal.SIGCONT)
                node.proc.send_signal(signal.SIGTERM)
        for node in self.nodes:
            if node.proc is None:
                continue
            try:
                await asyncio.wait_for(node.proc.wait(), 30)
            except TimeoutError:
                self.result.details.append(f"{node.name} did not stop on SIGTERM within 30 s")
                if node.life is not None:
                    node.life.killed = True
                    node.life.ended = time.time()
                node.proc.kill()
                await node.proc.wait()
            if node.life is not None and node.life.ended is None:
                node.life.ended = time.time()
            if node.log_file is not None:
                node.log_file.close()
                node.log_file = None
        for task in list(self._tasks):
            task.cancel()

    # ----------------------------------------------------------------- audit

    def _audit(self, data: Path) -> None:
        r = self.result
        with open(self.workdir / "logs" / "sent.jsonl", "w", encoding="utf-8") as f:  # the evidence
            for m in self.tg.sent:
                f.write(
                    json.dumps(
                        {"via": m.get("_via"), "mono": m.get("_at"), "chat": m["chat"]["id"], "text": m.get("text")}
                    )
                    + "\n"
                )
        r.inputs = sum(1 for p in self.pushed.values() if p[0] == "tg")  # Discord's are counted apart
        answers = self._answers()
        r.answers = len(answers)
        copies, by_node = copies_by_token(answers)
        r.answers_by_node = dict(sorted(by_node.items()))
        lost = self.acked - set(copies)
        r.lost = len(lost)
        r.details += [
            f"lost: {t} {self.pushed.get(t)}, acknowledged by {self.acked_by.get(t)}" for t in sorted(lost)[:20]
        ]
        r.details += self._pg_evidence(sorted(lost)[:5])
        dups = classify_duplicates(copies, self.kills_mono, self.stops_mono, self.pg_outages_mono)
        r.dup_window_kill, r.dup_window_pause, r.dup_window_pg, r.dup_other = (
            dups.window_kill,
            dups.window_pause,
            dups.window_pg,
            dups.other,
        )
        r.window_ms = dups.window_ms
        r.details += dups.details[:20]
        if self.paused_token is not None and r.pauses:
            r.paused_message_answers = len(copies.get(self.paused_token, []))
            r.paused_message_by = [c.node for c in copies.get(self.paused_token, [])]
        bad, details = order_violations((t for t, _ in answers), self.pushed)
        r.order_violations = bad
        r.details += details[:20]
        r.journal_mismatches, r.integrity_failures, details = profile_problems(data)
        r.details += details[:20]
        if self.discord_share:
            self._audit_discord()
        if self.streaming:
            self._audit_streams()
        if self.rm_pushed:
            self._audit_reminders({t for t, _ in answers})
        # the audit log
        audit = [
            rec
            for life in self.lives
            for rec in read_records(life.log)
            if rec.get("event") in ("profile_open", "profile_close")
        ]
        r.audit_records = len(audit)
        intervals, anomalies = profile_intervals(self.lives)
        r.audit_tenants = len({iv.tenant for iv in intervals})
        r.audit_anomalies = len(anomalies)
        r.details += anomalies[:10]
        overlaps, paused = find_overlaps(intervals, self.lives)
        r.overlaps, r.overlaps_paused = len(overlaps), len(paused)
        r.details += [f"overlap: {o}" for o in overlaps[:20]] + [
            f"overlap with a frozen holder: {o}" for o in paused[:10]
        ]
        if r.audit_records == 0:
            r.details.append("no profile_open/profile_close records in any node's log: the audit log is missing")
        for life in self.lives:
            for _a, b in life.stops:
                fenced = [
                    rec
                    for rec in read_records(life.log)
                    if (parse_ts(rec.get("ts")) or 0) >= b and any(h in json.dumps(rec).lower() for h in FENCED_HINTS)
                ]
                r.paused_fenced_records += len(fenced)
                r.paused_turns_fenced += sum(1 for rec in fenced if rec.get("event") == "turn_fenced")
                r.details += [
                    f"after SIGCONT {life.node}#{life.index} logged: {json.dumps(rec)[:300]}" for rec in fenced[:3]
                ]

    def _audit_reminders(self, answered: set[str]) -> None:
        """Reminders: every one set is delivered, each occurrence once, late exactly when late."""
        import psycopg

        r = self.result
        expecting = {rm for rm, t in self.rm_pushed.items() if not t or t in answered}
        r.reminders_set = len(expecting)
        deliveries = self._reminder_deliveries()
        copies: dict[str, list[Copy]] = defaultdict(list)
        first_text: dict[str, str] = {}
        for rm, copy, text in deliveries:
            copies[rm].append(copy)
            first_text.setdefault(rm, text)
        r.reminders_delivered = len(expecting & set(copies))
        lost = expecting - set(copies)
        r.reminders_lost = len(lost)
        r.details += [f"reminder lost: {rm} (set by {self.rm_pushed[rm] or 'the file'})" for rm in sorted(lost)]
        # the occurrences PostgreSQL recorded, by id; what each said (its rm token) from the session
        # that keeps it: a done inbox row keeps no text (docs/cluster.md#the-postgresql-layer)
        kept = reminder_records(self.workdir / "data")
        occurrences: dict[str, list[float]] = defaultdict(list)  # rm -> due times recorded in the inbox
        with psycopg.connect(self.dsn, connect_timeout=5) as conn:
            rows = conn.execute(
                "SELECT message_id, answered_at IS NOT NULL FROM inbox WHERE message_id LIKE 'reminder:%'"
            ).fetchall()
        for mid, answered_row in rows:
            if mid not in kept:
                if answered_row:  # answered, so its lane had stored it: a bug
                    r.reminders_unrecorded += 1
                    r.details.append(f"reminder occurrence {mid} answered but in no session")
                else:
                    r.details.append(f"reminder occurrence {mid} still pending when the nodes stopped")
                continue
            for rm in set(REMINDER_TOKEN_RE.findall(kept[mid])):
                occurrences[rm].append(reminder_due(mid))
        r.reminder_occurrences = sum(len(v) for v in occurrences.values())
        r.reminders_set_again = sum(len(v) - 1 for v in occurrences.values() if len(v) > 1)
        extra = {rm: seen for rm, seen in copies.items() if len(seen) > max(1, len(occurrences.get(rm, [])))}
        dups = classify_duplicates(extra, self.kills_mono, self.stops_mono, self.pg_outages_mono)
        r.reminders_dup_window_kill = dups.window_kill
        r.reminders_dup_other = dups.window_pause + dups.window_pg + dups.other
        r.details += [f"reminder {d}" for d in dups.details[:10]]
        for rm, seen in copies.items():
            dues = sorted(occurrences.get(rm, []))
            if not dues:
                r.details.append(f"reminder {rm} delivered but no occurrence of it is in the inbox and a session")
                continue
            late = seen[0].at + self.wall_minus_mono - dues[0]
            r.reminder_lateness_s.append(round(late, 2))
            said = "This is late" in first_text[rm]
            if said != (late > LATE_AFTER_S) and abs(late - LATE_AFTER_S) > 5:
                r.reminders_late_wrong += 1
                r.details.append(f"reminder {rm} {late:.1f} s after its time said late: {said}")
            if rm == OVERDUE_REMINDER:
                r.overdue_said_late = said
            if rm == TAKEOVER_REMINDER:
                r.takeover_fired_by = [c.via or "?" for c in seen]
                r.takeover_late_s = round(late, 2)

    def _audit_discord(self) -> None:
        """Discord: lost/missed, duplicates, order, and the shards from the fake's view."""
        assert self.dc is not None
        r = self.result
        with open(self.workdir / "logs" / "discord.jsonl", "w", encoding="utf-8") as f:  # the evidence
            for m in self.dc.sent_messages():
                f.write(json.dumps({k: m.get(k) for k in ("sender", "at", "channel_id", "content", "id")}) + "\n")
            for sess in self.dc.shard_sessions:
                f.write(json.dumps({k: v for k, v in sess.items() if k != "_ws"}) + "\n")
        took = self._dc_took()
        r.dc_sent, r.dc_recorded = len(self.dc_pushed), len(took)
        r.dc_missed = r.dc_sent - r.dc_recorded
        answers = self._dc_answers()
        r.dc_answers = len(answers)
        r.dc_nonce_replays = self.dc.nonce_replays
        copies, by_node = copies_by_token(answers)
        r.dc_answers_by_node = dict(sorted(by_node.items()))
        lost = took - set(copies)
        r.dc_lost = len(lost)
        r.details += [f"discord lost: {t} {self.pushed.get(t)} {self.dc_pushed.get(t)}" for t in sorted(lost)[:20]]
        r.details += self._pg_evidence(sorted(lost)[:5])
        dups = classify_duplicates(copies, self.kills_mono, self.stops_mono, self.pg_outages_mono)
        r.dc_dup_window_kill = dups.window_kill
        r.dc_dup_other = dups.window_pause + dups.window_pg + dups.other  # the nonce should close every window
        r.details += [f"discord {d}" for d in dups.details[:20]]
        bad, details = order_violations((t for t, _ in answers), self.pushed)
        r.dc_order_violations = bad
        r.order_violations += bad
        r.details += details[:20]
        # the shards, as the fake saw their connections
        sessions = [s for s in self.dc.shard_sessions if s["start"] is not None]
        r.shard_sessions = len(sessions)
        for sess in sessions:
            if "preempted_by" not in sess:
                continue
            life = str(sess["via"])
            frozen = any(sess["start"] <= t <= sess["end"] for t in self.stops_mono.get(life, []))
            if frozen:
                r.shard_preempted_paused += 1
            else:
                r.shard_preempted += 1
                r.details.append(
                    f"shard {sess['shard']} held by {life} was taken over by {sess['preempted_by']} while open"
                )
        answered_at = {t: c.at for t, c in reversed(answers)}  # first answer
        for sess in sessions:
            kill = self.kills_mono.get(str(sess["via"]))
            if kill is None or sess["end"] is None or abs(sess["end"] - kill) > 2.0:
                continue  # not ended by its node's SIGKILL
            after = [x for x in sessions if x["shard"] == sess["shard"] and x["start"] > sess["end"]]
            if not after:
                continue  # the run ended first
            nxt = min(after, key=lambda x: x["start"])
            if str(nxt["via"]).rsplit("-", 1)[0] == str(sess["via"]).rsplit("-", 1)[0]:
                continue  # its own next life took it back: not a takeover by another node
            r.shard_takeovers += 1
            end = nxt["end"] if nxt["end"] is not None else float("inf")
            proof = [
                t
                for t, (mid, shard, at) in self.dc_pushed.items()
                if mid is not None and shard == sess["shard"] and nxt["start"] < at < end and t in answered_at
            ]
            if not proof:
                # only messages a session heard count (a push while the shard had none is
                # heard by nobody, on Discord too): the proof above counts the same ones
                pushed_then = sum(
                    1
                    for mid, shard, at in self.dc_pushed.values()
                    if mid is not None and shard == sess["shard"] and nxt["start"] < at < end
                )
                if pushed_then:  # messages went to the new holder and none was answered
                    r.takeovers_unproven += 1
                    r.details.append(
                        f"shard {sess['shard']} of killed {sess['via']} taken over by {nxt['via']}: none of the "
                        f"{pushed_then} messages sent to it since was answered"
                    )
            elif sess["shard"] == 0 and any(self.pushed[t][1] == f"dc:{self.pushed[t][2]}" for t in proof):
                r.dm_takeovers_answered += 1

    def _audit_streams(self) -> None:
        """Final answers lost and doubled (Telegram and Discord), stale drafts, and the
        streams a SIGKILLed life started and another life finished (from the fake Telegram's
        record of who sent each message and who made each edit)."""
        r = self.result
        finals = [t for t, _ in self._answers()] + [t for t, _ in self._dc_answers()]
        counts: dict[str, int] = defaultdict(int)
        for token in finals:
            counts[token] += 1
        took = self.acked | (self._dc_took() if self.discord_share else set())
        r.finals_lost = len(took - set(counts))
        r.finals_doubled = sum(1 for n in counts.values() if n > 1)
        r.details += [f"final answer doubled: {t} ({n} finals)" for t, n in counts.items() if n > 1][:20]
        last_edit: dict[tuple[Any, Any], str | None] = {}
        for e in self.tg.edits:
            last_edit[(e["chat_id"], e["message_id"])] = e.get("_via")
        killed = set(self.kills_mono)
        stale_by_token: dict[str, set[str]] = defaultdict(set)  # token -> lives whose draft of it went stale
        for m in self.tg.sent:
            text, via = m.get("text", ""), m.get("_via")
            if not TOKEN_RE.search(text):
                continue
            if is_draft(text):
                r.stale_drafts += 1
                if via in killed:
                    r.stale_drafts_by_killed += 1
                    for token in TOKEN_RE.findall(text):
                        stale_by_token[token].add(str(via))
                continue
            editor = last_edit.get((m["chat"]["id"], m["message_id"]))
            if editor is None:
                if any(v != via for t in TOKEN_RE.findall(text) for v in stale_by_token.get(t, ())):
                    r.streams_taken_over += 1  # sent new under a killed life's stale draft
                continue
            r.streamed_finals += 1
            if via in killed and editor != via:
                r.streams_taken_over += 1
        for m in self.dc.sent_messages() if self.dc is not None and self.discord_share else []:
            content = m.get("content", "")
            if TOKEN_RE.search(content) and is_draft(content):
                r.stale_drafts += 1
                r.stale_drafts_by_killed += m.get("sender") in killed
            elif TOKEN_RE.search(content) and m.get("edits"):
                r.streamed_finals += 1

    def _pg_evidence(self, tokens: list[str]) -> list[str]:
        """What PostgreSQL holds about some lost messages: their inbox rows, lanes, outbox rows."""
        if not tokens:
            return []
        import psycopg
        from psycopg.rows import dict_row

        out = []
        try:
            with psycopg.connect(self.dsn, connect_timeout=5, row_factory=dict_row) as conn:
                for token in tokens:
                    rows = conn.execute(
                        "SELECT id, lane, tenant, message_id, received_at::text, answered_at::text, done_at::text, "
                        "done_epoch, outcome FROM inbox WHERE payload::text LIKE %s",
                        (f"%{token}%",),
                    ).fetchall()
                    if not rows:
                        out.append(f"  PG: {token} is not in the inbox")
                    named = conn.execute(
                        "SELECT id, inbox_id, seq, epoch, sent_at::text, sent_epoch, body->>'text' AS text "
                        "FROM outbox WHERE body::text LIKE %s",
                        (f"%{token}%",),
                    ).fetchall()
                    out.append(f"  PG: outbox chunks naming {token}: {named}")
                    for row in rows:
                        lane = conn.execute(
                            "SELECT to_jsonb(l)::text AS lane FROM lanes l WHERE lane = %s", (row["lane"],)
                        ).fetchone()
                        chunks = conn.execute(
                            "SELECT seq, epoch, sent_at::text, sent_epoch FROM outbox WHERE inbox_id = %s", (row["id"],)
                        ).fetchall()
                        lease = conn.execute(
                            "SELECT holder, epoch, expires_at::text FROM tenant_leases WHERE tenant = %s",
                            (row["tenant"],),
                        ).fetchone()
                        out.append(f"  PG: {token} inbox {row}; lane {lane}; outbox {chunks}; lease {lease}")
        except psycopg.Error as err:
            out.append(f"  PG evidence unavailable: {err}")
        return out


def is_draft(text: str) -> bool:
    """A message still showing a streamed draft (the cursor at its end), not an answer."""
    return text.rstrip().endswith("…")


async def cluster_storm(workdir: Path, **kwargs: Any) -> ClusterResult:
    """One storm on a fresh PostgreSQL schema (dropped afterwards)."""
    with fresh_schema() as dsn:
        return await ClusterStorm(workdir, dsn, **kwargs).run()


def summary(r: ClusterResult) -> list[str]:
    return [
        f"{r.nodes} nodes, {r.messages} messages from {r.people} people, lease_ttl_s {r.lease_ttl_s}: "
        f"{r.kills} SIGKILLs, {r.pauses} pauses, {r.pg_restarts} PostgreSQL restarts, {r.seconds} s",
        f"telegram inputs {r.inputs} (ingress retries {r.ingress_retries}, ingress failed {r.ingress_failed}), "
        f"answers {r.answers} by node {r.answers_by_node}",
        f"lost {r.lost}; duplicated: window kill {r.dup_window_kill}, window pause {r.dup_window_pause}, "
        f"window PostgreSQL {r.dup_window_pg}, other {r.dup_other}; order violations {r.order_violations}; "
        f"journal/SQLite mismatches {r.journal_mismatches}; integrity_check failures {r.integrity_failures}",
        f"audit log: {r.audit_records} records over {r.audit_tenants} tenants; overlaps {r.overlaps}, "
        f"with a frozen holder {r.overlaps_paused}; anomalies {r.audit_anomalies}",
        f"pause: fenced records after SIGCONT {r.paused_fenced_records} (turns stopped {r.paused_turns_fenced}), "
        f"fenced metric {r.paused_fenced_metric}, "
        f"answers to the held message {r.paused_message_answers} (paused {r.paused_node or '-'}, answered by "
        f"{r.paused_message_by or '-'}); PostgreSQL outage s {r.pg_outage_s}",
        f"discord ({r.shards} shards): sent {r.dc_sent}, recorded {r.dc_recorded}, missed while no node held the "
        f"shard {r.dc_missed}; answers {r.dc_answers} by node {r.dc_answers_by_node}; lost {r.dc_lost}; duplicated: "
        f"window kill {r.dc_dup_window_kill}, other {r.dc_dup_other} (resends deduplicated by nonce "
        f"{r.dc_nonce_replays}); order violations {r.dc_order_violations}",
        f"discord shards: {r.shard_sessions} connections, taken over while held {r.shard_preempted} (from a frozen "
        f"holder {r.shard_preempted_paused}); shards of killed nodes taken over by another {r.shard_takeovers} "
        f"(unproven {r.takeovers_unproven}, shard 0 with a DM answered after {r.dm_takeovers_answered})",
        f"streaming {'on' if r.streaming else 'off'}: final answers lost {r.finals_lost}, doubled "
        f"{r.finals_doubled}; finals that replaced a draft {r.streamed_finals}; streams a SIGKILLed node "
        f"started and another finished {r.streams_taken_over}; stale drafts left above an answer "
        f"{r.stale_drafts} (sent by a killed node {r.stale_drafts_by_killed})",
        f"reminders: set {r.reminders_set}, delivered {r.reminders_delivered}, lost {r.reminders_lost}; "
        f"occurrences {r.reminder_occurrences} (set again by a re-run turn {r.reminders_set_again}, answered but in "
        f"no session {r.reminders_unrecorded}); duplicated: "
        f"window kill {r.reminders_dup_window_kill}, other {r.reminders_dup_other}; late said wrongly "
        f"{r.reminders_late_wrong} (the 10-minute overdue one said late: {r.overdue_said_late}); lateness s "
        f"{spread(r.reminder_lateness_s)}; takeover: killed {r.takeover_killed or '-'}, delivered by "
        f"{r.takeover_fired_by or '-'}, {r.takeover_late_s} s after its time",
        f"send window (accepted -> SIGKILL) ms: {spread(r.window_ms)}; restart (spawn -> webhook up) s: "
        f"{spread(r.restart_s)}; nodes that exited on their own: {r.nodes_crashed or 'none'}",
    ]


START, END = "<!-- bench:cluster-storm:start -->", "<!-- bench:cluster-storm:end -->"


def write_section(path: Path, body: str, start: str = START, end: str = END) -> None:
    """Replace the text between the markers in `path` (append the section when absent)."""
    text = path.read_text(encoding="utf-8")
    if start in text and end in text:
        before, rest = text.split(start, 1)
        text = before + start + "\n" + body + "\n" + end + rest.split(end, 1)[1]
    else:
        text = text.rstrip("\n") + "\n\n" + start + "\n" + body + "\n" + end + "\n"
    path.write_text(text, encoding="utf-8")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--messages", type=int, default=2000)
    ap.add_argument("--people", type=int, default=200)
    ap.add_argument("--nodes", type=int, default=3)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--interval", type=float, default=0.04, help="seconds between two messages (all people)")
    ap.add_argument("--kill-every", type=float, nargs=2, default=(2.5, 4.0), metavar=("MIN", "MAX"))
    ap.add_argument("--no-kills", action="store_true")
    ap.add_argument("--pause", action="store_true", help="SIGSTOP a busy node past its lease, then SIGCONT")
    ap.add_argument("--pg-restart", action="store_true", help="restart the local PostgreSQL mid-run")
    ap.add_argument("--streaming", action="store_true", help="stream every answer; count final answers")
    ap.add_argument("--stream-s", type=float, default=2.5, help="with --streaming: seconds the model writes an answer")
    ap.add_argument("--lease-ttl", type=float, default=3.0)
    ap.add_argument("--discord-share", type=float, default=0.2, help="share of the messages sent on Discord (0: none)")
    ap.add_argument("--shards", type=int, default=3, help="platforms.discord.shard_count")
    ap.add_argument("--reminders", type=int, default=0, help="messages that set a reminder (0: reminders off)")
    ap.add_argument("--reminder-due", type=float, default=4.0, help="seconds from setting a reminder to its time")
    ap.add_argument(
        "--reminder-takeover", action="store_true", help="SIGKILL the node holding a reminder's tenant before it is due"
    )
    ap.add_argument("--keep", type=Path, help="run in this directory and keep it (logs, data)")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--write", type=Path, help="record the result in this markdown file (BENCHMARKS.md)")
    args = ap.parse_args(argv)
    import logging

    logging.getLogger("aiohttp.server").setLevel(logging.CRITICAL)
    why = pg_reachable()
    if why is not None:
        print(f"error: PostgreSQL at {BASE_DSN} is unreachable ({why})", file=sys.stderr)
        return 2
    kwargs = {
        "nodes": args.nodes,
        "messages": args.messages,
        "people": args.people,
        "seed": args.seed,
        "interval": args.interval,
        "kill_every": None if args.no_kills else tuple(args.kill_every),
        "pause": args.pause,
        "pg_restart": args.pg_restart,
        "lease_ttl_s": args.lease_ttl,
        "discord_share": args.discord_share,
        "shards": args.shards,
        "streaming": args.streaming,
        "stream_s": args.stream_s,
        "reminders": args.reminders,
        "reminder_due_s": args.reminder_due,
        "reminder_takeover": args.reminder_takeover,
    }
    t0, load0 = time.time(), os.getloadavg()[0]
    if args.keep:
        args.keep.mkdir(parents=True, exist_ok=True)
        r = asyncio.run(cluster_storm(args.keep, **kwargs))
    else:
        with tempfile.TemporaryDirectory(prefix="cluster-storm-") as tmp:
            r = asyncio.run(cluster_storm(Path(tmp), **kwargs))
    lines = summary(r)
    for line in lines:
        print(line)
    for line in r.details[:40]:
        print("  " + line)
    if args.json:
        args.json.write_text(json.dumps(asdict(r), indent=2))
    if args.write:
        from bench.cluster_bench import machine_line

        body = (
            f"`python -m bench.cluster_storm {' '.join(argv if argv is not None else sys.argv[1:])}` — "
            f"{machine_line(t0, load0)}\n\n"
            + "\n".join(f"- {line}" for line in lines)
            + "\n- targets met: "
            + ("yes" if r.targets_met() else "NO: " + "; ".join(r.details[:8]))
        )
        write_section(args.write, body)
    return 0 if r.targets_met() else 1


if __name__ == "__main__":
    sys.exit(main())
