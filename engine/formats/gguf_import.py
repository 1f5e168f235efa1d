"""Turn a GGUF file into an mlx-lm style model folder in float32.

Supported GGUF architectures and the mlx-lm model each becomes:

  llama                        -> llama (dense) or mixtral (when the file has experts)
  qwen2moe                     -> qwen2_moe
  qwen3moe                     -> qwen3_moe
  olmoe                        -> olmoe
  deepseek2                    -> deepseek_v2 (softmax routing) or deepseek_v3 (sigmoid routing
                                  with the exp_probs_b correction bias)
  gpt-oss                      -> gpt_oss
  glm4moe                      -> glm4_moe (GLM-4.5 / 4.6; the MTP layer is left out)
  llama4                       -> llama4 (text model)

The folder holds config.json, model.safetensors (Hugging Face tensor names; routed experts one
tensor per expert as in the original checkpoints, or stacked where those are, as in gpt-oss
and Llama 4), tokenizer.json (rebuilt from the GGUF vocabulary with the `tokenizers` library:
byte-level BPE, or SentencePiece as in Llama 2 / Mistral / Mixtral), tokenizer_config.json
(with the chat template) and generation_config.json. With `upcycle_experts=E` a dense llama
MLP is copied into E identical Mixtral experts behind a random router, which gives a real MoE
checkpoint whose output equals the dense model's.

Tensors are dequantized one at a time (a stacked expert tensor one expert at a time) and
written as soon as they are ready, so memory stays bounded by the largest single matrix.
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
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

# Types whose dequantization in the `gguf` package we rely on (and test where we can); MXFP4
# is what gpt-oss experts ship in. Anything else (the IQ* types, TQ*, NVFP4, ...) is refused,
# naming the tensor and its type.
SUPPORTED_TYPES = frozenset(
    GGMLQuantizationType[name]
    for name in (
        "F32",
        "F16",
        "BF16",
        "Q4_0",
        "Q4_1",
        "Q5_0",
        "Q5_1",
        "Q8_0",
        "Q2_K",
        "Q3_K",
        "Q4_K",
        "Q5_K",
        "Q6_K",
        "MXFP4",
    )
)

# GGUF general.architecture -> the mlx-lm model_type(s) it becomes.
SUPPORTED_ARCHITECTURES = {
    "llama": "llama or mixtral",
    "qwen2moe": "qwen2_moe",
    "qwen3moe": "qwen3_moe",
    "olmoe": "olmoe",
    "deepseek2": "deepseek_v2 or deepseek_v3",
    "gpt-oss": "gpt_oss",
    "glm4moe": "glm4_moe",
    "llama4": "llama4",
}

# The Llama 3 pre-tokenizer split (as in its tokenizer.json): digits in runs of up to three.
_LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Qwen2/Qwen3: the same split, but every digit on its own.
_QWEN2_PATTERN = _LLAMA3_PATTERN.replace(r"\p{N}{1,3}", r"\p{N}")
# DeepSeek V3: digits in runs of up to three, CJK runs, then words/punctuation/spaces.
_DEEPSEEK3_PATTERNS = (
    r"\p{N}{1,3}",
    "[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+",
    r"[!" + '"' + r"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"
    r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
)

# GPT-4o's "o200k" split (gpt-oss, Llama 4): upper/lower-case runs with contractions, digits in
# threes. The original regex of their tokenizer.json, quoted in llama.cpp's llama-vocab.cpp
# (LLAMA_VOCAB_PRE_TYPE_GPT4O, which "gpt-4o" and "llama4" select).
_O200K_PATTERN = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# tokenizer.ggml.pre -> the regex splits before byte-level BPE (llama-vocab.cpp: "glm4" is
# LLAMA_VOCAB_PRE_TYPE_CHATGLM4, whose regex is Llama 3's).
_PRE_PATTERNS = {
    "llama-bpe": (_LLAMA3_PATTERN,),
    "llama3": (_LLAMA3_PATTERN,),
    "glm4": (_LLAMA3_PATTERN,),
    "qwen2": (_QWEN2_PATTERN,),
    "deepseek-v3": _DEEPSEEK3_PATTERNS,
    "gpt-4o": (_O200K_PATTERN,),
    "llama4": (_O200K_PATTERN,),
}

# llama.cpp's expert gating functions (gguf.ExpertGatingFuncType).
_GATING_SOFTMAX, _GATING_SIGMOID = 1, 2

_MISSING = object()


# What check_structure() allows before GGUFReader allocates anything: nesting of arrays, tensor
# dimensions (GGML_MAX_DIMS) and elements, key and string lengths.
_MAX_ARRAY_DEPTH = 4
_MAX_DIMS = 4
_MAX_ELEMENTS = 1 << 48
_MAX_KEY = 1 << 16
# Bytes per value of GGUF's scalar types (gguf.GGUFValueType: 0-7 and 10-12), for bounds.
_SCALAR_BYTES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_STRING, _ARRAY = 8, 9


def check_structure(path: Path) -> None:
    """Walk a GGUF file's header, metadata and tensor table the way GGUFReader will, checking every
    count and length against the bytes that are left before anything is allocated (an array count
    of 2**62 would grow memory without bound; a truncated file, a duplicate key or a tensor past
    the end would give a traceback): ValueError, one line, naming what is wrong."""
    import mmap

    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    size = path.stat().st_size
    if size < 24:
        raise ValueError(f"not a GGUF file ({size} bytes, shorter than a GGUF header)")
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
        if data[:4] != b"GGUF":
            raise ValueError("not a GGUF file (no GGUF magic)")
        order = "<" if struct.unpack_from("<I", data, 4)[0] & 0xFFFF else ">"
        version = struct.unpack_from(order + "I", data, 4)[0]
        if version not in (2, 3):
            raise ValueError(f"GGUF version {version} is not supported (2 or 3)")
        pos = 8

        def take(fmt: str, what: str) -> int:
            nonlocal pos
            n = struct.calcsize(fmt)
            if pos + n > size:
                raise ValueError(f"GGUF file ends inside {what} (at byte {pos:,} of {size:,})")
            (value,) = struct.unpack_from(order + fmt, data, pos)
            pos += n
            return value

        def string(what: str, limit: int | None = None) -> bytes:
            nonlocal pos
            n = take("Q", what)
            if n > size - pos or (limit is not None and n > limit):
                raise ValueError(f"GGUF {what} is {n:,} bytes long, past the end of the file or its limit")
            pos += n
            return data[pos - n : pos]

        def value(kind: int, key: str, depth: int) -> None:
            nonlocal pos
            if kind in _SCALAR_BYTES:
                take({1: "B", 2: "H", 4: "I", 8: "Q"}[_SCALAR_BYTES[kind]], f"the value of {key}")
            elif kind == _STRING:
                string(f"string of {key}")
            elif kind == _ARRAY:
                if depth >= _MAX_ARRAY_DEPTH:
                    raise ValueError(f"GGUF array {key} nests more than {_MAX_ARRAY_DEPTH} deep")
                item, count = take("I", f"the array {key}"), take("Q", f"the array {key}")
                least = _SCALAR_BYTES.get(item, 8 if item in (_STRING, _ARRAY) else 0)
                if item not in _SCALAR_BYTES and item not in (_STRING, _ARRAY):
                    raise ValueError(f"GGUF array {key} holds values of unknown type {item}")
                if count * least > size - pos:
                    raise ValueError(f"GGUF array {key} claims {count:,} values, more than the file holds")
                if item in _SCALAR_BYTES:
                    pos += count * least
                else:
                    for _ in range(count):
                        value(item, key, depth + 1)
            else:
                raise ValueError(f"GGUF key {key} has a value of unknown type {kind}")

        tensors, kvs = take("Q", "the tensor count"), take("Q", "the key count")
        if kvs * 13 > size - pos or tensors * 24 > size - pos:
            raise ValueError(f"GGUF header claims {kvs:,} keys and {tensors:,} tensors, more than the file holds")
        keys: set[bytes] = set()
        alignment = 32
        for _ in range(kvs):
            key = string("a key name", _MAX_KEY)
            shown = key.decode("utf-8", "replace")
            if key in keys:
                raise ValueError(f"GGUF key {shown!r} is defined twice")
            keys.add(key)
            kind = take("I", f"the type of {shown}")
            if key == b"general.alignment":
                if kind != 4:
                    raise ValueError("GGUF general.alignment is not a uint32")
                alignment = take("I", "general.alignment")
                if alignment == 0 or alignment & (alignment - 1):
                    raise ValueError(f"GGUF general.alignment {alignment} is not a power of two")
            else:
                value(kind, shown, 0)
        names: set[bytes] = set()
        table = []
        for _ in range(tensors):
            raw = string("a tensor name", _MAX_KEY)
            name = raw.decode("utf-8", "replace")
            if raw in names:
                raise ValueError(f"GGUF tensor {name!r} is listed twice")
            names.add(raw)
            n_dims = take("I", f"tensor {name}")
            if not 1 <= n_dims <= _MAX_DIMS:
                raise ValueError(f"GGUF tensor {name!r} has {n_dims} dimensions (1 to {_MAX_DIMS})")
            dims = [take("Q", f"tensor {name}") for _ in range(n_dims)]
            kind, offset = take("I", f"tensor {name}"), take("Q", f"tensor {name}")
            elements = math.prod(dims)
            if elements > _MAX_ELEMENTS:
                raise ValueError(f"GGUF tensor {name!r} claims {elements:,} elements")
            try:
                block, type_bytes = GGML_QUANT_SIZES[GGMLQuantizationType(kind)]
            except (ValueError, KeyError):
                raise ValueError(f"GGUF tensor {name!r} has unknown GGML type {kind}") from None
            if dims[0] % block:
                raise ValueError(f"GGUF tensor {name!r} has rows of {dims[0]} values, not whole blocks of {block}")
            table.append((name, offset, elements // block * type_bytes))
        start = pos + (-pos % alignment)
        for name, offset, nbytes in table:
            if start + offset + nbytes > size:
                raise ValueError(
                    f"GGUF tensor {name!r} lies past the end of the file ({start + offset + nbytes:,} > {size:,} bytes)"
                )


def _open_reader(path: Path) -> GGUFReader:
    """GGUFReader on a file check_structure() passed; anything it still refuses, as ValueError."""
    check_structure(path)
    try:
        return GGUFReader(path)
    except (ValueError, KeyError, IndexError, TypeError, OverflowError, struct.error) as e:
        raise ValueError(f"GGUF file cannot be read: {e}") from None


def gguf_to_hf_folder(
    gguf_path, out_dir, *, upcycle_experts: int = 0, experts_per_token: int = 2, seed: int = 0
) -> Path:
    """Convert `gguf_path` into a float32 model folder at `out_dir` and return its path.

    upcycle_experts=E > 0 (dense llama files only) writes a Mixtral model with E copies of each
    dense MLP and a random router (float32, from `seed`) choosing `experts_per_token` of them;
    since Mixtral renormalises the chosen weights with a softmax, its output equals the dense
    model's. Raises ValueError for anything this importer does not handle (architecture,
    tensor type, tokenizer model, pre-tokenizer, extra tensors, settings mlx-lm cannot express).
    """
    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    if upcycle_experts < 0:
        raise ValueError(f"upcycle_experts must be >= 0, got {upcycle_experts}")
    if upcycle_experts and not 1 <= experts_per_token <= upcycle_experts:
        raise ValueError(f"experts_per_token must be between 1 and {upcycle_experts}, got {experts_per_token}")

    reader = _open_reader(gguf_path)
    arch = _meta(reader, "general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"GGUF architecture {arch!r} is not supported "
            f"(supported: {', '.join(repr(a) for a in SUPPORTED_ARCHITECTURES)})"
        )
    if upcycle_experts and arch != "llama":
        raise ValueError(f"upcycle_experts needs a dense llama GGUF; this one is {arch!r}")
    tokens = _meta(reader, "tokenizer.ggml.tokens")
    if not isinstance(tokens, list) or not all(isinstance(t, str) for t in tokens):
        raise ValueError("GGUF tokenizer.ggml.tokens is not a list of strings")
    tensors = {t.name: t for t in reader.tensors}
    if "token_embd.weight" not in tensors:
        raise ValueError("GGUF is missing tensor 'token_embd.weight'")
    # The embedding may be padded past the token list; HF's vocab_size counts its rows.
    vocab_size = _numpy_shape(tensors["token_embd.weight"])[0]
    if len(tokens) > vocab_size:
        raise ValueError(f"GGUF lists {len(tokens)} tokens but token_embd.weight has only {vocab_size} rows")

    m = _Meta(reader, arch)
    plan = _Planner(tensors)
    if arch == "llama":
        config = _llama(m, plan, vocab_size, gguf_path.name, upcycle_experts, experts_per_token, seed)
    else:
        config = {
            "qwen2moe": _qwen2moe,
            "qwen3moe": _qwen3moe,
            "olmoe": _olmoe,
            "deepseek2": _deepseek2,
            "gpt-oss": _gpt_oss,
            "glm4moe": _glm4moe,
            "llama4": _llama4,
        }[arch](m, plan, vocab_size)
    entries = plan.finish()

    tokenizer, special = _build_tokenizer(reader, tokens)
    if special.get("bos") is not None:
        config["bos_token_id"] = special["bos"]
    if special.get("eos") is not None:
        config["eos_token_id"] = special["eos"]
    config["torch_dtype"] = "float32"
    max_length = config.get("max_position_embeddings") or config["text_config"]["max_position_embeddings"]
    tok_config = _tokenizer_config(reader, tokens, special, max_length)
    gen_config = {
        k: v for k, v in (("bos_token_id", special.get("bos")), ("eos_token_id", _eos_ids(special))) if v is not None
    }

    out_dir.mkdir(parents=True, exist_ok=True)
    # Everything goes to temporary names first; config.json is renamed last, so a folder with
    # a config.json is complete even if a conversion was interrupted.
    names = ["model.safetensors", "tokenizer.json", "tokenizer_config.json", "generation_config.json", "config.json"]
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
    Only llama-family files (llama, Mixtral) are permuted; NEOX-RoPE models (Qwen, OLMoE)
    and DeepSeek (interleaved RoPE in HF too) are stored as they are.
    """
    rows = w.shape[0]
    head_dim = rows // n_heads
    return w.reshape(n_heads, head_dim // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def dequantize_tensor(t: ReaderTensor) -> np.ndarray:
    """A GGUF tensor as a float32 array in numpy order (GGUF lists dimensions reversed)."""
    qtype = _check_type(t)
    return np.ascontiguousarray(dequantize(t.data, qtype), dtype=np.float32).reshape(_numpy_shape(t))


def dequantize_expert(t: ReaderTensor, e: int) -> np.ndarray:
    """Expert `e` of a stacked [experts, out, in] GGUF tensor as float32, without the others.

    Quantization blocks run along the last axis, so every expert is a whole slice of the raw
    data and can be dequantized on its own.
    """
    qtype = _check_type(t)
    shape = _numpy_shape(t)
    return np.ascontiguousarray(dequantize(t.data[e], qtype), dtype=np.float32).reshape(shape[1:])


def _check_type(t: ReaderTensor) -> GGMLQuantizationType:
    qtype = GGMLQuantizationType(t.tensor_type)
    if qtype not in SUPPORTED_TYPES:
        supported = ", ".join(sorted(q.name for q in SUPPORTED_TYPES))
        raise ValueError(
            f"tensor {t.name!r} has GGML type {qtype.name}, which cannot be dequantized (supported: {supported})"
        )
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


class _Meta:
    """`{arch}.*` metadata of one file, with type checks."""

    def __init__(self, reader: GGUFReader, arch: str):
        self.reader, self.arch = reader, arch

    def get(self, key: str, default: Any = _MISSING) -> Any:
        return _meta(self.reader, f"{self.arch}.{key}", default)

    def int(self, key: str, default: Any = _MISSING) -> int:
        value = self.get(key, default)
        if not isinstance(value, int) or isinstance(value, bool):  # some files store per-layer lists
            raise ValueError(f"GGUF {self.arch}.{key} is {value!r}, expected one integer")
        return value

    def opt_int(self, key: str) -> int | None:
        return None if self.get(key, None) is None else self.int(key)

    def float(self, key: str, default: Any = _MISSING) -> float:
        value = self.get(key, default)
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            raise ValueError(f"GGUF {self.arch}.{key} is {value!r}, expected a number")
        return _f32(value)

    def flag(self, key: str, default: bool) -> bool:
        return bool(self.get(key, default))


def _attention_hparams(m: _Meta, *, eps_default: float) -> dict:
    """Sizes shared by the grouped-query-attention models (everything but deepseek2)."""
    hidden = m.int("embedding_length")
    heads = m.int("attention.head_count")
    hp = {
        "hidden_size": hidden,
        "num_hidden_layers": m.int("block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": m.int("attention.head_count_kv", heads),
        "head_dim": m.int("attention.key_length", hidden // heads),
        "rms_norm_eps": m.float("attention.layer_norm_rms_epsilon", eps_default),
        "rope_theta": m.float("rope.freq_base", 10000.0),
        "max_position_embeddings": m.int("context_length", 4096),
    }
    if m.int("attention.value_length", hp["head_dim"]) != hp["head_dim"]:
        raise ValueError(f"GGUF has different key and value head sizes; {m.arch} needs them equal")
    if m.int("rope.dimension_count", hp["head_dim"]) != hp["head_dim"]:
        raise ValueError(f"GGUF uses partial rotary embeddings; {m.arch} rotates the whole head")
    if m.get("attention.clamp_kqv", None) is not None:
        raise ValueError("GGUF clamps q/k/v (attention.clamp_kqv); mlx-lm's models do not")
    return hp


def _rope_scaling(m: _Meta, model_type: str, allowed: tuple[str, ...] = ()) -> dict | None:
    scaling = m.get("rope.scaling.type", "none")
    if scaling == "none":
        return None
    if scaling not in allowed:
        raise ValueError(f"GGUF rope scaling type {scaling!r} is not supported for {model_type}")
    factor = m.float("rope.scaling.factor")
    if scaling == "linear":
        return {"type": "linear", "factor": factor}
    # yarn (deepseek2). llama.cpp stores 0.1 * mscale_all_dim as yarn_log_multiplier and, like
    # the DeepSeek configs, assumes mscale == mscale_all_dim. Six significant digits undo the
    # float32 rounding of the stored product (0.0707 -> 0.707, not 0.70699996).
    log_mul = float(np.float32(m.float("rope.scaling.yarn_log_multiplier", 0.0)))
    mscale = float(f"{log_mul * 10:.6g}")
    return {
        "type": "yarn",
        "factor": factor,
        "original_max_position_embeddings": m.int("rope.scaling.original_context_length"),
        "beta_fast": m.float("rope.scaling.yarn_beta_fast", 32.0),
        "beta_slow": m.float("rope.scaling.yarn_beta_slow", 1.0),
        "mscale": mscale,
        "mscale_all_dim": mscale,
    }


def _moe_hparams(m: _Meta, plan: "_Planner", first_moe_layer: int = 0) -> dict:
    """Expert count, experts per token and expert FFN size; softmax routing is checked."""
    experts = m.int("expert_count", 0)
    if experts <= 0:
        raise ValueError(f"GGUF {m.arch} file has no experts ({m.arch}.expert_count)")
    gating = m.int("expert_gating_func", _GATING_SOFTMAX)
    if m.arch != "deepseek2" and gating != _GATING_SOFTMAX:
        raise ValueError(f"GGUF expert gating function {gating} is not supported for {m.arch} (only softmax)")
    return {
        "experts": experts,
        "used": m.int("expert_used_count"),
        "ff": _expert_ff(m, plan, first_moe_layer),
        "gating": gating,
    }


def _expert_ff(m: _Meta, plan: "_Planner", layer: int) -> int:
    ff = m.opt_int("expert_feed_forward_length")
    if ff is None:  # older files: read it off the stacked tensor, else the dense length
        t = plan.tensors.get(f"blk.{layer}.ffn_gate_exps.weight")
        ff = _numpy_shape(t)[1] if t is not None and len(t.shape) == 3 else m.int("feed_forward_length")
    return ff


# --- tensors --------------------------------------------------------------------------------


@dataclass
class _Entry:
    name: str
    shape: tuple[int, ...]
    make: Callable[[], Any]  # the array, or (stacked) an iterator of its shape[0] slices
    stacked: bool = False


def _numpy_shape(t: ReaderTensor) -> tuple[int, ...]:
    return tuple(int(d) for d in reversed(t.shape.tolist()))


class _Planner:
    """Lists every output tensor with its shape and a function that produces it.

    Shapes are known up front (the safetensors header needs them); data is dequantized only
    when written, one tensor (or one expert) at a time. Every GGUF tensor must be claimed:
    `finish` rejects files with tensors nobody asked for, since silently dropping them would
    give a wrong model.
    """

    def __init__(self, tensors: dict[str, ReaderTensor]):
        self.tensors = tensors
        self.used: set[str] = set()
        self.entries: list[_Entry] = []
        # maxsize=1: an upcycled layer writes the same dense MLP tensor E times in a row.
        self.load = functools.lru_cache(maxsize=1)(lambda gname: dequantize_tensor(tensors[gname]))

    def has(self, gname: str) -> bool:
        return gname in self.tensors

    def take(self, gname: str, *shapes: tuple[int, ...]) -> ReaderTensor:
        t = self.tensors.get(gname)
        if t is None:
            raise ValueError(f"GGUF is missing tensor {gname!r}")
        if _numpy_shape(t) not in shapes:
            raise ValueError(f"tensor {gname!r} has shape {_numpy_shape(t)}, expected {shapes[0]}")
        _check_type(t)  # fail before writing gigabytes, not halfway through
        self.used.add(gname)
        return t

    def add(
        self,
        hf_name: str,
        gname: str,
        shape: tuple[int, ...],
        fix: Callable[[np.ndarray], np.ndarray] | None = None,
        also: tuple[tuple[int, ...], ...] = (),
    ) -> None:
        """HF tensor `hf_name` is GGUF tensor `gname` (of `shape`, or one of `also` that `fix`
        turns into `shape`)."""
        self.take(gname, shape, *also)
        load = self.load
        self.entries.append(_Entry(hf_name, shape, (lambda: fix(load(gname))) if fix else (lambda: load(gname))))

    def add_array(self, hf_name: str, make: Callable[[], np.ndarray], shape: tuple[int, ...]) -> None:
        self.entries.append(_Entry(hf_name, shape, make))

    def add_experts(self, hf_pattern: str, gname: str, experts: int, shape: tuple[int, ...]) -> None:
        """A stacked [experts, *shape] GGUF tensor as one HF tensor per expert ({e} in the name)."""
        t = self.take(gname, (experts, *shape))
        for e in range(experts):
            self.entries.append(_Entry(hf_pattern.format(e=e), shape, functools.partial(dequantize_expert, t, e)))

    def add_stacked(
        self,
        hf_name: str,
        gname: str,
        gshape: tuple[int, ...],
        pick: Callable[[np.ndarray], np.ndarray] | None = None,
        shape: tuple[int, ...] | None = None,
    ) -> None:
        """A stacked [experts, ...] GGUF tensor as one stacked HF tensor (models whose checkpoints
        keep experts stacked: gpt-oss, Llama 4), still dequantized and written one expert at a
        time. `pick` takes each expert's part (e.g. the gate half of a fused gate/up tensor)."""
        t = self.take(gname, gshape)
        shape = shape or gshape

        def parts():
            for e in range(gshape[0]):
                a = dequantize_expert(t, e)
                yield pick(a) if pick else a

        self.entries.append(_Entry(hf_name, shape, parts, stacked=True))

    def skip(self, prefix: str, why: str) -> None:
        """Claim every tensor under `prefix` without writing it (`why` says why that is right)."""
        del why  # documentation at the call site
        for name in self.tensors:
            if name.startswith(prefix):
                _check_type(self.tensors[name])
                self.used.add(name)

    def finish(self) -> list[_Entry]:
        extra = sorted(set(self.tensors) - self.used)
        if extra:
            # e.g. rope_freqs.weight (Llama 3.1 rope scaling): dropping them would give a wrong model.
            raise ValueError(
                f"GGUF has tensors this importer does not understand: {', '.join(extra[:5])}"
                + (f" and {len(extra) - 5} more" if len(extra) > 5 else "")
            )
        return self.entries


def _add_embeddings(plan: _Planner, vocab: int, hidden: int, prefix: str = "") -> None:
    plan.add(f"{prefix}model.embed_tokens.weight", "token_embd.weight", (vocab, hidden))


def _add_head(plan: _Planner, vocab: int, hidden: int, *, always_lm_head: bool, prefix: str = "") -> bool:
    """Final norm and output projection; returns tie_word_embeddings. Models whose mlx-lm class
    always has an lm_head get a copy of the embedding when the file ties them."""
    plan.add(f"{prefix}model.norm.weight", "output_norm.weight", (hidden,))
    if plan.has("output.weight"):
        plan.add(f"{prefix}lm_head.weight", "output.weight", (vocab, hidden))
        return False
    if always_lm_head:
        plan.add(f"{prefix}lm_head.weight", "token_embd.weight", (vocab, hidden))
        return False
    return True


def _add_attention(
    plan: _Planner,
    i: int,
    hp: dict,
    *,
    permuted: bool,
    bias: bool = False,
    qk_norm: str | None = None,
    post_norm: str = "ffn_norm",
    out_bias: bool = False,
    prefix: str = "",
) -> None:
    """Norms and q/k/v/o of layer i. qk_norm: None, "head" (per head, Qwen3) or "full" (OLMoE).
    post_norm: the GGUF name of the norm before the FFN (ffn_norm, or post_attention_norm in
    gpt-oss and GLM-4.5); prefix: before HF's "model." (Llama 4's "language_model.")."""
    blk, hf = f"blk.{i}", f"{prefix}model.layers.{i}"
    hidden, hd = hp["hidden_size"], hp["head_dim"]
    heads, kv_heads = hp["num_attention_heads"], hp["num_key_value_heads"]
    q_rows, kv_rows = heads * hd, kv_heads * hd
    unq = (lambda w: undo_rope_permutation(w, heads)) if permuted else None
    unk = (lambda w: undo_rope_permutation(w, kv_heads)) if permuted else None
    plan.add(f"{hf}.input_layernorm.weight", f"{blk}.attn_norm.weight", (hidden,))
    plan.add(f"{hf}.self_attn.q_proj.weight", f"{blk}.attn_q.weight", (q_rows, hidden), unq)
    plan.add(f"{hf}.self_attn.k_proj.weight", f"{blk}.attn_k.weight", (kv_rows, hidden), unk)
    plan.add(f"{hf}.self_attn.v_proj.weight", f"{blk}.attn_v.weight", (kv_rows, hidden))
    if bias:
        plan.add(f"{hf}.self_attn.q_proj.bias", f"{blk}.attn_q.bias", (q_rows,), unq)
        plan.add(f"{hf}.self_attn.k_proj.bias", f"{blk}.attn_k.bias", (kv_rows,), unk)
        plan.add(f"{hf}.self_attn.v_proj.bias", f"{blk}.attn_v.bias", (kv_rows,))
    if qk_norm == "head":
        plan.add(f"{hf}.self_attn.q_norm.weight", f"{blk}.attn_q_norm.weight", (hd,))
        plan.add(f"{hf}.self_attn.k_norm.weight", f"{blk}.attn_k_norm.weight", (hd,))
    elif qk_norm == "full":
        plan.add(f"{hf}.self_attn.q_norm.weight", f"{blk}.attn_q_norm.weight", (q_rows,))
        plan.add(f"{hf}.self_attn.k_norm.weight", f"{blk}.attn_k_norm.weight", (kv_rows,))
    plan.add(f"{hf}.self_attn.o_proj.weight", f"{blk}.attn_output.weight", (hidden, q_rows))
    if out_bias:
        plan.add(f"{hf}.self_attn.o_proj.bias", f"{blk}.attn_output.bias", (hidden,))
    plan.add(f"{hf}.post_attention_layernorm.weight", f"{blk}.{post_norm}.weight", (hidden,))


_MLP = (("gate", "gate_proj", "w1"), ("up", "up_proj", "w3"), ("down", "down_proj", "w2"))


def _mlp_shape(proj: str, ff: int, hidden: int) -> tuple[int, int]:
    return (hidden, ff) if proj == "down" else (ff, hidden)


def _add_dense_mlp(plan: _Planner, blk: str, prefix: str, ff: int, hidden: int, suffix: str = "") -> None:
    """{prefix}.{gate,up,down}_proj.weight from {blk}.ffn_{gate,up,down}{suffix}.weight."""
    for g, proj, _ in _MLP:
        plan.add(f"{prefix}.{proj}.weight", f"{blk}.ffn_{g}{suffix}.weight", _mlp_shape(g, ff, hidden))


def _add_routed_experts(plan: _Planner, i: int, prefix: str, moe: dict, hidden: int, mixtral: bool = False) -> None:
    """Router and experts of layer i as {prefix}.gate.weight and {prefix}.experts.{e}.*."""
    blk, experts, ff = f"blk.{i}", moe["experts"], moe["ff"]
    plan.add(f"{prefix}.gate.weight", f"{blk}.ffn_gate_inp.weight", (experts, hidden))
    for g, proj, w in _MLP:
        hf = f"{prefix}.experts.{{e}}.{w if mixtral else proj}.weight"
        shape = _mlp_shape(g, ff, hidden)
        if mixtral and not plan.has(f"{blk}.ffn_{g}_exps.weight"):
            # Early Mixtral GGUFs store one tensor per expert: blk.N.ffn_gate.E.weight.
            for e in range(experts):
                plan.add(hf.format(e=e), f"{blk}.ffn_{g}.{e}.weight", shape)
            continue
        plan.add_experts(hf, f"{blk}.ffn_{g}_exps.weight", experts, shape)


# --- llama (dense, upcycled or Mixtral) -------------------------------------------------------


def _llama_hparams(m: _Meta, plan: _Planner) -> dict:
    hp = _attention_hparams(m, eps_default=1e-5)
    hp = {"hidden_size": hp.pop("hidden_size"), "intermediate_size": m.int("feed_forward_length"), **hp}
    scaling = _llama3_scaling(plan, m, hp["head_dim"], hp["rope_theta"]) or _rope_scaling(
        m, "llama", allowed=("linear",)
    )
    if scaling:
        hp["rope_scaling"] = scaling
    return hp


def _llama(m: _Meta, plan: _Planner, vocab: int, name: str, upcycle: int, per_token: int, seed: int) -> dict:
    hp = _llama_hparams(m, plan)
    hp["vocab_size"] = vocab
    moe = _moe_hparams(m, plan) if m.int("expert_count", 0) > 0 else None
    if moe and upcycle:
        raise ValueError(
            f"{name}: upcycle_experts needs a dense llama GGUF; this one already has {moe['experts']} experts"
        )
    experts, per_token = (moe["experts"], moe["used"]) if moe else (upcycle, per_token)
    if experts and hp["head_dim"] * hp["num_attention_heads"] != hp["hidden_size"]:
        # mlx-lm's Mixtral derives head_dim from hidden_size / heads.
        raise ValueError(
            f"{name}: head_dim {hp['head_dim']} x {hp['num_attention_heads']} heads "
            f"!= hidden size {hp['hidden_size']}; mixtral cannot express this model"
        )
    if experts and hp.get("rope_scaling"):
        raise ValueError(f"{name}: rope scaling is not supported by mlx-lm's mixtral")
    if moe:
        hp["intermediate_size"] = moe["ff"]

    hidden, inter = hp["hidden_size"], hp["intermediate_size"]
    _add_embeddings(plan, vocab, hidden)
    rng = np.random.default_rng(seed)
    for i in range(hp["num_hidden_layers"]):
        blk, hf = f"blk.{i}", f"model.layers.{i}"
        _add_attention(plan, i, hp, permuted=True)  # llama.cpp permutes llama q/k rows
        if moe:
            _add_routed_experts(plan, i, f"{hf}.block_sparse_moe", moe, hidden, mixtral=True)
        elif not experts:
            _add_dense_mlp(plan, blk, f"{hf}.mlp", inter, hidden)
        else:
            sparse = f"{hf}.block_sparse_moe"
            router = (rng.standard_normal((experts, hidden)) * 0.02).astype(np.float32)
            plan.add_array(f"{sparse}.gate.weight", lambda r=router: r, router.shape)
            for g, _, w in _MLP:
                for e in range(experts):
                    plan.add(f"{sparse}.experts.{e}.{w}.weight", f"{blk}.ffn_{g}.weight", _mlp_shape(g, inter, hidden))
    hp["tie_word_embeddings"] = _add_head(plan, vocab, hidden, always_lm_head=False)
    return _model_config(hp, experts, per_token)


def _model_config(hp: dict, experts: int, experts_per_token: int) -> dict:
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
    return config


# --- Qwen2-MoE, Qwen3-MoE, OLMoE -------------------------------------------------------------


def _qwen3moe(m: _Meta, plan: _Planner, vocab: int) -> dict:
    hp = _attention_hparams(m, eps_default=1e-6)
    _rope_scaling(m, "qwen3_moe")  # mlx-lm's qwen3_moe has plain RoPE only
    moe = _moe_hparams(m, plan)
    hidden = hp["hidden_size"]
    _add_embeddings(plan, vocab, hidden)
    for i in range(hp["num_hidden_layers"]):
        _add_attention(plan, i, hp, permuted=False, qk_norm="head")
        _add_routed_experts(plan, i, f"model.layers.{i}.mlp", moe, hidden)
    tied = _add_head(plan, vocab, hidden, always_lm_head=False)
    return {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        **hp,
        "vocab_size": vocab,
        "intermediate_size": m.int("feed_forward_length", moe["ff"]),
        "moe_intermediate_size": moe["ff"],
        "num_experts": moe["experts"],
        "num_experts_per_tok": moe["used"],
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        # llama.cpp always renormalises the chosen Qwen3-MoE expert weights.
        "norm_topk_prob": m.flag("expert_weights_norm", True),
        "tie_word_embeddings": tied,
        "hidden_act": "silu",
        "attention_bias": False,
    }


def _qwen2moe(m: _Meta, plan: _Planner, vocab: int) -> dict:
    hp = _attention_hparams(m, eps_default=1e-6)
    _rope_scaling(m, "qwen2_moe")
    if hp["head_dim"] * hp["num_attention_heads"] != hp["hidden_size"]:
        raise ValueError(
            f"GGUF head_dim {hp['head_dim']} x {hp['num_attention_heads']} heads != "
            f"hidden size {hp['hidden_size']}; mlx-lm's qwen2_moe cannot express this"
        )
    if m.flag("expert_weights_norm", False):
        raise ValueError("GGUF renormalises the chosen expert weights; mlx-lm's qwen2_moe does not")
    moe = _moe_hparams(m, plan)
    hidden = hp["hidden_size"]
    shared_ff = m.opt_int("expert_shared_feed_forward_length")
    if shared_ff is None and plan.has("blk.0.ffn_gate_shexp.weight"):
        shared_ff = _numpy_shape(plan.tensors["blk.0.ffn_gate_shexp.weight"])[0]
    if shared_ff is None:
        raise ValueError("GGUF qwen2moe file has no shared expert; mlx-lm's qwen2_moe needs one")
    _add_embeddings(plan, vocab, hidden)
    for i in range(hp["num_hidden_layers"]):
        blk, prefix = f"blk.{i}", f"model.layers.{i}.mlp"
        _add_attention(plan, i, hp, permuted=False, bias=True)
        _add_routed_experts(plan, i, prefix, moe, hidden)
        _add_dense_mlp(plan, blk, f"{prefix}.shared_expert", shared_ff, hidden, suffix="_shexp")
        # HF [1, hidden]; older converters squeezed it to [hidden].
        plan.add(
            f"{prefix}.shared_expert_gate.weight",
            f"{blk}.ffn_gate_inp_shexp.weight",
            (1, hidden),
            lambda w: w.reshape(1, hidden),
            also=((hidden,),),
        )
    _add_head(plan, vocab, hidden, always_lm_head=True)
    return {
        "architectures": ["Qwen2MoeForCausalLM"],
        "model_type": "qwen2_moe",
        **hp,
        "vocab_size": vocab,
        "intermediate_size": m.int("feed_forward_length", moe["ff"]),
        "moe_intermediate_size": moe["ff"],
        "shared_expert_intermediate_size": shared_ff,
        "num_experts": moe["experts"],
        "num_experts_per_tok": moe["used"],
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "norm_topk_prob": False,
        "tie_word_embeddings": False,
        "hidden_act": "silu",
    }


def _olmoe(m: _Meta, plan: _Planner, vocab: int) -> dict:
    hp = _attention_hparams(m, eps_default=1e-5)
    scaling = _rope_scaling(m, "olmoe", allowed=("linear",))
    moe = _moe_hparams(m, plan)
    hidden = hp["hidden_size"]
    _add_embeddings(plan, vocab, hidden)
    for i in range(hp["num_hidden_layers"]):
        _add_attention(plan, i, hp, permuted=False, qk_norm="full")
        _add_routed_experts(plan, i, f"model.layers.{i}.mlp", moe, hidden)
    tied = _add_head(plan, vocab, hidden, always_lm_head=False)
    return {
        "architectures": ["OlmoeForCausalLM"],
        "model_type": "olmoe",
        **hp,
        "vocab_size": vocab,
        "intermediate_size": moe["ff"],
        "num_experts": moe["experts"],
        "num_experts_per_tok": moe["used"],
        "norm_topk_prob": m.flag("expert_weights_norm", False),
        "rope_scaling": scaling,
        "tie_word_embeddings": tied,
        "attention_bias": False,
        "clip_qkv": None,
        "hidden_act": "silu",
    }


# --- DeepSeek V2 / V3 (MLA attention) ----------------------------------------------------------


def _deepseek2(m: _Meta, plan: _Planner, vocab: int) -> dict:
    hidden = m.int("embedding_length")
    layers = m.int("block_count")
    heads = m.int("attention.head_count")
    q_lora = m.opt_int("attention.q_lora_rank") or None
    kv_lora = m.int("attention.kv_lora_rank")
    rope_dim = m.int("rope.dimension_count")
    # Since llama.cpp's MLA rework, key/value_length describe the compressed cache and the
    # per-head sizes moved to *_mla; older files have only key/value_length.
    q_head = m.opt_int("attention.key_length_mla") or m.int("attention.key_length")
    v_head = m.opt_int("attention.value_length_mla") or m.int("attention.value_length")
    nope = q_head - rope_dim
    if nope <= 0:
        raise ValueError(f"GGUF deepseek2 head size {q_head} is not larger than its rotary part {rope_dim}")
    experts = m.int("expert_count", 0)
    dense_layers = m.int("leading_dense_block_count", 0 if experts else layers)
    ff = m.int("feed_forward_length")
    eps = m.float("attention.layer_norm_rms_epsilon", 1e-6)

    moe = None
    if experts:
        moe = _moe_hparams(m, plan, first_moe_layer=dense_layers)
        shared = m.int("expert_shared_count", 0)
        groups = m.int("expert_group_count", 1)
        groups_used = m.int("expert_group_used_count", 1)
        norm = m.flag("expert_weights_norm", False)
        has_bias = any(plan.has(f"blk.{i}.exp_probs_b.bias") for i in range(layers))
        if moe["gating"] == _GATING_SIGMOID:
            model_type = "deepseek_v3"
        elif moe["gating"] == _GATING_SOFTMAX:
            model_type = "deepseek_v2"
            if has_bias:
                raise ValueError(
                    "GGUF deepseek2 has an exp_probs_b correction bias with softmax "
                    "routing; neither deepseek_v2 nor deepseek_v3 in mlx-lm does that"
                )
            if norm:
                raise ValueError("GGUF deepseek2 renormalises softmax expert weights; mlx-lm's deepseek_v2 does not")
        else:
            raise ValueError(
                f"GGUF expert gating function {moe['gating']} is not supported for deepseek2 (softmax or sigmoid)"
            )
    else:
        model_type = "deepseek_v2"
    scaling = _rope_scaling(m, model_type, allowed=("yarn",))
    if scaling is None and model_type == "deepseek_v2":
        scaling = {"type": "yarn", "factor": 1.0}  # mlx-lm's deepseek_v2 needs one; plain RoPE

    _add_embeddings(plan, vocab, hidden)
    for i in range(layers):
        blk, hf = f"blk.{i}", f"model.layers.{i}"
        attn = f"{hf}.self_attn"
        plan.add(f"{hf}.input_layernorm.weight", f"{blk}.attn_norm.weight", (hidden,))
        if q_lora:
            plan.add(f"{attn}.q_a_proj.weight", f"{blk}.attn_q_a.weight", (q_lora, hidden))
            plan.add(f"{attn}.q_a_layernorm.weight", f"{blk}.attn_q_a_norm.weight", (q_lora,))
            plan.add(f"{attn}.q_b_proj.weight", f"{blk}.attn_q_b.weight", (heads * q_head, q_lora))
        else:
            plan.add(f"{attn}.q_proj.weight", f"{blk}.attn_q.weight", (heads * q_head, hidden))
        plan.add(f"{attn}.kv_a_proj_with_mqa.weight", f"{blk}.attn_kv_a_mqa.weight", (kv_lora + rope_dim, hidden))
        plan.add(f"{attn}.kv_a_layernorm.weight", f"{blk}.attn_kv_a_norm.weight", (kv_lora,))
        _add_kv_b(plan, blk, f"{attn}.kv_b_proj.weight", heads, nope, v_head, kv_lora)
        plan.add(f"{attn}.o_proj.weight", f"{blk}.attn_output.weight", (hidden, heads * v_head))
        plan.add(f"{hf}.post_attention_layernorm.weight", f"{blk}.ffn_norm.weight", (hidden,))
        if moe is None or i < dense_layers:
            _add_dense_mlp(plan, blk, f"{hf}.mlp", ff, hidden)
            continue
        _add_routed_experts(plan, i, f"{hf}.mlp", moe, hidden)
        if model_type == "deepseek_v3":
            bias = f"{hf}.mlp.gate.e_score_correction_bias"
            if plan.has(f"{blk}.exp_probs_b.bias"):
                plan.add(bias, f"{blk}.exp_probs_b.bias", (experts,))
            else:
                plan.add_array(bias, lambda: np.zeros(experts, np.float32), (experts,))
        if shared:
            _add_dense_mlp(plan, blk, f"{hf}.mlp.shared_experts", moe["ff"] * shared, hidden, "_shexp")
    _add_head(plan, vocab, hidden, always_lm_head=True)

    config = {
        "architectures": ["DeepseekV3ForCausalLM" if model_type == "deepseek_v3" else "DeepseekV2ForCausalLM"],
        "model_type": model_type,
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": ff,
        "moe_intermediate_size": moe["ff"] if moe else ff,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": heads,
        "n_shared_experts": (shared or None) if moe else None,
        "n_routed_experts": experts or None,
        "routed_scaling_factor": m.float("expert_weights_scale", 1.0),
        "kv_lora_rank": kv_lora,
        "q_lora_rank": q_lora,
        "qk_rope_head_dim": rope_dim,
        "v_head_dim": v_head,
        "qk_nope_head_dim": nope,
        "num_experts_per_tok": moe["used"] if moe else None,
        "moe_layer_freq": 1,
        "first_k_dense_replace": dense_layers,
        "max_position_embeddings": m.int("context_length", 4096),
        "rms_norm_eps": eps,
        "rope_theta": m.float("rope.freq_base", 10000.0),
        "rope_scaling": scaling,
        "attention_bias": False,
        "tie_word_embeddings": False,
        "hidden_act": "silu",
    }
    if moe:
        if model_type == "deepseek_v3":
            config.update(
                topk_method="noaux_tc",
                scoring_func="sigmoid",
                norm_topk_prob=norm,
                n_group=groups,
                topk_group=groups_used,
            )
        else:
            config.update(
                topk_method="group_limited_greedy" if groups > 1 else "greedy",
                scoring_func="softmax",
                norm_topk_prob=False,
                n_group=groups,
                topk_group=groups_used,
            )
    return config


def _add_kv_b(plan: _Planner, blk: str, hf_name: str, heads: int, nope: int, v_head: int, kv_lora: int) -> None:
    """kv_b_proj [heads * (nope + v), kv_lora]: the file's attn_kv_b, or rebuilt from the
    attn_k_b [heads, kv_lora, nope] and attn_v_b [heads, v, kv_lora] that llama.cpp splits it into."""
    shape = (heads * (nope + v_head), kv_lora)
    k_b, v_b = f"{blk}.attn_k_b.weight", f"{blk}.attn_v_b.weight"
    if plan.has(f"{blk}.attn_kv_b.weight"):
        plan.add(hf_name, f"{blk}.attn_kv_b.weight", shape)
        for redundant, s in ((k_b, (heads, kv_lora, nope)), (v_b, (heads, v_head, kv_lora))):
            if plan.has(redundant):  # some files carry both forms
                plan.take(redundant, s)
        return
    plan.take(k_b, (heads, kv_lora, nope))
    plan.take(v_b, (heads, v_head, kv_lora))

    def make() -> np.ndarray:
        k = dequantize_tensor(plan.tensors[k_b]).transpose(0, 2, 1)  # [heads, nope, kv_lora]
        v = dequantize_tensor(plan.tensors[v_b])
        return np.concatenate([k, v], axis=1).reshape(shape)

    plan.add_array(hf_name, make, shape)


# --- Llama 3 rope scaling, stored by llama.cpp as rope_freqs.weight --------------------------------


def _llama3_scaling(plan: _Planner, m: _Meta, head_dim: int, base: float) -> dict | None:
    """The "llama3" rope_scaling that rope_freqs.weight came from, or None without one.

    llama.cpp's converter (LlamaModel.generate_extra_tensors) turns Llama 3's rope_scaling into
    one factor per rotated pair, dividing the pair's frequency: 1 for short wavelengths
    (< original_context / high_freq_factor), `factor` for long ones (> original_context /
    low_freq_factor) and 1 / ((1 - s) / factor + s) in between, s = (original_context /
    wavelength - low_freq_factor) / (high_freq_factor - low_freq_factor). The factors depend on
    original_context only through the two ratios, so any context length rebuilds them; the
    file's own (rope.scaling.original_context_length, else the converter's default 8192) is used.
    """
    if not plan.has("rope_freqs.weight"):
        return None
    t = plan.take("rope_freqs.weight", (head_dim // 2,))
    f = dequantize_tensor(t).astype(np.float64)
    if np.allclose(f, 1.0, rtol=0, atol=1e-6):
        return None
    factor = float(f.max())
    old = m.int("rope.scaling.original_context_length", 8192)
    wavelen = 2 * math.pi * base ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    short = np.isclose(f, 1.0, rtol=1e-5)
    long = np.isclose(f, factor, rtol=1e-5)
    mid = ~(short | long)
    n_short, n_mid = int(short.sum()), int(mid.sum())
    # Wavelengths grow with the pair index: short pairs first, then the blend, then long ones.
    if not (short[:n_short].all() and mid[n_short : n_short + n_mid].all()):
        raise ValueError("GGUF rope_freqs.weight does not follow Llama 3 rope scaling")
    blend = (1 / f[mid] - 1 / factor) / (1 - 1 / factor)  # s of the blended pairs
    # In x = original_context / wavelength (falling with the pair index) the thresholds are
    # x = high_freq_factor and x = low_freq_factor, and s = (x - low) / (high - low).
    x = old / wavelen
    first = n_short  # the first pair that is not short
    x_prev = x[first - 1] if first else 2 * x[0]
    if n_mid >= 2:  # s is linear in x: the fit gives both factors
        slope, icept = np.polyfit(x[mid], blend, 1)
        low = -icept / slope
        high = low + 1 / slope
    elif n_mid == 0:  # both thresholds between the last short pair and the first long one
        low = high = math.sqrt(x_prev * x[first])
    else:  # one blended pair fixes s there; pick low between it and the next pair, then high
        xm, sm = x[first], blend[0]
        low = (xm + x[first + 1]) / 2
        for _ in range(60):
            high = low + (xm - low) / sm
            if high < x_prev:
                break
            low = (low + xm) / 2
    for digits in (6, 17):  # round trips like 1.0000001 -> 1.0 when that still fits
        scaling = {
            "rope_type": "llama3",
            "factor": float(f"{factor:.{digits}g}"),
            "low_freq_factor": float(f"{low:.{digits}g}"),
            "high_freq_factor": float(f"{high:.{digits}g}"),
            "original_max_position_embeddings": old,
        }
        if np.allclose(_llama3_factors(scaling, wavelen), f, rtol=1e-5, atol=0):
            return scaling
    raise ValueError("GGUF rope_freqs.weight does not follow Llama 3 rope scaling")


def _llama3_factors(scaling: dict, wavelen: np.ndarray) -> np.ndarray:
    """Per-pair divisors of the Llama 3 rope scaling (the formula in _llama3_scaling)."""
    factor, old = scaling["factor"], scaling["original_max_position_embeddings"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    out = np.ones_like(wavelen)
    out[wavelen > old / low] = factor
    mid = (wavelen >= old / high) & (wavelen <= old / low)
    if high != low and mid.any():
        s = (old / wavelen[mid] - low) / (high - low)
        out[mid] = 1 / ((1 - s) / factor + s)
    return out


# --- gpt-oss ---------------------------------------------------------------------------------------

# llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE_SOFTMAX_WEIGHT (llama-hparams.h): softmax over the
# chosen experts' logits, which is what gpt-oss does.
_GATING_SOFTMAX_WEIGHT = 3


def _gpt_oss(m: _Meta, plan: _Planner, vocab: int) -> dict:
    """gpt-oss (llama.cpp arch "gpt-oss", LLM_ARCH_OPENAI_MOE) -> mlx-lm gpt_oss.

    llama.cpp's converter (GptOssModel) splits HF's interleaved gate_up_proj (gate rows even,
    up rows odd) into ffn_gate_exps / ffn_up_exps and their biases (or, with
    --fuse-gate-up-exps, stores them gate-then-up as ffn_gate_up_exps), writes the attention
    sinks as attn_sinks.weight and leaves q/k unpermuted (NEOX RoPE). mlx-lm keeps experts
    stacked (mlp.experts.{gate,up,down}_proj), which its sanitize() accepts as they are.
    Sliding-window attention alternates: even layers use the window (llama.cpp: swa pattern 2).
    """
    hp = _attention_hparams(m, eps_default=1e-5)
    hidden, layers = hp["hidden_size"], hp["num_hidden_layers"]
    if layers < 2:
        raise ValueError("GGUF gpt-oss needs at least 2 layers (one sliding, one full attention)")
    experts = m.int("expert_count", 0)
    if experts <= 0:
        raise ValueError("GGUF gpt-oss file has no experts (gpt-oss.expert_count)")
    gating = m.int("expert_gating_func", _GATING_SOFTMAX_WEIGHT)
    if gating != _GATING_SOFTMAX_WEIGHT:
        raise ValueError(
            f"GGUF expert gating function {gating} is not supported for gpt-oss (only softmax over the chosen experts)"
        )
    clamp = m.get("swiglu_clamp_exp", None)
    if clamp is not None and any(abs(float(c) - 7.0) > 1e-6 for c in np.atleast_1d(clamp) if c):
        raise ValueError("GGUF gpt-oss clamps its SwiGLU at other than 7.0; mlx-lm's gpt_oss uses 7.0")
    ff = m.opt_int("expert_feed_forward_length") or m.int("feed_forward_length")
    window = m.int("attention.sliding_window")
    scaling = _gpt_oss_rope_scaling(m)

    _add_embeddings(plan, vocab, hidden)
    q_heads = hp["num_attention_heads"]
    for i in range(layers):
        blk, hf = f"blk.{i}", f"model.layers.{i}"
        _add_attention(plan, i, hp, permuted=False, bias=True, out_bias=True, post_norm="post_attention_norm")
        plan.add(f"{hf}.self_attn.sinks", f"{blk}.attn_sinks.weight", (q_heads,))
        plan.add(f"{hf}.mlp.router.weight", f"{blk}.ffn_gate_inp.weight", (experts, hidden))
        plan.add(f"{hf}.mlp.router.bias", f"{blk}.ffn_gate_inp.bias", (experts,))
        _add_stacked_experts(plan, blk, f"{hf}.mlp.experts", experts, ff, hidden, bias=True)
    _add_head(plan, vocab, hidden, always_lm_head=True)
    return {
        "architectures": ["GptOssForCausalLM"],
        "model_type": "gpt_oss",
        **hp,
        "vocab_size": vocab,
        "intermediate_size": ff,
        "num_local_experts": experts,
        "num_experts_per_tok": m.int("expert_used_count"),
        "experts_per_token": m.int("expert_used_count"),
        "sliding_window": window,
        "layer_types": ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)],
        "rope_scaling": scaling,
        "tie_word_embeddings": False,
        "attention_bias": True,
        "swiglu_limit": 7.0,
        "hidden_act": "silu",
    }


def _gpt_oss_rope_scaling(m: _Meta) -> dict | None:
    scaling = m.get("rope.scaling.type", "none")
    if scaling == "none":
        return None
    if scaling != "yarn":
        raise ValueError(f"GGUF rope scaling type {scaling!r} is not supported for gpt_oss")
    for key in ("rope.scaling.yarn_attn_factor", "rope.scaling.yarn_ext_factor"):
        if m.get(key, None) is not None:
            raise ValueError(f"GGUF sets {m.arch}.{key}; mlx-lm's YaRN RoPE has no such setting")
    # HF's gpt-oss config also says "truncate": false; llama.cpp keeps no such key.
    return {
        "rope_type": "yarn",
        "factor": m.float("rope.scaling.factor"),
        "original_max_position_embeddings": m.int("rope.scaling.original_context_length"),
        "beta_fast": m.float("rope.scaling.yarn_beta_fast", 32.0),
        "beta_slow": m.float("rope.scaling.yarn_beta_slow", 1.0),
        "truncate": False,
    }


def _add_stacked_experts(
    plan: _Planner, blk: str, prefix: str, experts: int, ff: int, hidden: int, bias: bool = False
) -> None:
    """{prefix}.{gate,up,down}_proj.weight (and .bias) stacked over experts, from the GGUF's
    ffn_{gate,up,down}_exps, or from a fused ffn_gate_up_exps (gate rows, then up rows)."""
    kinds = ("weight", "bias") if bias else ("weight",)
    fused = f"{blk}.ffn_gate_up_exps.weight"
    for kind in kinds:

        def gshape(g: str) -> tuple[int, ...]:
            shape = (experts, *_mlp_shape(g, ff, hidden))
            return shape if kind == "weight" else shape[:2]

        if plan.has(fused):
            both = f"{blk}.ffn_gate_up_exps.{kind}"
            full = (experts, 2 * ff, hidden)[: 3 if kind == "weight" else 2]
            plan.add_stacked(f"{prefix}.gate_proj.{kind}", both, full, lambda a: a[:ff], gshape("gate"))
            plan.add_stacked(f"{prefix}.up_proj.{kind}", both, full, lambda a: a[ff:], gshape("up"))
        else:
            for g in ("gate", "up"):
                plan.add_stacked(f"{prefix}.{g}_proj.{kind}", f"{blk}.ffn_{g}_exps.{kind}", gshape(g))
        plan.add_stacked(f"{prefix}.down_proj.{kind}", f"{blk}.ffn_down_exps.{kind}", gshape("down"))


# --- GLM-4.5 (glm4moe) -------------------------------------------------------------------------------


def _glm4moe(m: _Meta, plan: _Planner, vocab: int) -> dict:
    """GLM-4.5 / 4.6 (llama.cpp arch "glm4moe") -> mlx-lm glm4_moe.

    llama.cpp's converter (Glm4MoeModel) counts the multi-token-prediction layers in
    block_count (nextn_predict_layers of them, after the main ones), stacks the experts, keeps
    q/k unpermuted (NEOX RoPE over the first rope.dimension_count dims of each head) and routes
    with sigmoid scores plus the exp_probs_b correction bias. mlx-lm's sanitize drops the MTP
    layers, so they are not written here.
    """
    total = m.int("block_count")
    nextn = m.int("nextn_predict_layers", 0)
    layers = total - nextn
    hidden = m.int("embedding_length")
    heads = m.int("attention.head_count")
    head_dim = m.int("attention.key_length", hidden // heads)
    if m.int("attention.value_length", head_dim) != head_dim:
        raise ValueError("GGUF has different key and value head sizes; glm4_moe needs them equal")
    rope_dim = m.int("rope.dimension_count", head_dim // 2)
    if not 0 < rope_dim <= head_dim or rope_dim % 2:
        raise ValueError(f"GGUF glm4moe rotates {rope_dim} of {head_dim} head dims")
    _rope_scaling(m, "glm4_moe")  # mlx-lm's glm4_moe has plain RoPE only
    hp = {
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": m.int("attention.head_count_kv", heads),
        "head_dim": head_dim,
    }
    experts = m.int("expert_count", 0)
    if experts <= 0:
        raise ValueError("GGUF glm4moe file has no experts (glm4moe.expert_count)")
    gating = m.int("expert_gating_func", _GATING_SIGMOID)
    if gating != _GATING_SIGMOID:
        raise ValueError(f"GGUF expert gating function {gating} is not supported for glm4moe (only sigmoid)")
    dense = m.int("leading_dense_block_count", 0)
    ff, shared = m.int("feed_forward_length"), m.int("expert_shared_count", 0)
    moe = {"experts": experts, "used": m.int("expert_used_count"), "ff": _expert_ff(m, plan, dense)}
    qk_norm = plan.has("blk.0.attn_q_norm.weight")
    bias = plan.has("blk.0.attn_q.bias")

    _add_embeddings(plan, vocab, hidden)
    for i in range(layers):
        blk, hf = f"blk.{i}", f"model.layers.{i}"
        _add_attention(
            plan, i, hp, permuted=False, bias=bias, qk_norm="head" if qk_norm else None, post_norm="post_attention_norm"
        )
        if i < dense:
            _add_dense_mlp(plan, blk, f"{hf}.mlp", ff, hidden)
            continue
        _add_routed_experts(plan, i, f"{hf}.mlp", moe, hidden)
        corr = f"{hf}.mlp.gate.e_score_correction_bias"
        if plan.has(f"{blk}.exp_probs_b.bias"):
            plan.add(corr, f"{blk}.exp_probs_b.bias", (experts,))
        else:
            plan.add_array(corr, lambda: np.zeros(experts, np.float32), (experts,))
        if shared:
            _add_dense_mlp(plan, blk, f"{hf}.mlp.shared_experts", moe["ff"] * shared, hidden, "_shexp")
    for i in range(layers, total):
        plan.skip(f"blk.{i}.", "multi-token-prediction layer: mlx-lm's glm4_moe drops it")
    _add_head(plan, vocab, hidden, always_lm_head=True)
    return {
        "architectures": ["Glm4MoeForCausalLM"],
        "model_type": "glm4_moe",
        **hp,
        "vocab_size": vocab,
        "intermediate_size": ff,
        "moe_intermediate_size": moe["ff"],
        "max_position_embeddings": m.int("context_length", 4096),
        "rms_norm_eps": m.float("attention.layer_norm_rms_epsilon", 1e-5),
        "rope_theta": m.float("rope.freq_base", 10000.0),
        "rope_scaling": None,
        "partial_rotary_factor": rope_dim / head_dim,
        "use_qk_norm": qk_norm,
        "attention_bias": bias,
        "n_routed_experts": experts,
        "n_shared_experts": shared or None,
        "num_experts_per_tok": moe["used"],
        "first_k_dense_replace": dense,
        "norm_topk_prob": m.flag("expert_weights_norm", False),
        "routed_scaling_factor": m.float("expert_weights_scale", 1.0),
        "n_group": m.int("expert_group_count", 1),
        "topk_group": m.int("expert_group_used_count", 1),
        "topk_method": "noaux_tc",
        "scoring_func": "sigmoid",
        "num_nextn_predict_layers": nextn,
        "tie_word_embeddings": False,
        "hidden_act": "silu",
    }


# --- Llama 4 -------------------------------------------------------------------------------------------


def _llama4(m: _Meta, plan: _Planner, vocab: int) -> dict:
    """Llama 4 Scout / Maverick (llama.cpp arch "llama4") -> mlx-lm llama4.

    llama.cpp's converter (Llama4Model) writes q/k unpermuted (undo_permute = False), splits
    HF's stacked gate_up_proj [experts, hidden, 2 * ff] into ffn_gate_exps / ffn_up_exps and
    transposes down_proj, keeps the dense FFN size (intermediate_size_mlp) as
    feed_forward_length and the expert size as expert_feed_forward_length, and every
    interleave_moe_layer_step-th layer is MoE (a routed top-1 expert plus a shared one).
    llama.cpp fixes the rest for "llama4" (llama-model.cpp), as mlx-lm's llama4 does: chunked
    attention in 8192-token chunks on three of every four layers, the fourth without RoPE and
    with attention temperature tuning (floor 8192, scale 0.1), and a weightless q/k RMS norm
    unless the model has 128 experts (Maverick).
    """
    hp = _attention_hparams(m, eps_default=1e-5)
    hidden, layers = hp["hidden_size"], hp["num_hidden_layers"]
    experts = m.int("expert_count", 0)
    if experts <= 0:
        raise ValueError("GGUF llama4 file has no experts (a dense MobileLLM); mlx-lm's llama4 needs them")
    used = m.int("expert_used_count")
    if used != 1:
        raise ValueError(f"GGUF llama4 routes {used} experts per token; mlx-lm's llama4 supports 1")
    window = m.opt_int("attention.sliding_window")
    if window == 0:
        raise ValueError("GGUF llama4 turns chunked attention off (sliding_window 0); mlx-lm's llama4 cannot")
    step = m.int("interleave_moe_layer_step", 1)
    ff_moe = _expert_ff(m, plan, step - 1)
    ff = m.int("feed_forward_length")
    scaling = _llama3_scaling(plan, m, hp["head_dim"], hp["rope_theta"]) or _rope_scaling(
        m, "llama4", allowed=("linear",)
    )
    bias = plan.has("blk.0.attn_q.bias")
    lm = "language_model."
    _add_embeddings(plan, vocab, hidden, prefix=lm)
    for i in range(layers):
        blk, hf = f"blk.{i}", f"{lm}model.layers.{i}.feed_forward"
        _add_attention(plan, i, hp, permuted=False, bias=bias, out_bias=bias, prefix=lm)
        if (i + 1) % step:
            _add_dense_mlp(plan, blk, hf, ff, hidden)
            continue
        plan.add(f"{hf}.router.weight", f"{blk}.ffn_gate_inp.weight", (experts, hidden))
        _add_stacked_experts(plan, blk, f"{hf}.experts", experts, ff_moe, hidden)
        _add_dense_mlp(plan, blk, f"{hf}.shared_expert", ff_moe, hidden, "_shexp")
    _add_head(plan, vocab, hidden, always_lm_head=True, prefix=lm)
    text = {
        "model_type": "llama4_text",
        **hp,
        "vocab_size": vocab,
        "intermediate_size": ff_moe,
        "intermediate_size_mlp": ff,
        "num_local_experts": experts,
        "num_experts_per_tok": used,
        "interleave_moe_layer_step": step,
        "attention_chunk_size": 8192,
        "attention_bias": bias,
        "use_qk_norm": experts != 128,
        "attn_temperature_tuning": True,
        "floor_scale": 8192,
        "attn_scale": 0.1,
        "no_rope_layers": [int((i + 1) % 4 != 0) for i in range(layers)],
        "rope_scaling": scaling,
        "tie_word_embeddings": False,
        "hidden_act": "silu",
    }
    return {
        "architectures": ["Llama4ForConditionalGeneration"],
        "model_type": "llama4",
        "text_config": text,
        "tie_word_embeddings": False,
    }


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
            made = e.make()
            parts = made if e.stacked else (made,)
            n = 0
            for part in parts:
                arr = np.ascontiguousarray(part, dtype="<f4")
                want = e.shape[1:] if e.stacked else e.shape
                if arr.shape != want:
                    raise ValueError(f"{e.name}: produced shape {arr.shape}, expected {want}")
                arr.tofile(f)
                n += 1
            if e.stacked and n != e.shape[0]:
                raise ValueError(f"{e.name}: produced {n} slices, expected {e.shape[0]}")


# --- tokenizer ------------------------------------------------------------------------------


def _pre_tokenizer(pre: str):
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in ("gpt2", "olmo"):  # llama.cpp splits OLMo text with the GPT-2 pattern
        return byte_level
    if pre == "smollm":
        # SmolLM splits every digit on its own before the GPT-2 split.
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    patterns = _PRE_PATTERNS.get(pre)
    if patterns is None:
        raise ValueError(
            f"GGUF pre-tokenizer {pre!r} is not supported "
            f"(supported: {', '.join(repr(p) for p in ('gpt2', 'olmo', 'smollm', *_PRE_PATTERNS))})"
        )
    return pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(p), behavior="isolated") for p in patterns]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )


def _build_tokenizer(reader: GGUFReader, tokens: list[str]) -> tuple[Tokenizer, dict]:
    """Rebuild tokenizer.json from tokenizer.ggml.* metadata: byte-level BPE ("gpt2") or
    SentencePiece ("llama")."""
    model = _meta(reader, "tokenizer.ggml.model")
    types = _meta(reader, "tokenizer.ggml.token_type", [TokenType.NORMAL] * len(tokens))
    if len(types) != len(tokens):
        raise ValueError(f"GGUF lists {len(tokens)} tokens but {len(types)} token types")
    special = {}
    for name in ("bos", "eos", "unknown", "padding", "eot", "eom"):
        value = _meta(reader, f"tokenizer.ggml.{name}_token_id", None)
        if value is not None and 0 <= int(value) < len(tokens):
            special[name] = int(value)

    if model == "gpt2":
        pre = _meta(reader, "tokenizer.ggml.pre", "default")
        tokenizer = _bpe_tokenizer(reader, tokens, pre)
        if pre in ("glm4", "chatglm-bpe"):
            special.pop("bos", None)  # llama.cpp drops the BOS of GLM-4 vocabularies
    elif model == "llama":
        # llama.cpp's defaults for SentencePiece vocabularies that do not name them.
        for name, default in (("bos", 1), ("eos", 2), ("unknown", 0)):
            if _meta(reader, f"tokenizer.ggml.{name}_token_id", None) is None and default < len(tokens):
                special[name] = default
        tokenizer = _spm_tokenizer(reader, tokens, types, special.get("unknown"))
    else:
        raise ValueError(
            f"GGUF tokenizer model {model!r} is not supported (supported: 'gpt2' byte-level BPE, 'llama' SentencePiece)"
        )

    # Control/unknown tokens are special (skipped when decoding); user-defined ones are plain
    # added tokens. Both match as whole strings before the model runs.
    added = []
    for tok, kind in zip(tokens, types):
        if kind in (TokenType.CONTROL, TokenType.UNKNOWN):
            added.append(AddedToken(tok, special=True, normalized=False))
        elif kind == TokenType.USER_DEFINED:
            added.append(AddedToken(tok, special=False, normalized=False))
    tokenizer.add_tokens(added)

    # BOS/EOS insertion when the GGUF asks for it (Llama 3 style); SmolLM2 asks for neither.
    # SentencePiece vocabularies add BOS unless told otherwise (llama.cpp's default for them).
    add_bos = _meta(reader, "tokenizer.ggml.add_bos_token", model == "llama")
    bos = [special["bos"]] if add_bos and "bos" in special else []
    eos = [special["eos"]] if _meta(reader, "tokenizer.ggml.add_eos_token", False) and "eos" in special else []
    if bos or eos:

        def piece(ids: list[int], seq: int) -> list[str]:
            return [f"{tokens[i]}:{seq}" for i in ids]

        single = piece(bos, 0) + ["$A:0"] + piece(eos, 0)
        tokenizer.post_processor = processors.TemplateProcessing(
            single=single,
            pair=single + piece(bos, 1) + ["$B:1"] + piece(eos, 1),
            special_tokens=[(tokens[i], i) for i in dict.fromkeys(bos + eos)],
        )
    special["add_bos"], special["add_eos"] = bool(bos), bool(eos)
    return tokenizer, special


def _vocab(tokens: list[str]) -> dict[str, int]:
    vocab: dict[str, int] = {}
    for i, tok in enumerate(tokens):
        vocab.setdefault(tok, i)  # a duplicate string keeps its first id
    return vocab


def _bpe_tokenizer(reader: GGUFReader, tokens: list[str], pre: str) -> Tokenizer:
    """GPT-2 style byte-level BPE: the GGUF's merges, split first by the named pre-tokenizer."""
    pre_tokenizer = _pre_tokenizer(pre)
    merges = [tuple(m.split(" ", 1)) for m in _meta(reader, "tokenizer.ggml.merges")]
    tokenizer = Tokenizer(
        models.BPE(
            vocab=_vocab(tokens),
            merges=merges,
            unk_token=None,
            fuse_unk=False,
            byte_fallback=False,
            ignore_merges=pre in ("llama-bpe", "llama3"),
        )
    )
    if pre == "qwen2":
        tokenizer.normalizer = normalizers.NFC()  # as in Qwen's own tokenizer.json
    tokenizer.pre_tokenizer = pre_tokenizer
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def _spm_tokenizer(reader: GGUFReader, tokens: list[str], types: list[int], unk: int | None) -> Tokenizer:
    """A SentencePiece vocabulary (Llama 2, Mistral, Mixtral) as a BPE with byte fallback.

    llama.cpp's SPM tokenizer splits the text into characters and keeps merging the adjacent
    pair whose concatenation is the highest-scoring token; characters no token covers become
    <0xXX> byte tokens. A BPE whose merges are every (left, right) split of each token, ranked
    by that token's score, makes the same choices; this is also how Hugging Face's
    LlamaTokenizerFast is built from a SentencePiece model. (The two can differ only when
    different tokens have the same score: llama.cpp then takes the leftmost pair, a BPE the
    lower-ranked merge.) Spaces become "▁", and a "▁" starts the text and every piece of it
    that follows an added token, as in llama.cpp (tokenizer.ggml.add_space_prefix, default on).
    """
    scores = _meta(reader, "tokenizer.ggml.scores", None)
    if scores is None:
        raise ValueError("GGUF SentencePiece vocabulary has no tokenizer.ggml.scores; its merge order is unknown")
    if len(scores) != len(tokens):
        raise ValueError(f"GGUF lists {len(tokens)} tokens but {len(scores)} token scores")
    vocab = _vocab(tokens)
    # Pieces a merge may produce or use: ordinary ones (llama.cpp also merges into unused ones).
    # Control, unknown and byte tokens never come out of merging characters, and user-defined
    # tokens are matched as whole strings before the model runs.
    mergeable = {
        t: i for i, t in enumerate(tokens) if types[i] in (TokenType.NORMAL, TokenType.UNUSED) and vocab[t] == i
    }
    ranked = []
    for piece, i in mergeable.items():
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in mergeable and right in mergeable:
                ranked.append((-float(scores[i]), i, mergeable[left], mergeable[right], left, right))
    ranked.sort()
    tokenizer = Tokenizer(
        models.BPE(
            vocab=vocab,
            merges=[(l, r) for *_, l, r in ranked],
            unk_token=tokens[unk] if unk is not None else None,
            fuse_unk=True,
            byte_fallback=True,
        )
    )
    space_prefix = bool(_meta(reader, "tokenizer.ggml.add_space_prefix", True))
    replace = normalizers.Replace(" ", "\u2581")
    tokenizer.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), replace]) if space_prefix else replace
    steps = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    if space_prefix:
        steps.append(decoders.Strip(" ", 1, 0))  # the "▁" added in front of the text
    tokenizer.decoder = decoders.Sequence(steps)
    return tokenizer


def _tokenizer_config(reader: GGUFReader, tokens: list[str], special: dict, max_length: int) -> dict:
    config: dict = {"tokenizer_class": "PreTrainedTokenizerFast"}
    for key, name in (("bos_token", "bos"), ("eos_token", "eos"), ("unk_token", "unknown"), ("pad_token", "padding")):
        if name in special:
            config[key] = tokens[special[name]]
    config["add_bos_token"] = special["add_bos"]
    config["add_eos_token"] = special["add_eos"]
    config["clean_up_tokenization_spaces"] = False
    config["model_max_length"] = max_length
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
