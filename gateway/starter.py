"""The commented starter config that `hermes-gateway init` writes."""

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
  max_tokens: null
  timeout_s: 120

# auxiliary:
#   compression:                # the summary model; unset fields fall back to llm
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
  provider: ""                  # "" = built-in files only; "local" = file-backed notes provider

storage:
  fsync: batch                  # always | batch | never

tenancy:
  group_sessions_per_user: true     # each member of a group gets their own lane
  thread_sessions_per_user: false   # threads / forum topics are shared by default
  personal_memory_in_groups: full   # full | read | off
  identity_links: {}                # e.g. {alice: ["telegram:111", "discord:222"]}
  max_open_profiles: 256

access:
  allowed_users: ["*"]          # "<platform>:<user_id>" or "*"
  admins: []                    # e.g. ["telegram:111"]
  unauthorized_dm: pair         # pair | ignore

limits:
  rate_limit_per_minute: 20
  max_text_length: 16000
  max_queued_turns: 5

delivery:                       # the outbox: unsent answers are retried, in order
  max_age_s: 86400              # give an answer up after this long (log line + metric)
  retry_initial_s: 1.0          # backoff between attempts (platform retry_after wins)
  retry_max_s: 60.0

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

logging:
  level: INFO
  format: text                  # text | json
  include_text: false
"""
