"""`init`: write the commented starter config (docs/configuration.md)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from core.settings import ConfigError
from gateway.cli.common import DEFAULT_CONFIG, command_name


def register(sub: argparse._SubParsersAction) -> None:
    init = sub.add_parser("init", help="write a commented starter config (parent directories are created)")
    init.add_argument("--force", action="store_true", help="overwrite an existing file")


def cmd_init(args: argparse.Namespace) -> int:
    path = Path(args.config)
    if path.is_dir():
        raise ConfigError(f"{path} is a directory; give init the config file to write, e.g. -c {path / DEFAULT_CONFIG}")
    if path.exists() and not args.force:
        print(f"{path} already exists (use --force to overwrite).", file=sys.stderr)
        return 1
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(STARTER_CONFIG, encoding="utf-8")
    cmd = command_name()
    make = " (or `make run`)" if str(path) == DEFAULT_CONFIG and Path("Makefile").is_file() else ""
    print(
        f"Wrote {path}. Edit llm.base_url and llm.model in it, check them with "
        f"`{cmd} doctor -c {path}`, then chat with `{cmd} chat -c {path} --user you`{make}."
    )
    return 0


STARTER_CONFIG = """\
# hermes-gateway configuration. Every key is optional; the values shown are the defaults
# unless marked otherwise. Secrets never go in this file: keys ending in _env name the
# environment variable that holds the secret.

data_dir: ./data                # profiles/, gateway.db and links.json live here
agent_name: Hermes

llm:                            # any OpenAI-compatible /v1/chat/completions endpoint
  base_url: http://127.0.0.1:11434/v1   # a local Ollama; e.g. https://api.openai.com/v1
  model: llama3.1
  api_key_env: null             # e.g. OPENAI_API_KEY (unset for a local server)
  context_length: 32768
  max_tokens: null              # null: a quarter of context_length, at most 4096
  timeout_s: 120                # the longest silence while the model answers
  answer_timeout_s: 300         # the whole answer, streaming included: cut past this
  vision: false                 # send photos to the model as images (doctor checks it can)

# auxiliary:
#   compression:                # the summary model; unset fields fall back to llm
#     model: null
#   review:                     # the background memory/skill review model; falls back to llm
#     model: null

compression:                    # context compression (defaults from the Hermes agent)
  enabled: true
  threshold: 0.50               # compress at 50% of the context window (floor 75% below 512K)
  target_ratio: 0.20
  protect_first_n: 3
  protect_last_n: 20
  in_place: true                # false: end the session and continue in a child session
  progress_notices: false       # true: tell the chat when compression starts and ends

memory:
  memory_enabled: true
  user_profile_enabled: true
  memory_char_limit: 2200
  user_char_limit: 1375
  nudge_interval: 10            # review every 10 user turns of a chat and save what matters; 0 = off
  flush_min_turns: 6            # review a conversation of 6+ turns when it ends (/new, compression); 0 = off
  write_approval: allow         # allow | stage (the person approves with /memory approve N) | block
  provider: ""                  # "" = built-in files only; "local" = file-backed notes provider

skills:
  enabled: true                 # false: no skill_manage tool and no skill index in the prompt
  creation_nudge_interval: 15   # after 15 tool steps, review whether a reusable skill was learned; 0 = off

storage:
  fsync: batch                  # always | batch | never
  io_threads: 4                 # threads doing every profile's session I/O (1-8)
  memory_budget_mib: 80         # memory for open profiles (~272 KiB each): how many stay open

tenancy:
  group_sessions_per_user: true     # each member of a group gets their own lane
  thread_sessions_per_user: false   # threads / forum topics are shared by default
  personal_memory_in_groups: full   # full | read | off
  identity_links: {}                # e.g. {alice: ["telegram:111", "discord:222"]}
  # max_open_profiles: 1000         # a hard cap below what storage.memory_budget_mib allows

access:
  allowed_users: ["*"]          # "<platform>:<user_id>" or "*"
  admins: []                    # e.g. ["telegram:111"]
  unauthorized_dm: pair         # pair | ignore

limits:
  rate_limit_per_minute: 20
  max_text_length: 16000
  max_queued_turns: 5
  max_attachment_bytes: 20971520  # 20 MB, Telegram's own download cap
  max_attachment_chars: 20000     # text taken from one document or PDF
  busy_mode: collect              # messages during a running turn: collect | queue | interrupt

reminders:
  enabled: true
  max_per_tenant: 50            # reminders one person (or group) may have at once

# transcription:                # voice notes: an OpenAI-compatible /v1/audio/transcriptions
#   base_url: http://127.0.0.1:8080/v1   # whisper.cpp server, faster-whisper server, hosted API
#   model: whisper-1
#   api_key_env: null

delivery:                       # the outbox: unsent answers are retried, in order
  streaming: dm                 # edit the answer in as it is written: dm | all | off
  stream_edit_interval_s: 1.0   # at most one edit per message this often
  max_age_s: 86400              # give an answer up after this long (log line + metric)
  retry_initial_s: 1.0          # backoff between attempts (platform retry_after wins)
  retry_max_s: 60.0
  max_reply_chars: 12000        # a longer answer: this much, the rest with /more
  drain_timeout_s: 30           # on SIGTERM / Ctrl-C: how long running turns may finish

platforms:
  telegram:
    enabled: false
    token_env: TELEGRAM_BOT_TOKEN
    mode: polling               # polling | webhook
    require_mention_in_groups: true
  discord:
    enabled: false
    token_env: DISCORD_BOT_TOKEN
    require_mention_in_guilds: true
    free_response_channels: []
    allowed_guilds: []

observability:
  listen: null                  # e.g. 127.0.0.1:9464 for /healthz and /metrics
  unhealthy_after_s: 60         # a platform reconnecting this long turns /healthz red (503)

logging:
  level: INFO
  format: text                  # text | json
  include_text: false

# cluster:                      # several `run` nodes on one PostgreSQL (docs/cluster.md)
#   postgres_dsn_env: HERMES_PG_DSN   # env var with the DSN; unset = one node, SQLite only
#   node_id: null                # default <hostname>-<pid>; unique per running process
#   lease_ttl_s: 15              # a silent node's lanes and tenants move after this long
#   max_lanes: 4                 # conversations this node runs at once
#   poll_interval_s: 5           # look for work this often even without a wakeup
"""
