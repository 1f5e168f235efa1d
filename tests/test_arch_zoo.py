"""Every MoE architecture mlx-lm implements streams, token-exact against resident mlx-lm.

One case per model type whose experts run in mlx-lm's switch layers (53 in mlx-lm 0.32.2), built
from mlx-lm's own test configurations (tests/fixtures/mlx_lm_moe_configs.json says which test
each comes from and what was made smaller). For each, in float32 and 4-bit (2-bit for a few):
converted and direct, every expert cached, `--expert-cache 0`, and a budget under one layer.
The streamed model must give the resident model's logits (max |diff| <= 1e-5) and its greedy
tokens, with every expert block streamed (as many streamed layers as the model has blocks).

With --kernels cpu, the numba kernels compute the blocks they can (SwiGLU, affine quantized, no
biases) and MLX the rest; both must give the same greedy tokens as mlx-lm. The coverage table of
docs/models.md is rendered from these cases (tests/arch_zoo.py::coverage_table) and checked here.
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import pytest

from flashmoe.engine.formats.convert import convert
from flashmoe.engine.experts.blocks import cpu_kernels_reason, expert_blocks
from flashmoe.engine.runtime.loader import load
from mlx_lm.models.cache import make_prompt_cache

from tests.arch_zoo import (
    ARCH_TYPES,
    CASES,
    COLLAPSING_GREEDY,
    CONFIGS,
    FLOAT_ONLY,
    METAL_FORWARD,
    coverage_table,
    save_folder,
)
from tests.helpers.streaming import greedy, small_budget
from tests.tiny_models import reference_model

PROMPT = [3, 17, 250, 42, 9, 101, 77, 5, 64, 200, 13, 8]
FORCED = [5, 99, 250, 31, 7, 180, 64, 12]  # decode steps fed these tokens, whatever the model picks
STEPS = 12  # greedy tokens compared per variant
ROOT = Path(__file__).resolve().parents[1]

FULL = [c for c in CASES if c[0] not in METAL_FORWARD]


def forced_decode(model, prompt: list[int], forced: list[int]) -> mx.array:
    """The logits of each decode step (through the KV cache) when fed `forced`, stacked."""
    cache = make_prompt_cache(model)
    out = [model(mx.array([prompt]), cache=cache)[0, -1]]
    for tok in forced:
        out.append(model(mx.array([[tok]]), cache=cache)[0, -1])
    return mx.stack(out)


@pytest.fixture(scope="module")
def zoo(tmp_path_factory):
    """Each (type, bits) folder built once: the mlx-lm folder and its conversion."""
    base = tmp_path_factory.mktemp("zoo")
    built = {}

    def get(model_type: str, bits: int | None) -> tuple[Path, Path]:
        key = (model_type, bits)
        if key not in built:
            src = save_folder(base / f"{model_type}-{bits}", model_type, bits=bits)
            built[key] = (src, convert(src, base / f"{model_type}-{bits}-fm"))
        return built[key]

    return get


@pytest.mark.parametrize("model_type,bits", FULL, ids=[f"{t}-{b or 'f32'}" for t, b in FULL])
def test_streams_exactly(zoo, model_type, bits):
    src, packed = zoo(model_type, bits)
    ref = reference_model(src)
    blocks = len(expert_blocks(ref))
    assert blocks == CONFIGS[model_type]["moe_layers"] > 0
    tokens = mx.array([PROMPT])
    ref_logits = ref(tokens)
    ref_decode = forced_decode(ref, PROMPT, FORCED)
    ref_greedy = greedy(ref, PROMPT, STEPS)
    if model_type not in COLLAPSING_GREEDY:
        assert len(set(ref_greedy)) > 2, "degenerate reference: the test would prove little"

    probe = load(packed, load_tokenizer=False)
    variants = {
        "packed, all cached": (packed, None),
        "packed, cache 0": (packed, 0),
        "packed, budget < one layer": (packed, small_budget(probe)),
        "direct": (src, None),
        "direct, cache 0": (src, 0),
    }
    probe.close()
    for name, (path, budget) in variants.items():
        lm = load(path, expert_cache=budget, load_tokenizer=False)
        assert len(lm.layers) == blocks, f"{name}: {len(lm.layers)} of {blocks} expert blocks stream"
        assert lm.resident_experts is None
        diff = mx.abs(lm.model(tokens) - ref_logits).max().item()
        assert diff <= 1e-5, f"{name}: max |logit difference| {diff}"
        diff = mx.abs(forced_decode(lm.model, PROMPT, FORCED) - ref_decode).max().item()
        assert diff <= 1e-5, f"{name}: decode steps: max |logit difference| {diff}"
        assert greedy(lm.model, PROMPT, STEPS) == ref_greedy, name
        read = sum(s.bytes_read for s in lm.store.take_stats().values())
        if budget is not None:  # a small cache must really have read experts from disk
            assert read > 0, name
        lm.close()


@pytest.mark.parametrize(
    "model_type,bits",
    [c for c in CASES if c[0] in METAL_FORWARD],
    ids=[f"{t}-{b or 'f32'}" for t, b in CASES if t in METAL_FORWARD],
)
def test_streams_block_by_block(zoo, model_type, bits):
    """mlx-lm's forward of this type needs Metal: each streamed block must give the resident
    block's output on the same inputs and expert choices (converted and direct, cache 0)."""
    src, packed = zoo(model_type, bits)
    ref_blocks = expert_blocks(reference_model(src))
    assert len(ref_blocks) == CONFIGS[model_type]["moe_layers"] > 0
    for path in (packed, src):
        lm = load(path, expert_cache=0, load_tokenizer=False)
        assert len(lm.layers) == len(ref_blocks)
        streamed = dict(lm.model.named_modules())
        for i, (name, ref_block) in enumerate(ref_blocks.items()):
            num_experts = lm.layers[i].num_experts
            x = mx.random.normal((1, 5, _input_dim(ref_block)), key=mx.random.key(i))
            idx = mx.random.randint(0, num_experts, (1, 5, lm.top_k), key=mx.random.key(100 + i))
            diff = mx.abs(streamed[name](x, idx) - ref_block(x, idx)).max().item()
            assert diff <= 1e-5, (path, name, diff)
        assert sum(s.bytes_read for s in lm.store.take_stats().values()) > 0
        lm.close()


