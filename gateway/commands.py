"""Chat commands (`/help`, `/new`, ...): parsed from a message and run inside its lane,
so a command is ordered with the turns around it. Each returns the text to send."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from agent.compression import CompressionState, Compressor
from agent.fileio import private_mkdir, write_private
from agent.memory import MemoryStore
from agent.model_choice import ModelChoice
from agent.persona import NONE, PersonaChoice, custom_problem
from agent.prompt import ChatPlace
from agent.provenance import Asker, explain
from agent.provenance import Place as WhyPlace
from agent.toolkit import Speaker
from agent.visibility import GROUP_LANE, PRIVATE_CHAT, Visibility
from core.commands import COMMAND_SPECS, CommandSpec, find_command
from core.lanes import Lane
from core.messages import InboundMessage
from core.text import page_text
from gateway.delivery import more_key, more_mark, more_offer, read_more_mark

if TYPE_CHECKING:
    from agent.agents import Agents
    from agent.profile import Profile
    from agent.turn import Agent
    from core.settings import Config, ToolsConfig
    from gateway.access import Access
    from gateway.inbox import Inbox
    from gateway.linking import Linking
    from gateway.modes import Reminders
    from gateway.rekeys import Rekeys
    from tenancy.identity import IdentityLinks


def parse_command(text: str) -> tuple[CommandSpec, str] | None:
    """(`spec`, args) when `text` is a known `/command`, else None (unknown commands are
    ordinary text for the model)."""
    if not text.startswith("/"):
        return None
    head, _, args = text[1:].partition(" ")
    head = head.split("@", 1)[0]  # /cmd@botname
    spec = find_command(head)
    return (spec, args.strip()) if spec else None


@dataclass(frozen=True)
class CommandParts:
    """What the chat commands read and change of the gateway (built once, with the runtime)."""

    cfg: Config
    access: Access
    agent: Agent  # the default model's: what does not depend on the model (memory, access)
    agents: Agents  # the agent of the model a tenant chose (agent/agents.py)
    inbox: Inbox
    links: IdentityLinks
    linking: Linking
    reminders: Reminders
    rekeys: Rekeys  # /forget all re-keys the tenant with encryption on


@dataclass
class CommandContext:
    parts: CommandParts
    msg: InboundMessage
    lane: Lane
    place: ChatPlace
    profile: Profile
    args: str
    #: whether the sender moderates this chat on the platform (the adapter's capability)
    chat_admin: Callable[[], Awaitable[bool]] | None = None


#: commands that change a shared lane's conversation or memory for everyone in it
SHARED_LANE_ADMIN_COMMANDS = frozenset({"new", "undo", "forget"})


async def shared_lane_refusal(ctx: CommandContext, name: str) -> str | None:
    """In a shared group lane or thread, /new, /undo and /forget are for the chat's admins
    and the gateway's admins; everyone else gets this refusal."""
    if name not in SHARED_LANE_ADMIN_COMMANDS or ctx.lane.kind != "chat" or await _lane_admin(ctx):
        return None
    return (
        f"This conversation is shared by everyone here, so only the chat's admins can use /{name}. "
        "Ask one of them, or talk to me in a private chat."
    )


async def speaker_of(
    access: Access,
    senders: Sequence[str],
    place: ChatPlace,
    chat_admin_checks: Sequence[Callable[[], Awaitable[bool]] | None],
    ask_chat_admin: bool,
) -> Speaker:
    """Who a turn's (or /tools') tools serve (docs/concepts.md#who-may-use-a-tool): every
    sender must qualify for a tier; the platform is asked about chat admins only in a group,
    and only when a tool's rule needs it (`ask_chat_admin`, from `asks_chat_admin`)."""
    dm = place.chat_type == "dm" and not place.shared
    operator = all(access.is_admin(p) for p in senders)
    chat_admin = operator
    if not dm and not chat_admin and ask_chat_admin:
        chat_admin = all(c is not None for c in chat_admin_checks) and all(
            [await c() for c in chat_admin_checks if c is not None]
        )
    return Speaker(dm=dm, operator=operator, chat_admin=chat_admin)


