"""The one YAML config file, validated by pydantic; unknown keys and bad values name the key.

Secrets never live in the file: keys ending in `_env` name environment variables.
Defaults follow the Hermes seed documents (compression and memory numbers).
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

#: the external memory providers `memory.provider` may name; agent/providers.py builds them
MEMORY_PROVIDERS = ("local",)


def parse_listen(listen: str) -> tuple[str, int]:
    """`host:port`, `[v6]:port` or `:port` (all interfaces) -> (host, port)."""
    text = listen.strip()
    if text.startswith("["):
        host, sep, port = text[1:].partition("]:")
    else:
        host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError(f"observability.listen: {listen!r} must look like 127.0.0.1:9464")
    return host or "0.0.0.0", int(port)  # noqa: S104 ("":port asks for every interface)


class ConfigError(Exception):
    """A config file that cannot be used; the message names the file and the key."""


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_default=True)


DEFAULT_ANSWER_MAX_TOKENS = 4096
#: storage.memory_budget_mib's default: 286 profiles open, so the gateway stays under
#: 200 MiB RSS at 1,000 people (docs/concepts.md#open-profiles)
DEFAULT_MEMORY_BUDGET_MIB = 76


_CHOICE_NAME = re.compile(r"^[a-z0-9][a-z0-9_.-]{0,31}$")
_RESERVED_CHOICES = {"off", "custom", "default"}


def _choice_names(kind: str, names: Iterable[str]) -> None:
    """Model and persona names are typed in chat (`/model NAME`): short, lower case, and not
    one of the command's own words."""
    for name in names:
        if not _CHOICE_NAME.match(name) or name in _RESERVED_CHOICES:
            raise ValueError(
                f"{kind} name {name!r}: use 1-32 lower-case letters, digits, '.', '_' or '-' "
                f"(not {', '.join(sorted(_RESERVED_CHOICES))})"
            )


class ModelOffer(_Section):
    """One model the operator offers people (`llm.models.NAME`); an unset field falls back
    to the `llm` section's (docs/configuration.md#llm-the-model)."""

    model: str
    base_url: str | None = None
    api_key_env: str | None = None
    context_length: int | None = Field(default=None, ge=512)
    vision: bool | None = None
    price_in_per_mtok: float | None = Field(default=None, ge=0)
    price_out_per_mtok: float | None = Field(default=None, ge=0)

    @field_validator("base_url")
    @classmethod
    def _http_url(cls, url: str | None) -> str | None:
        return None if url is None else _http_url(url)


def _http_url(url: str) -> str:
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"{url!r} must be an http(s) URL such as http://127.0.0.1:11434/v1")
    return url


