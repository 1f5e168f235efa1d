"""flashmoe convert: same weights as mlx-lm, atomic output, resumable, bounded memory."""

from __future__ import annotations

import contextlib
import io
import json
import subprocess
import sys
import textwrap

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten
from mlx_lm.utils import load_model, quantize_model

from flashmoe.engine.formats.convert import convert
from flashmoe.engine.errors import ConvertError, ModelLoadError
from flashmoe.engine.runtime.loader import load
from tests.helpers.paths import ROOT
from tests.helpers.cli import run_cli

TOKENS = mx.array([[3, 17, 250, 42, 9, 101, 77, 5]])


@pytest.mark.parametrize("bits,group_size", [(4, 64), (2, 32), (8, 64)])
def test_bits_gives_mlx_lms_quantization(model_factory, tmp_path, bits, group_size):
    src = model_factory("qwen3_next")  # float32 source
    out = convert(src, tmp_path / "q", bits=bits, group_size=group_size)
    ref, config = load_model(src)
    with contextlib.redirect_stdout(io.StringIO()):
        ref, _ = quantize_model(ref, config, group_size, bits)
    lm = load(out, load_tokenizer=False)
    assert lm.config["quantization"]["bits"] == bits
    assert mx.abs(lm.model(TOKENS) - ref(TOKENS)).max().item() <= 1e-5
    # the router stays 8-bit, as mlx-lm's qwen3_next predicate says
    assert lm.config["quantization"]["model.layers.0.mlp.gate"]["bits"] == 8


def test_rerun_on_finished_output_does_nothing(model_factory, tmp_path):
    out = convert(model_factory("olmoe", 4), tmp_path / "o")
    stamps = {p: p.stat().st_mtime_ns for p in out.rglob("*")}
    r = run_cli("convert", model_factory("olmoe", 4), out)
    assert r.returncode == 0 and "already converted" in r.stderr
    assert {p: p.stat().st_mtime_ns for p in out.rglob("*")} == stamps


def test_interrupted_conversion_leaves_nothing_loadable_and_resumes(model_factory, tmp_path):
    src = model_factory("deepseek_v3", 4)
    out = tmp_path / "d"
    with pytest.raises(RuntimeError, match="injected"):
        convert(src, out, _fail_after_layers=1)
    assert not out.exists()
    with pytest.raises(ModelLoadError):
        load(out)
    partial = out.with_name("d.partial")
    kept = partial / "experts/layer_001.bin"  # deepseek's first MoE layer is layer 1
    assert kept.exists()
    inode = kept.stat().st_ino
    convert(src, out)
    assert not partial.exists()
    assert (out / "experts/layer_001.bin").stat().st_ino == inode  # finished layer not redone
    fresh = convert(src, tmp_path / "fresh")
    for f in ("experts/layer_001.bin", "experts/layer_002.bin", "resident.safetensors", "experts/manifest.json"):
        assert (out / f).read_bytes() == (fresh / f).read_bytes(), f


def test_conversion_errors(model_factory, tmp_path):
    src = model_factory("mixtral", 4)
    with pytest.raises(ConvertError, match="already quantized"):
        convert(src, tmp_path / "x", bits=2)
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "file").write_text("mine")
    with pytest.raises(ConvertError, match="not a finished flashmoe model"):
        convert(src, tmp_path / "taken")
    assert (tmp_path / "taken" / "file").read_text() == "mine"
    r = run_cli("convert", tmp_path / "nothing", tmp_path / "y")
    assert r.returncode == 3 and "no such file" in r.stderr and "Traceback" not in r.stderr
    r = run_cli("convert", src, tmp_path / "y", "--bits", "7")
    assert r.returncode == 2