def asks_chat_admin(tools: ToolsConfig) -> bool:
    """Whether any tool's rule is `chat_admin` (then a group turn asks the platform)."""
    rules: list[str | None] = [tools.memory.allow, tools.session_search.allow, tools.skill_manage.allow]
    rules += [tools.reminders.allow, tools.web_fetch.allow, tools.web_search.allow]
    for server in tools.mcp.servers.values():
        rules += [server.allow, *(r.allow for r in server.tools.values())]
    return "chat_admin" in rules


async def _lane_admin(ctx: CommandContext) -> bool:
    """Whether the sender is a gateway admin or moderates this chat on the platform."""
    if ctx.parts.access.is_admin(ctx.msg.principal):
        return True
    return ctx.chat_admin is not None and await ctx.chat_admin()


async def run_command(name: str, ctx: CommandContext) -> str:
    """Run the chat command `name` (after the shared-lane admin check)."""
    if refusal := await shared_lane_refusal(ctx, name):
        return refusal
    return await HANDLERS[name](ctx)


Handler = Callable[[CommandContext], Awaitable[str]]


async def cmd_help(ctx: CommandContext) -> str:
    admin = ctx.parts.access.is_admin(ctx.msg.principal)
    lines = [
        f"I'm {ctx.parts.cfg.agent_name}. Talk to me normally; I remember what matters to you "
        "across conversations. Commands:"
    ]
    for spec in COMMAND_SPECS:
        if spec.name == "start" or (spec.admin_only and not admin):
            continue
        lines.append(f"/{spec.name} — {spec.description}")
    return "\n".join(lines)


async def cmd_start(ctx: CommandContext) -> str:
    name = ctx.msg.user_name or "there"
    return (
        f"Hi {name}! I'm {ctx.parts.cfg.agent_name}. Tell me what you need; I'll remember "
        "what you ask me to. Send /help for the commands."
    )


async def cmd_new(ctx: CommandContext) -> str:
    agent = await ctx.parts.agents.of(ctx.profile)
    await agent.new_session(ctx.profile, ctx.lane, ctx.place, reason="new")
    return "Started a new conversation. What I remember about you is kept (see /memory)."


async def cmd_status(ctx: CommandContext) -> str:
    store = ctx.profile.sessions
    session_id = await store.route(ctx.lane.session_key)
    info = await store.session_info(session_id) if session_id else None
    if ctx.lane.kind == "chat":
        shared = "shared with everyone here"
    elif ctx.lane.private:
        shared = "between you and me"
    else:
        shared = "yours, but my replies here are seen by everyone in this chat"
    choice = (await ctx.profile.model()).name
    model = ctx.parts.agents.named(choice).settings.llm.model
    named = f" ({choice})" if choice is not None and choice in ctx.parts.agents.offered else ""
    lines = [f"Model: {model}{named}", f"This conversation is {shared}."]
    if info:
        started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(info.get("started_at") or 0))
        lines += [
            f"Session: {session_id} (since {started})",
            f"Messages: {info.get('message_count', 0)}",
            f"Compressions: {info.get('compressions', 0)}",
        ]
    else:
        lines.append("No conversation yet.")
    return "\n".join(lines)