class LLMConfig(_Section):
    base_url: str = "http://127.0.0.1:11434/v1"
    model: str = "llama3.1"
    api_key_env: str | None = None
    context_length: int = Field(default=32768, ge=512)
    max_tokens: int | None = Field(default=None, ge=1)
    timeout_s: float = Field(default=120.0, gt=0)
    # the whole answer, streaming included: a model still writing then is cut
    # (docs/operator-guide.md#runaway-answers-and-long-replies)
    answer_timeout_s: float = Field(default=300.0, gt=0)
    max_retries: int = Field(default=3, ge=0, le=10)
    vision: bool = False  # images go to the model as inline image parts (doctor checks it accepts one)
    price_in_per_mtok: float | None = Field(default=None, ge=0)  # the default model's price, for budgets
    price_out_per_mtok: float | None = Field(default=None, ge=0)
    models: dict[str, ModelOffer] = {}  # what `/model NAME` may choose; `model` stays the default
    max_concurrency: int = Field(default=16, ge=1, le=1024)  # model calls at once, shared fairly by tenants

    @model_validator(mode="after")
    def _answer_fits_the_window(self) -> LLMConfig:
        if self.max_tokens is not None and self.max_tokens >= self.context_length:
            raise ValueError(
                f"max_tokens ({self.max_tokens}) must be smaller than context_length "
                f"({self.context_length}): no prompt would fit beside the answer"
            )
        return self

    @model_validator(mode="after")
    def _offers_are_whole(self) -> LLMConfig:
        for name in self.models:  # each offer, with what it leaves to the llm section, is a valid section
            try:
                self.for_offer(name)
            except ValidationError as err:
                raise ValueError(f"llm.models.{name}: {err.errors()[0]['msg']}") from None
        return self

    def for_offer(self, name: str) -> LLMConfig:
        """This section as the offer `name` changes it: what the turns, summaries and reviews
        of a tenant that chose it use (docs/concepts.md#models)."""
        data = self.model_dump()
        data.update({k: v for k, v in self.models[name].model_dump().items() if v is not None})
        data["models"] = {}
        return LLMConfig.model_validate(data)

    def answer_max_tokens(self) -> int:
        """The `max_tokens` sent with each answer: the operator's, else a default that
        leaves most of the window to the prompt."""
        return self.max_tokens or min(DEFAULT_ANSWER_MAX_TOKENS, self.context_length // 4)

    def api_key(self) -> str | None:
        return os.environ.get(self.api_key_env) if self.api_key_env else None

    @field_validator("base_url")
    @classmethod
    def _http_url(cls, url: str) -> str:
        return _http_url(url)

    @field_validator("models")
    @classmethod
    def _model_names(cls, models: dict[str, ModelOffer]) -> dict[str, ModelOffer]:
        _choice_names("llm.models", models)
        return models


class AuxModelConfig(_Section):
    """An auxiliary model; every unset field falls back to the main `llm` section."""

    base_url: str | None = None
    model: str | None = None
    api_key_env: str | None = None
    timeout_s: float | None = Field(default=None, gt=0)


class AuxiliaryConfig(_Section):
    compression: AuxModelConfig = AuxModelConfig()
    review: AuxModelConfig = AuxModelConfig()  # background memory/skill review (agent/review.py)


class CompressionConfig(_Section):
    enabled: bool = True
    threshold: float = Field(default=0.50, gt=0, le=1)
    model_thresholds: dict[str, float] = {}
    threshold_tokens: int | None = Field(default=None, ge=1)
    target_ratio: float = Field(default=0.20, gt=0, le=1)
    protect_first_n: int = Field(default=3, ge=0)
    protect_last_n: int = Field(default=20, ge=1)
    min_tail_user_messages: int = Field(default=1, ge=0)
    max_attempts: int = Field(default=3, ge=1, le=10)
    in_place: bool = True
    abort_on_summary_failure: bool = False
    proactive_prune_tokens: int = Field(default=0, ge=0)
    proactive_prune_min_result_chars: int = Field(default=8000, ge=0)
    proactive_prune_min_reclaim_tokens: int = Field(default=4096, ge=0)
    progress_notices: bool = False
    idle_compact_after_seconds: int = Field(default=0, ge=0)
    micro_compact: bool = False
    min_prune_chars: int = Field(default=200, ge=0)

    @model_validator(mode="after")
    def _unsupported_switches_stay_off(self) -> CompressionConfig:
        # Hermes has these opt-in modes; this gateway does not implement them yet, and a
        # key that silently does nothing would mislead, so turning one on is an error.
        for key, off in (("proactive_prune_tokens", 0), ("idle_compact_after_seconds", 0), ("micro_compact", False)):
            if getattr(self, key) != off:
                raise ValueError(f"{key} is not supported by hermes-gateway yet; leave it at {off!r}")
        return self


class MemoryConfig(_Section):
    memory_enabled: bool = True
    user_profile_enabled: bool = True
    memory_char_limit: int = Field(default=2200, ge=100)
    user_char_limit: int = Field(default=1375, ge=100)
    nudge_interval: int = Field(default=10, ge=0)  # user turns of a lane between reviews; 0 = off
    flush_min_turns: int = Field(default=6, ge=0)  # review a session this long when it ends; 0 = off
    review_timeout_s: float = Field(default=120.0, gt=0)
    write_approval: Literal["allow", "stage", "block"] = "allow"
    provider: str = ""  # "" = no external provider

    @field_validator("provider")
    @classmethod
    def _known_provider(cls, kind: str) -> str:
        if kind and kind not in MEMORY_PROVIDERS:
            known = ", ".join(repr(k) for k in ["", *MEMORY_PROVIDERS])
            raise ValueError(f"unknown memory provider {kind!r} (known: {known})")
        return kind


class SkillsConfig(_Section):
    enabled: bool = True  # false: no skill_manage tool, no skill index, no skill reviews
    creation_nudge_interval: int = Field(default=15, ge=0)  # tool iterations between skill reviews; 0 = off


class StorageConfig(_Section):
    fsync: Literal["always", "batch", "never"] = "batch"
    # threads that do every profile's session I/O (SQLite and journals), shared by all profiles
    io_threads: int = Field(default=4, ge=1, le=8)
    # memory the open profiles may take; it sizes the open-profile cache (docs/concepts.md#open-profiles)
    memory_budget_mib: int = Field(default=DEFAULT_MEMORY_BUDGET_MIB, ge=1)
    # per-person encryption at rest (docs/privacy.md#encryption-at-rest): each tenant's own key,
    # wrapped by the master key that one of these two names
    encryption: Literal["off", "per_tenant"] = "off"
    master_key_env: str | None = None
    master_key_file: Path | None = None

    @model_validator(mode="after")
    def _one_master_key(self) -> StorageConfig:
        named = [k for k in ("master_key_env", "master_key_file") if getattr(self, k) is not None]
        if self.encryption == "off" and named:
            raise ValueError(f"storage.{named[0]} does nothing while storage.encryption is off; remove it")
        if self.encryption == "per_tenant" and len(named) != 1:
            raise ValueError(
                "storage.encryption: per_tenant needs the master key: set exactly one of "
                "storage.master_key_env (a variable's name) or storage.master_key_file"
            )
        return self


class TenancyConfig(_Section):
    group_sessions_per_user: bool = True
    thread_sessions_per_user: bool = False
    personal_memory_in_groups: Literal["full", "read", "off"] = "full"
    # link name -> principals, e.g. {"alice": ["telegram:111", "discord:222"]}
    identity_links: dict[str, list[str]] = {}
    # an optional hard cap on open profiles, below what storage.memory_budget_mib allows
    max_open_profiles: int | None = Field(default=None, ge=1)

    @field_validator("identity_links")
    @classmethod
    def _principals_look_right(cls, links: dict[str, list[str]]) -> dict[str, list[str]]:
        seen: dict[str, str] = {}
        for name, principals in links.items():
            for p in principals:
                platform, sep, uid = p.partition(":")
                if not sep or not platform or not uid:
                    raise ValueError(f"{name}: principal {p!r} must look like 'platform:user_id'")
                if p in seen:
                    raise ValueError(f"{p!r} is linked to both {seen[p]!r} and {name!r}")
                seen[p] = name
        return links


class AccessConfig(_Section):
    # "<platform>:<user_id>" or "*"; empty means nobody but admins (and paired users).
    allowed_users: list[str] = ["*"]
    admins: list[str] = []
    unauthorized_dm: Literal["pair", "ignore"] = "pair"
    pairing_code_ttl_s: int = Field(default=3600, ge=60)


class LimitsConfig(_Section):
    rate_limit_per_minute: int = Field(default=20, ge=1)
    max_text_length: int = Field(default=16000, ge=1)
    max_queued_turns: int = Field(default=5, ge=1)
    max_tool_iterations: int = Field(default=8, ge=1)
    coalesce_burst_ms: int = Field(default=0, ge=0)
    max_attachment_bytes: int = Field(default=20 * 1024 * 1024, ge=1)  # Telegram's own download cap
    max_attachment_chars: int = Field(default=20000, ge=0)  # text taken from one document
    # messages arriving while the lane's turn runs: answered together in the next turn
    # (collect), one turn each (queue), or they stop the running turn (interrupt)
    busy_mode: Literal["queue", "collect", "interrupt"] = "collect"

    @model_validator(mode="after")
    def _burst_needs_collecting(self) -> LimitsConfig:
        if self.busy_mode == "queue" and self.coalesce_burst_ms:
            raise ValueError(
                "coalesce_burst_ms merges messages into one turn; it cannot be used "
                "with busy_mode: queue (set busy_mode: collect or coalesce_burst_ms: 0)"
            )
        return self


class RemindersConfig(_Section):
    """The `reminders` tool and `/reminders`; delivered by the gateway's scheduler."""

    enabled: bool = True
    max_per_tenant: int = Field(default=50, ge=1, le=10000)


class TranscriptionConfig(_Section):
    """An OpenAI-compatible `/v1/audio/transcriptions` endpoint (whisper.cpp server,
    faster-whisper servers, hosted APIs); no base_url: voice notes are not transcribed."""

    base_url: str | None = None  # e.g. http://127.0.0.1:8080/v1
    model: str = "whisper-1"
    api_key_env: str | None = None
    timeout_s: float = Field(default=120.0, gt=0)
    price_per_minute: float | None = Field(default=None, ge=0)  # counted to budgets when set

    def api_key(self) -> str | None:
        return os.environ.get(self.api_key_env) if self.api_key_env else None


#: who may use a tool (docs/concepts.md#who-may-use-a-tool): anyone; only in a direct
#: message; the operator (`access.admins`) in a direct message; a chat's admins (and anyone
#: in a direct message); the operator anywhere
ToolAllow = Literal["everyone", "dm", "owner", "chat_admin", "admin"]
_HOST_ENTRY = re.compile(r"^(?:\[[0-9a-f:.]+\]|[a-z0-9.-]+)(?::\d{1,5})?$")
_SERVER_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]{0,31}$")


