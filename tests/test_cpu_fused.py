"""The fused CPU decode blocks (engine/cpu/fused.py) and their small kernels (cpu_attn.py): equal
to MLX's ops within float32 rounding, installed only where the probe passes, and exact over a
long decode that grows the KV cache and after the cache is trimmed."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

import numba  # noqa: E402,F401 - required: a missing one fails here, never skips

from flashmoe.engine.cpu.fused import CpuAttention, CpuMLP, CpuMoE, RopeTable  # noqa: E402
from flashmoe.engine.cpu import attn as cpu_attn  # noqa: E402
from flashmoe.engine.runtime.loader import load  # noqa: E402
from tests.helpers.streaming import PROMPT, greedy  # noqa: E402

RNG = np.random.default_rng(3)


def rand(*shape) -> np.ndarray:
    return RNG.standard_normal(shape).astype(np.float32)


def close(got, want, tol=1e-5) -> bool:
    got, want = np.asarray(got), np.asarray(want)
    return got.shape == want.shape and np.abs(got - want).max() <= tol * max(1.0, np.abs(want).max())


@pytest.mark.parametrize(
    "H,Hk,T", [(4, 4, 1), (8, 2, 37), (6, 3, 300), (32, 4, 5), (32, 4, 1100), (9, 3, 600), (9, 3, 4 * 256 + 3)]
)
def test_attend_matches_mlx_sdpa(H, Hk, T):
    """Short caches: scores, softmax, the weighted sum of V's rows; from ATTEND_BLOCKS_FROM positions, blocks of
    positions on every core joined flash-decoding's way (one peaked score among them)."""
    D = 64
    q, K, V = rand(H, D), rand(Hk, T + 7, D), rand(Hk, T + 7, D)  # capacity beyond T is ignored
    K[0, T // 3] *= 20
    assert (T >= cpu_attn.ATTEND_BLOCKS_FROM) == (T in (1100, 600, 4 * 256 + 3))
    got = cpu_attn.attend(q, K, V, T, np.float32(D**-0.5))
    want = mx.fast.scaled_dot_product_attention(
        mx.array(q)[None, :, None], mx.array(K[:, :T])[None], mx.array(V[:, :T])[None], scale=D**-0.5
    )
    assert close(got, np.array(want)[0, :, 0])


@pytest.mark.parametrize("norms", ["none", "per head", "all heads"])
def test_decode_qs_is_the_separate_steps_bit_for_bit(norms):
    """decode_qs (one numba call from the fused q/k/v row to the scaled queries) then attend_qs
    do what the separate steps did: norms, rope, the cache write, q * scale, attention. Bit for
    bit, since the probe at load and the exactness tests were set against those."""
    H, Hk, hd, pos = 8, 2, 32, 9
    row = rand(H * hd + 2 * Hk * hd + 16)  # a stacked projection's row: q | k | v (| padding)
    q0, k0, v0 = 0, H * hd, H * hd + Hk * hd
    K, V = rand(Hk, 16, hd), rand(Hk, 16, hd)
    a, b, partner = rand(hd), rand(hd), np.roll(np.arange(hd), hd // 2).astype(np.int64)
    none = (np.zeros(0, np.float32), np.float32(0), False)
    qn = {
        "none": none,
        "per head": (rand(hd), np.float32(1e-6), True),
        "all heads": (rand(H * hd), np.float32(1e-5), False),
    }[norms]
    kn = {
        "none": none,
        "per head": (rand(hd), np.float32(1e-6), True),
        "all heads": (rand(Hk * hd), np.float32(1e-5), False),
    }[norms]
    K2, V2 = K.copy(), V.copy()
    qs = cpu_attn.decode_qs(row, q0, k0, v0, H, Hk, hd, *qn, *kn, a, b, partner, K2, V2, pos, np.float32(0.125))
    got = cpu_attn.attend_qs(qs, K2, V2, pos + 1)
    q, k = row[q0:k0].copy().reshape(H, hd), row[k0:v0].copy().reshape(Hk, hd)
    for t, (w, eps, per_head) in ((q, qn), (k, kn)):
        if w.size:
            cpu_attn.rms_norm_rows(t if per_head else t.reshape(1, -1), w, eps)
    cpu_attn.rope_rows(q, a, b, partner)
    cpu_attn.rope_rows(k, a, b, partner)
    K[:, pos], V[:, pos] = k, row[v0 : v0 + Hk * hd].reshape(Hk, hd)
    assert np.array_equal(K2, K) and np.array_equal(V2, V)
    assert np.array_equal(got, cpu_attn.attend(q, K, V, pos + 1, np.float32(0.125)))


def test_rms_norm_and_silu_match_mlx():
    x, w, u = rand(3, 48), rand(48), rand(3, 48)
    got = x.copy()
    cpu_attn.rms_norm_rows(got, w, np.float32(1e-6))
    assert close(got, np.array(mx.fast.rms_norm(mx.array(x), mx.array(w), 1e-6)))
    g = rand(3, 48)
    assert close(cpu_attn.silu_mul(g[:, ::1], u), np.array(nn.silu(mx.array(g)) * mx.array(u)))
    gu = rand(2, 96)  # strided halves of one matrix, as the fused gate/up call returns them
    assert close(
        cpu_attn.silu_mul(gu[:, :48], gu[:, 48:]), np.array(nn.silu(mx.array(gu[:, :48])) * mx.array(gu[:, 48:]))
    )
    # a prefill's rows run on every core: each is what it gives alone; large |g| saturates
    many = rand(cpu_attn.SILU_ROWS_PARALLEL + 3, 48) * np.float32(30)
    u2 = rand(*many.shape)
    got = cpu_attn.silu_mul(many, u2)
    assert np.array_equal(
        got, np.concatenate([cpu_attn.silu_mul(many[i : i + 1], u2[i : i + 1]) for i in range(len(many))])
    )
    assert close(got, np.array(nn.silu(mx.array(many)) * mx.array(u2)))


def _ropes():
    from mlx_lm.models.rope_utils import initialize_rope

    yield "default", nn.RoPE(32, traditional=False, base=10000.0)
    yield "traditional", nn.RoPE(32, traditional=True, base=10000.0)
    yield "partial", nn.RoPE(16, traditional=False, base=1e6)  # glm4: rotary on part of the head
    yield "linear", initialize_rope(32, 10000.0, False, {"type": "linear", "factor": 2.0}, 64)
    yield (
        "llama3",
        initialize_rope(
            32,
            500000.0,
            False,
            {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 16,
            },
            64,
        ),
    )
    yield "dynamic", initialize_rope(32, 10000.0, False, {"type": "dynamic", "factor": 2.0}, 16)
    yield (
        "yarn",
        initialize_rope(
            32, 10000.0, False, {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}, 64
        ),
    )


@pytest.mark.parametrize("name,rope", list(_ropes()), ids=[n for n, _ in _ropes()])
def test_rope_table_matches_the_module_at_every_position(name, rope):
    table = RopeTable(rope, 32)
    x = rand(3, 32)
    for pos in list(range(0, 70)) + [500, 4097, 3]:  # grows the table, then reads back an old row
        a, b = table.row(pos)
        got = x.copy()
        cpu_attn.rope_rows(got, a, b, table.partner)
        want = np.array(rope(mx.array(x)[None, :, None, :], offset=pos))[0, :, 0, :]
        assert close(got, want, 1e-6), (name, pos)


def _longrope():
    from mlx_lm.models.rope_utils import initialize_rope

    return initialize_rope(
        32,
        10000.0,
        False,
        {
            "type": "longrope",
            "long_factor": [1.5] * 16,
            "short_factor": [1.0] * 16,
            "original_max_position_embeddings": 100,
        },
        4096,
    )


@pytest.mark.parametrize(
    "name,rope", list(_ropes()) + [("longrope", _longrope())], ids=[n for n, _ in _ropes()] + ["longrope"]
)
def test_rope_table_rows_in_batches_are_the_one_position_calls_bit_for_bit(name, rope, monkeypatch):
    """Rows come 64 positions per MLX call (one-token sequences at an array of offsets) where that
    gives the one-position calls' rows exactly; a rope that takes no array of offsets (dynamic
    NTK) is computed one position at a time."""
    monkeypatch.setattr(RopeTable, "AHEAD", 1)
    one = RopeTable(rope, 32)  # the reference: one position per call, always
    one.AHEAD = 1
    monkeypatch.setattr(RopeTable, "AHEAD", 64)
    table = RopeTable(rope, 32)
    calls = []
    rows = RopeTable._rows
    monkeypatch.setattr(
        RopeTable, "_rows", lambda self, pos, n: (self is table and calls.append(n)) or rows(self, pos, n)
    )
    for pos in range(1, 400):
        assert all(np.array_equal(x, y) for x, y in zip(table.row(pos), one.row(pos))), (name, pos)
    if name != "dynamic":
        assert len(calls) < 400 // 8  # a batch and 3 checks per 64 positions


def test_rope_table_refuses_what_is_not_a_pairwise_rotation():
    class Mixing(nn.Module):
        def __call__(self, x, offset=0):
            return x + (offset + 1) * x.sum(axis=-1, keepdims=True)

    with pytest.raises(ValueError, match="pairs"):
        RopeTable(Mixing(), 8)


def _counts(lm) -> tuple[int, int, int]:
    modules = [m for _, m in lm.model.named_modules()]
    kinds = [type(m).__name__ for m in modules]
    # a shared expert's CpuMLP sits inside its SharedAhead, or inside the fused block it belongs to
    in_moe = sum(isinstance(m._orig.module[m._shared], CpuMLP) for m in modules if isinstance(m, CpuMoE) and m._shared)
    return (
        kinds.count("CpuAttention"),
        kinds.count("CpuMLP") + kinds.count("SharedAhead") + in_moe,
        kinds.count("CpuMoE"),
    )


@pytest.mark.parametrize(
    "arch,attention,mlp,moe",
    [
        ("qwen3_moe", True, False, True),
        ("mixtral", True, False, True),
        ("olmoe", True, False, True),
        ("glm4_moe", True, True, False),
        ("deepseek_v3", False, True, False),
        ("qwen3_next", False, True, True),
    ],
)
def test_blocks_are_replaced_only_where_the_probe_passes(model_factory, arch, attention, mlp, moe):
    """deepseek_v3 (latent attention) has no q/k/v projections; qwen3_next's gated attention has
    them but computes something else: the probe refuses it and the original module stays. MoE
    blocks with grouped / sigmoid routing (glm4_moe, deepseek_v3) keep mlx-lm's block (their
    shared experts run fused beside it); qwen3_next's softmax block with a gated shared expert is
    fused whole."""
    lm = load(model_factory(arch, 4, converted=True), kernels="cpu", load_tokenizer=False)
    n_attn, n_mlp, n_moe = _counts(lm)
    assert (n_attn > 0) == attention and n_attn == lm.fused["attention"]
    assert (n_mlp > 0) == mlp and n_mlp == lm.fused["mlp"]
    assert (n_moe > 0) == moe and n_moe == lm.fused["moe"] and lm.fused["moe_tried"] > 0
    if arch == "qwen3_next":
        assert lm.fused["attention_tried"] > 0
    if attention:
        attn = next(m for _, m in lm.model.named_modules() if isinstance(m, CpuAttention))
        assert attn.q_proj is attn._orig.module.q_proj  # the original's parts stay reachable


def test_long_decode_grows_the_cache_and_matches_mlx(model_factory):
    """300 tokens: the KV cache (256-token steps) grows on the MLX path in the middle of the
    fused decode, and the tokens stay those of MLX's kernels."""
    path = model_factory("qwen3_moe", 8, converted=True)
    want = greedy(load(path, kernels="mlx", load_tokenizer=False).model, PROMPT, 300)
    cpu = load(path, kernels="cpu", load_tokenizer=False)
    assert cpu.fused["attention"] > 0
    assert greedy(cpu.model, PROMPT, 300) == want


def test_trimmed_cache_continues_exactly(model_factory):
    """A conversation's next turn trims the cache back to the shared prefix: the fused decode
    writes into the same buffers, so the trimmed cache must give what a fresh prefill gives."""
    from mlx_lm.models.cache import make_prompt_cache, trim_prompt_cache

    lm = load(model_factory("mixtral", 4, converted=True), kernels="cpu", load_tokenizer=False)
    model = lm.model
    cache = make_prompt_cache(model)
    model(mx.array([PROMPT]), cache=cache)
    for tok in (5, 6, 7, 8):
        model(mx.array([[tok]]), cache=cache)
    trim_prompt_cache(cache, 3)
    got = model(mx.array([[9]]), cache=cache)[0, -1]
    fresh = make_prompt_cache(model)
    model(mx.array([PROMPT + [5]]), cache=fresh)
    want = model(mx.array([[9]]), cache=fresh)[0, -1]
    assert close(np.array(got), np.array(want), 1e-4)


def test_fused_mlp_keeps_prefill_rows_apart(model_factory):
    lm = load(model_factory("glm4_moe", 4, converted=True), kernels="cpu", load_tokenizer=False)
    mlp = next(m for _, m in lm.model.named_modules() if isinstance(m, CpuMLP))
    x = mx.array(rand(2, 5, mlp._orig.module.gate_proj.in_features))
    assert close(np.array(mlp(x)), np.array(mlp._orig.module(x)), 1e-5)


@pytest.mark.parametrize("routing", ["topk_softmax", "softmax_topk_norm", "softmax_topk"])
def test_probe_tells_the_routings_apart(model_factory, routing):
    """A block whose routing is one of the three is recognised by what it computes (the probe's
    fixed expert outputs make wrong weights or a wrong expert order visible). Renormalised top-k
    probabilities are the softmax of the top-k logits, so that block may match either name."""
    from flashmoe.engine.cpu.fused import _probe_moe, route

    lm = load(model_factory("qwen3_moe", 4, converted=True), kernels="cpu", load_tokenizer=False)
    block = lm.model.model.layers[0].mlp._orig.module
    gate, k = block.gate, block.top_k

    class Block(nn.Module):  # the same parts, routed the way under test
        def __init__(self):
            super().__init__()
            self.gate, self.switch_mlp, self.top_k = gate, block.switch_mlp, k

        def __call__(self, x):
            from flashmoe.engine.cpu.fused import _linear_np

            x2 = np.array(x).reshape(-1, x.shape[-1])
            ids, scores = route(_linear_np(gate, x2), k, routing)
            y = self.switch_mlp(x, mx.array(ids.reshape(*x.shape[:-1], k)))
            return (y * mx.array(scores.astype(np.float32)).reshape(*x.shape[:-1], k)[..., None]).sum(axis=-2)

    same = {
        "topk_softmax": {"topk_softmax"},
        "softmax_topk_norm": {"topk_softmax", "softmax_topk_norm"},
        "softmax_topk": {"softmax_topk"},
    }
    assert _probe_moe(Block()) in same[routing]


@pytest.mark.parametrize(
    "arch,layers",
    [
        ("qwen3_moe", "all"),
        ("mixtral", "all"),
        ("glm4_moe", "dense only"),
        ("deepseek_v3", "none"),
        ("qwen3_next", "none"),
    ],
)
def test_decoder_layers_fuse_where_both_blocks_did(model_factory, arch, layers):
    from flashmoe.engine.cpu.fused import CpuDecoderLayer

    lm = load(model_factory(arch, 4, converted=True), kernels="cpu", load_tokenizer=False)
    fused = [isinstance(l, CpuDecoderLayer) for l in lm.model.layers]
    if layers == "dense only":  # glm4_moe: the first layer is dense, the MoE blocks stay mlx-lm's
        want = [not hasattr(l.mlp, "switch_mlp") for l in lm.model.layers]
        assert want[0] and not all(want)
    else:
        want = [layers == "all"] * len(fused)
    assert fused == want and lm.fused.get("layer", 0) == sum(fused)


def test_layer_timing_still_splits_fused_layers(model_factory):
    """--timing layer wraps the attention inside a fused layer: it is then called through MLX
    and timed, and the tokens do not change."""
    from flashmoe.engine import GenerationFinished, LayerTimings, TokenGenerated
    from flashmoe.engine.runtime.engine import Engine
    from flashmoe.engine.runtime.generate import GenerationRequest

    eng = Engine(model_factory("qwen3_moe", 4, converted=True), kernels="auto")
    eng.wait_loaded()
    assert eng.loaded.kernels == "cpu" and eng.loaded.fused["layer"] == eng.loaded.num_layers
    chat = [{"role": "user", "content": "Bonjour"}]
    runs = {}
    for mode in ("off", "layer", "off"):
        toks, rows = [], []
        for ev in eng.submit(GenerationRequest(messages=chat, max_tokens=6, timing=mode)):
            if isinstance(ev, TokenGenerated):
                toks.append(ev.id)
            elif isinstance(ev, LayerTimings):
                rows.append(ev.rows)
            elif isinstance(ev, GenerationFinished):
                runs.setdefault(mode, []).append(toks)
        if mode == "layer":
            assert rows and all(r.attn_ms > 0 and r.route_ms > 0 for r in rows[-1])
    assert runs["layer"][0] == runs["off"][0] == runs["off"][1]
    eng.close()


@pytest.mark.parametrize("arch", ["deepseek_v3", "glm4_moe"])
def test_shared_expert_runs_while_the_experts_load(model_factory, arch):
    """With cache 0 every routed expert is read on every step; the shared expert is computed
    while those reads are in flight and handed to the block, once per MoE block and forward pass,
    and the tokens stay those of MLX's kernels."""
    from flashmoe.engine.cpu.fused import SharedAhead

    path = model_factory(arch, 4, converted=True)
    want = greedy(load(path, kernels="mlx", load_tokenizer=False).model, PROMPT, 8)
    lm = load(path, kernels="cpu", expert_cache=0, load_tokenizer=False)
    shared = [m for _, m in lm.model.named_modules() if isinstance(m, SharedAhead)]
    assert shared and len(shared) == lm.fused["shared_ahead"] == len(lm.layers)
    assert greedy(lm.model, PROMPT, 8) == want
    assert [m.used for m in shared] == [1 + 8] * len(shared)  # the prefill and every decode step


def test_compute_paths_name_what_load_chose(model_factory):
    """`flashmoe info --load` reads the compute path back from the loaded modules: with the CPU
    kernels every block of this model passes its probe and is fused; with MLX's none is."""
    from flashmoe.engine.runtime.compute_paths import compute_paths
    from flashmoe.engine.runtime.loader import load

    folder = model_factory("qwen3_moe", 4, converted=True)
    cpu = load(folder, kernels="cpu", expert_cache=0, load_tokenizer=False)
    n = cpu.num_layers
    assert compute_paths(cpu) == {
        "one-token steps on numpy from embedding to final norm (one sync per token)": list(range(n)),
        "decoder layer fused whole (one sync per layer)": list(range(n)),
        "decode steps one kernel call a layer while its experts are cached": list(range(n)),
        "attention as one fused CPU block": list(range(n)),
        "MoE as one fused CPU block": list(range(n)),
        "prompt chunks' attention on numpy's BLAS": list(range(n)),
        "streamed experts on the CPU kernels, repacked into tiles as they land": list(range(n)),
    }
    cpu.close()
    int8 = load(folder, kernels="cpu-int8", expert_cache=0, load_tokenizer=False)
    from flashmoe.engine.cpu.int8 import x_name

    assert compute_paths(int8)[
        f"streamed experts on the CPU kernels, repacked into tiles as they land, on {x_name()} (approximate)"
    ] == list(range(n))
    int8.close()
    three = load(model_factory("qwen3_moe", 3, converted=True), kernels="cpu", expert_cache=0, load_tokenizer=False)
    paths = compute_paths(three)  # (3-bit experts: not in tiles, so no one-call layer)
    assert paths["streamed experts on the CPU kernels (in the layout read)"] == list(range(n))
    assert not any(p.startswith("decode steps one kernel call") for p in paths)
    three.close()
    mlx = load(folder, kernels="mlx", expert_cache=0, load_tokenizer=False)
    assert compute_paths(mlx) == {
        "attention and other matmuls on MLX": list(range(n)),
        "streamed experts on MLX": list(range(n)),
    }
    mlx.close()


def test_info_load_prints_the_compute_paths(model_factory):
    import json

    from tests.helpers.cli import run_cli

    folder = model_factory("qwen3_moe", 4, converted=True)
    r = run_cli("info", folder, "--load", "--json")
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)["compute_at_load"]
    assert d["kernels"] == "cpu" and "MoE as one fused CPU block" in d["blocks"]
    r = run_cli("info", folder, "--load", "--kernels", "mlx")
    assert r.returncode == 0 and "as loaded (mlx kernels): attention and other matmuls on MLX" in r.stdout
    r = run_cli("info", folder, "--kernels", "mlx")
    assert (
        r.returncode == 2
        and r.stderr.strip() == "flashmoe: error: --kernels is for --load (the kernels to load the model with)"
    )


def test_fused_block_computes_its_shared_expert_while_the_experts_load(model_factory):
    """qwen3_next's block (softmax routing, a shared expert behind a sigmoid gate) is fused whole:
    with cache 0 every step reads its experts, and once per block and forward pass the shared
    expert is computed inside the store's fetch, while those reads are in flight; the tokens stay
    those of MLX's kernels."""
    from flashmoe.engine.cpu.fused import CpuMoE

    path = model_factory("qwen3_next", 4, converted=True)
    want = greedy(load(path, kernels="mlx", load_tokenizer=False).model, PROMPT, 8)
    lm = load(path, kernels="cpu", expert_cache=0, load_tokenizer=False)
    blocks = [m for _, m in lm.model.named_modules() if isinstance(m, CpuMoE)]
    assert blocks and all(b._shared == "shared_expert" and b._shared_gate is not None for b in blocks)
    fetches, store_fetch = [], lm.store.fetch

    def fetch(layer, experts, ready=None, during=None):
        inside = []
        if during is not None:
            original = during
            during = lambda: (inside.append(True), original())  # noqa: E731
        lut = store_fetch(layer, experts, ready=ready, during=during)
        fetches.append(bool(inside))
        return lut

    lm.store.fetch = fetch
    assert greedy(lm.model, PROMPT, 8) == want
    assert sum(fetches) == 9 * len(blocks)  # once per block and forward pass (a prefill's later groups have none)
    assert lm.store.stats[lm.layers[0].layer].misses > 0


def test_whole_decode_step_runs_on_numpy_and_gives_mlx_tokens(model_factory, monkeypatch):
    """Every layer fused: the inner model is wrapped, one-token steps go embedding -> layers ->
    norm on numpy (the per-layer MLX round trip not taken), prompt chunks through the original,
    and the tokens are those of MLX's kernels."""
    from flashmoe.engine.cpu import decode_step

    path = model_factory("qwen3_moe", 4, converted=True)
    want = greedy(load(path, kernels="mlx", load_tokenizer=False).model, PROMPT, 12)
    lm = load(path, kernels="cpu", load_tokenizer=False)
    assert lm.fused["model_step"] == 1 and isinstance(lm.model.model, decode_step.CpuModelStep)
    steps, original = [], decode_step.CpuModelStep.fast
    monkeypatch.setattr(decode_step.CpuModelStep, "fast", lambda *a: steps.append(original(*a)) or steps[-1])
    assert greedy(lm.model, PROMPT, 12) == want
    assert steps == [False] + [True] * 12  # the prompt, then every decode step


def test_whole_decode_step_is_refused_where_the_probe_disagrees(model_factory, monkeypatch):
    """A model whose inner module does more than embed -> layers -> norm keeps its own: here the
    probe is shown an embedding scaled behind its back."""
    from flashmoe.engine.cpu import decode_step

    original = decode_step._embedding
    monkeypatch.setattr(decode_step, "_embedding", lambda e: lambda ids, f=original(e): f(ids) * 2)  # noqa: B008 (made once, at patch time)
    lm = load(model_factory("qwen3_moe", 4, converted=True), kernels="cpu", load_tokenizer=False)
    assert lm.fused["model_step"] == 0 and not isinstance(lm.model.model, decode_step.CpuModelStep)
    assert lm.fused["layer"] == lm.num_layers


def test_softmax_rows_and_its_exp_against_float64():
    """softmax_rows (one numba call, with the vectorisable Cephes exp) against float64 softmax:
    within 4e-7 of each row's largest probability (a few float32 steps; numpy's own softmax is
    within 2e-7), short rows and long, with scores far below the maximum underflowing to 0."""
    rng = np.random.default_rng(3)
    for R, T in ((9, 1), (9, 40), (3, 1000), (2, 4099)):
        s = (rng.standard_normal((R, T)) * 8).astype(np.float32)
        s[0, 0] = -1e4 if T > 1 else s[0, 0]  # exp underflows (where it is not the row's only score)
        want = np.exp(s.astype(np.float64) - s.max(axis=-1, keepdims=True))
        want /= want.sum(axis=-1, keepdims=True)
        got = s.copy()
        cpu_attn.softmax_rows(got)
        assert np.abs(got - want).max() <= 4e-7 * want.max() and (T == 1 or got[0, 0] == 0.0)
        assert np.allclose(got.sum(axis=-1), 1.0, atol=1e-6)


def _prefilled(lm, n=5):
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(lm.model)
    mx.eval(lm.model(mx.array([list(range(1, n + 1))]), cache=cache))
    return cache


def _copy(c):
    from mlx_lm.models.cache import KVCache

    d = KVCache()
    d.keys, d.values, d.offset = mx.array(np.array(c.keys)), mx.array(np.array(c.values)), c.offset
    return d


@pytest.mark.parametrize(
    "arch,bias,int8",
    [
        ("qwen3_moe", False, False),
        ("olmoe", False, False),
        ("mixtral", False, False),
        ("mixtral", True, False),
        ("qwen3_moe", False, True),
    ],
)
def test_attention_block_in_one_call_is_decode_np_bit_for_bit(model_factory, arch, bias, int8):
    """CpuAttention.block_np (norm, q/k/v, norms, rope, cache write, attention, o, residual and
    the next norm in one kernel call) gives decode_np's floats between the layer's two norms, and
    writes the same cache row: per-head q/k norms (qwen3_moe), norms over all heads (olmoe), none
    (mixtral), with biases on q/k/v and o added here, on float and int8 kernels."""
    from flashmoe.engine.cpu.attn import rms_norm_rows
    from flashmoe.engine.cpu.fused import CpuDecoderLayer
    from flashmoe.engine.cpu.int8 import use_int8

    lm = load(model_factory(arch, 8, converted=True), kernels="cpu", load_tokenizer=False)
    if int8:
        assert use_int8(lm.model) > 0
    layers = [m for _, m in lm.model.named_modules() if isinstance(m, CpuDecoderLayer)]
    assert layers
    cache = _prefilled(lm)
    for layer, c in zip(layers, cache):
        attn = layer["self_attn"]
        if bias:  # (the tiny models have none: give q/k/v and o one, as Qwen2's and GPT-OSS's)
            attn._qkv.bias = rand(attn._qkv.tiled.n)
            attn._o._bias = rand(attn._o.out_features)
            attn._block = None
        x2 = rand(1, attn._o.out_features)
        a, b = _copy(c), _copy(c)
        got = attn.block_np(x2, a, layer._norms)
        (w1, e1), (w2, e2) = layer._norms
        n1 = x2.copy()
        rms_norm_rows(n1, w1, e1)
        h = x2 + attn.decode_np(n1, b)
        n2 = h.copy()
        rms_norm_rows(n2, w2, e2)
        assert got is not None and np.array_equal(got[0], h) and np.array_equal(got[1], n2)
        assert a.offset == b.offset == c.offset + 1
        assert np.array_equal(np.array(a.keys), np.array(b.keys)) and np.array_equal(
            np.array(a.values), np.array(b.values)
        )


@pytest.mark.parametrize(
    "arch,bits,int8",
    [
        ("qwen3_moe", 4, False),
        ("mixtral", 8, False),
        ("qwen3_moe", 4, True),
        ("qwen2_moe", 8, False),
        ("qwen2_moe", 4, True),
    ],
)
def test_layer_in_one_call_is_the_block_calls_bit_for_bit(model_factory, monkeypatch, arch, bits, int8):
    """A MoE layer's decode step in one call (layer_step.moe_kernel: attention block, router, routing,
    experts; shared_moe_kernel with Qwen2-MoE's gated shared expert, the shipped demo's block)
    gives the separate calls' floats and cache rows; where an expert chosen is not in the slot it
    was last found in, the call stops after the routing and CpuMoE.routed gives the same floats
    again. Its books: the hits, and routing and expert seconds that are real (the router at 8
    bits beside 4-bit layers, as mlx-lm quantizes it; float and int8 kernels)."""
    from flashmoe.engine.cpu.fused import CpuDecoderLayer
    from flashmoe.engine.cpu.int8 import use_int8
    from flashmoe.engine.experts.switch import StreamingSwitchGLU

    lm = load(model_factory(arch, bits, converted=True), kernels="cpu", expert_cache=10**9, load_tokenizer=False)
    if int8:
        assert use_int8(lm.model) > 0
    for info in lm.layers:
        lm.store.fetch(info.layer, range(info.num_experts))
    layers = [m for _, m in lm.model.named_modules() if isinstance(m, CpuDecoderLayer)]
    cache = _prefilled(lm)
    fusable = StreamingSwitchGLU.fusable
    for layer, c in zip(layers, cache):
        attn, moe = layer["self_attn"], layer[layer._ffn]
        assert layer.one_call() == "moe"
        for spoil in (False, True):
            x2 = rand(1, attn._o.out_features)
            a, b = _copy(c), _copy(c)
            monkeypatch.setattr(StreamingSwitchGLU, "fusable", lambda self: False)
            want = layer.step_np(x2, a)  # (decode_cached: repacks the experts, learns their slots)
            monkeypatch.setattr(StreamingSwitchGLU, "fusable", fusable)
            if spoil:
                moe._switch._slot_of[:] = -1
            stats = lm.store.stats[moe._switch._layer]
            hits, route_s, compute_s = stats.hits, stats.route_s, stats.compute_s
            stopped = []
            monkeypatch.setattr(
                CpuMoE, "routed", lambda self, *args, f=CpuMoE.routed: stopped.append(1) or f(self, *args)
            )
            got = layer._one_call(attn, x2, b)
            monkeypatch.undo()
            assert got is not None and np.array_equal(got, want) and len(stopped) == int(spoil)
            assert np.array_equal(np.array(a.keys), np.array(b.keys)) and a.offset == b.offset == c.offset + 1
            assert stats.hits == hits + moe.k and 0 < stats.route_s - route_s < 0.1
            assert 0 < stats.compute_s - compute_s < 0.1


@pytest.mark.parametrize("bits,int8", [(4, False), (8, False), (4, True)])
def test_dense_layer_in_one_call_is_the_block_calls_bit_for_bit(model_factory, monkeypatch, bits, int8):
    """A dense layer's decode step in one call (layer_step.mlp_kernel: attention block, gate and
    up, SiLU, down, residual) gives the separate calls' floats and cache rows (glm4_moe's first
    layer: dense, q/k norms, partial rope), and greedy tokens stay MLX's."""
    from flashmoe.engine.cpu.fused import CpuDecoderLayer
    from flashmoe.engine.cpu.int8 import use_int8

    path = model_factory("glm4_moe", bits, converted=True)
    lm = load(path, kernels="cpu", load_tokenizer=False)
    if int8:
        assert use_int8(lm.model) > 0
    layers = [(i, m) for i, m in enumerate(lm.model.model.layers) if isinstance(m, CpuDecoderLayer)]
    assert [i for i, _ in layers] == [0] and layers[0][1].one_call() == "mlp"
    layer = layers[0][1]
    cache = _prefilled(lm)
    one_call = CpuDecoderLayer._one_call
    for _ in range(3):
        x2 = rand(1, layer["self_attn"]._o.out_features)
        a, b = _copy(cache[0]), _copy(cache[0])
        monkeypatch.setattr(CpuDecoderLayer, "_one_call", lambda *args: None)
        want = layer.step_np(x2, a)
        monkeypatch.setattr(CpuDecoderLayer, "_one_call", one_call)
        got = layer._one_call(layer["self_attn"], x2, b)
        assert got is not None and np.array_equal(got, want) and a.offset == b.offset == cache[0].offset + 1
        assert np.array_equal(np.array(a.keys), np.array(b.keys)) and np.array_equal(
            np.array(a.values), np.array(b.values)
        )
    if not int8:
        calls = []
        monkeypatch.setattr(CpuDecoderLayer, "_one_call", lambda *args: calls.append(one_call(*args)) or calls[-1])
        assert greedy(lm.model, PROMPT, 8) == greedy(load(path, kernels="mlx", load_tokenizer=False).model, PROMPT, 8)
        assert len(calls) >= 7 and all(c is not None for c in calls)


@pytest.mark.parametrize("policy", ["lru", "lfu"])
def test_note_hits_keeps_the_books_fetch_keeps(model_factory, policy):
    """The decode fast path's bookkeeping (store.note_hits) leaves a store as fetch of the same
    cached experts does: use counts, clock, LRU order, last-use times, hits and the trace; so the
    victims of the next miss are the same."""
    path = model_factory("qwen3_moe", 4, converted=True)
    a, b = (
        load(path, kernels="cpu", expert_cache=10**9, cache_policy=policy, load_tokenizer=False).store for _ in range(2)
    )
    rng = np.random.default_rng(3)
    for s in (a, b):
        s.trace = []
        for info in s.layers.values():
            s.fetch(info.layer, range(info.num_experts))
    for _ in range(30):
        layer = int(rng.choice(list(a.layers)))
        experts = [int(e) for e in rng.choice(a.layers[layer].num_experts, 2, replace=False)]
        lut = a.fetch(layer, experts)
        b.note_hits(layer, experts, lut[experts].astype(np.int64))
    assert a.trace == b.trace and a._tick == b._tick
    assert np.array_equal(a.freq, b.freq) and np.array_equal(a.asked, b.asked)
    for pa, pb in zip(a.pools, b.pools):
        assert list(pa.table.items()) == list(pb.table.items()) and np.array_equal(pa.used_at, pb.used_at)
    assert {l: s.hits for l, s in a.stats.items()} == {l: s.hits for l, s in b.stats.items()}
    layer = next(iter(a.layers))
    for s in (a, b):  # a miss now evicts the same slot in both
        s.pools[0].free.clear()
        s._take_slots(s.pool(layer), layer, {0}, 1)
    assert list(a.pools[0].table) == list(b.pools[0].table)


@pytest.mark.parametrize(
    "arch,fused",
    [("qwen3_moe", True), ("qwen3_moe", False), ("qwen2_moe", True)],
    ids=["layer in one call", "block by block", "with a gated shared expert"],
)
def test_decode_steps_take_one_call_per_layer_and_give_mlx_tokens(model_factory, monkeypatch, arch, fused):
    """With every expert cached ahead, a decode step is one kernel call per layer (_moe_layer:
    attention, router, routing, experts), and the tokens are MLX's. An expert's first step stops
    that call after the routing (it is not yet repacked) and goes on through decode_cached; the
    same steps again are one call each. Block by block (as with --prefetch), the attention
    block and the experts are one call each: decode_cached, then decode_slots. With the
    smallest expert cache (one token's experts) the steps that must read take the reading path
    and the tokens stay."""
    from flashmoe.engine.cpu.fused import CpuDecoderLayer
    from flashmoe.engine.experts.switch import StreamingSwitchGLU

    path = model_factory(arch, 4, converted=True)
    want = greedy(load(path, kernels="mlx", load_tokenizer=False).model, PROMPT, 10)
    calls = {"block": [], "experts": [], "slots": [], "layer": []}
    block, cached, slots = CpuAttention.block_np, StreamingSwitchGLU.decode_cached, StreamingSwitchGLU.decode_slots
    done = StreamingSwitchGLU.fused_done
    monkeypatch.setattr(CpuAttention, "block_np", lambda *a: calls["block"].append(block(*a)) or calls["block"][-1])
    monkeypatch.setattr(
        StreamingSwitchGLU, "decode_cached", lambda *a: calls["experts"].append(cached(*a)) or calls["experts"][-1]
    )
    monkeypatch.setattr(
        StreamingSwitchGLU, "decode_slots", lambda *a: calls["slots"].append(slots(*a)) or calls["slots"][-1]
    )
    monkeypatch.setattr(
        StreamingSwitchGLU,
        "fused_done",
        lambda self, ids, s, times, **kw: calls["layer"].append(s is not None) or done(self, ids, s, times, **kw),
    )
    if not fused:
        monkeypatch.setattr(StreamingSwitchGLU, "fusable", lambda self: False)
    for budget, hits in ((10**9, True), (0, False)):
        lm = load(path, kernels="cpu", expert_cache=budget, load_tokenizer=False)
        if hits:  # every expert in the cache before the first token
            for info in lm.layers:
                lm.store.fetch(info.layer, range(info.num_experts))
        for v in calls.values():
            v.clear()
        layers = sum(isinstance(m, CpuDecoderLayer) for _, m in lm.model.named_modules())
        assert greedy(lm.model, PROMPT, 10) == want
        if fused:
            assert not calls["block"] and not calls["slots"] and len(calls["layer"]) == 10 * layers
            computed = [r is not None for r in calls["experts"]]  # (the calls that stopped: cached or read?)
            assert calls["layer"].count(False) == len(calls["experts"])  # each stopped call went on there
        else:
            assert len(calls["block"]) == 10 * layers and all(r is not None for r in calls["block"])
            assert not calls["layer"]
            computed = [r is not None for r in calls["experts"] + calls["slots"]]
        assert all(computed) if hits else not all(computed)
        if hits:  # the same steps again: every expert is where the first run left it
            for v in calls.values():
                v.clear()
            assert greedy(lm.model, PROMPT, 10) == want
            assert not calls["experts"]
            assert (calls["layer"] == [True] * 10 * layers) if fused else (len(calls["slots"]) == 10 * layers)