async def cmd_usage(ctx: CommandContext) -> str:
    app = ctx.parts
    store = ctx.profile.sessions
    # the tenant's budget: today's and this month's use, what is left (docs/concepts.md#budgets)
    budget = await app.agent.meter.report(await app.agent.meter.payer(ctx.profile, ctx.lane))
    session_id = await store.route(ctx.lane.session_key)
    if not session_id:
        return "\n".join([*budget, "No conversation yet in this chat."])
    info = await store.session_info(session_id) or {}
    history = await store.history(session_id)
    agent = await app.agents.of(ctx.profile)  # the window and threshold of the model chosen
    comp = agent.compression
    context_tokens = comp.context_tokens(history)  # cached per-message counts, no re-encoding
    window = agent.settings.llm.context_length
    threshold = agent.threshold_tokens()
    state = await store.compression_state(session_id)
    lines = [
        *budget,
        f"Tokens this session: {info.get('input_tokens') or 0:,} in, {info.get('output_tokens') or 0:,} out",
        f"Context: {context_tokens:,} of {window:,} tokens ({100 * context_tokens // window}%), "
        f"compression at {threshold:,} ({100 * threshold // window}%)",
    ]
    if state.get("last_prompt_tokens"):
        lines.append(f"Last request: {int(state['last_prompt_tokens']):,} prompt tokens (as the model counted)")
    lines.append(f"Compressions so far: {info.get('compressions') or 0}")
    if not app.cfg.compression.enabled:
        lines.append("Automatic compression is off; /compress still works.")
    else:
        reason = Compressor.block_reason(CompressionState.from_dict(state))
        if reason in ("blocked", "probe"):
            lines.append(
                "Automatic compression is paused (recent attempts didn't help); "
                "send /compress to try now or /new to start fresh."
            )
        elif reason == "cooldown":
            lines.append("Automatic compression is waiting a moment after a summary-model failure.")
    return "\n".join(lines)


async def cmd_compress(ctx: CommandContext) -> str:
    args = ctx.args.strip()
    head, _, rest = args.partition(" ")
    focus = rest.strip() if head.lower() == "focus" else args
    agent = await ctx.parts.agents.of(ctx.profile)
    return await agent.compress_now(ctx.profile, ctx.lane, ctx.place, focus=focus or None)


def _private_only(ctx: CommandContext, command: str) -> str | None:
    """A refusal when a person's own data would be shown in a chat others can read."""
    if ctx.lane.kind == "person" and ctx.msg.chat_type != "dm":
        return f"That's private: send /{command} in a private chat with me."
    return None


_MEMORY_USAGE = (
    "Usage: /memory, /memory share N or /memory unshare N (N as /memory numbers them); "
    "/memory pending, /memory approve N, /memory reject N"
)


async def _numbered(memory: MemoryStore) -> list[tuple[str, str, Visibility]]:
    """(target, entry, visibility) in /memory's numbering: about the person, then notes."""
    out = []
    for target in ("user", "memory"):
        entries = await memory.entries(target)
        marks = await asyncio.to_thread(memory.marks().of, target, entries)
        out += [(target, e, v) for e, v in zip(entries, marks, strict=False)]
    return out


def _pick(items: list[tuple[str, str, Visibility]], arg: str) -> tuple[str, str, Visibility] | str:
    """The entry numbered `arg`, or a message saying why there is none."""
    if not arg.isdigit() or not 1 <= int(arg) <= len(items):
        return (
            (f"There is no entry {arg or '(none given)'}; send /memory to see the numbers (1 to {len(items)}).")
            if items
            else "I don't remember anything about you yet."
        )
    return items[int(arg) - 1]


async def cmd_memory(ctx: CommandContext) -> str:
    if refusal := _private_only(ctx, "memory"):
        return refusal
    memory = ctx.parts.agent.lane_memory(ctx.profile, ctx.lane)
    if memory is None:
        return "Memory is turned off in this chat."
    sub, _, rest = ctx.args.strip().partition(" ")
    if sub:
        handler = MEMORY_SUBCOMMANDS.get(sub.lower())
        if handler is None:
            return _MEMORY_USAGE
        return await handler(ctx, memory, rest.strip())
    return await _memory_list(ctx, memory)


async def _memory_list(ctx: CommandContext, memory: MemoryStore) -> str:
    """The entries, numbered, each with its visibility in a private chat."""
    group = ctx.lane.kind == "chat"
    whose = "this group" if group else "you"
    items = await _numbered(memory)
    parts, n = [], 0
    for target, title in (("user", f"About {whose}"), ("memory", "My notes")):
        lines = []
        for t, entry, vis in items:
            if t == target:
                n += 1
                label = "" if group else f" [{vis}]"
                lines.append(f"{n}.{label} {entry}")
        if lines:
            parts.append(f"{title}:\n" + "\n".join(lines))
    if items and not group:
        parts.append(
            "Private entries never reach a group chat; shared ones may. "
            "Change one with /memory share N or /memory unshare N; erase one with /forget N."
        )
    pending = await memory.pending_writes().list()
    if pending:
        parts.append(f"{len(pending)} change(s) wait for your approval: see /memory pending.")
    return "\n\n".join(parts) if parts else f"I don't remember anything about {whose} yet."