class BuiltinToolRule(_Section):
    """`tools.<tool>` for a built-in tool the agent always had (memory, session_search,
    skill_manage, reminders): who may use it, and whether each call waits for the person."""

    allow: ToolAllow = "everyone"
    confirm: bool = False


class WebHostsConfig(_Section):
    """`tools.web`: hosts the web tools may reach although they resolve to a private,
    loopback or link-local address (`host` or `host:port`)."""

    allow_hosts: list[str] = []

    @field_validator("allow_hosts")
    @classmethod
    def _hosts(cls, hosts: list[str]) -> list[str]:
        out = []
        for host in hosts:
            entry = host.strip().lower()
            if not _HOST_ENTRY.match(entry):
                raise ValueError(f"{host!r}: use a host name or address, optionally with :port (e.g. wiki.lan:8080)")
            out.append(entry)
        return out


class WebFetchConfig(_Section):
    """`tools.web_fetch`: a URL to readable text (HTML, PDF, plain text)."""

    enabled: bool = False
    allow: ToolAllow = "dm"
    confirm: bool = False
    max_bytes: int = Field(default=2_000_000, ge=1024, le=50_000_000)
    timeout_s: float = Field(default=15.0, gt=0, le=300)
    max_chars: int = Field(default=20_000, ge=500, le=200_000)  # of text handed to the model