@pytest.mark.parametrize("layout,version", [("auto", 2), ("mlx", 1)])
def test_manifest_describes_the_packed_files(model_factory, layout, version):
    """Version 1 when every layer keeps MLX's rows; 2 when some are in the CPU kernels' tiles, so
    that a flashmoe from before tiles refuses the folder instead of reading tiles as rows."""
    out = model_factory("glm4_moe", 4, converted=True, expert_layout=layout)
    doc = json.loads((out / "experts/manifest.json").read_text())
    assert doc["format"] == "flashmoe-experts" and doc["version"] == version
    assert all(l.get("layout", "mlx") == ("tiles" if version == 2 else "mlx") for l in doc["layers"])
    for layer in doc["layers"]:
        assert layer["stride"] % doc["alignment"] == 0 and layer["stride"] >= layer["expert_bytes"]
        names = [p["name"] for p in layer["parts"]]
        assert set(names) == {
            f"{p}.{k}" for p in ("gate_proj", "up_proj", "down_proj") for k in ("weight", "scales", "biases")
        }
        size = (out / "experts" / layer["file"]).stat().st_size
        assert size == layer["stride"] * layer["num_experts"] and len(layer["checksums"]) == layer["num_experts"]


@pytest.mark.slow
def test_peak_memory_is_about_one_layer(tmp_path):
    """Convert a float model of ~400 MB of experts in a fresh process and watch its peak RSS."""
    script = textwrap.dedent(f"""
        import json, resource, sys
        sys.path.insert(0, {str(ROOT)!r})
        from pathlib import Path
        import mlx.core as mx
        from mlx_lm.utils import save_config, save_model
        from tests.tiny_models import make_model
        import tests.tiny_models as tm
        tm.CONFIGS["big"] = dict(tm.CONFIGS["qwen3_moe"], hidden_size=256, moe_intermediate_size=512,
                                 num_experts=32, num_hidden_layers=8, head_dim=64)
        model, config = make_model("big")
        save_model(Path({str(tmp_path / "src")!r}), model)
        save_config(config, Path({str(tmp_path / "src")!r}) / "config.json")
        del model
        import gc; gc.collect(); mx.clear_cache()
        from flashmoe.engine.formats.convert import convert
        import os
        def rss():
            with open("/proc/self/statm") as f:
                return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        base = rss()
        peak = [base]
        import threading, time
        def watch():
            while True:
                peak[0] = max(peak[0], rss()); time.sleep(0.01)
        threading.Thread(target=watch, daemon=True).start()
        convert({str(tmp_path / "src")!r}, {str(tmp_path / "out")!r})
        print(json.dumps({{"growth": peak[0] - base}}))
    """)
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    growth = json.loads(r.stdout.strip().splitlines()[-1])["growth"]
    layer_bytes = 32 * 3 * 256 * 512 * 4  # 50 MB of float32 experts per layer; 400 MB in all
    assert growth < 3 * layer_bytes, f"peak grew by {growth / 2**20:.0f} MB"


def test_mixed_precision_experts(model_factory, tmp_path):
    """2-bit experts, 4-bit in the first and last layer, 8-bit elsewhere: recorded and exact."""
    src = model_factory("qwen3_moe")  # float32, 3 layers
    out = convert(src, tmp_path / "mixed", bits=8, expert_bits=2, layer_bits=["first:1=4", "last:1=4"])
    manifest = json.loads((out / "experts/manifest.json").read_text())
    assert [l["quantization"]["bits"] for l in manifest["layers"]] == [4, 2, 4]
    q = json.loads((out / "config.json").read_text())["quantization"]
    assert q["model.layers.1.mlp.switch_mlp.gate_proj"]["bits"] == 2
    assert q["model.layers.0.mlp.switch_mlp.down_proj"]["bits"] == 4
    assert q["bits"] == 8 and q["model.layers.0.mlp.gate"]["bits"] == 8  # router
    # 2- and 4-bit layers have different shapes: they get separate slot pools
    lm = load(out, load_tokenizer=False)
    assert len(lm.store.pools) == 2
    # the same plan through mlx-lm's own quantization is the exact reference
    from flashmoe.engine.formats.convert import QuantPlan, _quantize

    ref, config = load_model(src)
    ref, _ = _quantize(ref, config, QuantPlan(8, 64, 2, ((0, 4), (2, 4))))
    assert mx.abs(lm.model(TOKENS) - ref(TOKENS)).max().item() <= 1e-5
    info = run_cli("info", out)
    assert "2-bit (layer 1), 4-bit (layers 0, 2)" in info.stdout, info.stdout


def test_layer_bits_errors(model_factory, tmp_path):
    src = model_factory("qwen3_moe")
    with pytest.raises(ConvertError, match="layer 7 does not exist"):
        convert(src, tmp_path / "a", bits=4, layer_bits=["7=8"])
    with pytest.raises(ConvertError, match="expected LAYERS=BITS"):
        convert(src, tmp_path / "a", bits=4, layer_bits=["first=8"])


