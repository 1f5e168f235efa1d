"""Turn a GGUF file into an mlx-lm style model folder in float32.

Supported GGUF architectures and the mlx-lm model each becomes:

  llama                        -> llama (dense) or mixtral (when the file has experts)
  qwen2moe                     -> qwen2_moe
  qwen3moe                     -> qwen3_moe
  olmoe                        -> olmoe
  deepseek2                    -> deepseek_v2 (softmax routing) or deepseek_v3 (sigmoid routing
                                  with the exp_probs_b correction bias)

The folder holds config.json, model.safetensors (Hugging Face tensor names, routed experts one
tensor per expert as in the original checkpoints), tokenizer.json (rebuilt from the GGUF
vocabulary with the `tokenizers` library), tokenizer_config.json (with the chat template) and
generation_config.json. With `upcycle_experts=E` a dense llama MLP is copied into E identical
Mixtral experts behind a random router, which gives a real MoE checkpoint whose output equals
the dense model's.

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

# Types whose dequantization in the `gguf` package we rely on (and test where we can).
SUPPORTED_TYPES = frozenset(
    GGMLQuantizationType[name]
    for name in ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0",
                 "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")
)

# GGUF general.architecture -> the mlx-lm model_type(s) it becomes.
SUPPORTED_ARCHITECTURES = {
    "llama": "llama or mixtral",
    "qwen2moe": "qwen2_moe",
    "qwen3moe": "qwen3_moe",
    "olmoe": "olmoe",
    "deepseek2": "deepseek_v2 or deepseek_v3",
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

# llama.cpp's expert gating functions (gguf.ExpertGatingFuncType).
_GATING_SOFTMAX, _GATING_SIGMOID = 1, 2

_MISSING = object()


def gguf_to_hf_folder(gguf_path, out_dir, *, upcycle_experts: int = 0,
                      experts_per_token: int = 2, seed: int = 0) -> Path:
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
        raise ValueError(f"experts_per_token must be between 1 and {upcycle_experts}, "
                         f"got {experts_per_token}")

    reader = GGUFReader(gguf_path)
    arch = _meta(reader, "general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(f"GGUF architecture {arch!r} is not supported "
                         f"(supported: {', '.join(repr(a) for a in SUPPORTED_ARCHITECTURES)})")
    if upcycle_experts and arch != "llama":
        raise ValueError(f"upcycle_experts needs a dense llama GGUF; this one is {arch!r}")
    tokens = _meta(reader, "tokenizer.ggml.tokens")
    tensors = {t.name: t for t in reader.tensors}
    if "token_embd.weight" not in tensors:
        raise ValueError("GGUF is missing tensor 'token_embd.weight'")
    # The embedding may be padded past the token list; HF's vocab_size counts its rows.
    vocab_size = _numpy_shape(tensors["token_embd.weight"])[0]
    if len(tokens) > vocab_size:
        raise ValueError(f"GGUF lists {len(tokens)} tokens but token_embd.weight has only "
                         f"{vocab_size} rows")

    m = _Meta(reader, arch)
    plan = _Planner(tensors)
    if arch == "llama":
        config = _llama(m, plan, vocab_size, gguf_path.name, upcycle_experts, experts_per_token, seed)
    else:
        config = {"qwen2moe": _qwen2moe, "qwen3moe": _qwen3moe, "olmoe": _olmoe,
                  "deepseek2": _deepseek2}[arch](m, plan, vocab_size)
    entries = plan.finish()

    tokenizer, special = _build_tokenizer(reader, tokens)
    if special.get("bos") is not None:
        config["bos_token_id"] = special["bos"]
    if special.get("eos") is not None:
        config["eos_token_id"] = special["eos"]
    config["torch_dtype"] = "float32"
    tok_config = _tokenizer_config(reader, tokens, special, config["max_position_embeddings"])
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
    Only llama-family files (llama, Mixtral) are permuted; NEOX-RoPE models (Qwen, OLMoE)
    and DeepSeek (interleaved RoPE in HF too) are stored as they are.
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
    return {"type": "yarn", "factor": factor,
            "original_max_position_embeddings": m.int("rope.scaling.original_context_length"),
            "beta_fast": m.float("rope.scaling.yarn_beta_fast", 32.0),
            "beta_slow": m.float("rope.scaling.yarn_beta_slow", 1.0),
            "mscale": mscale, "mscale_all_dim": mscale}


def _moe_hparams(m: _Meta, plan: "_Planner", first_moe_layer: int = 0) -> dict:
    """Expert count, experts per token and expert FFN size; softmax routing is checked."""
    experts = m.int("expert_count", 0)
    if experts <= 0:
        raise ValueError(f"GGUF {m.arch} file has no experts ({m.arch}.expert_count)")
    gating = m.int("expert_gating_func", _GATING_SOFTMAX)
    if m.arch != "deepseek2" and gating != _GATING_SOFTMAX:
        raise ValueError(f"GGUF expert gating function {gating} is not supported for {m.arch} "
                         "(only softmax)")
    return {"experts": experts, "used": m.int("expert_used_count"),
            "ff": _expert_ff(m, plan, first_moe_layer), "gating": gating}


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
    make: Callable[[], np.ndarray]


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

    def add(self, hf_name: str, gname: str, shape: tuple[int, ...],
            fix: Callable[[np.ndarray], np.ndarray] | None = None,
            also: tuple[tuple[int, ...], ...] = ()) -> None:
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

    def finish(self) -> list[_Entry]:
        extra = sorted(set(self.tensors) - self.used)
        if extra:
            # e.g. rope_freqs.weight (Llama 3.1 rope scaling): dropping them would give a wrong model.
            raise ValueError(f"GGUF has tensors this importer does not understand: {', '.join(extra[:5])}"
                             + (f" and {len(extra) - 5} more" if len(extra) > 5 else ""))
        return self.entries


def _add_embeddings(plan: _Planner, vocab: int, hidden: int) -> None:
    plan.add("model.embed_tokens.weight", "token_embd.weight", (vocab, hidden))


def _add_head(plan: _Planner, vocab: int, hidden: int, *, always_lm_head: bool) -> bool:
    """Final norm and output projection; returns tie_word_embeddings. Models whose mlx-lm class
    always has an lm_head get a copy of the embedding when the file ties them."""
    plan.add("model.norm.weight", "output_norm.weight", (hidden,))
    if plan.has("output.weight"):
        plan.add("lm_head.weight", "output.weight", (vocab, hidden))
        return False
    if always_lm_head:
        plan.add("lm_head.weight", "token_embd.weight", (vocab, hidden))
        return False
    return True


def _add_attention(plan: _Planner, i: int, hp: dict, *, permuted: bool, bias: bool = False,
                   qk_norm: str | None = None) -> None:
    """Norms and q/k/v/o of layer i. qk_norm: None, "head" (per head, Qwen3) or "full" (OLMoE)."""
    blk, hf = f"blk.{i}", f"model.layers.{i}"
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
    plan.add(f"{hf}.post_attention_layernorm.weight", f"{blk}.ffn_norm.weight", (hidden,))


_MLP = (("gate", "gate_proj", "w1"), ("up", "up_proj", "w3"), ("down", "down_proj", "w2"))


def _mlp_shape(proj: str, ff: int, hidden: int) -> tuple[int, int]:
    return (hidden, ff) if proj == "down" else (ff, hidden)


def _add_dense_mlp(plan: _Planner, blk: str, prefix: str, ff: int, hidden: int, suffix: str = "") -> None:
    """{prefix}.{gate,up,down}_proj.weight from {blk}.ffn_{gate,up,down}{suffix}.weight."""
    for g, proj, _ in _MLP:
        plan.add(f"{prefix}.{proj}.weight", f"{blk}.ffn_{g}{suffix}.weight", _mlp_shape(g, ff, hidden))


def _add_routed_experts(plan: _Planner, i: int, prefix: str, moe: dict, hidden: int,
                        mixtral: bool = False) -> None:
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

def _llama_hparams(m: _Meta) -> dict:
    hp = _attention_hparams(m, eps_default=1e-5)
    hp = {"hidden_size": hp.pop("hidden_size"), "intermediate_size": m.int("feed_forward_length"), **hp}
    scaling = _rope_scaling(m, "llama", allowed=("linear",))
    if scaling:
        hp["rope_scaling"] = scaling
    return hp


def _llama(m: _Meta, plan: _Planner, vocab: int, name: str, upcycle: int, per_token: int,
           seed: int) -> dict:
    hp = _llama_hparams(m)
    hp["vocab_size"] = vocab
    moe = _moe_hparams(m, plan) if m.int("expert_count", 0) > 0 else None
    if moe and upcycle:
        raise ValueError(f"{name}: upcycle_experts needs a dense llama GGUF; this one already "
                         f"has {moe['experts']} experts")
    experts, per_token = (moe["experts"], moe["used"]) if moe else (upcycle, per_token)
    if experts and hp["head_dim"] * hp["num_attention_heads"] != hp["hidden_size"]:
        # mlx-lm's Mixtral derives head_dim from hidden_size / heads.
        raise ValueError(f"{name}: head_dim {hp['head_dim']} x {hp['num_attention_heads']} heads "
                         f"!= hidden size {hp['hidden_size']}; mixtral cannot express this model")
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
                    plan.add(f"{sparse}.experts.{e}.{w}.weight", f"{blk}.ffn_{g}.weight",
                             _mlp_shape(g, inter, hidden))
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
    return {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", **hp,
            "vocab_size": vocab, "intermediate_size": m.int("feed_forward_length", moe["ff"]),
            "moe_intermediate_size": moe["ff"], "num_experts": moe["experts"],
            "num_experts_per_tok": moe["used"], "decoder_sparse_step": 1, "mlp_only_layers": [],
            # llama.cpp always renormalises the chosen Qwen3-MoE expert weights.
            "norm_topk_prob": m.flag("expert_weights_norm", True),
            "tie_word_embeddings": tied, "hidden_act": "silu", "attention_bias": False}


def _qwen2moe(m: _Meta, plan: _Planner, vocab: int) -> dict:
    hp = _attention_hparams(m, eps_default=1e-6)
    _rope_scaling(m, "qwen2_moe")
    if hp["head_dim"] * hp["num_attention_heads"] != hp["hidden_size"]:
        raise ValueError(f"GGUF head_dim {hp['head_dim']} x {hp['num_attention_heads']} heads != "
                         f"hidden size {hp['hidden_size']}; mlx-lm's qwen2_moe cannot express this")
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
        plan.add(f"{prefix}.shared_expert_gate.weight", f"{blk}.ffn_gate_inp_shexp.weight", (1, hidden),
                 lambda w: w.reshape(1, hidden), also=((hidden,),))
    _add_head(plan, vocab, hidden, always_lm_head=True)
    return {"architectures": ["Qwen2MoeForCausalLM"], "model_type": "qwen2_moe", **hp,
            "vocab_size": vocab, "intermediate_size": m.int("feed_forward_length", moe["ff"]),
            "moe_intermediate_size": moe["ff"], "shared_expert_intermediate_size": shared_ff,
            "num_experts": moe["experts"], "num_experts_per_tok": moe["used"],
            "decoder_sparse_step": 1, "mlp_only_layers": [], "norm_topk_prob": False,
            "tie_word_embeddings": False, "hidden_act": "silu"}


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
    return {"architectures": ["OlmoeForCausalLM"], "model_type": "olmoe", **hp,
            "vocab_size": vocab, "intermediate_size": moe["ff"], "num_experts": moe["experts"],
            "num_experts_per_tok": moe["used"], "norm_topk_prob": m.flag("expert_weights_norm", False),
            "rope_scaling": scaling, "tie_word_embeddings": tied, "attention_bias": False,
            "clip_qkv": None, "hidden_act": "silu"}


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
                raise ValueError("GGUF deepseek2 has an exp_probs_b correction bias with softmax "
                                 "routing; neither deepseek_v2 nor deepseek_v3 in mlx-lm does that")
            if norm:
                raise ValueError("GGUF deepseek2 renormalises softmax expert weights; mlx-lm's "
                                 "deepseek_v2 does not")
        else:
            raise ValueError(f"GGUF expert gating function {moe['gating']} is not supported for "
                             "deepseek2 (softmax or sigmoid)")
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
        plan.add(f"{attn}.kv_a_proj_with_mqa.weight", f"{blk}.attn_kv_a_mqa.weight",
                 (kv_lora + rope_dim, hidden))
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

    config = {"architectures": ["DeepseekV3ForCausalLM" if model_type == "deepseek_v3"
                                else "DeepseekV2ForCausalLM"],
              "model_type": model_type, "vocab_size": vocab, "hidden_size": hidden,
              "intermediate_size": ff, "moe_intermediate_size": moe["ff"] if moe else ff,
              "num_hidden_layers": layers, "num_attention_heads": heads, "num_key_value_heads": heads,
              "n_shared_experts": (shared or None) if moe else None,
              "n_routed_experts": experts or None,
              "routed_scaling_factor": m.float("expert_weights_scale", 1.0),
              "kv_lora_rank": kv_lora, "q_lora_rank": q_lora, "qk_rope_head_dim": rope_dim,
              "v_head_dim": v_head, "qk_nope_head_dim": nope,
              "num_experts_per_tok": moe["used"] if moe else None,
              "moe_layer_freq": 1, "first_k_dense_replace": dense_layers,
              "max_position_embeddings": m.int("context_length", 4096), "rms_norm_eps": eps,
              "rope_theta": m.float("rope.freq_base", 10000.0), "rope_scaling": scaling,
              "attention_bias": False, "tie_word_embeddings": False, "hidden_act": "silu"}
    if moe:
        if model_type == "deepseek_v3":
            config.update(topk_method="noaux_tc", scoring_func="sigmoid", norm_topk_prob=norm,
                          n_group=groups, topk_group=groups_used)
        else:
            config.update(topk_method="group_limited_greedy" if groups > 1 else "greedy",
                          scoring_func="softmax", norm_topk_prob=False,
                          n_group=groups, topk_group=groups_used)
    return config


def _add_kv_b(plan: _Planner, blk: str, hf_name: str, heads: int, nope: int, v_head: int,
              kv_lora: int) -> None:
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
    if pre in ("gpt2", "olmo"):  # llama.cpp splits OLMo text with the GPT-2 pattern
        return byte_level
    if pre == "smollm":
        # SmolLM splits every digit on its own before the GPT-2 split.
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    patterns = {"llama-bpe": (_LLAMA3_PATTERN,), "llama3": (_LLAMA3_PATTERN,),
                "qwen2": (_QWEN2_PATTERN,), "deepseek-v3": _DEEPSEEK3_PATTERNS}.get(pre)
    if patterns is None:
        raise ValueError(f"GGUF pre-tokenizer {pre!r} is not supported "
                         "(supported: 'gpt2', 'olmo', 'smollm', 'llama-bpe', 'qwen2', 'deepseek-v3')")
    return pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(p), behavior="isolated") for p in patterns]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])


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
    if pre == "qwen2":
        tokenizer.normalizer = normalizers.NFC()  # as in Qwen's own tokenizer.json
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


def _tokenizer_config(reader: GGUFReader, tokens: list[str], special: dict, max_length: int) -> dict:
    config: dict = {"tokenizer_class": "PreTrainedTokenizerFast"}
    for key, name in (("bos_token", "bos"), ("eos_token", "eos"),
                      ("unk_token", "unknown"), ("pad_token", "padding")):
        if name in special:
            config[key] = tokens[special[name]]
    config["add_bos_token"] = bool(_meta(reader, "tokenizer.ggml.add_bos_token", False))
    config["add_eos_token"] = bool(_meta(reader, "tokenizer.ggml.add_eos_token", False))
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
