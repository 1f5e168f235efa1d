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

from collections import defaultdict
from typing import Any

import pytest

from flashmoe.tools.parsers import PARSERS
from tests.helpers.parser_cases import CASES, run, splits

MIN_RATE = 0.95


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
    for chunks in splits(case["text"]):
        assert run(case, chunks) == whole, chunks
