"""The tool-call parser corpus (tests/fixtures/parser_corpus/*.json) and how a case is run: through
the agent's own path, TextState over the streamed text, parse_reply over the call blocks,
check_call against a registry of the case's tools."""

from __future__ import annotations

import json
from typing import Any

from flashmoe.tools.parsers import PARSERS, parse_reply
from flashmoe.tools.registry import Tool, ToolRegistry
from flashmoe.tools.textstate import TextState
from flashmoe.tools.validate import check_call
from tests.helpers.paths import ROOT

CORPUS = sorted((ROOT / "tests" / "fixtures" / "parser_corpus").glob("*.json"))
CASES: list[dict[str, Any]] = [c for p in CORPUS for c in json.loads(p.read_text(encoding="utf-8"))]


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


def splits(text: str) -> list[list[str]]:
    """Every split into 2 chunks; every split into 3 for short texts, a spread of them for longer
    ones (all of them would be quadratic in the text: minutes for the corpus)."""
    n = len(text)
    out = [[text[:i], text[i:]] for i in range(1, n)]
    step = 1 if n <= 40 else n // 15
    out += [[text[:i], text[i:j], text[j:]] for i in range(1, n, step) for j in range(i + 1, n, step)]
    return out
