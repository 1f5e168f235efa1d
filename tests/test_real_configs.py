"""Real releases' configs (tests/fixtures/configs, copied from ../shared/reference/configs),
scaled down, and the quirks of real checkpoints: transformers-5 key names, zero-centred norms in
Qwen3-Next / Qwen3.5 originals, router gate bits that differ between checkpoints, tied embeddings.
"""

from __future__ import annotations

import contextlib
import copy
import io
import json
from pathlib import Path

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten
from mlx_lm.utils import _get_classes, quantize_model, save_config, save_model
import numpy as np
from safetensors.numpy import save_file

from flashmoe.engine.formats.convert import convert
from flashmoe.engine.runtime.loader import load, normalize_config
from tests.tiny_tokenizer import write_tiny_tokenizer

CONFIGS = Path(__file__).parent / "fixtures" / "configs"
TOKENS = mx.array([[3, 17, 250, 42, 9, 101, 77, 5, 64, 200]])

SIZES = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "moe_intermediate_size": 64,
    "shared_expert_intermediate_size": 64,
    "num_attention_heads": 4,
    "head_dim": 16,
    "vocab_size": 320,
    "max_position_embeddings": 512,
    "num_experts": 8,
    "num_local_experts": 8,
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
    "linear_num_value_heads": 4,
    "linear_num_key_heads": 2,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    "kv_lora_rank": 32,
    "qk_rope_head_dim": 16,
    "qk_nope_head_dim": 16,
    "v_head_dim": 16,
}


def scale_down(c: dict) -> dict:
    """Same model_type and switches, tiny sizes."""
    c = copy.deepcopy(c)
    c.pop("quantization", None)
    c.pop("quantization_config", None)
    for k, v in SIZES.items():
        if k in c:
            c[k] = v
    if c.get("q_lora_rank"):
        c["q_lora_rank"] = 32
    if "num_key_value_heads" in c:  # MLA (DeepSeek) wants as many kv heads as heads
        c["num_key_value_heads"] = 4 if c.get("model_type", "").startswith("deepseek") else 2
    interval = c.get("full_attention_interval", 0)
    c["num_hidden_layers"] = interval if interval else 3
    if "layer_types" in c:
        c["layer_types"] = c["layer_types"][: c["num_hidden_layers"]]
    if "first_k_dense_replace" in c:
        c["first_k_dense_replace"] = min(c["first_k_dense_replace"], 1)
    if "n_group" in c:
        c["n_group"] = min(c["n_group"], 4)
        c["topk_group"] = min(c.get("topk_group", 1), c["n_group"])
    rope = c.get("rope_parameters")
    if isinstance(rope, dict) and "mrope_section" in rope:
        rope["mrope_section"] = [1, 1, 0]  # sums to head_dim * partial_rotary / 2
    if isinstance(c.get("text_config"), dict):
        c["text_config"] = scale_down(c["text_config"])
    return c


def real_config_names():
    return sorted(p.name for p in CONFIGS.glob("*.config.json"))


def build_folder(raw: dict, folder: Path, seed: int = 0, bits: int | None = None):
    """Save a random model for `raw` (kept as it is in config.json, like a real release)."""
    norm = copy.deepcopy(raw)
    normalize_config(norm)
    if isinstance(norm.get("text_config"), dict):
        normalize_config(norm["text_config"])
    model_class, args_class = _get_classes(norm)
    mx.random.seed(seed)
    model = model_class(args_class.from_dict(norm))
    params = tree_flatten(model.parameters())
    keys = mx.random.split(mx.random.key(seed), len(params))
    new = []
    for (name, p), k in zip(params, keys):
        if mx.issubdtype(p.dtype, mx.floating):
            scale = 1.0 / p.shape[-1] ** 0.5 if p.ndim >= 2 else 0.1
            p = mx.random.normal(p.shape, key=k) * scale + (1.0 if p.ndim == 1 and "norm" in name else 0.0)
            p = p.astype(mx.float32)
        new.append((name, p))
    model.load_weights(new, strict=False)
    mx.eval(model.parameters())
    config = raw
    if bits:
        with contextlib.redirect_stdout(io.StringIO()):
            model, qc = quantize_model(model, copy.deepcopy(norm), 64, bits)
        config = dict(raw, quantization=qc["quantization"])
    folder.mkdir(parents=True, exist_ok=True)
    save_model(folder, model)
    save_config(copy.deepcopy(config), folder / "config.json")
    write_tiny_tokenizer(folder, 320)
    return model


@pytest.mark.parametrize("name", real_config_names())
def test_real_config_scaled_down_streams_exactly(name, tmp_path):
    raw = json.loads((CONFIGS / name).read_text())
    bits = raw.get("quantization", {}).get("bits")
    tiny = scale_down(raw)
    ref = build_folder(tiny, tmp_path / "src", bits=bits)
    want = ref(TOKENS)
    for path in (tmp_path / "src", convert(tmp_path / "src", tmp_path / "fm")):
        lm = load(path, expert_cache=0)
        assert lm.layers, "no streamed experts"
        assert mx.abs(lm.model(TOKENS) - want).max().item() <= 1e-5, (name, lm.mode)


