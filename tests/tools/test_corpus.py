"""Real tool-call outputs from peers' test suites (tests/fixtures/parser_corpus/*.json, each case with its
source), run through the agent's own path: TextState over the streamed text, parse_reply over
the call blocks, check_call against a registry of the case's tools.

A case is {"id", "format", "text", "expected", "source", "tools"?, "deviation"?, "needs_textstate"?,
"in_reasoning"?}. "in_reasoning": true is a reply whose prompt already opened the reasoning block
(a template that ends the generation prompt with <think>; llama.cpp's thinking_forced_open), as
the engine tells TextState.
"expected" is the list of calls that should run ({"name", "arguments"}) or refusals
({"refused": KIND}); [] means the reply is text. Without "tools" every expected tool exists and
takes any object, so only parsing is tested.

Deliberate deviations from a peer are written in the case's "deviation" field (the test prints
them); cases that need a TextState change are marked "needs_textstate" with what is missing and
count as failures in the pass rate until TextState has it.
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest

from flashmoe.tools.parsers import PARSERS, parse_reply
from flashmoe.tools.registry import Tool, ToolRegistry
from flashmoe.tools.textstate import TextState
from flashmoe.tools.validate import check_call

CORPUS = sorted((Path(__file__).resolve().parents[1] / "fixtures" / "parser_corpus").glob("*.json"))
CASES: list[dict[str, Any]] = [c for p in CORPUS for c in json.loads(p.read_text(encoding="utf-8"))]
MIN_RATE = 0.95


_REGISTRIES: dict[str, ToolRegistry] = {}


def _registry(case: dict[str, Any]) -> ToolRegistry:
    """The case's tools, built once per case (checking each schema is most of a run's cost)."""
    if case["id"] in _REGISTRIES:
        return _REGISTRIES[case["id"]]
    reg = _REGISTRIES[case["id"]] = ToolRegistry()
    for t in case.get("tools") or []:
        f = t["function"]
        reg.add(Tool(f["name"], f.get("description", ""), f.get("parameters") or {}, lambda **kw: None))
    for call in case["expected"]:
        if "name" in call and call["name"] not in reg.names():
            reg.add(Tool(call["name"], "", {"type": "object"}, lambda **kw: None))
    return reg


def run(case: dict[str, Any], chunks: list[str]) -> list[dict[str, Any]]:
    """What the agent would do with the reply streamed as `chunks`: the calls it runs, the refusals."""
    parser = PARSERS[case["format"]]
    tools = case.get("tools")
    reg = _registry(case)
    state = TextState(parser, tools=tools, in_reasoning=case.get("in_reasoning", False))
    for chunk in chunks:
        state.feed(chunk)
    state.finish()
    out = []
    for call in parse_reply(parser, state.tool_calls, tools):
        v = check_call(call, reg)
        out.append({"name": call.name, "arguments": v.arguments} if v.ok else {"refused": v.kind})
    return out


def _splits(text: str) -> list[list[str]]:
    """Every split into 2 chunks; every split into 3 for short texts, a spread of them for longer
    ones (all of them would be quadratic in the text: minutes for the corpus)."""
    n = len(text)
    out = [[text[:i], text[i:]] for i in range(1, n)]
    step = 1 if n <= 40 else n // 15
    out += [[text[:i], text[i:j], text[j:]] for i in range(1, n, step) for j in range(i + 1, n, step)]
    return out


def _ok(case: dict[str, Any]) -> bool:
    return run(case, [case["text"]]) == case["expected"]


def test_corpus_is_real_and_sourced():
    assert len(CASES) >= 200
    ids = [c["id"] for c in CASES]
    assert len(ids) == len(set(ids))
    for c in CASES:
        assert c["format"] in PARSERS, c["id"]
        assert {"repo", "path", "test"} <= set(c["source"]), c["id"]


def test_pass_rate_per_format_and_total():
    by_format: dict[str, list[bool]] = defaultdict(list)
    for c in CASES:
        by_format[c["format"]].append(_ok(c))
    report = {f: f"{sum(v)}/{len(v)}" for f, v in sorted(by_format.items())}
    total = [ok for v in by_format.values() for ok in v]
    print("corpus pass rates:", report, f"total {sum(total)}/{len(total)}")
    for c in CASES:
        if "deviation" in c:
            print(f"deviation {c['id']}: {c['deviation']}")
    assert sum(total) / len(total) >= MIN_RATE, report
    for f, v in by_format.items():
        assert sum(v) / len(v) >= MIN_RATE or len(v) - sum(v) <= 1, (f, report[f])


@pytest.mark.parametrize("case", CASES, ids=[c["id"] for c in CASES])
def test_case(case):
    if "needs_textstate" in case:
        pytest.xfail(case["needs_textstate"])
    assert run(case, [case["text"]]) == case["expected"]


@pytest.mark.parametrize("case", CASES, ids=[c["id"] for c in CASES])
def test_every_split_gives_the_same_calls(case):
    whole = run(case, [case["text"]])
    for chunks in _splits(case["text"]):
        assert run(case, chunks) == whole, chunks
