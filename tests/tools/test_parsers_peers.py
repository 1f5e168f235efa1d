"""Peers' tool-call cases, as the peers expect them: llama.cpp, vLLM, SGLang and mlx-lm test
suites transcribed as data (tests/fixtures/parser_cases/*.json, each case with its source repo,
path and commit), run through the agent's own path like the older corpus (tests/fixtures/parser_corpus/,
test_corpus.py: TextState over the streamed text, parse_reply, check_call).

In these fixtures "expected" is always the peer's expectation. Where flashmoe deliberately does
otherwise the case says so in "deviation" (the argument) and "flashmoe" (what it does instead):
the test holds flashmoe to that, and the case counts as a miss in the rate. The rate that must
reach 95% is over these cases, none of which the older corpus has (issue 40 measured 83% on such
unseen cases); it is also given over every peer case, the older corpus included, where each of
its argued deviations is a miss.

    python -m pytest -q -n0 tests/tools/test_parsers_peers.py -k rate -s

prints the figures.
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

import pytest

from flashmoe.tools.parsers import PARSERS
from tests.helpers.parser_cases import CASES as OLD_CASES
from tests.helpers.parser_cases import run, splits

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "parser_cases"
NEW_CASES = [c for p in sorted(FIXTURES.glob("*.json")) for c in json.loads(p.read_text(encoding="utf-8"))]
MIN_RATE = 0.95
OVERALL_FLOOR = 0.92


def matches_peer(case: dict) -> bool:
    return "deviation" not in case and run(case, [case["text"]]) == case["expected"]


def test_the_cases_are_sourced_and_new():
    ids = [c["id"] for c in NEW_CASES + OLD_CASES]
    assert len(ids) == len(set(ids))
    old_texts = {(c["format"], c["text"]) for c in OLD_CASES}
    for c in NEW_CASES:
        assert c["format"] in PARSERS, c["id"]
        assert {"repo", "path", "commit", "test"} <= set(c["source"]) and len(c["source"]["commit"]) == 40, c["id"]
        assert (c["format"], c["text"]) not in old_texts, c["id"]  # not seen in the older corpus
        if "deviation" in c:
            assert c["deviation"] and "flashmoe" in c, c["id"]


def test_rate_of_peer_cases_parsed_as_the_peers_expect():
    by_source: dict[str, list[bool]] = defaultdict(list)
    for c in NEW_CASES:
        by_source[c["source"]["repo"]].append(matches_peer(c))
    new = [ok for v in by_source.values() for ok in v]
    old = [matches_peer(c) for c in OLD_CASES]  # (the older corpus's deviations are misses)
    both = new + old
    print(
        f"peer cases new in issue 40: {sum(new)}/{len(new)} = {sum(new) / len(new):.1%} "
        f"({', '.join(f'{k} {sum(v)}/{len(v)}' for k, v in sorted(by_source.items()))}); "
        f"all peer cases, tests/fixtures/parser_corpus included: {sum(both)}/{len(both)} = {sum(both) / len(both):.1%}"
    )
    for c in NEW_CASES:
        if "deviation" in c:
            print(f"deviation {c['id']}: {c['deviation']}")
    assert sum(new) / len(new) >= MIN_RATE
    # every peer case, the older corpus's argued deviations (cut-off calls refused rather than
    # dropped, llama.cpp's trimmed Qwen3-Coder strings) counted as misses: a floor, not the goal
    assert sum(both) / len(both) >= OVERALL_FLOOR


@pytest.mark.parametrize("case", NEW_CASES, ids=[c["id"] for c in NEW_CASES])
def test_case(case):
    assert run(case, [case["text"]]) == case.get("flashmoe", case["expected"])


@pytest.mark.parametrize("case", NEW_CASES, ids=[c["id"] for c in NEW_CASES])
def test_every_split_gives_the_same_calls(case):
    whole = run(case, [case["text"]])
    for chunks in splits(case["text"]):
        assert run(case, chunks) == whole, chunks