class WebSearchConfig(_Section):
    """`tools.web_search`: results with titles, URLs and snippets; no provider: off."""

    provider: Literal["searxng", "brave", "tavily"] | None = None
    base_url: str | None = None  # SearXNG's address; for brave/tavily it replaces the official endpoint
    api_key_env: str | None = None  # brave, tavily
    allow: ToolAllow = "dm"
    confirm: bool = False
    max_results: int = Field(default=5, ge=1, le=10)
    timeout_s: float = Field(default=15.0, gt=0, le=120)

    @field_validator("base_url")
    @classmethod
    def _url(cls, url: str | None) -> str | None:
        return None if url is None else _http_url(url)

    @model_validator(mode="after")
    def _provider_needs(self) -> WebSearchConfig:
        if self.provider == "searxng" and not self.base_url:
            raise ValueError("provider searxng needs base_url (your SearXNG's address, e.g. http://127.0.0.1:8888)")
        if self.provider in ("brave", "tavily") and not self.api_key_env:
            raise ValueError(f"provider {self.provider} needs api_key_env (the variable holding its API key)")
        return self

    def api_key(self) -> str | None:
        return os.environ.get(self.api_key_env) if self.api_key_env else None


class McpToolRule(_Section):
    """`tools.mcp.servers.<NAME>.tools.<TOOL>`: one tool's rule over its server's."""

    allow: ToolAllow | None = None
    confirm: bool | None = None