def _input_dim(block) -> int:
    proj = getattr(block, "gate_proj", None) or block.fc1
    return proj["weight"].shape[-1] * (32 // proj.bits if "scales" in proj else 1)


QUANTIZED = [(t, 4) for t in ARCH_TYPES if t not in FLOAT_ONLY + METAL_FORWARD]


@pytest.mark.parametrize("model_type,bits", QUANTIZED, ids=[f"{t}-{b}" for t, b in QUANTIZED])
def test_cpu_kernels_where_they_apply(zoo, model_type, bits):
    """--kernels cpu: the numba kernels take the blocks they can compute, MLX runs the rest, and
    the greedy tokens are mlx-lm's (logits within float32 rounding of another summation order)."""
    src, packed = zoo(model_type, bits)
    ref = reference_model(src)
    want = ref(mx.array([PROMPT]))
    want_tokens = greedy(ref, PROMPT, STEPS)
    reasons = {p: cpu_kernels_reason(b, quantized=True) for p, b in expert_blocks(ref).items()}
    lm = load(packed, kernels="cpu", expert_cache=0, load_tokenizer=False)
    for module in lm.layers:
        on_cpu = lm.switches[module.module]._cpu is not None
        assert on_cpu == (reasons[module.module] is None), (module.module, reasons[module.module])
    got = lm.model(mx.array([PROMPT]))
    rel = mx.abs(got - want).max().item() / max(1.0, mx.abs(want).max().item())
    assert rel <= 5e-4, rel  # measured: up to 3.0e-4 (deepseek_v41: clamped SwiGLU, MLA), most below 1e-5
    assert greedy(lm.model, PROMPT, STEPS) == want_tokens
    lm.close()


def test_readme_coverage_table_is_the_tested_one():
    """docs/models.md's table (README's once) is rendered from CASES (regenerate: python -m tests.arch_zoo --readme)."""
    doc = (ROOT / "docs" / "models.md").read_text(encoding="utf-8")
    table = coverage_table(CASES)
    assert table in doc, "docs/models.md's architecture table is stale: run python -m tests.arch_zoo --readme"