async def _memory_share(ctx: CommandContext, memory: MemoryStore, args: str) -> str:
    return await _set_visibility(ctx, memory, args, "shared")


async def _memory_unshare(ctx: CommandContext, memory: MemoryStore, args: str) -> str:
    return await _set_visibility(ctx, memory, args, "private")


async def _set_visibility(ctx: CommandContext, memory: MemoryStore, arg: str, value: Visibility) -> str:
    if ctx.lane.kind == "chat":
        return "Everything in this group's memory is seen by the whole group already."
    picked = _pick(await _numbered(memory), arg)
    if isinstance(picked, str):
        return picked
    target, entry, _ = picked
    if not await memory.set_visibility(target, entry, value):
        return "That entry changed meanwhile; send /memory to see the current list."
    await _provider_mark(ctx, target, entry, value)
    if value == "shared":
        return f'Shared: "{_short(entry)}". I may use it in group chats, where everyone there can read my replies.'
    return f'Private again: "{_short(entry)}". It stays out of group chats from your next message on.'


def _short(entry: str, limit: int = 60) -> str:
    flat = " ".join(entry.split())
    return flat if len(flat) <= limit else flat[:limit] + "..."


def _approver_refusal(ctx: CommandContext, memory: MemoryStore) -> str | None:
    """Approvals are the memory owner's: the person in a private chat, an admin for a group."""
    if memory.read_only:
        return "Memory can't be changed from this chat; send this in a private chat with me."
    if ctx.lane.kind == "chat" and not ctx.parts.access.is_admin(ctx.msg.principal):
        return "Only an admin can approve or reject changes to this group's memory."
    return None


async def _memory_pending(ctx: CommandContext, memory: MemoryStore, args: str) -> str:
    pending = await memory.pending_writes().list()
    if not pending:
        return "No memory changes are waiting for approval."
    lines = ["Memory changes waiting for your approval (/memory approve N or /memory reject N):"]
    lines += [item.describe() for item in pending]
    return "\n".join(lines)


def _pending_number(args: str) -> int | None:
    text = args.strip().lstrip("#")
    return int(text) if text.isdigit() else None


async def _memory_approve(ctx: CommandContext, memory: MemoryStore, args: str) -> str:
    if refusal := _approver_refusal(ctx, memory):
        return refusal
    number = _pending_number(args)
    if number is None:
        return "Usage: /memory approve N (the number shown by /memory pending)"
    item = await memory.pending_writes().take(number)
    if item is None:
        return f"There is no pending change #{number}; see /memory pending."
    if item.origin == "shared" and memory.scope is PRIVATE_CHAT:
        # a write staged in a group lane is applied as there: it sees and writes shared entries only
        memory = MemoryStore(
            memory.profile_dir,
            memory.memory_char_limit,
            memory.user_char_limit,
            scope=GROUP_LANE,
            guard=memory.guard,
            files=memory.files,
        )
    if item.action == "add":
        result = await memory.add(item.target, item.content or "")
    elif item.action == "replace":
        result = await memory.replace(item.target, item.old_text or "", item.content or "")
    else:
        result = await memory.remove(item.target, item.old_text or "")
    if not result.get("success"):
        return f"Couldn't apply #{number}: {result.get('error')} It was dropped from the queue."
    return f"Approved #{number}: {result.get('message')}"


async def _memory_reject(ctx: CommandContext, memory: MemoryStore, args: str) -> str:
    if refusal := _approver_refusal(ctx, memory):
        return refusal
    number = _pending_number(args)
    if number is None:
        return "Usage: /memory reject N (the number shown by /memory pending)"
    item = await memory.pending_writes().take(number)
    return (
        f"Rejected #{number}; nothing was saved."
        if item
        else f"There is no pending change #{number}; see /memory pending."
    )


