"""Versioned schema migrations, applied by the gateway itself (`hermes-gateway cluster migrate`).

Each migration runs once, in order, recorded in `schema_migrations`. All of them run in one
transaction under an advisory lock keyed by the schema, so two nodes migrating at the same
time apply each version exactly once and never see a half-made schema. Migrations are only
ever appended; an applied one is never edited.
"""

from __future__ import annotations

from dataclasses import dataclass

from gateway.cluster.db import ClusterError, Pool, fetch_one


@dataclass(frozen=True)
class Migration:
    version: int
    name: str
    sql: str


MIGRATIONS: tuple[Migration, ...] = (
    Migration(
        1,
        "nodes, leases, inbox, lanes, outbox, pairing and links",
        """
CREATE TABLE nodes (
    node_id          text PRIMARY KEY,
    started_at       timestamptz NOT NULL DEFAULT now(),
    heartbeat_at     timestamptz NOT NULL DEFAULT now(),
    lease_expires_at timestamptz NOT NULL
);

-- A tenant (profile) is opened only under its lease. `epoch` grows on every takeover and
-- fences the old holder out; a released lease keeps its row so the epoch never restarts.
CREATE TABLE tenant_leases (
    tenant      text PRIMARY KEY,
    holder      text NOT NULL,
    epoch       bigint NOT NULL,
    acquired_at timestamptz NOT NULL DEFAULT now(),
    expires_at  timestamptz NOT NULL
);

-- Every inbound message, committed before the platform is acknowledged. `answered_at`: the
-- turn ran and its reply is in the outbox; `done_at`: every reply chunk was sent.
CREATE TABLE inbox (
    id           bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    platform     text NOT NULL,
    chat_id      text NOT NULL,
    message_id   text NOT NULL,
    lane         text NOT NULL,
    tenant       text NOT NULL,
    payload      jsonb NOT NULL,
    received_at  timestamptz NOT NULL DEFAULT now(),
    answered_at  timestamptz,
    done_at      timestamptz,
    done_epoch   bigint,
    UNIQUE (platform, chat_id, message_id)
);
-- a lane's pending messages in arrival order (the head of each lane is the first entry)
CREATE INDEX inbox_pending_by_lane ON inbox (lane, id) WHERE done_at IS NULL;

-- One row per lane that ever had work. `head_id` is the lane's oldest pending inbox id
-- (NULL: nothing pending); `claimed_by` the node running the lane, NULL when free.
CREATE TABLE lanes (
    lane       text PRIMARY KEY,
    tenant     text NOT NULL,
    head_id    bigint,
    claimed_by text,
    claimed_at timestamptz
);
-- the claim query: free lanes with work, oldest head first
CREATE INDEX lanes_claimable ON lanes (head_id) WHERE claimed_by IS NULL AND head_id IS NOT NULL;
-- reaping the claims of a node whose lease expired
CREATE INDEX lanes_by_claimer ON lanes (claimed_by) WHERE claimed_by IS NOT NULL;

-- Replies, one row per chunk, recorded before sending and in the same transaction that
-- marks the turn answered.
CREATE TABLE outbox (
    id          bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    inbox_id    bigint NOT NULL REFERENCES inbox (id) ON DELETE CASCADE,
    seq         integer NOT NULL,
    lane        text NOT NULL,
    tenant      text NOT NULL,
    platform    text NOT NULL,
    chat_id     text NOT NULL,
    body        jsonb NOT NULL,
    epoch       bigint NOT NULL,
    created_at  timestamptz NOT NULL DEFAULT now(),
    sent_at     timestamptz,
    sent_epoch  bigint,
    UNIQUE (inbox_id, seq)
);
CREATE INDEX outbox_unsent_by_lane ON outbox (lane, inbox_id, seq) WHERE sent_at IS NULL;

CREATE TABLE pairing_codes (
    code       text PRIMARY KEY,
    platform   text NOT NULL,
    user_id    text NOT NULL,
    created_at timestamptz NOT NULL DEFAULT now(),
    expires_at timestamptz NOT NULL
);

CREATE TABLE link_codes (
    code       text PRIMARY KEY,
    principal  text NOT NULL,
    created_at timestamptz NOT NULL DEFAULT now(),
    expires_at timestamptz NOT NULL
);

CREATE TABLE identity_links (
    principal  text PRIMARY KEY,
    link_name  text NOT NULL,
    created_at timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX identity_links_by_name ON identity_links (link_name);
""",
    ),
    Migration(
        2,
        "inbox and outbox outcomes, sent message ids, per-chat delivery order",
        """
-- why a message was finished (replied, refused, unauthorized, ...), as in gateway.db
ALTER TABLE inbox ADD COLUMN outcome text;
-- chunks also carry notices recorded mid-turn; `outcome`: sent | refused | expired once
-- settled, `sent_id` the platform's message id (for edits)
ALTER TABLE outbox ADD COLUMN outcome text;
ALTER TABLE outbox ADD COLUMN sent_id text;
-- the per-chat delivery order: a chat's unsent chunks by id
CREATE INDEX outbox_unsent_by_chat ON outbox (platform, chat_id, id) WHERE sent_at IS NULL;
""",
    ),
    Migration(
        3,
        "shared key-value state, identity link order and generation",
        """
-- Pairing codes and approvals, link codes, link requests and rate-limit stamps: the keys and
-- values gateway.db's kv table holds on a single node (gateway/kv.py), shared by every node.
CREATE TABLE shared_kv (
    key        text PRIMARY KEY,
    value      text NOT NULL,
    updated_at timestamptz NOT NULL DEFAULT now()
);

-- principals of a link in the order they joined
ALTER TABLE identity_links ADD COLUMN seq bigint GENERATED ALWAYS AS IDENTITY;

-- bumped by every change to identity_links, so a node re-reads the links only when they changed
CREATE TABLE identity_links_generation (
    only_row   boolean PRIMARY KEY DEFAULT true CHECK (only_row),
    generation bigint NOT NULL
);
INSERT INTO identity_links_generation (only_row, generation) VALUES (true, 0);
""",
    ),
    Migration(
        4,
        "the process behind each node id",
        """
-- which process registered the node id (host, pid and a random token): a second process
-- started with an id that a live process heartbeats under is refused
ALTER TABLE nodes ADD COLUMN instance text;
""",
    ),
    Migration(
        5,
        "model budgets counted across nodes",
        """
-- each tenant's use per period ('d:YYYY-MM-DD', 'm:YYYY-MM'), in its own time zone's days
CREATE TABLE budget_usage (
    tenant     text NOT NULL,
    period     text NOT NULL,
    tokens     bigint NOT NULL DEFAULT 0,
    cost_nanos bigint NOT NULL DEFAULT 0,
    PRIMARY KEY (tenant, period)
);
-- a call's estimate, counted before the call and replaced by its usage after it
CREATE TABLE budget_pending (
    tenant     text NOT NULL,
    call_id    text NOT NULL,
    day        text NOT NULL,
    month      text NOT NULL,
    tokens     bigint NOT NULL,
    cost_nanos bigint NOT NULL,
    at         timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (tenant, call_id)
);
-- the notices said once per period (the refusal, the warning)
CREATE TABLE budget_said (
    tenant text NOT NULL,
    key    text NOT NULL,
    at     timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (tenant, key)
);
""",
    ),
    Migration(
        6,
        "tool-call confirmations answered on any node",
        """
-- a tool call waiting for a press (docs/cluster.md#stop-and-confirmations-across-nodes): a
-- press on any node decides it with one conditional UPDATE and notifies `node`, whose turn
-- waits; the row is deleted once the asker is done, and expires by itself if it died
CREATE TABLE confirmations (
    token      text PRIMARY KEY,
    tenant     text NOT NULL,
    lane       text NOT NULL,
    user_id    text NOT NULL,
    node       text NOT NULL,
    state      text NOT NULL DEFAULT 'open' CHECK (state IN ('open', 'allowed', 'denied', 'expired')),
    created_at timestamptz NOT NULL DEFAULT now(),
    expires_at timestamptz NOT NULL,
    decided_at timestamptz
);
CREATE INDEX confirmations_by_expiry ON confirmations (expires_at);
""",
    ),
    Migration(
        7,
        "flood pacing shared by the nodes, interaction replies from any node",
        """
-- Telegram's flood limits for the whole cluster (docs/cluster.md#flood-pacing-across-nodes):
-- one row per window (`telegram:bot`, `telegram:chat:<id>`, `telegram:group:<id>`) with the
-- grant times of its last sends (epoch seconds by the database's clock, oldest first) and
-- the end of a 429's hold; `pacing_take` grants a send in one round trip or says how long
-- to wait.
CREATE TABLE send_pacing (
    key        text PRIMARY KEY,
    times      float8[] NOT NULL DEFAULT '{}',
    held_until float8 NOT NULL DEFAULT 0,
    touched_at timestamptz NOT NULL DEFAULT now()
);

CREATE FUNCTION pacing_take(keys text[], limits integer[], periods float8[], hold_key text, hold_s float8)
RETURNS float8 LANGUAGE plpgsql AS $fn$
DECLARE
    t     float8;
    wait  float8;
    n     integer;
BEGIN
    -- lock every window of this send, always in key order (no deadlock between nodes); a
    -- row pruned between the insert and the lock is inserted again
    LOOP
        INSERT INTO send_pacing (key) SELECT unnest(keys) ON CONFLICT (key) DO NOTHING;
        SELECT count(*) INTO n FROM (SELECT 1 FROM send_pacing WHERE key = ANY(keys) ORDER BY key FOR UPDATE) s;
        EXIT WHEN n = cardinality(keys);
    END LOOP;
    -- read under the locks: every grant of a window is later than the one before it
    t := extract(epoch FROM clock_timestamp());
    IF hold_key IS NOT NULL AND hold_s > 0 THEN
        UPDATE send_pacing SET held_until = greatest(held_until, t + hold_s) WHERE key = hold_key;
    END IF;
    SELECT coalesce(max(greatest(
               p.held_until - t,
               CASE WHEN w.n >= k.lim THEN w.recent[w.n - k.lim + 1] + k.period - t ELSE 0 END)), 0)
      INTO wait
      FROM send_pacing p
      JOIN unnest(keys, limits, periods) AS k(key, lim, period) ON k.key = p.key
      CROSS JOIN LATERAL (SELECT array_agg(x ORDER BY x) AS recent, count(*)::integer AS n
                          FROM unnest(p.times) AS x WHERE x > t - k.period) w;
    IF wait > 0 THEN
        RETURN wait;
    END IF;
    UPDATE send_pacing p
       SET times = coalesce((SELECT array_agg(x ORDER BY x) FROM (
                       SELECT x FROM unnest(p.times) AS x WHERE x > t - k.period
                       ORDER BY x DESC LIMIT greatest(k.lim - 1, 0)) kept), '{}') || t,
           touched_at = now()
      FROM unnest(keys, limits, periods) AS k(key, lim, period)
     WHERE p.key = k.key;
    RETURN 0;
END
$fn$;

-- a Discord interaction's follow-up webhook (application id, token, ephemeral, expiry) for
-- whichever node answers the message; erased once the message is done
-- (docs/cluster.md#slash-commands-answered-from-any-node)
ALTER TABLE inbox ADD COLUMN reply_handle jsonb;
""",
    ),
    Migration(
        8,
        "the due index of reminders",
        """
-- one row per current occurrence of a reminder (docs/cluster.md#reminders): the tenant's
-- reminders.json is the truth, this is what nodes scan for due work. `due_at` is the file's
-- UTC timestamp; `fired_*` are set, under the tenant's lease and epoch, in the transaction
-- that records the occurrence in the inbox, and the row goes once the file moved past it
CREATE TABLE reminder_due (
    tenant      text NOT NULL,
    reminder_id bigint NOT NULL,
    due_at      double precision NOT NULL,
    principal   text NOT NULL,
    fired_at    timestamptz,
    fired_epoch bigint,
    fired_by    text,
    PRIMARY KEY (tenant, reminder_id, due_at)
);
CREATE INDEX reminder_due_unfired ON reminder_due (due_at) WHERE fired_at IS NULL;
CREATE INDEX reminder_due_fired ON reminder_due (fired_at) WHERE fired_at IS NOT NULL;
""",
    ),
)

