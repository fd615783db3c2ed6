"""MCP tool servers for the agent, through the official `mcp` SDK.

`McpHub` starts each configured server when it is first needed (a command over stdio, or
a streamable HTTP URL), lists its tools for the model under names OpenAI accepts, and
calls them with a timeout and an output cap. A server that crashes is restarted on its
next use, with `core.backoff` delays between failed restarts; one that cannot start is
left out. Results are the tools' JSON strings (`{"success": ...}`); nothing here raises.

`per_tenant` servers run one process (or HTTP session) per tenant, with the literal
`{tenant}` in args, env values, url and header values replaced by the tenant id exactly
as given: ids such as `discord:1234` keep their `:`, so a server that makes a path of it
must cope with that. Other servers are one session shared by everyone.

A stdio server gets the SDK's short list of safe variables (PATH, HOME, …) plus its own
`env`, never the gateway's environment, which holds bot tokens and API keys. Args, env,
url and header values may hold credentials: they are kept out of reprs and logs.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import math
import os
import re
import sys
import time
from collections import Counter, OrderedDict
from collections.abc import AsyncGenerator, Callable, Collection, Mapping, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Generic, TextIO, TypeVar

import anyio
import anyio.to_thread
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from core.backoff import backoff_delay
from core.redact import Redactor

if TYPE_CHECKING:  # the SDK costs ~0.6 s to import: a gateway without MCP servers never loads it
    from mcp import Client
    from mcp.client._transport import ReadStream, WriteStream
    from mcp.shared.message import SessionMessage
    from mcp_types import CallToolResult

__all__ = ["TENANT_PLACEHOLDER", "McpHub", "McpServerSpec", "McpTool"]

logger = logging.getLogger(__name__)

TENANT_PLACEHOLDER = "{tenant}"

_SERVER_NAME = re.compile(r"[A-Za-z0-9_-]+")
_UNSAFE = re.compile(r"[^A-Za-z0-9_-]")
_MAX_NAME = 64  # OpenAI function names: ^[a-zA-Z0-9_-]{1,64}$
_RESTART_INITIAL_S = 1.0
_RESTART_MAX_S = 300.0
_STABLE_AFTER_S = 60.0  # a session up this long before it stopped counts as healthy
_CALL_GRACE_S = 5.0  # past the call timeout, the caller stops waiting for the session at all
_CLOSE_TIMEOUT_S = 15.0  # the SDK's own stdio shutdown is bounded at about 6 s
_LIST_PAGES = 100  # a server whose tool listing never ends cannot hang a start


@dataclass(frozen=True)
class McpServerSpec:
    """One configured MCP server: a `command` run over stdio, or a streamable HTTP `url`.

    `env` and `headers` hold values already resolved by the caller. `per_tenant` runs one
    server per tenant with `{tenant}` substituted (see the module docstring)."""

    name: str
    command: str | None = None
    args: tuple[str, ...] = field(default=(), repr=False)
    env: Mapping[str, str] = field(default_factory=dict, repr=False)
    url: str | None = field(default=None, repr=False)
    headers: Mapping[str, str] = field(default_factory=dict, repr=False)
    per_tenant: bool = False
    call_timeout_s: float = 30.0
    max_output_chars: int = 20_000
    start_timeout_s: float = 20.0

    def __post_init__(self) -> None:
        if not _SERVER_NAME.fullmatch(self.name):
            raise ValueError(f"MCP server name {self.name!r}: use only letters, digits, '_' and '-'")
        if (self.command is None) == (self.url is None):
            raise ValueError(f"MCP server {self.name}: give exactly one of command and url")
        if self.call_timeout_s <= 0 or self.start_timeout_s <= 0 or self.max_output_chars < 1:
            raise ValueError(f"MCP server {self.name}: timeouts and max_output_chars must be positive")
        object.__setattr__(self, "args", tuple(self.args))

    def for_tenant(self, tenant: str) -> McpServerSpec:
        """This spec with `{tenant}` in args, env values, url and header values replaced by
        `tenant` as given."""

        def sub(value: str) -> str:
            return value.replace(TENANT_PLACEHOLDER, tenant)

        return replace(
            self,
            args=tuple(sub(a) for a in self.args),
            env={k: sub(v) for k, v in self.env.items()},
            url=None if self.url is None else sub(self.url),
            headers={k: sub(v) for k, v in self.headers.items()},
        )


@dataclass(frozen=True)
class McpTool:
    """One tool of one server as the model sees it: `qualified` is its function name,
    `name` the server's own name for it."""

    server: str
    name: str
    qualified: str
    description: str
    input_schema: dict[str, Any]

    def openai_tool(self) -> dict[str, Any]:
        """The OpenAI tool definition (`{"type": "function", "function": {...}}`)."""
        return {
            "type": "function",
            "function": {"name": self.qualified, "description": self.description, "parameters": self.input_schema},
        }