MemorySubcommand = Callable[[CommandContext, MemoryStore, str], Awaitable[str]]
# `/memory <sub> ...`; plain `/memory` lists the entries
MEMORY_SUBCOMMANDS: dict[str, MemorySubcommand] = {
    "pending": _memory_pending,
    "approve": _memory_approve,
    "reject": _memory_reject,
    "share": _memory_share,
    "unshare": _memory_unshare,
}


async def cmd_forget(ctx: CommandContext) -> str:
    if ctx.lane.personal_memory != "full":
        return "Memory can't be changed from this chat; send /forget in a private chat with me."
    memory = ctx.parts.agent.lane_memory(ctx.profile, ctx.lane)
    if memory is None:
        return "Memory is turned off in this chat."
    target = ctx.args.lower() or "all"
    gone = (
        "It is gone from my prompts and from search from your next message on; what we said "
        "in our conversations stays in their history."
    )
    if target.isdigit():
        if ctx.lane.kind == "person" and not ctx.lane.private:
            return "Send /forget N in a private chat with me, where /memory shows the numbers."
        picked = _pick(await _numbered(memory), target)
        if isinstance(picked, str):
            return picked
        if not await memory.forget_entry(picked[0], picked[1]):
            return "That entry changed meanwhile; send /memory to see the current list."
        await _provider_forget(ctx, [picked[:2]])
        return f'Done: I forgot "{_short(picked[1])}". {gone}'
    if target not in ("memory", "user", "all"):
        return "Usage: /forget N (one entry, numbered as in /memory) or /forget [memory|user|all]"
    targets = ("user", "memory") if target == "all" else (target,)
    erased = [(t, e) for t in targets for e in await memory.entries(t)]
    await memory.clear(None if target == "all" else target)
    await _provider_forget(ctx, erased)
    if (
        target == "all" and ctx.parts.rekeys.on
    ):  # older copies of it no longer open (docs/privacy.md#delete-is-crypto-shredding)
        await ctx.parts.rekeys.forget_all(ctx.profile.tenant_id, ctx.profile.path)
    what = {"all": "everything I remembered", "user": "what I knew about you", "memory": "my notes"}[target]
    if ctx.lane.kind == "person" and not ctx.lane.private:
        what += " that you shared with groups (private entries are untouched; see /memory in a private chat)"
    return f"Done: I erased {what}. {gone}"


async def _provider_forget(ctx: CommandContext, entries: list[tuple[str, str]]) -> None:
    """Tell the memory provider which entries were forgotten, so it never recalls them."""
    provider = ctx.profile.provider
    access = ctx.parts.agent.provider_access(ctx.lane)
    if provider is None or not access.write:
        return
    for target, entry in entries:
        try:
            await provider.on_memory_write("remove", target, entry, visibility=access.mark)
        except Exception:  # the entry is forgotten in memory either way
            logging.getLogger("hermes.commands").exception("memory provider on_memory_write failed")


async def _provider_mark(ctx: CommandContext, target: str, entry: str, value: Visibility) -> None:
    """Tell the memory provider an entry was shared or unshared, so a group lane's recall
    follows the entry's visibility."""
    provider = ctx.profile.provider
    if provider is None:
        return
    try:
        await provider.on_memory_write("share" if value == "shared" else "unshare", target, entry, visibility=value)
    except Exception:  # the mark is changed in memory either way
        logging.getLogger("hermes.commands").exception("memory provider on_memory_write failed")


async def cmd_why(ctx: CommandContext) -> str:
    """/why [N]: which stored things went into this lane's last reply (N: the Nth back), as
    far as the asker may see them here (docs/concepts.md#why-an-answer-said-what-it-said)."""
    arg = ctx.args.strip().lstrip("#")
    if arg and (not arg.isdigit() or int(arg) < 1):
        return "Usage: /why for my last reply here, /why 2 for the one before it, and so on."
    session_id = await ctx.profile.sessions.route(ctx.lane.session_key)
    history = await ctx.profile.sessions.history(session_id) if session_id else []
    if ctx.lane.kind == "chat":
        place: WhyPlace = "shared"
    else:
        place = "private" if ctx.lane.private else "member"
    asker = Asker(principal=ctx.msg.principal, place=place, session_key=ctx.lane.session_key)
    return await explain(history, int(arg or 1), asker, ctx.profile.store_files, ctx.profile.sessions)


