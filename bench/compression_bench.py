#!/usr/bin/env python3
"""Context-compression benchmark: the non-LLM stages on long histories.

    python bench/compression_bench.py                 # 50k, 200k and 1M tokens
    python bench/compression_bench.py --sizes 50000 --repeat 3 --json out.json

What runs
---------
* A synthetic chat history per size, built once (not timed): a system prompt, then turns
  of a person's message (20-80 words), sometimes an assistant tool call (`memory` add,
  sometimes with an 800-char argument; `session_search`) with its JSON result (search
  results of 0.5-2 KB, 10% of them identical to an earlier one), and an answer (50-300
  words). Every message is a `StoredMessage` whose `token_count` was counted once with the
  cl100k tokenizer, as the agent does before storing it (the persisted, cached count).
* The real code: `Compressor.view` (history -> items with cached counts and overrides),
  the four pruning passes (`prune_tool_results`), the boundaries (`protect_head_size`,
  `align_forward`, `find_tail_cut`), the serialisation of the middle for the summary model
  (`serialize_for_summary` + `build_summary_prompt`, 160K-char cap included) and the
  static fallback summary (`build_fallback_summary`). No LLM, no I/O. The tail budget is
  threshold x target_ratio with the history sitting at the threshold (0.2 x its tokens).
* The per-request check a turn that does NOT compress pays: building the wire
  (`Compressor.wire`: view + summary/note/tool-pair handling) and the seed's chars/4
  estimate, plus `context_tokens` (the sum of cached per-message counts, as /usage uses).
  Compared with a full recount of the history with the tokenizer (what caching avoids).

What is reported
----------------
Best of `--repeat` runs per stage (ms; the garbage collector paused while timing, as
`timeit` does), microseconds per 1k history tokens (flat across
sizes = linear cost), and the tokens saved by pruning alone (cached counts before and after
the four passes, with the per-pass counts of messages changed).
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import random
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from agent.compression import Compressor
from agent.compression_stages import (
    align_forward,
    build_fallback_summary,
    build_summary_prompt,
    find_tail_cut,
    protect_head_size,
    prune_tool_results,
    serialize_for_summary,
)
from agent.messages import StoredMessage
from agent.tokens import TokenCounter
from core.settings import AgentSettings, parse_config

WORDS = [
    "the",
    "a",
    "to",
    "of",
    "and",
    "in",
    "is",
    "it",
    "you",
    "that",
    "for",
    "on",
    "with",
    "as",
    "this",
    "be",
    "are",
    "have",
    "not",
    "was",
    "but",
    "at",
    "can",
    "what",
    "about",
    "your",
    "my",
    "we",
    "they",
    "so",
    "if",
    "do",
    "there",
    "from",
    "how",
    "would",
    "just",
    "one",
    "all",
    "time",
    "like",
    "more",
    "trip",
    "booking",
    "museum",
    "kyoto",
    "garden",
    "recipe",
    "tomato",
    "budget",
    "meeting",
    "friday",
    "doctor",
    "appointment",
    "invoice",
    "password",
    "reminder",
    "birthday",
    "sister",
    "project",
    "deadline",
    "train",
    "ticket",
    "hotel",
    "flight",
    "weather",
    "umbrella",
    "marathon",
    "training",
    "knee",
    "physio",
    "schedule",
    "dentist",
    "groceries",
    "pasta",
    "basil",
    "garlic",
    "olive",
    "oil",
    "lemon",
    "coffee",
    "tea",
    "chamomile",
    "novel",
    "chapter",
    "poem",
    "guitar",
    "chord",
    "lesson",
    "spanish",
    "vocabulary",
    "verb",
    "tense",
    "bicycle",
    "repair",
    "tyre",
    "chain",
    "brake",
    "mortgage",
    "rate",
    "bank",
    "loan",
]


def sentence(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n)).capitalize() + "."


def build_history(target_tokens: int, counter: TokenCounter, seed: int = 7) -> list[StoredMessage]:
    rng = random.Random(seed)
    sid = "bench"
    msgs = [StoredMessage(sid, "system", "You are Hermes, a helpful assistant. " + sentence(rng, 300))]
    counter.count_message(msgs[0])
    total = msgs[0].token_count or 0
    earlier_results: list[str] = []
    call_n = 0
    while total < target_tokens:
        turn = [StoredMessage(sid, "user", sentence(rng, rng.randint(20, 80)))]
        if rng.random() < 0.4:
            call_n += 1
            cid = f"call_{call_n:08d}"
            if rng.random() < 0.5:
                content = sentence(rng, 140 if rng.random() < 0.1 else rng.randint(8, 40))
                args = {"action": "add", "target": rng.choice(["user", "memory"]), "content": content}
                name, result = "memory", json.dumps({"success": True, "message": "Entry added."})
            else:
                args = {"query": " ".join(rng.choice(WORDS) for _ in range(3))}
                name = "session_search"
                if earlier_results and rng.random() < 0.1:
                    result = rng.choice(earlier_results)
                else:
                    hits = [
                        {
                            "session_id": "2026_x",
                            "role": rng.choice(["user", "assistant"]),
                            "snippet": sentence(rng, rng.randint(15, 40)),
                            "timestamp": 1.7e9 + i,
                            "uid": f"u{call_n}-{i}",
                            "active": True,
                            "compacted": False,
                        }
                        for i in range(rng.randint(3, 10))
                    ]
                    result = json.dumps({"success": True, "count": len(hits), "results": hits})
                    earlier_results.append(result)
            turn.append(
                StoredMessage(
                    sid,
                    "assistant",
                    None,
                    tool_calls=[
                        {"id": cid, "type": "function", "function": {"name": name, "arguments": json.dumps(args)}}
                    ],
                )
            )
            turn.append(StoredMessage(sid, "tool", result, tool_call_id=cid, tool_name=name))
        turn.append(StoredMessage(sid, "assistant", sentence(rng, rng.randint(50, 300))))
        for m in turn:
            total += counter.count_message(m)
        msgs.extend(turn)
    return msgs


def best_of(repeat: int, fn: Callable[[], Any], prepare: Callable[[], Any] | None = None) -> tuple[float, Any]:
    """Best wall time (s) of `repeat` runs of fn(prepared)."""
    best, out = float("inf"), None
    for _ in range(repeat):
        arg = prepare() if prepare else None
        gc.collect()
        gc.disable()  # like timeit: a full collection landing in one run is not the stage's cost
        try:
            t0 = time.perf_counter()
            out = fn(arg) if prepare else fn()  # type: ignore[call-arg]
            best = min(best, time.perf_counter() - t0)
        finally:
            gc.enable()
    return best, out


def bench_size(target: int, counter: TokenCounter, repeat: int) -> dict[str, Any]:
    t0 = time.perf_counter()
    history = build_history(target, counter)
    build_s = time.perf_counter() - t0
    tokens = sum(m.token_count or 0 for m in history)
    cfg = parse_config({"llm": {"context_length": max(4096, int(tokens / 0.75))}})

    async def no_system(*_: Any) -> StoredMessage:  # never called: nothing is committed here
        raise AssertionError

    comp = Compressor(AgentSettings.from_config(cfg), llm=None, tokens=counter, system_factory=no_system)  # type: ignore[arg-type]
    ccfg = cfg.compression
    budget = int(tokens * ccfg.target_ratio)  # threshold x target_ratio, history at the threshold

    t_view, items = best_of(repeat, lambda: comp.view(history))
    t_prune, (pruned, stats) = best_of(
        repeat,
        lambda its: prune_tool_results(
            its,
            protect_tail_count=ccfg.protect_last_n,
            protect_tail_tokens=budget,
            tokens=comp._tok,
            min_prune_chars=ccfg.min_prune_chars,
        ),
        prepare=lambda: comp.view(history),
    )

    def boundaries(its: list[dict]) -> tuple[int, int]:
        start = align_forward(its, protect_head_size(its, ccfg.protect_first_n))
        end = find_tail_cut(
            its,
            start,
            budget=budget,
            protect_last_n=ccfg.protect_last_n,
            min_tail_user_messages=ccfg.min_tail_user_messages,
            tokens=comp._tok,
        )
        return start, end

    t_bounds, (start, end) = best_of(repeat, boundaries, prepare=lambda: list(pruned))
    middle = pruned[start:end]
    t_serial, prompt = best_of(
        repeat,
        lambda: build_summary_prompt(
            serialize_for_summary(middle), previous_summary=None, focus=None, budget_tokens=2000
        ),
    )
    t_fallback, fallback = best_of(repeat, lambda: build_fallback_summary(middle))

    # a turn that does not compress: wire + estimate, and the cached context count
    t_wire, wire = best_of(repeat, lambda: comp.wire(history))
    t_estimate, estimate = best_of(repeat, lambda: comp.estimate(wire))
    t_cached, cached = best_of(repeat, lambda: comp.context_tokens(history))

    def full_recount() -> int:
        n = 0
        for m in history:
            n += counter.count_text(m.content or "") + 4
            if m.tool_calls:
                n += counter.count_text(json.dumps(m.tool_calls, ensure_ascii=False, separators=(",", ":")))
        return n

    t_recount, recounted = best_of(max(1, min(repeat, 2)), full_recount)

    before = sum(comp._tok(it) for it in items)
    after = sum(comp._tok(it) for it in pruned)
    non_llm = t_view + t_prune + t_bounds + t_serial
    return {
        "target_tokens": target,
        "history_tokens": tokens,
        "messages": len(history),
        "chars": sum(len(m.content or "") for m in history),
        "build_s": round(build_s, 2),
        "tail_budget": budget,
        "head_end": start,
        "tail_start": end,
        "middle_messages": end - start,
        "ms": {
            "view": t_view * 1e3,
            "prune": t_prune * 1e3,
            "boundaries": t_bounds * 1e3,
            "serialise": t_serial * 1e3,
            "non_llm_total": non_llm * 1e3,
            "fallback_summary": t_fallback * 1e3,
            "turn_wire": t_wire * 1e3,
            "turn_estimate": t_estimate * 1e3,
            "turn_cached_count": t_cached * 1e3,
            "full_recount": t_recount * 1e3,
        },
        "us_per_1k_tokens": {
            "non_llm_total": non_llm * 1e6 / (tokens / 1000),
            "turn_check": (t_wire + t_estimate) * 1e6 / (tokens / 1000),
            "full_recount": t_recount * 1e6 / (tokens / 1000),
        },
        "prune": {
            "tokens_before": before,
            "tokens_after": after,
            "saved": before - after,
            "saved_pct": 100.0 * (before - after) / before if before else 0.0,
            "duplicates": stats.duplicates,
            "summarised": stats.summarised,
            "args_truncated": stats.args_truncated,
            "pressure": stats.pressure,
        },
        "summary_prompt_chars": len(prompt),
        "fallback_chars": len(fallback),
        "estimate": estimate,
        "cached_count": cached,
        "recount": recounted,
    }


def table(results: list[dict[str, Any]]) -> str:
    def row(cells: list[str]) -> str:
        return "| " + " | ".join(cells) + " |"

    lines = [
        row(
            [
                "history",
                "messages",
                "view",
                "prune",
                "boundaries",
                "serialise",
                "non-LLM total",
                "µs / 1k tok",
                "fallback summary",
            ]
        ),
        row(["---"] * 9),
    ]
    for r in results:
        ms = r["ms"]
        lines.append(
            row(
                [
                    f"{r['history_tokens']:,} tok",
                    f"{r['messages']:,}",
                    f"{ms['view']:.1f} ms",
                    f"{ms['prune']:.1f} ms",
                    f"{ms['boundaries']:.1f} ms",
                    f"{ms['serialise']:.1f} ms",
                    f"{ms['non_llm_total']:.1f} ms",
                    f"{r['us_per_1k_tokens']['non_llm_total']:.1f}",
                    f"{ms['fallback_summary']:.1f} ms",
                ]
            )
        )
    lines += [
        "",
        row(
            [
                "history",
                "turn without compression: wire + estimate",
                "cached count (/usage)",
                "full tokenizer recount",
                "recount / turn check",
            ]
        ),
        row(["---"] * 5),
    ]
    for r in results:
        ms = r["ms"]
        turn = ms["turn_wire"] + ms["turn_estimate"]
        lines.append(
            row(
                [
                    f"{r['history_tokens']:,} tok",
                    f"{turn:.1f} ms",
                    f"{ms['turn_cached_count']:.1f} ms",
                    f"{ms['full_recount']:.0f} ms",
                    f"{ms['full_recount'] / turn:.0f}x",
                ]
            )
        )
    lines += [
        "",
        row(["history", "tokens before", "after pruning", "saved", "dedup", "summarised", "args cut", "tail pressure"]),
        row(["---"] * 8),
    ]
    for r in results:
        p = r["prune"]
        lines.append(
            row(
                [
                    f"{r['history_tokens']:,} tok",
                    f"{p['tokens_before']:,}",
                    f"{p['tokens_after']:,}",
                    f"{p['saved']:,} ({p['saved_pct']:.0f}%)",
                    str(p["duplicates"]),
                    str(p["summarised"]),
                    str(p["args_truncated"]),
                    str(p["pressure"]),
                ]
            )
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="50000,200000,1000000", help="history sizes in tokens, comma separated")
    ap.add_argument("--repeat", type=int, default=5, help="runs per stage; the best is reported")
    ap.add_argument("--json", help="also write the raw results to this file")
    args = ap.parse_args(argv)
    counter = TokenCounter.create()
    if not counter.exact:
        print("warning: tokenizer unavailable; counts are chars/4", file=sys.stderr)
    results = []
    for size in (int(s) for s in args.sizes.split(",")):
        r = bench_size(size, counter, args.repeat)
        results.append(r)
        print(
            f"{r['history_tokens']:,} tokens: non-LLM {r['ms']['non_llm_total']:.1f} ms, "
            f"turn check {r['ms']['turn_wire'] + r['ms']['turn_estimate']:.1f} ms, "
            f"full recount {r['ms']['full_recount']:.0f} ms",
            file=sys.stderr,
        )
    print(
        f"python {platform.python_version()} on {platform.machine()}, tokenizer "
        f"{counter.encoding_name or 'chars/4'}, best of {args.repeat}\n"
    )
    print(table(results))
    if len(results) > 1:
        a, b = results[0], results[-1]
        size_ratio = b["history_tokens"] / a["history_tokens"]
        print(
            f"\nscaling {a['history_tokens']:,} -> {b['history_tokens']:,} tokens (x{size_ratio:.1f}): "
            f"non-LLM x{b['ms']['non_llm_total'] / a['ms']['non_llm_total']:.1f}, "
            f"turn check x{(b['ms']['turn_wire'] + b['ms']['turn_estimate']) / (a['ms']['turn_wire'] + a['ms']['turn_estimate']):.1f}"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