def _errlog(stack: AsyncExitStack) -> TextIO:
    """Where a stdio server's stderr goes: the gateway's own stderr when it is a real file
    (the operator sees a server's complaints), else nowhere (stdio_client needs a descriptor)."""
    try:
        sys.stderr.fileno()
        return sys.stderr
    except (AttributeError, OSError, ValueError):  # io.UnsupportedOperation is both
        return stack.enter_context(open(os.devnull, "w", encoding="utf-8"))


class McpHub:
    """Every configured MCP server, started lazily per session key (the server, plus the
    tenant for `per_tenant` ones); at most `max_tenant_sessions` per-tenant sessions, the
    least recently used closed first. `clock` (monotonic seconds) times the restart backoff."""

    def __init__(
        self,
        specs: Sequence[McpServerSpec],
        *,
        max_tenant_sessions: int = 64,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        names = [spec.name for spec in specs]
        if len(set(names)) != len(names):
            raise ValueError(f"MCP server names repeat: {sorted(n for n, c in Counter(names).items() if c > 1)}")
        if max_tenant_sessions < 1:
            raise ValueError("max_tenant_sessions must be at least 1")
        self._specs = tuple(specs)
        self._max_tenant_sessions = max_tenant_sessions
        self._clock = clock
        self._shared: dict[str, _Slot] = {}
        self._per_tenant: OrderedDict[tuple[str, str], _Slot] = OrderedDict()
        self._closing: set[asyncio.Task[None]] = set()
        self._closed = False

    async def tools(self, tenant: str, servers: Collection[str] | None = None) -> list[McpTool]:
        """The tools of every server `tenant` can use now (of `servers` only, when given: the
        others are not started), starting the ones not yet running. A server that cannot
        start is left out (and logged); this never raises."""
        try:
            found = await self._catalog(tenant, start=True, only=servers)
            return [tool for tool, _, live in found if live]
        except Exception:
            logger.exception("listing MCP tools failed")
            return []

    async def call(self, tenant: str, qualified: str, arguments: dict[str, Any]) -> str:
        """Call the tool the model knows as `qualified`; the JSON result string for the model.
        Every failure (unknown tool, tool error, timeout, a server down) is a result."""
        try:
            if self._closed:
                return _failure("MCP tools are shut down")
            if not isinstance(arguments, dict):
                return _failure(f"the arguments of {qualified} must be a JSON object")
            # known tools first: a call must not wait for other servers to (re)start
            for start in (False, True):
                for tool, slot, _ in await self._catalog(tenant, start=start):
                    if tool.qualified == qualified:
                        return await slot.call(tool, arguments)
            return _failure(f"unknown tool {qualified}")
        except Exception:
            logger.exception("calling the MCP tool %s failed", qualified)
            return _failure(f"the tool {qualified} failed inside the gateway")

    async def probe(self, name: str, tenant: str) -> tuple[int, str | None]:
        """Start server `name` as `tenant` would: (its tool count, None) or (0, why it cannot
        run), for `hermes-gateway doctor`."""
        spec = next((s for s in self._specs if s.name == name), None)
        if spec is None:
            return 0, f"no server {name}"
        slot = self._slot(spec, tenant)
        running = await slot._running()
        if isinstance(running, str):
            return 0, running
        return len(slot.listed), None

    async def close(self) -> None:
        """Stop every session and its process, waiting until they are gone."""
        self._closed = True
        slots = [*self._shared.values(), *self._per_tenant.values()]
        self._shared.clear()
        self._per_tenant.clear()
        await asyncio.gather(*(slot.close() for slot in slots), *list(self._closing))

    async def _catalog(
        self, tenant: str, *, start: bool, only: Collection[str] | None = None
    ) -> list[tuple[McpTool, _Slot, bool]]:
        """Every tool known for `tenant`, named, with its slot and whether its server runs
        now (`start`: starting those that do not and may). Tools of a server that stopped
        stay known, so a call to one says why it fails and the names of the others hold."""
        if self._closed:
            return []
        slots = [self._slot(spec, tenant) for spec in self._specs if only is None or spec.name in only]
        if start:
            live = await asyncio.gather(*(slot.ensure_running() for slot in slots))
        else:
            live = [slot.running for slot in slots]
        listed = [(slot, tool, up) for slot, up in zip(slots, live, strict=True) for tool in slot.listed]
        names = _qualified_names([(slot.spec.name, tool.name) for slot, tool, _ in listed])
        return [
            (
                McpTool(
                    server=slot.spec.name,
                    name=tool.name,
                    qualified=qualified,
                    description=tool.description,
                    input_schema=tool.input_schema,
                ),
                slot,
                up,
            )
            for (slot, tool, up), qualified in zip(listed, names, strict=True)
        ]

    def _slot(self, spec: McpServerSpec, tenant: str) -> _Slot:
        if not spec.per_tenant:
            slot = self._shared.get(spec.name)
            if slot is None:
                slot = self._shared[spec.name] = _Slot(spec, self._clock, tenant=None)
            return slot
        key = (spec.name, tenant)
        slot = self._per_tenant.get(key)
        if slot is not None:
            self._per_tenant.move_to_end(key)
            return slot
        while len(self._per_tenant) >= self._max_tenant_sessions:
            self._evict_one()
        slot = self._per_tenant[key] = _Slot(spec.for_tenant(tenant), self._clock, tenant=tenant)
        return slot

    def _evict_one(self) -> None:
        """Close the least recently used per-tenant slot, preferring one with no call in flight."""
        victim = next((k for k, s in self._per_tenant.items() if not s.busy), next(iter(self._per_tenant)))
        slot = self._per_tenant.pop(victim)
        task = asyncio.create_task(slot.close(), name=f"mcp-close:{slot.spec.name}")
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)


