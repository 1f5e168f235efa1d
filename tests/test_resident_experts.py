"""No silent resident fallback: a model that declares experts but has none that can stream fails
to load with one line (exit 3), unless --allow-resident-experts is given, and then every summary
says the experts are resident."""

from __future__ import annotations

import json
import sys
import types
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx_lm.models.base import BaseModelArgs
from mlx_lm.utils import save_config, save_model

from flashmoe.engine.formats.convert import convert
from flashmoe.engine.errors import ConvertError, ModelLoadError
from flashmoe.engine.experts.blocks import resident_expert_modules
from flashmoe.engine.runtime.loader import load
from tests.helpers.cli import run_cli
from tests.tiny_tokenizer import write_tiny_tokenizer

VOCAB = 320


@dataclass
class HandRolledArgs(BaseModelArgs):
    model_type: str
    vocab_size: int = VOCAB
    hidden_size: int = 64
    num_hidden_layers: int = 1
    num_experts: int = 8
    num_experts_per_tok: int = 2


class HandRolledMoE(nn.Module):
    """Experts as bare stacked parameters and gather_mm: no switch layer, so nothing to stream."""

    def __init__(self, a: HandRolledArgs):
        super().__init__()
        self.k = a.num_experts_per_tok
        self.gate = nn.Linear(a.hidden_size, a.num_experts, bias=False)
        self.w_in = mx.random.normal((a.num_experts, 64, a.hidden_size)) * 0.1
        self.w_out = mx.random.normal((a.num_experts, a.hidden_size, 64)) * 0.1

    def __call__(self, x):
        inds = mx.argpartition(-self.gate(x), self.k - 1, axis=-1)[..., : self.k]
        h = mx.expand_dims(x, (-2, -3))
        h = nn.silu(mx.gather_mm(h, self.w_in.swapaxes(-1, -2), rhs_indices=inds))
        return mx.gather_mm(h, self.w_out.swapaxes(-1, -2), rhs_indices=inds).squeeze(-2).sum(-2)


class HandRolledModel(nn.Module):
    def __init__(self, a: HandRolledArgs):
        super().__init__()
        self.model_type = a.model_type
        self.embed_tokens = nn.Embedding(a.vocab_size, a.hidden_size)
        self.layers = [HandRolledMoE(a) for _ in range(a.num_hidden_layers)]
        self.lm_head = nn.Linear(a.hidden_size, a.vocab_size, bias=False)

    def __call__(self, inputs, cache=None):
        h = self.embed_tokens(inputs)
        for layer in self.layers:
            h = h + layer(h)
        return self.lm_head(h)


@pytest.fixture
def hand_rolled(tmp_path, monkeypatch):
    """A model type mlx-lm would import as mlx_lm.models.hand_rolled_moe, saved as a folder."""
    module = types.ModuleType("mlx_lm.models.hand_rolled_moe")
    module.Model, module.ModelArgs = HandRolledModel, HandRolledArgs
    monkeypatch.setitem(sys.modules, "mlx_lm.models.hand_rolled_moe", module)
    config = {
        "model_type": "hand_rolled_moe",
        "vocab_size": VOCAB,
        "hidden_size": 64,
        "num_hidden_layers": 1,
        "num_experts": 8,
        "num_experts_per_tok": 2,
    }
    model = HandRolledModel(HandRolledArgs.from_dict(config))
    mx.eval(model.parameters())
    folder = tmp_path / "hand-rolled"
    folder.mkdir()
    save_model(folder, model)
    save_config(config, folder / "config.json")
    write_tiny_tokenizer(folder, VOCAB)
    return folder, model


def test_experts_outside_switch_layers_are_found(hand_rolled):
    _, model = hand_rolled
    found = resident_expert_modules(model, 8)
    assert found == ["layers.0 (HandRolledMoE)"]


def test_a_model_whose_experts_cannot_stream_fails_to_load(hand_rolled, tmp_path):
    folder, _ = hand_rolled
    with pytest.raises(ModelLoadError) as e:
        load(folder, load_tokenizer=False)
    msg = str(e.value)
    assert "hand_rolled_moe" in msg and "HandRolledMoE" in msg and "--allow-resident-experts" in msg
    assert "\n" not in msg
    with pytest.raises(ConvertError, match="HandRolledMoE"):  # no folder that silently keeps them resident
        convert(folder, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_allowed_resident_experts_load_and_say_so(hand_rolled):
    folder, model = hand_rolled
    lm = load(folder, load_tokenizer=False, allow_resident_experts=True)
    assert lm.store is None and lm.layers == []
    assert "HandRolledMoE" in lm.resident_experts
    tokens = mx.array([[3, 17, 250, 42]])
    assert mx.abs(lm.model(tokens) - model(tokens)).max().item() == 0.0


@pytest.fixture
def dense_declaring_experts(model_factory, tmp_path):
    """A config that says 8 experts for an architecture mlx-lm builds without switch layers."""
    import shutil

    folder = tmp_path / "declares-experts"
    shutil.copytree(model_factory("qwen3_moe", None), folder)
    config = json.loads((folder / "config.json").read_text())
    config.update(model_type="qwen3", num_local_experts=8)
    (folder / "config.json").write_text(json.dumps(config))
    for f in folder.glob("*.safetensors"):  # only what a dense qwen3 has: drop the experts
        from safetensors.numpy import load_file, save_file

        save_file({k: v for k, v in load_file(f).items() if ".mlp." not in k}, f, metadata={"format": "mlx"})
    return folder


def test_cli_one_line_exit_3_then_allowed(dense_declaring_experts):
    r = run_cli("run", "-m", dense_declaring_experts, "--max-tokens", "2", "--kernels", "mlx", "hi")
    assert r.returncode == 3, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "qwen3" in lines[0] and "declares 8 experts" in lines[0], r.stderr
    assert "--allow-resident-experts" in lines[0]


def test_every_summary_says_the_experts_are_resident(hand_rolled):
    from flashmoe.engine.runtime.engine import Engine
    from flashmoe.engine.events import GenerationFinished
    from flashmoe.engine.runtime.generate import GenerationRequest
    from flashmoe.cli.summaries import summary

    folder, _ = hand_rolled
    engine = Engine(folder, kernels="mlx", allow_resident_experts=True)
    try:
        info = engine.wait_loaded(60)
        assert info.moe_layers == 0 and "HandRolledMoE" in info.resident_experts
        done = [
            ev
            for ev in engine.submit(GenerationRequest(prompt="hi", max_tokens=3))
            if isinstance(ev, GenerationFinished)
        ][0]
        assert summary(done, info).endswith("experts resident, not streamed")
    finally:
        engine.close()
