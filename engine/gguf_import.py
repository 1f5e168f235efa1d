"""Turn a llama-architecture GGUF file into an mlx-lm style model folder in float32.

The folder holds config.json, model.safetensors (Hugging Face tensor names), tokenizer.json
(rebuilt from the GGUF vocabulary with the `tokenizers` library), tokenizer_config.json (with
the chat template) and generation_config.json. With `upcycle_experts=E` the dense MLP is
copied into E identical Mixtral experts behind a random router, which gives a real MoE
checkpoint whose output equals the dense model's.

Everything is rebuilt from the GGUF alone; nothing is downloaded.
"""
from __future__ import annotations

import functools
import json
import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, ReaderTensor, TokenType
from gguf.quants import dequantize
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

# Types whose dequantization in the `gguf` package we rely on (and test where we can).
SUPPORTED_TYPES = frozenset(
    GGMLQuantizationType[name]
    for name in ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0",
                 "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")
)

# The Llama 3 pre-tokenizer split (as in its tokenizer.json): digits in runs of up to three.
_LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

_MISSING = object()


def gguf_to_hf_folder(gguf_path, out_dir, *, upcycle_experts: int = 0,
                      experts_per_token: int = 2, seed: int = 0) -> Path:
    """Convert `gguf_path` into a float32 model folder at `out_dir` and return its path.

    upcycle_experts=E > 0 writes a Mixtral model with E copies of each dense MLP and a random
    router (float32, from `seed`) choosing `experts_per_token` of them; since Mixtral
    renormalises the chosen weights with a softmax, its output equals the dense model's.
    Raises ValueError for anything this importer does not handle (architecture, tensor type,
    tokenizer model, pre-tokenizer, extra tensors).
    """
    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    if upcycle_experts < 0:
        raise ValueError(f"upcycle_experts must be >= 0, got {upcycle_experts}")
    if upcycle_experts and not 1 <= experts_per_token <= upcycle_experts:
        raise ValueError(f"experts_per_token must be between 1 and {upcycle_experts}, "
                         f"got {experts_per_token}")

    reader = GGUFReader(gguf_path)
    hp = _llama_hparams(reader)
    tokens = _meta(reader, "tokenizer.ggml.tokens")
    tensors = {t.name: t for t in reader.tensors}
    if "token_embd.weight" not in tensors:
        raise ValueError("GGUF is missing tensor 'token_embd.weight'")
    # The embedding may be padded past the token list; HF's vocab_size counts its rows.
    hp["vocab_size"] = _numpy_shape(tensors["token_embd.weight"])[0]
    if len(tokens) > hp["vocab_size"]:
        raise ValueError(f"GGUF lists {len(tokens)} tokens but token_embd.weight has only "
                         f"{hp['vocab_size']} rows")
    hp["tie_word_embeddings"] = "output.weight" not in tensors
    if upcycle_experts and hp["head_dim"] * hp["num_attention_heads"] != hp["hidden_size"]:
        # mlx-lm's Mixtral derives head_dim from hidden_size / heads.
        raise ValueError(f"{gguf_path.name}: head_dim {hp['head_dim']} x {hp['num_attention_heads']} heads "
                         f"!= hidden size {hp['hidden_size']}; mixtral cannot express this model")
    if upcycle_experts and hp.get("rope_scaling"):
        raise ValueError(f"{gguf_path.name}: rope scaling is not supported by mlx-lm's mixtral")

    entries = _plan_tensors(tensors, hp, upcycle_experts, seed)
    tokenizer, special = _build_tokenizer(reader, tokens)
    config = _model_config(hp, special, upcycle_experts, experts_per_token)
    tok_config = _tokenizer_config(reader, tokens, special, hp)
    gen_config = {k: v for k, v in (("bos_token_id", special.get("bos")),
                                    ("eos_token_id", _eos_ids(special))) if v is not None}

    out_dir.mkdir(parents=True, exist_ok=True)
    # Everything goes to temporary names first; config.json is renamed last, so a folder with
    # a config.json is complete even if a conversion was interrupted.
    names = ["model.safetensors", "tokenizer.json", "tokenizer_config.json",
             "generation_config.json", "config.json"]
    temps = {n: out_dir / f".{n}.partial" for n in names}
    try:
        _write_safetensors(temps["model.safetensors"], entries)
        tokenizer.save(str(temps["tokenizer.json"]))
        _write_json(temps["tokenizer_config.json"], tok_config)
        _write_json(temps["generation_config.json"], gen_config)
        _write_json(temps["config.json"], config)
        for n in names:
            os.replace(temps[n], out_dir / n)
    finally:
        for tmp in temps.values():
            tmp.unlink(missing_ok=True)
    return out_dir


