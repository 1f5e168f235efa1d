"""The fast tier (`python -m pytest -m "not slow"`, at most 3 minutes on two cores) and the slow
one, decided here and in the `@pytest.mark.slow` marks some tests carry.

Slow: the whole architecture zoo, the Hugging Face comparisons, the tmux and pty tests (listed
below), and every test measured at SLOW_S or more (tests/slow_tests.txt, written from a run's
durations). One model of each block kind stays fast: the 4-bit case of each model type in the
exactness suites (KEEP_FAST), whatever it took.

    python -m pytest -q --durations=0 > /tmp/durations.log   # (a warm numba cache)
    python -m tests.helpers.tiers /tmp/durations.log         # rewrites tests/slow_tests.txt
"""

from __future__ import annotations

import re
import sys
from collections import defaultdict
from pathlib import Path

SLOW_S = 1.0  # a test's setup, call and teardown together, with two workers on two cores
SESSION_SETUP_S = 10.0  # a setup this long is the first test of a worker waiting for the kernels
SLOW_FILE = Path(__file__).resolve().parents[1] / "slow_tests.txt"
SLOW_MODULES = {
    "tests/test_arch_zoo.py": "the 53-type architecture zoo",
    "tests/test_hf_transformers.py": "comparisons with Hugging Face transformers",
    "tests/tui/test_tmux.py": "the chat app driven in tmux",
    "tests/test_repl.py": "the line REPL on a pty",
    "tests/test_prefill_progress.py": "progress on a pty",
}
KEEP_FAST = re.compile(r"::test_(streamed_equals_resident|cpu_kernels_match_mlx_kernels)\[[^\]]*-4\]$")


def slow_ids() -> set[str]:
    if not SLOW_FILE.is_file():
        return set()
    return {
        line.strip()
        for line in SLOW_FILE.read_text(encoding="utf-8").splitlines()
        if line.strip() and not line.startswith("#")
    }


def is_slow(nodeid: str, listed: set[str]) -> bool:
    if KEEP_FAST.search(nodeid):
        return False
    return nodeid.split("::", 1)[0] in SLOW_MODULES or nodeid in listed


def durations(log: str) -> dict[str, float]:
    """Each test's seconds (setup + call + teardown) from pytest's `--durations=0` output."""
    seconds: dict[str, float] = defaultdict(float)
    for line in log.splitlines():
        m = re.match(r"\s*([\d.]+)s (call|setup|teardown)\s+(\S.*)$", line)
        if m and not (m.group(2) == "setup" and float(m.group(1)) >= SESSION_SETUP_S):
            seconds[m.group(3).strip()] += float(m.group(1))
    return seconds


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m tests.helpers.tiers DURATIONS_LOG", file=sys.stderr)
        return 2
    seconds = durations(Path(argv[0]).read_text(encoding="utf-8"))
    slow = sorted(
        t
        for t, s in seconds.items()
        if s >= SLOW_S and not KEEP_FAST.search(t) and t.split("::", 1)[0] not in SLOW_MODULES
    )
    tmp = SLOW_FILE.with_suffix(".tmp")
    tmp.write_text(
        f"# Tests measured at {SLOW_S} s or more (python -m tests.helpers.tiers); "
        "the slow tier.\n" + "".join(f"{t}\n" for t in slow),
        encoding="utf-8",
    )
    tmp.replace(SLOW_FILE)
    print(f"{len(slow)} tests listed in {SLOW_FILE}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
