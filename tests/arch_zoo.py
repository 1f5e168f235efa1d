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
        new += [(f"{path}.weight", codes), (f"{path}.scales", scales),
                (f"{path}.biases", -1.5 * scales)]
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
    with mock.patch.dict(tiny_models.CONFIGS, {key: config}), \
            mock.patch.object(tiny_models, "make_model", _make):
        yield key


def make_model(model_type: str, seed: int = 0):
    """(float32 mlx-lm model with spread random weights, its config dict)."""
    with _registered(model_type) as key:
        return tiny_models.make_model(key, seed)


def save_folder(folder: Path, model_type: str, bits: int | None = None, group_size: int = 64,
                seed: int = 0) -> Path:
    """An mlx-lm folder (config.json, model.safetensors, the 320-id tiny tokenizer) of a tiny
    random `model_type` model, quantized to `bits` at `group_size` when bits is given."""
    with _registered(model_type) as key:
        return tiny_models.save_folder(Path(folder), key, bits=bits, group_size=group_size,
                                       seed=seed, tokenizer=True)