async def cmd_undo(ctx: CommandContext) -> str:
    session_id = await ctx.profile.sessions.route(ctx.lane.session_key)
    count = await ctx.profile.sessions.undo_last_turn(session_id) if session_id else 0
    return "Took back your last message and my answer." if count else "Nothing to undo."


async def cmd_more(ctx: CommandContext) -> str:
    """The next page of the lane's last answer (docs/operator-guide.md#runaway-answers-and-long-replies)."""
    nothing = "There's nothing more of my last answer to send."
    mark = await ctx.parts.inbox.get(more_key(ctx.lane))
    session_id = await ctx.profile.sessions.route(ctx.lane.session_key)
    if mark is None or session_id is None:
        return nothing
    answer = next(
        (
            m.content
            for m in reversed(await ctx.profile.sessions.history(session_id))
            if m.role == "assistant" and m.content and not m.tool_calls
        ),
        None,
    )
    start = read_more_mark(mark, answer)
    if answer is None or start is None:
        return nothing
    page, nxt = page_text(answer, start, ctx.parts.cfg.delivery.max_reply_chars)
    await ctx.parts.inbox.put(more_key(ctx.lane), more_mark(answer, nxt) if nxt < len(answer) else None)
    return page + more_offer(len(answer) - nxt) if nxt < len(answer) else page


async def cmd_export(ctx: CommandContext) -> str:
    if refusal := _private_only(ctx, "export"):
        return refusal
    data = await ctx.profile.sessions.export()
    memory = ctx.parts.agent.lane_memory(ctx.profile, ctx.lane)
    if memory is not None:
        # each entry with its visibility, as /memory shows it (private entries never reach a group)
        data["memory"] = {t: [] for t in ("memory", "user")}
        for target, entry, visibility in await _numbered(memory):
            data["memory"][target].append({"entry": entry, "visibility": visibility})
    skills = ctx.parts.agent.lane_skills(ctx.profile, ctx.lane)
    if skills is not None:
        data["skills"] = [
            {"name": info.name, "description": info.description, "content": body}
            for info, body in await skills.bodies()
        ]
    out_dir = ctx.profile.path / "exports"
    private_mkdir(out_dir)
    path = out_dir / f"export-{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}.json"
    text = json.dumps(data, ensure_ascii=False, indent=1, default=str)
    files = ctx.profile.files
    if files is not None and files.sealed:  # sealed like the rest; `profiles export` opens it (docs/privacy.md)
        files.write_text(f"exports/{path.name}", text)
    else:
        write_private(path, text)
    sessions = data.get("sessions", [])
    messages = sum(len(s.get("messages", [])) for s in sessions)
    return (
        f"Exported {len(sessions)} conversation(s) with {messages} message(s) and your memory "
        f"to {path.name}. Ask the operator for the file "
        f"(`hermes-gateway profiles export {ctx.lane.tenant_id}`)."
    )


async def cmd_whoami(ctx: CommandContext) -> str:
    if ctx.msg.chat_type != "dm" and not ctx.msg.private_reply:
        # a group reads the answer: never show the person's other (linked) accounts here
        who = ctx.msg.principal + (f" ({ctx.msg.user_name})" if ctx.msg.user_name else "")
        return (
            f"You are {who}. Your profile and linked accounts are private: send /whoami in a "
            "private chat with me to see them."
        )
    lines = [
        f"You are {ctx.msg.principal}" + (f" ({ctx.msg.user_name})" if ctx.msg.user_name else ""),
        f"Profile: {ctx.lane.tenant_id}",
        f"Conversation: {ctx.lane.session_key}",
    ]
    name = ctx.parts.links.name_for(ctx.msg.principal)
    if name:
        lines.append(f"Linked accounts: {', '.join(ctx.parts.links.principals_of(name))}")
    if ctx.parts.access.is_admin(ctx.msg.principal):
        lines.append("You are an admin.")
    return "\n".join(lines)


async def cmd_link(ctx: CommandContext) -> str:
    return await ctx.parts.linking.link_command(ctx.msg, ctx.args)


