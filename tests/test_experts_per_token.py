"""--experts-per-token: a model routed to more or fewer experts than it was trained with is still
exactly mlx-lm's model with that setting, reads what K experts cost, and says K=N of TRAINED."""

from __future__ import annotations

import json

import mlx.core as mx
import pytest

from flashmoe.engine.runtime.loader import load
from tests.helpers.cli import run_cli
from tests.helpers.streaming import PROMPT, greedy


def resident_with_k(folder, k):
    from mlx_lm.utils import load_model

    model, _ = load_model(folder, model_config={"num_experts_per_tok": k})
    return model


@pytest.mark.parametrize("k", [1, 4, 8])  # fewer than trained (2), more, and every expert
def test_streamed_at_k_equals_resident_mlx_lm_at_k(model_factory, k):
    src = model_factory("qwen3_moe", 4)
    packed = model_factory("qwen3_moe", 4, converted=True)
    ref = resident_with_k(src, k)
    tokens = mx.array([PROMPT])
    want = ref(tokens)
    lm = load(packed, load_tokenizer=False, experts_per_token=k, expert_cache=0)
    assert lm.top_k == k and lm.trained_top_k == 2
    assert mx.abs(lm.model(tokens) - want).max().item() <= 1e-5
    assert greedy(lm.model, PROMPT, 32) == greedy(ref, PROMPT, 32)
    lm.close()
    if k != 2:  # and the setting really changes the model
        base = load(packed, load_tokenizer=False)
        assert mx.abs(base.model(tokens) - want).max().item() > 1e-3
        base.close()


def test_bytes_read_per_token_scale_with_k(model_factory):
    from flashmoe.engine.runtime.generate import GenerationRequest, Session, generate
    from flashmoe.engine.runtime.sampling import SamplingParams

    packed = model_factory("qwen3_moe", 4, converted=True)
    read = {}
    for k in (1, 4):
        lm = load(packed, experts_per_token=k, expert_cache=0)  # nothing cached: every expert is read
        done = list(
            generate(
                lm,
                Session(lm),
                GenerationRequest(prompt="hello there", max_tokens=12, sampling=SamplingParams(temperature=0.0)),
            )
        )[-1]
        per_expert = lm.layers[0].expert_bytes
        assert done.top_k == k
        # K experts per MoE layer per token, none cached; the budget holds the K the token needs
        assert done.bytes_per_token == pytest.approx(k * per_expert * len(lm.layers), rel=0.01)
        assert lm.store.capacity_bytes <= k * per_expert
        read[k] = done.bytes_per_token
        lm.close()
    assert read[4] == pytest.approx(4 * read[1], rel=0.01)


def test_the_summary_says_k_of_trained_and_bad_values_are_refused(model_factory):
    packed = model_factory("qwen3_moe", 4, converted=True)
    out = run_cli("run", "-m", packed, "--experts-per-token", "4", "--max-tokens", "3", "-n", "hi")
    assert out.returncode == 0, out.stderr
    assert "| K=4 of 2 |" in out.stderr
    out = run_cli("run", "-m", packed, "--experts-per-token", "9", "--max-tokens", "3", "-n", "hi")
    assert out.returncode != 0 and "--experts-per-token 9: this model has 8 experts per layer" in out.stderr
    assert "Traceback" not in out.stderr
    out = run_cli("run", "-m", packed, "--experts-per-token", "0", "-n", "hi")
    assert out.returncode == 2 and "--experts-per-token" in out.stderr
    out = run_cli("run", "-m", packed, "--json", "--experts-per-token", "4", "--max-tokens", "2", "-n", "hi")
    loaded = json.loads(out.stdout.splitlines()[0])
    assert loaded["top_k"] == 4 and loaded["trained_top_k"] == 2


def test_bench_speed_says_k_of_trained(model_factory):
    packed = model_factory("qwen3_moe", 4, converted=True)
    out = run_cli(
        "bench",
        "speed",
        "-m",
        packed,
        "--experts-per-token",
        "4",
        "--tokens",
        "3",
        "--prompt-tokens",
        "4",
        "--skip-disk",
        "--cold-only",
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    assert "K=4 of 2," in out.stdout
    out = run_cli("bench", "speed", "-m", packed, "--disk-cache", "1GB", "--skip-disk")
    assert out.returncode == 2 and "--disk-cache: bench speed" in out.stderr
