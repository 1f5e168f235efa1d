"""Tiny random models of every mlx-lm model type that routes through switch layers.

mlx-lm 0.32.2 has 53 model types whose experts are SwitchGLU / SwitchMLP modules
(mlx_lm/models/switch_layers.py). Their configs are data, in fixtures/mlx_lm_moe_configs.json:
each is mlx-lm's own test config for that type (its "source" names the test and lists what was
changed; the four types without one have a config written from their ModelArgs), changed only as
far as these tests need: every Linear and expert tensor quantizes at group size 64, more experts
than top_k + 1, at least two MoE layers, a vocabulary of 320 ids for the shared tiny tokenizer,
max_position_embeddings >= 4096. "known_issues" records what a probe of them found on CPU.

Models are built and saved with tests/tiny_models.py's own make_model / save_folder (the same
weight spread, float32, the same mlx-lm folder layout and tokenizer).
"""

from __future__ import annotations

import contextlib
import copy
import json
from pathlib import Path
from unittest import mock

from tests import tiny_models

FIXTURE = Path(__file__).resolve().parent / "fixtures" / "mlx_lm_moe_configs.json"
_DATA = json.loads(FIXTURE.read_text())

# model_type -> {"config": config.json dict, "source": test and changes, "moe_layers": number of
# SwitchGLU/SwitchMLP modules, "expert_paths_example": the first one's path, "known_issues"?}
CONFIGS: dict[str, dict] = _DATA["configs"]
ARCH_TYPES: list[str] = sorted(CONFIGS)
VOCAB = tiny_models.VOCAB


_tiny_make_model = tiny_models.make_model  # tiny_models' own, called by _make below