LATEST = MIGRATIONS[-1].version

_LOCK = "SELECT pg_advisory_xact_lock(hashtext('hermes-gateway migrate ' || current_schema()))"


async def migrate(pool: Pool) -> list[int]:
    """Apply the missing migrations; returns the versions applied now (empty: up to date)."""
    async with pool.connection() as conn, conn.transaction():
        schema = (await fetch_one(conn, "SELECT current_schema() AS s"))["s"]
        if schema is None:
            raise ClusterError("no schema to migrate into: the search_path names no existing schema")
        await conn.execute(_LOCK)
        await conn.execute("""CREATE TABLE IF NOT EXISTS schema_migrations (
            version integer PRIMARY KEY, name text NOT NULL,
            applied_at timestamptz NOT NULL DEFAULT now())""")
        done = {r["version"] for r in await (await conn.execute("SELECT version FROM schema_migrations")).fetchall()}
        newest = max(done, default=0)
        if newest > LATEST:
            raise ClusterError(
                f"the database schema is at version {newest}, newer than this gateway "
                f"knows ({LATEST}); upgrade hermes-gateway on this node"
            )
        applied = []
        for m in MIGRATIONS:
            if m.version in done:
                continue
            await conn.execute(m.sql)
            await conn.execute("INSERT INTO schema_migrations (version, name) VALUES (%s, %s)", (m.version, m.name))
            applied.append(m.version)
        return applied


async def schema_version(pool: Pool) -> int:
    """The newest applied migration, 0 for an empty database."""
    async with pool.connection() as conn:
        exists = await fetch_one(conn, "SELECT to_regclass('schema_migrations') IS NOT NULL AS e")
        if not exists["e"]:
            return 0
        row = await fetch_one(conn, "SELECT coalesce(max(version), 0) AS v FROM schema_migrations")
        return int(row["v"])