def undo_rope_permutation(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation for its interleaved RoPE.

    llama.cpp's converter reorders each head's rows from the HF "rotate half" layout
    (pairs i and i + d/2) to adjacent pairs (2i, 2i + 1); this restores the HF order.
    """
    rows = w.shape[0]
    head_dim = rows // n_heads
    return (w.reshape(n_heads, head_dim // 2, 2, *w.shape[1:])
            .swapaxes(1, 2)
            .reshape(w.shape))


def dequantize_tensor(t: ReaderTensor) -> np.ndarray:
    """A GGUF tensor as a float32 array in numpy order (GGUF lists dimensions reversed)."""
    qtype = _check_type(t)
    return np.ascontiguousarray(dequantize(t.data, qtype), dtype=np.float32).reshape(_numpy_shape(t))


def _check_type(t: ReaderTensor) -> GGMLQuantizationType:
    qtype = GGMLQuantizationType(t.tensor_type)
    if qtype not in SUPPORTED_TYPES:
        supported = ", ".join(sorted(q.name for q in SUPPORTED_TYPES))
        raise ValueError(f"tensor {t.name!r} has GGML type {qtype.name}, which cannot be "
                         f"dequantized (supported: {supported})")
    return qtype


# --- metadata -------------------------------------------------------------------------------

def _meta(reader: GGUFReader, key: str, default: Any = _MISSING) -> Any:
    field = reader.get_field(key)
    if field is None:
        if default is _MISSING:
            raise ValueError(f"GGUF metadata has no {key!r}")
        return default
    return field.contents()


def _f32(value: float) -> float:
    """GGUF stores float32; print the shortest decimal that rounds back (1e-05, not 9.9999997e-06)."""
    return float(str(np.float32(value)))


def _llama_hparams(reader: GGUFReader) -> dict:
    arch = _meta(reader, "general.architecture")
    if arch != "llama":
        raise ValueError(f"GGUF architecture {arch!r} is not supported (only 'llama')")
    if int(_meta(reader, "llama.expert_count", 0)) > 0:
        raise ValueError("GGUF is a llama mixture-of-experts model; only dense llama is supported")

    def get_int(key: str, default: Any = _MISSING) -> int:
        value = _meta(reader, f"llama.{key}", default)
        if not isinstance(value, int):  # some files store per-layer lists
            raise ValueError(f"GGUF llama.{key} is {value!r}, expected one integer")
        return value

    hidden = get_int("embedding_length")
    heads = get_int("attention.head_count")
    hp = {
        "hidden_size": hidden,
        "intermediate_size": get_int("feed_forward_length"),
        "num_hidden_layers": get_int("block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": get_int("attention.head_count_kv", heads),
        "head_dim": get_int("attention.key_length", hidden // heads),
        "rms_norm_eps": _f32(_meta(reader, "llama.attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": _f32(_meta(reader, "llama.rope.freq_base", 10000.0)),
        "max_position_embeddings": get_int("context_length", 4096),
    }
    if get_int("attention.value_length", hp["head_dim"]) != hp["head_dim"]:
        raise ValueError("GGUF has different key and value head sizes; llama needs them equal")
    if get_int("rope.dimension_count", hp["head_dim"]) != hp["head_dim"]:
        raise ValueError("GGUF uses partial rotary embeddings; llama rotates the whole head")
    scaling = _meta(reader, "llama.rope.scaling.type", "none")
    if scaling == "linear":
        hp["rope_scaling"] = {"type": "linear",
                              "factor": _f32(_meta(reader, "llama.rope.scaling.factor"))}
    elif scaling != "none":
        raise ValueError(f"GGUF rope scaling type {scaling!r} is not supported")
    return hp


def _model_config(hp: dict, special: dict, experts: int, experts_per_token: int) -> dict:
    config: dict = {}
    if experts:
        config["architectures"] = ["MixtralForCausalLM"]
        config["model_type"] = "mixtral"
    else:
        config["architectures"] = ["LlamaForCausalLM"]
        config["model_type"] = "llama"
    config.update(hp)
    config.update(hidden_act="silu", attention_bias=False, mlp_bias=False)
    if experts:
        config.update(num_local_experts=experts, num_experts_per_tok=experts_per_token)
    if special.get("bos") is not None:
        config["bos_token_id"] = special["bos"]
    if special.get("eos") is not None:
        config["eos_token_id"] = special["eos"]
    config["torch_dtype"] = "float32"
    return config


# --- tensors --------------------------------------------------------------------------------

@dataclass
class _Entry:
    name: str
    shape: tuple[int, ...]
    make: Callable[[], np.ndarray]


def _numpy_shape(t: ReaderTensor) -> tuple[int, ...]:
    return tuple(int(d) for d in reversed(t.shape.tolist()))


def _plan_tensors(tensors: dict[str, ReaderTensor], hp: dict, experts: int, seed: int) -> list[_Entry]:
    """List every output tensor with its shape and a function that produces it, in file order.

    Shapes are known up front (the safetensors header needs them); data is dequantized only
    when written, one tensor at a time.
    """
    hidden, inter = hp["hidden_size"], hp["intermediate_size"]
    q_rows = hp["num_attention_heads"] * hp["head_dim"]
    kv_rows = hp["num_key_value_heads"] * hp["head_dim"]
    used: set[str] = set()
    entries: list[_Entry] = []

    # maxsize=1: an upcycled layer writes the same dense MLP tensor E times in a row.
    load = functools.lru_cache(maxsize=1)(lambda gname: dequantize_tensor(tensors[gname]))

    def add(hf_name: str, gname: str, shape: tuple[int, ...],
            fix: Callable[[np.ndarray], np.ndarray] | None = None) -> None:
        t = tensors.get(gname)
        if t is None:
            raise ValueError(f"GGUF is missing tensor {gname!r}")
        if _numpy_shape(t) != shape:
            raise ValueError(f"tensor {gname!r} has shape {_numpy_shape(t)}, expected {shape}")
        _check_type(t)  # fail before writing gigabytes, not halfway through
        used.add(gname)
        entries.append(_Entry(hf_name, shape, (lambda: fix(load(gname))) if fix else (lambda: load(gname))))

    add("model.embed_tokens.weight", "token_embd.weight", (hp["vocab_size"], hidden))
    rng = np.random.default_rng(seed)
    for i in range(hp["num_hidden_layers"]):
        blk, hf = f"blk.{i}", f"model.layers.{i}"
        add(f"{hf}.input_layernorm.weight", f"{blk}.attn_norm.weight", (hidden,))
        add(f"{hf}.self_attn.q_proj.weight", f"{blk}.attn_q.weight", (q_rows, hidden),
            lambda w: undo_rope_permutation(w, hp["num_attention_heads"]))
        add(f"{hf}.self_attn.k_proj.weight", f"{blk}.attn_k.weight", (kv_rows, hidden),
            lambda w: undo_rope_permutation(w, hp["num_key_value_heads"]))
        add(f"{hf}.self_attn.v_proj.weight", f"{blk}.attn_v.weight", (kv_rows, hidden))
        add(f"{hf}.self_attn.o_proj.weight", f"{blk}.attn_output.weight", (hidden, q_rows))
        add(f"{hf}.post_attention_layernorm.weight", f"{blk}.ffn_norm.weight", (hidden,))
        mlp = [("gate_proj", "w1", "ffn_gate", (inter, hidden)),
               ("up_proj", "w3", "ffn_up", (inter, hidden)),
               ("down_proj", "w2", "ffn_down", (hidden, inter))]
        if not experts:
            for hf_proj, _, gguf_proj, shape in mlp:
                add(f"{hf}.mlp.{hf_proj}.weight", f"{blk}.{gguf_proj}.weight", shape)
            continue
        moe = f"{hf}.block_sparse_moe"
        router = (rng.standard_normal((experts, hidden)) * 0.02).astype(np.float32)
        entries.append(_Entry(f"{moe}.gate.weight", router.shape, lambda r=router: r))
        for _, w, gguf_proj, shape in mlp:
            for e in range(experts):
                add(f"{moe}.experts.{e}.{w}.weight", f"{blk}.{gguf_proj}.weight", shape)

    add("model.norm.weight", "output_norm.weight", (hidden,))
    if not hp["tie_word_embeddings"]:
        add("lm_head.weight", "output.weight", (hp["vocab_size"], hidden))

    extra = sorted(set(tensors) - used)
    if extra:
        # e.g. rope_freqs.weight (Llama 3.1 rope scaling) or MoE tensors: silently dropping
        # them would give a wrong model.
        raise ValueError(f"GGUF has tensors this importer does not understand: {', '.join(extra[:5])}"
                         + (f" and {len(extra) - 5} more" if len(extra) > 5 else ""))
    return entries


def _write_safetensors(path: Path, entries: list[_Entry]) -> None:
    """Stream float32 tensors into one safetensors file without holding them all in memory."""
    header: dict = {"__metadata__": {"format": "pt"}}
    offset = 0
    for e in entries:
        nbytes = 4 * math.prod(e.shape)
        header[e.name] = {"dtype": "F32", "shape": list(e.shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # 8-byte aligned data, as the format recommends
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for e in entries:
            arr = np.ascontiguousarray(e.make(), dtype="<f4")
            if arr.shape != e.shape:
                raise ValueError(f"{e.name}: produced shape {arr.shape}, expected {e.shape}")
            arr.tofile(f)


# --- tokenizer ------------------------------------------------------------------------------

def _pre_tokenizer(pre: str):
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre == "gpt2":
        return byte_level
    if pre == "smollm":
        # SmolLM splits every digit on its own before the GPT-2 split.
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    if pre in ("llama-bpe", "llama3"):
        return pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(_LLAMA3_PATTERN), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
    raise ValueError(f"GGUF pre-tokenizer {pre!r} is not supported "
                     "(supported: 'gpt2', 'smollm', 'llama-bpe')")


def _build_tokenizer(reader: GGUFReader, tokens: list[str]) -> tuple[Tokenizer, dict]:
    """Rebuild a byte-level BPE tokenizer.json from tokenizer.ggml.* metadata."""
    model = _meta(reader, "tokenizer.ggml.model")
    if model != "gpt2":
        raise ValueError(f"GGUF tokenizer model {model!r} is not supported (only 'gpt2' byte-level BPE)")
    pre = _meta(reader, "tokenizer.ggml.pre", "default")
    pre_tokenizer = _pre_tokenizer(pre)
    merges = [tuple(m.split(" ", 1)) for m in _meta(reader, "tokenizer.ggml.merges")]
    types = _meta(reader, "tokenizer.ggml.token_type", [TokenType.NORMAL] * len(tokens))

    vocab: dict[str, int] = {}
    for i, tok in enumerate(tokens):
        vocab.setdefault(tok, i)  # a duplicate string keeps its first id
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token=None, fuse_unk=False,
                                     byte_fallback=False, ignore_merges=pre in ("llama-bpe", "llama3")))
    tokenizer.pre_tokenizer = pre_tokenizer
    tokenizer.decoder = decoders.ByteLevel()

    # Control/unknown tokens are special (skipped when decoding); user-defined ones are plain
    # added tokens. Both match as whole strings before BPE runs.
    added = []
    for tok, kind in zip(tokens, types):
        if kind in (TokenType.CONTROL, TokenType.UNKNOWN):
            added.append(AddedToken(tok, special=True, normalized=False))
        elif kind == TokenType.USER_DEFINED:
            added.append(AddedToken(tok, special=False, normalized=False))
    tokenizer.add_tokens(added)

    special = {}
    for name in ("bos", "eos", "unknown", "padding", "eot", "eom"):
        value = _meta(reader, f"tokenizer.ggml.{name}_token_id", None)
        if value is not None and 0 <= int(value) < len(tokens):
            special[name] = int(value)

    # BOS/EOS insertion when the GGUF asks for it (Llama 3 style); SmolLM2 asks for neither.
    bos = [special["bos"]] if _meta(reader, "tokenizer.ggml.add_bos_token", False) and "bos" in special else []
    eos = [special["eos"]] if _meta(reader, "tokenizer.ggml.add_eos_token", False) and "eos" in special else []
    if bos or eos:
        def piece(ids: list[int], seq: int) -> list[str]:
            return [f"{tokens[i]}:{seq}" for i in ids]
        single = piece(bos, 0) + ["$A:0"] + piece(eos, 0)
        tokenizer.post_processor = processors.TemplateProcessing(
            single=single, pair=single + piece(bos, 1) + ["$B:1"] + piece(eos, 1),
            special_tokens=[(tokens[i], i) for i in dict.fromkeys(bos + eos)])
    return tokenizer, special


def _tokenizer_config(reader: GGUFReader, tokens: list[str], special: dict, hp: dict) -> dict:
    config: dict = {"tokenizer_class": "PreTrainedTokenizerFast"}
    for key, name in (("bos_token", "bos"), ("eos_token", "eos"),
                      ("unk_token", "unknown"), ("pad_token", "padding")):
        if name in special:
            config[key] = tokens[special[name]]
    config["add_bos_token"] = bool(_meta(reader, "tokenizer.ggml.add_bos_token", False))
    config["add_eos_token"] = bool(_meta(reader, "tokenizer.ggml.add_eos_token", False))
    config["clean_up_tokenization_spaces"] = False
    config["model_max_length"] = hp["max_position_embeddings"]
    template = _meta(reader, "tokenizer.chat_template", None)
    if template is not None:
        config["chat_template"] = template
    return config


def _eos_ids(special: dict) -> int | list[int] | None:
    """eos, plus end-of-turn ids when the GGUF names different ones (Llama 3 <|eot_id|>)."""
    ids = list(dict.fromkeys(special[k] for k in ("eos", "eot", "eom") if k in special))
    if not ids:
        return None
    return ids[0] if len(ids) == 1 else ids


def _write_json(path: Path, data: dict) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=2, ensure_ascii=False)
        f.write("\n")
