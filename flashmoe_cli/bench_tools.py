"""`flashmoe bench tools`: how reliably a model calls tools, per model (bit width) and per
constrained-decoding mode, with the speed conditions of every run.

A fixed suite of prompts, each with the tool a good answer calls, in a scratch workspace. A
turn ends after the first call that runs (or when repairs run out): we measure the calls, not
the prose after them.
"""

from __future__ import annotations

import json
import os
import platform
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

SUITE = [
    ("Read the file notes.txt.", "read_file"),
    ("List the files in the current folder.", "list_dir"),
    ("Search the files for the word 'budget'.", "search_files"),
    ("Create a file called todo.txt that contains the text 'buy milk'.", "write_file"),
    ("In notes.txt, replace the word 'hello' with 'goodbye'.", "edit_file"),
    ("What files are in the folder docs?", "list_dir"),
    ("Show me the first 3 lines of data.csv.", "read_file"),
    ("Which file mentions Paris?", "search_files"),
]
TOOLS = "read_file,list_dir,search_files,write_file,edit_file"


def make_workspace(root: Path) -> Path:
    (root / "docs").mkdir(parents=True)
    (root / "notes.txt").write_text("hello world\nthe budget is 40 euros\n")
    (root / "data.csv").write_text("city,country\nParis,France\nRome,Italy\nOslo,Norway\n")
    (root / "docs" / "trip.md").write_text("A weekend in Paris.\n")
    return root


def run_suite(args, model: str, constrain: str) -> dict:
    """One model, one mode: the suite's counts and speeds."""
    from argparse import Namespace

    from .agent import RepairEvent, ToolCallEvent, ToolResultEvent
    from .agent_cli import ToolOptions, make_agent
    from .approvers import AutoApprover
    from .stats import mean_figures
    from .startup import ConversationOptions, EngineOptions, make_engine, open_conversation
    from flashmoe.engine.events import GenerationFinished

    ns = Namespace(
        **{
            **vars(args),
            "model": model,
            "constrain": constrain,
            "tools": [TOOLS],
            "no_log": True,
            "continue_": False,
            "cid": None,
            "mode": "workspace-write",
            "allow": [],
            "ask": [],
            "deny": [],
            "dangerously_skip_approvals": False,
            "chain_limit": 1,
            "stop": [],
            "pass_env": [],
        }
    )
    engine = make_engine(EngineOptions.from_args(ns))
    loaded = engine.wait_loaded()
    rows, kinds, speeds = [], Counter(), []
    try:
        for prompt, expected in SUITE:
            with tempfile.TemporaryDirectory() as tmp:
                ns.workspace = str(make_workspace(Path(tmp)))
                session = open_conversation(ConversationOptions.from_args(ns), engine, model_name=model)
                # One engine cache for the suite: every prompt shares the long tool preamble,
                # which then runs once, not once per prompt.
                session.session_key = "bench-tools"
                calls, repairs = [], []
                loop = None

                def on_event(ev):
                    if isinstance(ev, ToolCallEvent):
                        calls.append(ev)
                        if ev.kind:
                            kinds[ev.kind] += 1
                    elif isinstance(ev, RepairEvent):
                        repairs.append(ev)
                    elif isinstance(ev, ToolResultEvent) and ev.status != "invalid":
                        loop.cancel()  # a call ran: that is what we measure
                    elif isinstance(ev, GenerationFinished):
                        speeds.append(ev)

                loop = make_agent(ToolOptions.from_args(ns), session, loaded.chat_template, None, on_event)
                loop.executor.approver = AutoApprover(loop.executor.registry)
                t0 = time.perf_counter()
                loop.run_turn(prompt)
                if not calls:
                    kinds["no-call"] += 1
                rows.append(
                    {
                        "prompt": prompt,
                        "expected": expected,
                        "seconds": time.perf_counter() - t0,
                        "calls": [
                            {"name": c.name, "valid": c.valid, "kind": c.kind, "raw": c.raw, "arguments": c.arguments}
                            for c in calls
                        ],
                        "first_valid": bool(calls) and calls[0].valid,
                        "right_tool": bool(calls) and calls[0].valid and calls[0].name == expected,
                        "repaired": bool(repairs),
                        "ended_valid": any(c.valid for c in calls),
                    }
                )
    finally:
        engine.close()
    n = len(rows)
    started = [c for r in rows for c in r["calls"]]  # every call the model began, repairs included
    return {
        "model": model,
        "model_type": loaded.model_type,
        "bits": loaded.bits,
        "top_k": loaded.top_k,
        "constrain": constrain,
        "prompts": n,
        "valid_call_rate": sum(r["first_valid"] for r in rows) / n,
        "right_tool_rate": sum(r["right_tool"] for r in rows) / n,
        "repair_rate": sum(r["repaired"] for r in rows) / n,
        "valid_after_repair_rate": sum(r["ended_valid"] for r in rows) / n,
        "failure_kinds": dict(kinds),
        "started_calls": len(started),
        # valid as written: a call run after the low-bit quoting repair does not count
        "started_valid_rate": sum(c["valid"] and not c["kind"] for c in started) / len(started) if started else 0.0,
        "mean_call_chars": sum(len(c["raw"]) for c in started) / len(started) if started else 0.0,
        "max_string_chars": max((len(v) for c in started for v in _strings(c.get("arguments"))), default=0),
        **mean_figures(speeds),  # decode_tps, prefill_tps, bytes_per_token, hit_rate, generated_tokens
        "cache_state": "warm after the first prompt",
        # replies whose call was open at max_tokens and was finished under the grammar past it
        # (engine/runtime/generate.py FINISH_CALL_TOKENS), rather than cut into an invalid call
        "finished_past_max_tokens": sum(s.generation_tokens > args.max_tokens for s in speeds),
        "rows": rows,
    }


