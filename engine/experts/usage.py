"""Which experts a model's runs ask for, kept across runs, and read into the cache at start.

A fresh process starts with an empty expert cache, so its first tokens miss on every expert
(cold start). Trained MoEs route unevenly (a tenth of the experts serve about half the lookups on
Qwen3.6-35B-A3B), and a user's workload changes slowly, so the experts that earlier runs asked
for most are the best guess for the next run's. As colibri (`.coli_usage`) and rabbit do, each
run adds its counts to a usage file; the next run starts reading the hottest experts into free
slots (ExpertStore.preload) while it loads the prompt, and seeds LFU with the counts so that they
are not the first evicted. Decisions and figures:
benchmarks/log/2026-12-04-preload-and-prefetch.md.

The file is `expert-usage.json` beside the model (in its folder); where that folder cannot be
written, FLASHMOE_HOME/usage/<name>-<hash of the folder's path>.json. It holds counts per
(MoE layer, expert) and how many tokens they cover; older runs weigh less (their counts halve
every HALF_LIFE_TOKENS tokens of newer runs). Writes go to a temporary name, then rename.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import tempfile
from pathlib import Path

import numpy as np

from flashmoe.engine.errors import ModelLoadError

FILE = "expert-usage.json"
FORMAT = 1
HALF_LIFE_TOKENS = 4096


class UsageError(ValueError):
    """A usage file that cannot be used (it is then rewritten from this run's counts)."""


def _writable(folder: Path) -> bool:
    return folder.is_dir() and os.access(folder, os.W_OK | os.X_OK)


def usage_path(model_path: Path) -> Path:
    """Where the usage file of the model in `model_path` lives (see the module's docstring)."""
    model_path = Path(model_path)
    if _writable(model_path):
        return model_path / FILE
    from flashmoe.engine.formats.demo import flashmoe_home

    real = str(model_path.resolve())
    tag = hashlib.sha256(real.encode("utf-8", "surrogateescape")).hexdigest()[:16]
    return flashmoe_home() / "usage" / f"{model_path.name or 'model'}-{tag}.json"


def read_usage(path: Path, shape: tuple[int, int]) -> tuple[np.ndarray, int] | None:
    """(counts [layers, experts], tokens) from the file, or None when there is none yet.
    Raises UsageError naming the file when it is not a usage file of a model of this shape."""
    from flashmoe.engine.runtime.jsonfile import read_bytes

    if not path.exists():
        return None
    try:
        data = json.loads(read_bytes(path, limit=64 << 20))
    except ModelLoadError as e:
        raise UsageError(str(e)) from None
    except (ValueError, RecursionError) as e:
        raise UsageError(f"{path}: not JSON ({e})") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise UsageError(f"{path}: not a flashmoe usage file of format {FORMAT}")
    try:
        counts = np.asarray(data["counts"], dtype=np.float64)
        tokens = int(data["tokens"])
    except (KeyError, TypeError, ValueError) as e:
        raise UsageError(f"{path}: bad counts or tokens ({e})") from None
    if counts.shape != shape:
        raise UsageError(
            f"{path}: counts for {counts.shape[0] if counts.ndim else 0} layers x "
            f"{counts.shape[1] if counts.ndim == 2 else 0} experts, this model has "
            f"{shape[0]} x {shape[1]}"
        )
    if tokens < 0 or not np.all(np.isfinite(counts)) or np.any(counts < 0):
        raise UsageError(f"{path}: counts must be finite and at least 0")
    return counts, tokens


def merged(old: tuple[np.ndarray, int] | None, counts: np.ndarray, tokens: int) -> tuple[np.ndarray, int]:
    """This run's counts added to the file's, which first halve once per HALF_LIFE_TOKENS new tokens."""
    if old is None:
        return counts, tokens
    w = 0.5 ** (tokens / HALF_LIFE_TOKENS)
    return old[0] * w + counts, int(round(old[1] * w)) + tokens


def write_usage(path: Path, counts: np.ndarray, tokens: int) -> None:
    """Merge this run's counts into the file (a bad or foreign file is replaced), atomically."""
    try:
        old = read_usage(path, counts.shape)
    except UsageError:
        old = None
    total, n = merged(old, counts, tokens)
    path.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(
        {"format": FORMAT, "tokens": n, "counts": [[round(float(c), 3) for c in row] for row in total]},
        separators=(",", ":"),
    )
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def hottest(counts: np.ndarray, layers: list[int]) -> list[tuple[int, int]]:
    """(layer, expert) pairs with a count above zero, hottest first. counts' rows follow `layers`."""
    order = np.argsort(-counts, axis=None, kind="stable")
    rows, cols = np.unravel_index(order, counts.shape)
    return [(layers[r], int(c)) for r, c in zip(rows, cols) if counts[r, c] > 0]


class Usage:
    """One model's usage file, for one process: read (and preloaded) at start, written after runs."""

    def __init__(self, store, model_path: Path, path: Path | None = None):
        self.store = store
        self.layers = sorted(store.layers)
        self.shape = (len(self.layers), max(l.num_experts for l in store.layers.values()))
        self.path = Path(path) if path is not None else usage_path(model_path)
        self._written_steps = 0
        self._written = np.zeros(self.shape)

    def start(self) -> tuple[int, str | None]:
        """Read the file and start preloading; returns (experts whose reads started, a warning
        naming the file when it could not be used, else None)."""
        try:
            found = read_usage(self.path, self.shape)
        except UsageError as e:
            return 0, f"{e}; starting without it (it is rewritten after this run)"
        if found is None or found[1] == 0:
            return 0, None
        counts, tokens = found
        full = np.zeros_like(self.store.freq)
        full[self.layers, : counts.shape[1]] = counts
        return self.store.preload(hottest(counts, self.layers), full, tokens), None

    def save(self) -> str | None:
        """Add what this process asked for since the last save to the file; returns a warning
        when it cannot be written, else None."""
        steps = self.store.asked_steps - self._written_steps
        if steps <= 0:
            return None
        asked = self.store.asked[self.layers, : self.shape[1]]
        try:
            write_usage(self.path, asked - self._written, steps)
        except OSError as e:
            return f"{self.path}: cannot write the expert usage file ({e.strerror or e})"
        self._written, self._written_steps = asked.copy(), self.store.asked_steps
        return None