def test_dtype_casts_scales(model_factory, tmp_path):
    src = model_factory("mixtral")
    out = convert(src, tmp_path / "bf", bits=4, dtype="bfloat16")
    manifest = json.loads((out / "experts/manifest.json").read_text())
    dtypes = {p["name"]: p["dtype"] for p in manifest["layers"][0]["parts"]}
    assert dtypes["gate_proj.scales"] == "BF16" and dtypes["gate_proj.weight"] == "U32"
    assert load(out, load_tokenizer=False).model(TOKENS).dtype == mx.bfloat16


def test_dense_model_converts_and_runs(tmp_path):
    """A model without routed experts still converts and runs (nothing to stream)."""
    from mlx_lm.utils import save_config, save_model

    from tests.tiny_models import _COMMON

    import mlx_lm.models.llama as llama

    config = dict(_COMMON, model_type="llama", intermediate_size=128, head_dim=16)
    model = llama.Model(llama.ModelArgs.from_dict(config))
    mx.eval(model.parameters())
    save_model(tmp_path / "dense", model)
    save_config(config, tmp_path / "dense" / "config.json")
    out = convert(tmp_path / "dense", tmp_path / "dense-fm", bits=4)
    lm = load(out, load_tokenizer=False)
    assert lm.store is None and lm.layers == []
    ref, cfg = load_model(tmp_path / "dense")
    with contextlib.redirect_stdout(io.StringIO()):
        ref, _ = quantize_model(ref, cfg, 64, 4)
    assert mx.abs(lm.model(TOKENS) - ref(TOKENS)).max().item() <= 1e-5


def test_bf16_sharded_per_expert_original_to_4bit(model_factory, tmp_path):
    """A Hugging Face style release: bf16, one tensor per expert, two shards with an index."""
    from tests.tiny_models import make_model

    model, config = make_model("mixtral")
    flat = dict(tree_flatten(model.parameters()))
    hf = {}
    for k, v in flat.items():
        v = v.astype(mx.bfloat16)
        if ".switch_mlp." in k:
            base, rest = k.split(".switch_mlp.")
            proj = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}[rest.split(".")[0]]
            for e in range(v.shape[0]):
                hf[f"{base}.experts.{e}.{proj}.weight"] = v[e]
        else:
            hf[k] = v
    src = tmp_path / "hf"
    src.mkdir()
    names = sorted(hf)
    shards = {
        "model-00001-of-00002.safetensors": names[: len(names) // 2],
        "model-00002-of-00002.safetensors": names[len(names) // 2 :],
    }
    for fname, keys in shards.items():
        mx.save_safetensors(str(src / fname), {k: hf[k] for k in keys})
    index = {"weight_map": {k: f for f, ks in shards.items() for k in ks}}
    (src / "model.safetensors.index.json").write_text(json.dumps(index))
    (src / "config.json").write_text(json.dumps(config))
    out = convert(src, tmp_path / "q4", bits=4, dtype="float32")
    lm = load(out, load_tokenizer=False)
    ref, cfg = load_model(src)  # mlx-lm on the same folder, same steps
    from mlx.utils import tree_map as tmap

    ref.update(tmap(lambda p: p.astype(mx.float32) if mx.issubdtype(p.dtype, mx.floating) else p, ref.parameters()))
    with contextlib.redirect_stdout(io.StringIO()):
        ref, _ = quantize_model(ref, cfg, 64, 4)
    assert mx.abs(lm.model(TOKENS) - ref(TOKENS)).max().item() <= 1e-5
    # The experts also stream straight out of the bf16 shards, widened to float32 as they are
    # read (MLX's CPU gather_mm takes float32 only), against mlx-lm on the same widened weights.
    direct = load(src, load_tokenizer=False, dtype="float32")
    assert direct.layers[0].parts[0].dtype == "BF16" and direct.store.pools[0].held[0].dtype == "F32"
    ref32, _ = load_model(src)
    ref32.update(tmap(lambda p: p.astype(mx.float32) if mx.issubdtype(p.dtype, mx.floating) else p, ref32.parameters()))
    assert mx.abs(direct.model(TOKENS) - ref32(TOKENS)).max().item() <= 1e-5