async def cmd_unlink(ctx: CommandContext) -> str:
    return await ctx.parts.linking.unlink_command(ctx.msg, ctx.args)


async def cmd_pair(ctx: CommandContext) -> str:
    if not ctx.parts.access.is_admin(ctx.msg.principal):
        return "Only an admin can approve pairing codes."
    if not ctx.args:
        return "Usage: /pair CODE"
    principal = await ctx.parts.access.approve(ctx.args)
    return f"Approved {principal}; they can talk to me now." if principal else "That code is unknown or expired."


async def cmd_stop(ctx: CommandContext) -> str:
    """Reached only when no turn runs (a running turn is stopped before the lane queue)."""
    return "There's nothing to stop right now."


async def cmd_reminders(ctx: CommandContext) -> str:
    """/reminders lists the reminders set in this lane (in a private chat: all of yours);
    /reminders cancel N cancels one."""
    from agent.reminders import Reminder, ReminderStore

    store = ReminderStore(ctx.profile.store_files, ctx.profile.guard)
    msg = ctx.msg

    def here(reminder: Reminder) -> bool:  # any other lane sees only what was set in it
        return ctx.lane.private or reminder.chat.in_lane(msg.platform, msg.chat_id, msg.thread_id, ctx.lane.session_key)

    words = ctx.args.split()
    if words and words[0].lower() == "cancel":
        if len(words) != 2 or not words[1].lstrip("#").isdigit():
            return "Usage: /reminders cancel N (the number from /reminders)."
        removed = await store.cancel(int(words[1].lstrip("#")), where=here)
        if removed is None:
            return f"There's no reminder #{words[1].lstrip('#')} here."
        await ctx.parts.reminders.note(ctx.profile.tenant_id, await store.next_due(), False)
        return f"Cancelled: {removed.describe()}"
    if words:
        return "Usage: /reminders, or /reminders cancel N."
    mine = [r for r in await store.all() if here(r)]
    if not mine:
        return 'No reminders set here. Ask me, e.g. "remind me tomorrow at 9 to call Sam".'
    return "\n".join(["Your reminders:", *(r.describe() for r in mine), "Cancel one with /reminders cancel N."])


async def cmd_model(ctx: CommandContext) -> str:
    """`/model` lists the offered models, `/model NAME` chooses one for the lane's tenant,
    `/model default` goes back to the default (docs/concepts.md#models)."""
    agents = ctx.parts.agents
    default = agents.default.settings.llm.model
    word = ctx.args.strip().lower()
    current = (await ctx.profile.model()).name
    if not word:
        if not agents.offered:
            return f"Model: {default}. It is the only model offered here."
        names = ", ".join(f"{n} ({a.settings.llm.model})" for n, a in sorted(agents.offered.items()))
        if current in agents.offered:
            now = f"Current: {current}."
        elif current is not None:
            now = f"Current: the default, {default} ({current} is no longer offered)."
        else:
            now = f"Current: the default, {default}."
        return f"Models: {names}; the default is {default}.\n{now}\nChoose with /model NAME, or /model default."
    if ctx.lane.kind == "person" and ctx.msg.chat_type != "dm":
        return "Your model is yours to choose in private: send /model in a private chat with me."
    if ctx.lane.kind == "chat" and not await _lane_admin(ctx):
        return "This conversation is shared by everyone here, so only the chat's admins can choose its model."
    if word == "default":
        await ctx.profile.set_model(ModelChoice())
        return f"Model set: the default, {default}. It applies from the next message."
    if word not in agents.offered:
        names = ", ".join(sorted(agents.offered)) or "none besides the default are offered"
        return f"There is no model named {word!r} ({names})."
    await ctx.profile.set_model(ModelChoice(word))
    return f"Model set: {word} ({agents.offered[word].settings.llm.model}). It applies from the next message."