@dataclass(frozen=True)
class _Listed:
    """A tool as its server listed it."""

    name: str
    description: str
    input_schema: dict[str, Any]


@dataclass(frozen=True)
class _StartFailed:
    reason: str


class _Slot:
    """One server for one session key: the session running now (if any), the tools it last
    listed, and the restart backoff that outlives each session."""

    def __init__(self, spec: McpServerSpec, clock: Callable[[], float], *, tenant: str | None) -> None:
        self.spec = spec
        self.listed: list[_Listed] = []
        self._clock = clock
        self._label = spec.name if tenant is None else f"{spec.name} (tenant {tenant})"
        self._session: _Session | None = None
        self._failures = 0  # sessions in a row that failed to start or stopped unhealthy
        self._not_before = 0.0  # clock time before which no new session is tried
        self._last_failure = ""
        self._closed = False

    @property
    def busy(self) -> bool:
        return self._session is not None and self._session.busy

    @property
    def running(self) -> bool:
        return self._session is not None and self._session.ready.done() and not self._session.stopping

    async def ensure_running(self) -> bool:
        """Whether a session runs, starting one if none does and the backoff allows."""
        return not isinstance(await self._running(), str)

    async def call(self, tool: McpTool, arguments: dict[str, Any]) -> str:
        session = await self._running()
        if isinstance(session, str):
            return _failure(session)
        return await session.call(tool.qualified, tool.name, arguments)

    async def close(self) -> None:
        self._closed = True
        if self._session is not None:
            await self._session.close()

    async def _running(self) -> _Session | str:
        """The running session, or why there is none (a sentence for the model)."""
        while not self._closed and self._session is not None and self._session.stopping:
            ending = self._session  # let it end, then start anew
            await ending.ended()
            if self._session is ending:  # it ended without its bookkeeping (closed): never spin
                self._session = None
        if self._session is None and not self._closed:
            if self._clock() < self._not_before:
                return self._unavailable()
            self._session = _Session(self.spec, self._label, self._session_ended, self._clock)
        session = self._session
        outcome = None if session is None else await asyncio.shield(session.ready)
        if self._closed or session is None:
            return f"the MCP server {self.spec.name} is shut down"
        if isinstance(outcome, list):
            self.listed = outcome
        if isinstance(outcome, _StartFailed) or self._session is not session:
            return self._unavailable()
        return session

    def _unavailable(self) -> str:
        wait = self._not_before - self._clock()
        when = f"in {math.ceil(wait)} s" if wait > 0 else "at its next use"
        return f"the MCP server {self.spec.name} is unavailable: {self._last_failure}; it will be tried again {when}"

    def _session_ended(self, session: _Session, reason: str) -> None:
        """Bookkeeping when a session ends other than by `close`: count the failure and set
        when the next start may be tried (the first at once, then `core.backoff` delays)."""
        if session is not self._session:
            return
        self._session = None
        if self._closed:
            return
        now = session.stopped_at if session.stopped_at is not None else self._clock()
        if session.started_at is None:
            self._last_failure = f"it could not start ({reason})"
        else:
            if session.succeeded or now - session.started_at >= _STABLE_AFTER_S:
                self._failures = 0
            self._last_failure = f"it stopped ({reason})"
        self._failures += 1
        delay = 0.0 if self._failures == 1 else backoff_delay(self._failures - 1, _RESTART_INITIAL_S, _RESTART_MAX_S)
        self._not_before = now + delay
        logger.warning(
            "MCP server %s: %s; next start %s",
            self._label,
            self._last_failure,
            f"in {delay:.0f} s at the earliest" if delay else "at its next use",
        )