def _strings(value) -> list[str]:
    """Every string inside decoded arguments (for the longest one a model wrote)."""
    if isinstance(value, str):
        return [value]
    if isinstance(value, dict):
        return [s for v in value.values() for s in _strings(v)]
    if isinstance(value, list):
        return [s for v in value for s in _strings(v)]
    return []


def cmd_bench_tools(args) -> int:
    from .errors import UsageError
    from .units import human_bytes

    modes = [m.strip() for m in args.constrain_modes.split(",")]
    if any(m not in ("off", "tools", "required") for m in modes):
        raise UsageError(f"--constrain-modes {args.constrain_modes}: use off, tools and/or required")
    models = args.models or [None]
    machine = f"{os.cpu_count()} CPUs, {platform.machine()}, {platform.system()} {platform.release()}"
    results = []
    print(
        f"flashmoe bench tools: {len(SUITE)} prompts x {len(models)} model(s) x modes {', '.join(modes)}; "
        f"machine {machine}",
        file=sys.stderr,
    )
    for model in models:
        for mode in modes:
            r = run_suite(args, model, mode)
            results.append(r)
            kinds = ", ".join(f"{k} {v}" for k, v in sorted(r["failure_kinds"].items())) or "none"
            print(
                f"{r['model_type']} {r['bits'] or 'float'}-bit K={r['top_k']} constrain={mode:<8} "
                f"valid calls {r['valid_call_rate']:.0%}  right tool {r['right_tool_rate']:.0%}  "
                f"started calls {r['started_calls']} ({r['started_valid_rate']:.0%} valid)  "
                f"mean call {r['mean_call_chars']:.0f} chars  longest string {r['max_string_chars']}  "
                f"repaired {r['repair_rate']:.0%}  valid after repair {r['valid_after_repair_rate']:.0%}  "
                f"failures: {kinds} | decode {r['decode_tps']:.2f} tok/s, prefill {r['prefill_tps']:.1f} tok/s, "
                f"{human_bytes(r['bytes_per_token'])}/token read, hit rate {r['hit_rate']:.0%}, "
                f"{r['generated_tokens']} tokens generated, {r['finished_past_max_tokens']} call(s) finished past "
                f"--max-tokens, expert cache {r['cache_state']} "
                f"[{r['model']}]"
            )
    if args.out:
        out = Path(args.out)
        tmp = out.with_name(out.name + ".partial")
        tmp.write_text(json.dumps({"machine": machine, "results": results}, indent=2))
        os.replace(tmp, out)
    return 0