def test_rope_parameters_reach_the_model(tmp_path):
    """transformers 5 nests rope_theta and yarn scaling under rope_parameters (DeepSeek-V2 dump)."""
    raw = scale_down(json.loads((CONFIGS / "DeepSeek-V2-Lite-Chat.transformers5-dump.config.json").read_text()))
    raw["rope_parameters"]["rope_theta"] = 12345.0
    assert "rope_theta" not in raw and "rope_scaling" not in raw
    build_folder(raw, tmp_path / "src")
    lm = load(tmp_path / "src")
    assert lm.model.args.rope_theta == 12345.0
    assert lm.model.args.rope_scaling["type"] == "yarn" and lm.model.args.rope_scaling["factor"] == 40


def test_layer_types_must_be_periodic(tmp_path):
    raw = scale_down(json.loads((CONFIGS / "Qwen3-Next-80B-A3B.config.json").read_text()))
    raw.pop("full_attention_interval")
    raw["layer_types"] = ["linear_attention", "full_attention", "linear_attention", "linear_attention"]
    (tmp_path / "config.json").write_text(json.dumps(raw))
    from flashmoe.engine.errors import ModelLoadError

    with pytest.raises(ModelLoadError, match="not periodic"):
        load(tmp_path)


def _to_hf_original(mlx_folder: Path, out: Path, fused: bool) -> None:
    """Rewrite a tiny Qwen3-Next / Qwen3.5 mlx-lm folder the way the original release stores it:
    per-expert (or fused gate_up) tensors, conv1d as [C, 1, K], and zero-centred norms (w - 1)."""
    weights = {k: np.array(v) for k, v in mx.load(str(mlx_folder / "model.safetensors")).items()}
    out.mkdir()
    hf = {}
    norms = (
        ".input_layernorm.weight",
        ".post_attention_layernorm.weight",
        "model.norm.weight",
        ".q_norm.weight",
        ".k_norm.weight",
    )
    for k, v in weights.items():
        name = k.replace("language_model.model.", "model.language_model.").replace("language_model.lm_head", "lm_head")
        if "conv1d.weight" in k:
            v = np.ascontiguousarray(np.moveaxis(v, 2, 1))
        if v.ndim == 1 and any(name.endswith(n) for n in norms):
            v = v - 1.0
        if ".switch_mlp." in k:
            base, proj = name.split(".switch_mlp.")[0], name.split(".switch_mlp.")[1].split(".")[0]
            if fused:
                if proj == "gate_proj":
                    up = weights[k.replace("gate_proj", "up_proj")]
                    hf[f"{base}.experts.gate_up_proj"] = np.ascontiguousarray(np.concatenate([v, up], axis=1))
                elif proj == "down_proj":
                    hf[f"{base}.experts.down_proj"] = v
                continue
            for e in range(v.shape[0]):
                hf[f"{base}.experts.{e}.{proj}.weight"] = np.ascontiguousarray(v[e])
            continue
        hf[name] = v
    save_file(hf, str(out / "model.safetensors"))
    for f in mlx_folder.iterdir():
        if f.suffix == ".json" and f.name != "model.safetensors.index.json":
            (out / f.name).write_bytes(f.read_bytes())


@pytest.mark.parametrize(
    "name,fused", [("Qwen3-Next-80B-A3B.config.json", False), ("Qwen3.5-35B-A3B.config.json", True)]
)
def test_zero_centred_norms_of_originals_get_plus_one(name, fused, tmp_path):
    raw = scale_down(json.loads((CONFIGS / name).read_text()))
    ref = build_folder(raw, tmp_path / "mlx")
    want = ref(TOKENS)
    _to_hf_original(tmp_path / "mlx", tmp_path / "hf", fused)
    direct = load(tmp_path / "hf")  # streams the original's expert tensors in place
    assert direct.mode == "direct"
    assert mx.abs(direct.model(TOKENS) - want).max().item() <= 1e-5
    packed = load(convert(tmp_path / "hf", tmp_path / "fm"))
    assert mx.abs(packed.model(TOKENS) - want).max().item() <= 1e-5
    # mlx-community style folders already hold w + 1 and must not get another +1
    assert mx.abs(load(tmp_path / "mlx").model(TOKENS) - want).max().item() <= 1e-5


def test_router_bits_inferred_per_tensor(model_factory, tmp_path):
    """mlx-lm keeps Qwen3 routers at 8 bits; older conversions do not say so in the config."""
    import shutil

    src = tmp_path / "q"
    shutil.copytree(model_factory("qwen3_moe", 4), src)
    cfg = json.loads((src / "config.json").read_text())
    for key in ("quantization", "quantization_config"):
        cfg[key] = {"group_size": 64, "bits": 4}  # no per-path entries
    (src / "config.json").write_text(json.dumps(cfg))
    from tests.tiny_models import reference_model

    want = reference_model(model_factory("qwen3_moe", 4))(TOKENS)
    for path in (src, convert(src, tmp_path / "fm")):
        lm = load(path)
        assert lm.model.model.layers[0].mlp.gate.bits == 8
        assert mx.abs(lm.model(TOKENS) - want).max().item() <= 1e-5


@pytest.mark.parametrize("bits", [None, 4])
def test_tied_embeddings(tmp_path, bits):
    raw = scale_down(json.loads((CONFIGS / "OLMoE-1B-7B-0125-Instruct.config.json").read_text()))
    raw["tie_word_embeddings"] = True
    ref = build_folder(raw, tmp_path / "src", bits=bits)
    assert "lm_head" not in ref
    want = ref(TOKENS)
    lm = load(convert(tmp_path / "src", tmp_path / "fm"))
    assert mx.abs(lm.model(TOKENS) - want).max().item() <= 1e-5