T = TypeVar("T")


class _EofWatch(Generic[T]):
    """The transport's read stream, setting `ended` when it runs out: how a server process
    that exits between calls is noticed (the SDK's session just stops reading)."""

    def __init__(self, stream: ReadStream[T], ended: anyio.Event) -> None:
        self._stream = stream
        self._ended = ended

    @property
    def last_context(self) -> Any:  # the SDK's dispatcher reads it when the stream has one
        return getattr(self._stream, "last_context", None)

    async def receive(self) -> T:
        try:
            return await self._stream.receive()
        except (anyio.EndOfStream, anyio.ClosedResourceError, anyio.BrokenResourceError):
            self._ended.set()
            raise

    def __aiter__(self) -> _EofWatch[T]:
        return self

    async def __anext__(self) -> T:
        try:
            return await self.receive()
        except anyio.EndOfStream:
            raise StopAsyncIteration from None

    async def aclose(self) -> None:
        await self._stream.aclose()

    async def __aenter__(self) -> _EofWatch[T]:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()


@asynccontextmanager
async def _opened(
    read: ReadStream[SessionMessage | Exception], write: WriteStream[SessionMessage]
) -> AsyncGenerator[tuple[ReadStream[SessionMessage | Exception], WriteStream[SessionMessage]], None]:
    """Already-open streams as the SDK's `Transport` (their opener closes them)."""
    yield read, write