class McpServerConfig(_Section):
    """`tools.mcp.servers.<NAME>`: a tool server started on first use, over stdio (`command`)
    or streamable HTTP (`url`) (docs/concepts.md#mcp-tool-servers)."""

    command: str | None = None
    args: list[str] = []
    env: dict[str, str] = {}  # plain settings; credentials go through env_from
    env_from: dict[str, str] = {}  # the server's variable -> the gateway's variable holding the value
    url: str | None = None
    headers_env: dict[str, str] = {}  # header name -> the variable holding its value
    per_tenant: bool = False  # one process per tenant, `{tenant}` substituted in args, env, url
    allow: ToolAllow = "dm"
    confirm: bool = False
    timeout_s: float = Field(default=30.0, gt=0, le=600)  # per call
    max_output_chars: int = Field(default=20_000, ge=500, le=200_000)
    tools: dict[str, McpToolRule] = {}

    @field_validator("url")
    @classmethod
    def _url(cls, url: str | None) -> str | None:
        if url is not None:
            _http_url(url.replace("{tenant}", "t"))  # the placeholder is filled per tenant
        return url

    @model_validator(mode="after")
    def _one_transport(self) -> McpServerConfig:
        if (self.command is None) == (self.url is None):
            raise ValueError("give either command (a stdio server) or url (streamable HTTP), not both or neither")
        if self.url is not None and (self.args or self.env or self.env_from):
            raise ValueError("args, env and env_from are for a command; a url server takes headers_env")
        return self

    def secret_envs(self) -> list[str]:
        """The gateway's variables this server's credentials come from."""
        return [*self.env_from.values(), *self.headers_env.values()]

    def rule(self, tool: str) -> tuple[ToolAllow, bool]:
        """(allow, confirm) of one of its tools: the tool's own rule over the server's."""
        own = self.tools.get(tool)
        allow = own.allow if own is not None and own.allow is not None else self.allow
        confirm = own.confirm if own is not None and own.confirm is not None else self.confirm
        return allow, confirm


class McpConfig(_Section):
    servers: dict[str, McpServerConfig] = {}

    @field_validator("servers")
    @classmethod
    def _names(cls, servers: dict[str, McpServerConfig]) -> dict[str, McpServerConfig]:
        for name in servers:
            if not _SERVER_NAME.match(name):
                raise ValueError(f"server name {name!r}: use 1-32 letters, digits, '_' or '-'")
        return servers


class ToolsConfig(_Section):
    """What the agent may do beyond its own stores, and who may ask it to
    (docs/concepts.md#tools)."""

    confirm_timeout_s: float = Field(default=120.0, ge=1, le=3600)  # no answer by then: denied
    memory: BuiltinToolRule = BuiltinToolRule()
    session_search: BuiltinToolRule = BuiltinToolRule()
    skill_manage: BuiltinToolRule = BuiltinToolRule()
    reminders: BuiltinToolRule = BuiltinToolRule()
    web: WebHostsConfig = WebHostsConfig()
    web_fetch: WebFetchConfig = WebFetchConfig()
    web_search: WebSearchConfig = WebSearchConfig()
    mcp: McpConfig = McpConfig()


class BudgetLimits(_Section):
    """Caps on one tenant's model use; unset = no cap (docs/configuration.md#budgets)."""

    tokens_per_day: int | None = Field(default=None, ge=1)
    tokens_per_month: int | None = Field(default=None, ge=1)
    cost_per_day: float | None = Field(default=None, gt=0)
    cost_per_month: float | None = Field(default=None, gt=0)


class BudgetsConfig(_Section):
    per_person: BudgetLimits = BudgetLimits()  # personal tenants (DMs, and a person's own group lanes)
    per_chat: BudgetLimits = BudgetLimits()  # shared lanes (a group's shared tenant)
    warn_at: float = Field(default=0.8, gt=0, le=1)
    exempt_admins: bool = True  # access.admins are never capped