def _fill_packed(model, seed: int) -> None:
    """prism_hadamard_qwen35 ships some modules pre-packed (2-bit codes, float16 scales, Hadamard
    signs). make_model spreads float weights only, so their codes stay 0 and greedy decoding
    cycles; give them random codes, scales and signs as mlx-lm's own test does
    (tests/test_models.py::TestModels::_prism_hadamard_packed)."""
    if not any(type(m).__name__ == "HadamardQuantizedLinear" for m in model.modules()):
        return
    import mlx.core as mx
    from mlx_lm.models.prism_hadamard_qwen35 import HadamardQuantizedLinear

    packed = [(p, m) for p, m in model.named_modules() if isinstance(m, HadamardQuantizedLinear)]
    keys = mx.random.split(mx.random.key(seed + 1), len(packed))
    new = []
    for (path, m), key in zip(packed, keys):
        rows, width = m.weight.shape[0], m.weight.shape[1] * 16
        k1, k2, k3 = mx.random.split(key, 3)
        codes = mx.random.randint(0, 4, (rows, width // 16, 16), key=k1).astype(mx.uint32)
        codes = (codes << (2 * mx.arange(16, dtype=mx.uint32))).sum(axis=-1).astype(mx.uint32)
        scales = mx.random.uniform(0.01, 0.05, (rows, width // 128), key=k2).astype(mx.float16)
        new += [(f"{path}.weight", codes), (f"{path}.scales", scales), (f"{path}.biases", -1.5 * scales)]
        if m.block:
            signs = mx.where(mx.random.bernoulli(0.5, (width,), key=k3), 1.0, -1.0)
            new.append((f"{path}.signs", signs))
    model.load_weights(new, strict=False)
    mx.eval(model.parameters())


def _make(key: str, seed: int = 0):
    model, config = _tiny_make_model(key, seed)
    _fill_packed(model, seed)
    return model, config


@contextlib.contextmanager
def _registered(model_type: str):
    """tiny_models' functions with `model_type`'s config registered under a key of its own, and
    its make_model followed by _fill_packed; both undone afterwards (not thread-safe)."""
    if model_type not in CONFIGS:
        raise KeyError(f"no zoo config for model type {model_type!r}")
    key = f"arch_zoo/{model_type}"
    config = copy.deepcopy(CONFIGS[model_type]["config"])
    with mock.patch.dict(tiny_models.CONFIGS, {key: config}), mock.patch.object(tiny_models, "make_model", _make):
        yield key


def make_model(model_type: str, seed: int = 0):
    """(float32 mlx-lm model with spread random weights, its config dict)."""
    with _registered(model_type) as key:
        return tiny_models.make_model(key, seed)


def save_folder(folder: Path, model_type: str, bits: int | None = None, group_size: int = 64, seed: int = 0) -> Path:
    """An mlx-lm folder (config.json, model.safetensors, the 320-id tiny tokenizer) of a tiny
    random `model_type` model, quantized to `bits` at `group_size` when bits is given."""
    with _registered(model_type) as key:
        return tiny_models.save_folder(Path(folder), key, bits=bits, group_size=group_size, seed=seed, tokenizer=True)


# 2-bit too for a few: the most used families and both kinds of block.
TWO_BIT = ("gpt_oss", "llama4", "gemma4_text", "nemotron_h", "qwen3_5_moe", "deepseek_v3")
# Tested in float32 only: its checkpoints are Hadamard 2-bit packs of its own (which the tiny
# model has too), and mlx-lm refuses any other quantization of it (see its known_issues).
FLOAT_ONLY = ("prism_hadamard_qwen35",)
# Its mlx-lm forward calls Metal kernels unconditionally: on CPU the blocks are checked one by one.
METAL_FORWARD = ("muse_spark",)
# Tied embeddings with the tiny weight spread: greedy decoding repeats one token (known_issues);
# their decode is checked on forced tokens instead.
COLLAPSING_GREEDY = tuple(t for t, c in CONFIGS.items() if "greedy decoding collapses" in c.get("known_issues", ""))
# The (model type, bits) cases tests/test_arch_zoo.py runs and docs/models.md's table lists.
CASES = (
    [(t, None) for t in ARCH_TYPES] + [(t, 4) for t in ARCH_TYPES if t not in FLOAT_ONLY] + [(t, 2) for t in TWO_BIT]
)

MODES = "converted, direct"  # each with every expert cached, --expert-cache 0, a budget < one layer
README_START = "<!-- architecture table: generated by python -m tests.arch_zoo --readme -->"
README_END = "<!-- end of architecture table -->"
TABLE_DOC = Path(__file__).resolve().parents[1] / "docs" / "models.md"  # where the table lives, between the markers


def coverage_table(cases) -> str:
    """docs/models.md's table of what tests/test_arch_zoo.py proves, from its cases and the blocks each
    model type builds (its class, activation, and whether the CPU kernels compute it)."""
    from flashmoe.engine.experts.blocks import cpu_kernels_reason, expert_blocks, kind

    bits: dict[str, list[str]] = {}
    for t, b in cases:
        bits.setdefault(t, []).append("float32" if b is None else f"{b}-bit")
    lines = [
        README_START,
        "",
        "| model type | expert blocks | path of the first | modes | bits | CPU kernels | compared |",
        "|---|---|---|---|---|---|---|",
    ]
    for t in sorted(bits, key=str.lower):
        model, _ = make_model(t)
        blocks = expert_blocks(model)
        path, first = next(iter(blocks.items()))
        why = cpu_kernels_reason(first, quantized=True)
        kinds = sorted({kind(b) for b in blocks.values()})
        lines.append(
            f"| {t} | {len(blocks)} x {', '.join(kinds)} | `{path}` | {MODES} | {', '.join(bits[t])} | "
            f"{'yes' if why is None else 'no: ' + why} | "
            f"{'each block (forward needs Metal)' if t in METAL_FORWARD else 'logits, greedy tokens'} |"
        )
    return "\n".join(lines + ["", README_END])


def _write_readme() -> None:
    """Rewrite the table between the markers in docs/models.md (it lived in README.md once, hence
    the flag's name, kept so the command in the marker still works)."""
    doc = TABLE_DOC
    text = doc.read_text(encoding="utf-8")
    start, end = text.index(README_START), text.index(README_END) + len(README_END)
    tmp = doc.with_name(doc.name + ".tmp")
    tmp.write_text(text[:start] + coverage_table(CASES) + text[end:], encoding="utf-8")
    tmp.replace(doc)


if __name__ == "__main__":
    import sys

    if sys.argv[1:] != ["--readme"]:
        sys.exit("usage: python -m tests.arch_zoo --readme   (rewrites docs/models.md's architecture table)")
    _write_readme()