@dataclass(eq=False)
class _Job:
    """One tool call handed to a session's task; `future` gets the model's JSON string."""

    qualified: str
    tool: str
    arguments: dict[str, Any]
    future: asyncio.Future[str]
    scope: anyio.CancelScope | None = None

    def abandoned(self, future: asyncio.Future[str]) -> None:
        """The caller stopped waiting (cancelled or timed out): stop the call too."""
        if future.cancelled() and self.scope is not None:
            self.scope.cancel()


class _Session:
    """One connection to one server (one process, for stdio), owned by one task.

    The SDK's transports and session are anyio task groups, which must be entered and left
    in the same task, and a transport failure cancels whatever task entered them. So one
    task holds the whole `async with` stack for the session's life, runs each call in its
    own task group, and callers reach it through `_inbox` and a future per call."""

    def __init__(
        self,
        spec: McpServerSpec,
        label: str,
        on_end: Callable[[_Session, str], None],
        clock: Callable[[], float],
    ) -> None:
        self.spec = spec
        self.ready: asyncio.Future[list[_Listed] | _StartFailed] = asyncio.get_running_loop().create_future()
        self.started_at: float | None = None
        self.stopped_at: float | None = None  # when its server was seen gone
        self.succeeded = False  # a call got an answer: the server works
        self._label = label
        self._on_end = on_end
        self._clock = clock
        self._redact = Redactor([*spec.args, *spec.env.values(), *spec.headers.values(), spec.url or ""], min_len=4)
        send, receive = anyio.create_memory_object_stream[_Job](math.inf)
        self._inbox: MemoryObjectSendStream[_Job] = send
        self._inbox_out: MemoryObjectReceiveStream[_Job] = receive
        self._pending: set[_Job] = set()
        self._scope: anyio.CancelScope | None = None
        self._calls_scope: anyio.CancelScope | None = None
        self._stop_reason: str | None = None
        self._closing = False
        self._task = asyncio.create_task(self._run(), name=f"mcp:{spec.name}")

    @property
    def busy(self) -> bool:
        return bool(self._pending) or not self.ready.done()

    @property
    def stopping(self) -> bool:
        """The session is ending or has ended (closed, or its server gone)."""
        return self._closing or self._stop_reason is not None or self._task.done()

    async def ended(self) -> None:
        """Wait until the session's task is over (without cancelling it if the caller is)."""
        await asyncio.wait({self._task})

    async def call(self, qualified: str, tool: str, arguments: dict[str, Any]) -> str:
        job = _Job(qualified, tool, arguments, asyncio.get_running_loop().create_future())
        try:
            self._inbox.send_nowait(job)
        except (anyio.ClosedResourceError, anyio.BrokenResourceError):
            return self._stopped()
        self._pending.add(job)
        job.future.add_done_callback(job.abandoned)
        job.future.add_done_callback(lambda _: self._pending.discard(job))
        try:
            return await asyncio.wait_for(job.future, self.spec.call_timeout_s + _CALL_GRACE_S)
        except TimeoutError:
            return self._timed_out(qualified)

    async def close(self) -> None:
        """End the session and wait for its process to be gone."""
        self._closing = True
        if self._scope is not None:
            self._scope.cancel()
        done, _ = await asyncio.wait({self._task}, timeout=_CLOSE_TIMEOUT_S)
        if not done:  # the SDK's bounded shutdown never takes this long; do not hang the gateway
            logger.error("MCP server %s did not stop within %.0f s", self._label, _CLOSE_TIMEOUT_S)
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def _run(self) -> None:
        reason = "it ended"
        try:
            with anyio.CancelScope() as scope:
                self._scope = scope
                if self._closing:
                    scope.cancel()
                scope.deadline = anyio.current_time() + self.spec.start_timeout_s
                try:
                    await self._serve(scope)
                except Exception as exc:
                    reason = self._describe(exc)
            if self.started_at is None and scope.cancelled_caught and not self._closing:
                reason = f"it did not start within {self.spec.start_timeout_s:g} s"
            elif self._stop_reason is not None:
                reason = self._stop_reason
        finally:  # also when the task itself is cancelled: no caller may wait forever
            self._inbox.close()
            self._inbox_out.close()
            for job in list(self._pending):
                if not job.future.done():
                    job.future.set_result(self._stopped())
            if not self._closing:
                self._on_end(self, reason)
            if not self.ready.done():
                self.ready.set_result(_StartFailed(reason))

    async def _serve(self, scope: anyio.CancelScope) -> None:
        ended = anyio.Event()
        await anyio.to_thread.run_sync(_import_sdk)  # the first import takes ~0.6 s: not on the loop
        async with AsyncExitStack() as stack:
            client = await self._connect(stack, ended)
            tools = await self._list_tools(client)
            scope.deadline = math.inf
            self.started_at = self._clock()
            self.ready.set_result(tools)
            async with anyio.create_task_group() as calls:
                self._calls_scope = calls.cancel_scope
                calls.start_soon(self._watch, ended)
                async for job in self._inbox_out:
                    calls.start_soon(self._run_job, client, job)

    async def _connect(self, stack: AsyncExitStack, ended: anyio.Event) -> Client:
        import httpx2
        from mcp import Client, Implementation, StdioServerParameters, stdio_client
        from mcp.client.streamable_http import streamable_http_client

        spec = self.spec
        if spec.command is not None:
            # stdio_client gives the process get_default_environment() | env, nothing more
            params = StdioServerParameters(command=spec.command, args=list(spec.args), env=dict(spec.env))
            read, write = await stack.enter_async_context(stdio_client(params, errlog=_errlog(stack)))
        else:
            assert spec.url is not None
            # the SDK's default HTTP timeouts; headers go on the client, the SDK's way
            http = httpx2.AsyncClient(headers=dict(spec.headers), timeout=httpx2.Timeout(30.0, read=300.0))
            await stack.enter_async_context(http)
            read, write = await stack.enter_async_context(streamable_http_client(spec.url, http_client=http))
        client = Client(
            _opened(_EofWatch(read, ended), write),
            cache=None,
            client_info=Implementation(name="hermes-gateway", version="1"),
        )
        return await stack.enter_async_context(client)

    @staticmethod
    async def _list_tools(client: Client) -> list[_Listed]:
        listed: list[_Listed] = []
        cursor: str | None = None
        for _ in range(_LIST_PAGES):
            page = await client.list_tools(cursor=cursor)
            for tool in page.tools:
                schema = dict(tool.input_schema) if tool.input_schema else {}
                schema.setdefault("type", "object")
                if schema["type"] == "object":
                    schema.setdefault("properties", {})
                listed.append(_Listed(tool.name, tool.description or tool.title or tool.name, schema))
            cursor = page.next_cursor
            if cursor is None:
                break
        return listed

    async def _watch(self, ended: anyio.Event) -> None:
        await ended.wait()
        self._stop("the server closed the connection")

    def _stop(self, reason: str) -> None:
        """End the session from inside (the server is gone): its task unwinds the stack."""
        if self._stop_reason is None:
            self._stop_reason = reason
            self.stopped_at = self._clock()
        if self._calls_scope is not None:
            self._calls_scope.cancel()

    async def _run_job(self, client: Client, job: _Job) -> None:
        if job.future.done():  # the caller gave up before the call started
            return
        with anyio.CancelScope() as job.scope:
            reply = await self._call(client, job)
            if not job.future.done():
                job.future.set_result(reply)

    async def _call(self, client: Client, job: _Job) -> str:
        from mcp import MCPError
        from mcp_types import CONNECTION_CLOSED, INVALID_REQUEST, REQUEST_TIMEOUT

        timeout = self.spec.call_timeout_s
        try:
            with anyio.fail_after(timeout):
                result = await client.call_tool(job.tool, job.arguments, read_timeout_seconds=timeout)
        except TimeoutError:
            return self._timed_out(job.qualified)
        except MCPError as exc:
            if exc.code == REQUEST_TIMEOUT:
                return self._timed_out(job.qualified)
            if exc.code == CONNECTION_CLOSED:
                self._stop("the connection closed")
                return self._stopped()
            if exc.code == INVALID_REQUEST and exc.error.message == "Session terminated":  # HTTP 404 on a session
                self._stop("the server ended the session")
                return self._stopped()
            return _failure(f"the MCP server {self.spec.name} refused the call: {self._redact(exc.error.message)}")
        except Exception as exc:  # a malformed answer, an unsupported result kind
            return _failure(f"the tool {job.qualified} failed: {self._describe(exc)}")
        self.succeeded = True
        return _result_json(result, self.spec.max_output_chars)

    def _stopped(self) -> str:
        return _failure(f"the MCP server {self.spec.name} stopped; it will be restarted")

    def _timed_out(self, qualified: str) -> str:
        return _failure(f"the tool {qualified} did not answer within {self.spec.call_timeout_s:g} s")

    def _describe(self, exc: BaseException) -> str:
        """A short reason for a failure, with the spec's secret-bearing values redacted."""
        while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
            exc = exc.exceptions[0]
        text = str(exc).strip()
        return self._redact(f"{type(exc).__name__}: {text}" if text else type(exc).__name__)[:300]