class DeliveryConfig(_Section):
    """How replies reach the chat. `streaming` edits one message as the answer is generated
    (`dm`: in private chats only, `all`: everywhere, `off`: send the finished answer); the
    outbox retries an unsent chunk for `max_age_s` with backoff (docs/concepts.md#delivery)."""

    streaming: Literal["dm", "all", "off"] = "dm"
    # the least time between two edits of a streamed message (Telegram and Discord allow
    # about one edit a second per message before rate limiting)
    stream_edit_interval_s: float = Field(default=1.0, ge=0.1, le=60)
    max_age_s: float = Field(default=24 * 3600, gt=0)
    retry_initial_s: float = Field(default=1.0, gt=0)
    retry_max_s: float = Field(default=60.0, gt=0)
    # a longer answer sends this much, and the rest when the person asks for it (/more)
    max_reply_chars: int = Field(default=12000, ge=500)
    # on SIGTERM / Ctrl-C: how long running turns may finish and deliver before the process
    # exits anyway (docs/operator-guide.md#stopping)
    drain_timeout_s: float = Field(default=30.0, ge=0, le=3600)


class WebhookConfig(_Section):
    listen: str = "127.0.0.1"
    port: int = Field(default=8443, ge=1, le=65535)
    path: str = "/telegram"
    public_url: str | None = None
    secret_token_env: str | None = None


class TelegramConfig(_Section):
    enabled: bool = False
    token_env: str = "TELEGRAM_BOT_TOKEN"  # noqa: S105 (the variable\'s name, not a token)
    base_url: str = "https://api.telegram.org/bot"
    base_file_url: str | None = None
    mode: Literal["polling", "webhook"] = "polling"
    webhook: WebhookConfig = WebhookConfig()
    require_mention_in_groups: bool = True
    handle_edited_messages: bool = False
    handle_channel_posts: bool = False
    poll_timeout_s: int = Field(default=30, ge=0, le=60)


class DiscordConfig(_Section):
    enabled: bool = False
    token_env: str = "DISCORD_BOT_TOKEN"  # noqa: S105 (the variable\'s name, not a token)
    api_base: str | None = None  # None = Discord's own
    gateway_url: str | None = None
    require_mention_in_guilds: bool = True
    free_response_channels: list[str] = []
    allowed_guilds: list[str] = []
    sync_slash_commands: bool = True
    # gateway shards: 1 = one connection. More: one connection per shard (guild events on
    # shard (guild_id >> 22) % shard_count, DMs on shard 0); a cluster spreads them over nodes
    shard_count: int = Field(default=1, ge=1, le=1024)

    @field_validator("free_response_channels", "allowed_guilds", mode="before")
    @classmethod
    def _ids_as_strings(cls, v: object) -> object:
        return [str(x) for x in v] if isinstance(v, list) else v


class PlatformsConfig(_Section):
    telegram: TelegramConfig = TelegramConfig()
    discord: DiscordConfig = DiscordConfig()


class ObservabilityConfig(_Section):
    listen: str | None = None  # "127.0.0.1:9464" serves /healthz and /metrics
    # a platform still connecting (or reconnecting) this long turns /healthz red (503)
    unhealthy_after_s: float = Field(default=60.0, ge=0)

    @field_validator("listen")
    @classmethod
    def _host_port(cls, listen: str | None) -> str | None:
        if listen is not None:
            try:
                parse_listen(listen)
            except ValueError:
                raise ValueError(f"{listen!r} must look like 127.0.0.1:9464 (host:port)") from None
        return listen


class LoggingConfig(_Section):
    level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = "INFO"
    format: Literal["text", "json"] = "text"
    include_text: bool = False