async def cmd_persona(ctx: CommandContext) -> str:
    """`/persona` lists, `/persona NAME` and `/persona off` choose for the lane's tenant,
    `/persona custom TEXT` sets a person's own instructions (their DMs only; docs/concepts.md#personas)."""
    offered = ctx.parts.cfg.personas
    private = ctx.lane.kind == "person" and ctx.msg.chat_type == "dm"
    head, _, rest = ctx.args.strip().partition(" ")
    word = head.lower()
    if not word:
        return _persona_list(offered, await ctx.profile.persona(), private)
    if ctx.lane.kind == "person" and not private:
        return "Your persona is yours to choose in private: send /persona in a private chat with me."
    if word == "custom" and not private:
        return (
            "Own instructions are private, so they are only for a private chat with me; "
            "here only the operator's personas apply (/persona lists them)."
        )
    if ctx.lane.kind == "chat" and not await _lane_admin(ctx):
        return "This conversation is shared by everyone here, so only the chat's admins can choose its persona."
    if word == "off":
        choice, said = NONE, "Persona off: I answer in my own way here again."
    elif word == "custom":
        text = rest.strip()
        if (problem := custom_problem(text)) is not None:
            return f"I can't use those instructions: {problem}."
        choice = PersonaChoice(custom=text)
        said = (
            "Your own instructions are set. I use them only in our private chats, never in a group. "
            "/persona off removes them."
        )
    elif word in offered:
        choice, said = PersonaChoice(name=word), f"Persona set: {word}. It applies from the next message."
    else:
        names = ", ".join(sorted(offered)) or "none are offered"
        return f"There is no persona named {head!r} ({names})."
    await ctx.profile.set_persona(choice)
    return said


def _persona_list(offered: dict[str, str], choice: PersonaChoice, private: bool) -> str:
    lines = [f"Personas: {', '.join(sorted(offered))}." if offered else "The operator offers no personas."]
    if private and choice.custom is not None:
        lines.append("Current: your own instructions (used only in our private chats).")
    elif choice.name is not None and choice.name in offered:
        lines.append(f"Current: {choice.name}.")
    elif choice.name is not None:
        lines.append(f"Current: {choice.name}, which is no longer offered, so none applies.")
    else:
        lines.append("Current: none.")
    usage = "Choose with /persona NAME, or /persona off"
    lines.append(usage + (", or give your own with /persona custom TEXT." if private else "."))
    return "\n".join(lines)


async def cmd_tools(ctx: CommandContext) -> str:
    """/tools: what the sender may use in this chat, and which calls ask them first."""
    from agent.reminders import ReminderChat

    agent = await ctx.parts.agents.of(ctx.profile)
    msg = ctx.msg
    ask = asks_chat_admin(ctx.parts.cfg.tools)
    speaker = await speaker_of(ctx.parts.access, [msg.principal], ctx.place, [ctx.chat_admin], ask)
    chat = ReminderChat(msg.platform, msg.chat_id, msg.chat_type, msg.thread_id, msg.user_id, msg.user_name)
    box = agent.toolbox(
        ctx.profile, ctx.lane, ctx.place, agent.lane_memory(ctx.profile, ctx.lane), chat, speaker=speaker
    )
    lines = ["Tools I can use for you here:"]
    for schema in await box.schemas():
        fn = schema["function"]
        first = str(fn.get("description") or "").split(". ")[0].rstrip(".")
        asks = " (I ask you first)" if box.rule_of(fn["name"])[1] else ""
        lines.append(f"- {fn['name']}: {first}{asks}")
    if not speaker.dm and box.has_dm_only():
        lines.append("Some tools are only offered in a direct message with me.")
    return "\n".join(lines)


HANDLERS: dict[str, Handler] = {
    "model": cmd_model,
    "persona": cmd_persona,
    "tools": cmd_tools,
    "reminders": cmd_reminders,
    "stop": cmd_stop,
    "help": cmd_help,
    "start": cmd_start,
    "new": cmd_new,
    "status": cmd_status,
    "usage": cmd_usage,
    "compress": cmd_compress,
    "memory": cmd_memory,
    "forget": cmd_forget,
    "undo": cmd_undo,
    "why": cmd_why,
    "more": cmd_more,
    "export": cmd_export,
    "whoami": cmd_whoami,
    "link": cmd_link,
    "unlink": cmd_unlink,
    "pair": cmd_pair,
}