def _import_sdk() -> None:
    import mcp.client.streamable_http  # noqa: F401 (loads the whole SDK)


def _qualified_names(pairs: Sequence[tuple[str, str]]) -> list[str]:
    """The model's names for (server, tool) pairs: `server__tool`, every character outside
    [A-Za-z0-9_-] made '_', cut to 64. Pairs that would share a name each end in a short
    hash of their own (server, tool) instead, so no name depends on the order of the list."""
    bases = [_UNSAFE.sub("_", f"{server}__{tool}")[:_MAX_NAME] for server, tool in pairs]
    counts = Counter(bases)
    names = []
    for base, (server, tool) in zip(bases, pairs, strict=True):
        if counts[base] > 1:
            digest = hashlib.sha256(f"{server}\0{tool}".encode()).hexdigest()[:8]
            base = f"{base[: _MAX_NAME - 9]}_{digest}"
        names.append(base)
    taken: set[str] = set()
    unique = []
    for name in names:  # a hashed name meeting another one: practically never, still unique
        candidate, n = name, 2
        while candidate in taken:
            candidate = f"{name[: _MAX_NAME - len(str(n)) - 1]}_{n}"
            n += 1
        taken.add(candidate)
        unique.append(candidate)
    return unique


def _result_json(result: CallToolResult, max_chars: int) -> str:
    """The model's JSON for a tool's answer: its content blocks' text joined, cut at `max_chars`."""
    text = _content_text(result)
    if result.is_error:
        return _failure(text[:max_chars] or "the tool reported an error")
    reply: dict[str, Any] = {"success": True, "content": text[:max_chars]}
    if len(text) > max_chars:
        reply["truncated"] = True
    return json.dumps(reply, ensure_ascii=False)


def _content_text(result: CallToolResult) -> str:
    from mcp_types import AudioContent, EmbeddedResource, ImageContent, ResourceLink, TextContent

    parts: list[str] = []
    for block in result.content:
        if isinstance(block, TextContent):
            parts.append(block.text)
        elif isinstance(block, ImageContent | AudioContent):
            parts.append(f"[{block.type}: {block.mime_type}]")
        elif isinstance(block, ResourceLink):
            parts.append(f"[resource: {block.uri}]")
        elif isinstance(block, EmbeddedResource):
            resource = block.resource
            parts.append(getattr(resource, "text", None) or f"[resource: {resource.uri}]")
    if not parts and result.structured_content is not None:
        parts.append(json.dumps(result.structured_content, ensure_ascii=False))
    return "\n".join(parts)


def _failure(error: str) -> str:
    return json.dumps({"success": False, "error": error}, ensure_ascii=False)