class ClusterConfig(_Section):
    """Several nodes on one PostgreSQL (docs/cluster.md#turning-it-on): set `postgres_dsn_env` and
    `hermes-gateway run` is one node of the cluster; unset, the gateway is a single node."""

    postgres_dsn_env: str | None = None  # env var holding the DSN; None = single node (the default)
    node_id: str | None = None  # None = "<hostname>-<pid>"
    lease_ttl_s: float = Field(default=15.0, ge=1, le=3600)
    max_lanes: int = Field(default=4, ge=1, le=256)  # lanes this node runs at once
    poll_interval_s: float = Field(default=5.0, gt=0, le=300)  # claim without a wakeup this often

    @field_validator("postgres_dsn_env", "node_id")
    @classmethod
    def _not_blank(cls, v: str | None) -> str | None:
        if v is not None and not v.strip():
            raise ValueError("must not be empty (leave the key out instead)")
        return v

    @field_validator("node_id")
    @classmethod
    def _node_id_chars(cls, v: str | None) -> str | None:
        if v is not None and not re.fullmatch(r"[A-Za-z0-9._:-]{1,64}", v):
            raise ValueError(f"{v!r} must be 1-64 letters, digits or . _ : -")
        return v

    @property
    def enabled(self) -> bool:
        return self.postgres_dsn_env is not None

    def node_name(self) -> str:
        """This process's node id: the configured one, else hostname and pid."""
        import socket

        return self.node_id or f"{socket.gethostname()}-{os.getpid()}"


class Config(_Section):
    data_dir: Path = Path("./data")
    agent_name: str = "Hermes"
    llm: LLMConfig = LLMConfig()
    auxiliary: AuxiliaryConfig = AuxiliaryConfig()
    compression: CompressionConfig = CompressionConfig()
    memory: MemoryConfig = MemoryConfig()
    skills: SkillsConfig = SkillsConfig()
    storage: StorageConfig = StorageConfig()
    tenancy: TenancyConfig = TenancyConfig()
    access: AccessConfig = AccessConfig()
    limits: LimitsConfig = LimitsConfig()
    delivery: DeliveryConfig = DeliveryConfig()
    reminders: RemindersConfig = RemindersConfig()
    transcription: TranscriptionConfig = TranscriptionConfig()
    personas: dict[str, str] = {}  # operator personas `/persona NAME` may choose: name -> instructions
    budgets: BudgetsConfig = BudgetsConfig()
    tools: ToolsConfig = ToolsConfig()
    platforms: PlatformsConfig = PlatformsConfig()
    observability: ObservabilityConfig = ObservabilityConfig()
    logging: LoggingConfig = LoggingConfig()
    cluster: ClusterConfig = ClusterConfig()

    @field_validator("personas")
    @classmethod
    def _persona_names(cls, personas: dict[str, str]) -> dict[str, str]:
        _choice_names("personas", personas)
        for name, text in personas.items():
            if not text.strip():
                raise ValueError(f"personas.{name}: the instructions are empty")
        return personas

    @model_validator(mode="after")
    def _cluster_refuses_encryption(self) -> Config:
        """PostgreSQL holds message text and drafts in cluster mode; encrypting only the
        profiles would promise what the cluster does not keep (docs/privacy.md#what-is-not-encrypted)."""
        if self.cluster.enabled and self.storage.encryption != "off":
            raise ValueError(
                "storage.encryption: per_tenant is not available in cluster mode yet "
                "(PostgreSQL would hold message text unencrypted); set it to off"
            )
        return self

    @property
    def reminders_on(self) -> bool:
        """Reminders are delivered (on one node, and in cluster mode: docs/cluster.md#reminders)."""
        return self.reminders.enabled

    @property
    def streaming_mode(self) -> Literal["dm", "all", "off"]:
        """`delivery.streaming`, in either mode (a cluster records drafts in PostgreSQL)."""
        return self.delivery.streaming


class AgentSettings(BaseModel):
    """The part of the config the agent reads (agent/): its name, the model, auxiliary
    models, compression, memory, skills, reminders and the tool-iteration limit. The agent
    is handed this, never the whole `Config`, so it cannot come to depend on platform,
    storage or cluster settings. The sections are the validated `Config` sections
    themselves (`from_config` shares them, it does not copy them)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    agent_name: str = "Hermes"
    llm: LLMConfig = LLMConfig()
    auxiliary: AuxiliaryConfig = AuxiliaryConfig()
    compression: CompressionConfig = CompressionConfig()
    memory: MemoryConfig = MemoryConfig()
    skills: SkillsConfig = SkillsConfig()
    reminders: RemindersConfig = RemindersConfig()
    max_tool_iterations: int = Field(default=LimitsConfig().max_tool_iterations, ge=1)  # limits.max_tool_iterations
    personas: dict[str, str] = {}  # the operator's personas (agent/persona.py)

    @classmethod
    def from_config(cls, cfg: Config) -> AgentSettings:
        return cls(
            agent_name=cfg.agent_name,
            llm=cfg.llm,
            auxiliary=cfg.auxiliary,
            compression=cfg.compression,
            memory=cfg.memory,
            skills=cfg.skills,
            reminders=cfg.reminders,
            max_tool_iterations=cfg.limits.max_tool_iterations,
            personas=cfg.personas,
        )


def _describe(err: ValidationError) -> str:
    lines = []
    for e in err.errors():
        key = ".".join(str(p) for p in e["loc"]) or "(top level)"
        msg = "unknown key" if e["type"] == "extra_forbidden" else e["msg"].removeprefix("Value error, ")
        lines.append(f"  {key}: {msg}")
    return "\n".join(lines)


def parse_config(data: object, source: str = "<config>", base_dir: Path | None = None) -> Config:
    """Validate a parsed YAML document; relative `data_dir` is taken from `base_dir`."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: the top level must be a mapping of sections")
    try:
        cfg = Config.model_validate(data)
    except ValidationError as err:
        raise ConfigError(f"{source}: invalid configuration\n{_describe(err)}") from None
    if base_dir is not None and not cfg.data_dir.is_absolute():
        cfg = cfg.model_copy(update={"data_dir": (base_dir / cfg.data_dir).resolve()})
    return cfg


class _StrictLoader(yaml.SafeLoader):
    """PyYAML's safe loader, but a key given twice in one mapping is an error instead of the
    last one silently winning."""


def _mapping_without_duplicates(loader: _StrictLoader, node: yaml.MappingNode, deep: bool = False) -> Any:
    seen: dict[Any, int] = {}
    for key_node, _value in node.value:  # the keys written here; `<<` merges may be overridden
        if not isinstance(key_node, yaml.ScalarNode) or key_node.tag == "tag:yaml.org,2002:merge":
            continue
        key = loader.construct_object(key_node, deep=deep)
        line = key_node.start_mark.line + 1
        if key in seen:
            raise yaml.constructor.ConstructorError(
                None, None, f"duplicate key {key!r} (first given on line {seen[key]})", key_node.start_mark
            )
        seen[key] = line
    return yaml.SafeLoader.construct_mapping(loader, node, deep=deep)


_StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _mapping_without_duplicates)


def parse_yaml(text: str) -> Any:
    """Parse one YAML document with the strict loader (duplicate keys refused)."""
    return yaml.load(text, Loader=_StrictLoader)  # noqa: S506 - a SafeLoader subclass


def load_config(path: str | Path) -> Config:
    """Read and validate the YAML file at `path`."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"{p}: no such config file (create one with `hermes-gateway init -c {p}`)") from None
    except IsADirectoryError:
        raise ConfigError(f"{p} is a directory; -c needs the path of a YAML config file") from None
    except UnicodeDecodeError as err:
        raise ConfigError(
            f"{p} is not UTF-8 text (byte {err.start} cannot be decoded); save the config file as UTF-8"
        ) from None
    except OSError as err:
        raise ConfigError(f"{p}: cannot read the config file ({err.strerror or err})") from None
    try:
        data = parse_yaml(text)
    except yaml.MarkedYAMLError as err:
        mark = err.problem_mark or err.context_mark
        where = f", line {mark.line + 1}" if mark is not None else ""
        raise ConfigError(f"{p}{where}: not valid YAML: {err.problem or err.context}") from None
    except yaml.YAMLError as err:
        raise ConfigError(f"{p}: not valid YAML: {err}") from None
    return parse_config(data, str(p), base_dir=p.resolve().parent)
