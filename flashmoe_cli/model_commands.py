"""The commands about model folders: convert, info, verify, demo."""

from __future__ import annotations

import json
import sys

from .errors import UsageError, error
from .exit_codes import ExitCode
from .models import model_arg, resolve_model
from .progress import Progress
from .units import human_bytes


def cmd_convert(args) -> int:
    from flashmoe.engine.formats.convert import convert
    from flashmoe.engine.formats.hf_cache import resolve

    out = convert(
        resolve(args.src),
        args.out,
        bits=args.bits,
        group_size=args.group_size,  # org/name: the cache's
        expert_bits=args.expert_bits,
        layer_bits=args.layer_bits,
        dtype=args.dtype,
        progress=Progress(),
        expert_layout=args.expert_layout,
    )
    print(f"flashmoe: wrote {out}", file=sys.stderr)
    return ExitCode.OK


def cmd_info(args) -> int:
    from flashmoe.engine.runtime.info import describe, expert_bits_summary, layers_text

    path = resolve_model(model_arg(args))  # no MODEL: the demo, as `run` uses it
    d = describe(path, ctx_size=getattr(args, "ctx_size", None))
    if args.load:
        d["compute_at_load"] = loaded_compute(path, args.kernels)
    elif args.kernels != "auto":
        raise UsageError("--kernels is for --load (the kernels to load the model with)")
    if args.json:
        print(json.dumps(d, indent=2))
        return ExitCode.OK
    rows = [
        ("model", d["path"]),
        ("format", d["format"]),
        ("architecture", d["model_type"]),
        ("layers", f"{d['layers']} ({d['moe_layers']} with routed experts)"),
        ("experts", f"{d['experts']} per layer, top-{d['top_k']} routed per token"),
        ("bits", f"{d['bits']} (group size {d['group_size']})" if d["bits"] else "unquantized"),
        ("resident bytes", human_bytes(d["resident_bytes"])),
        ("expert bits", expert_bits_summary(d["expert_bits"])),
        ("expert bytes", f"{human_bytes(d['expert_bytes'])} ({human_bytes(d['expert_block_bytes'])} per expert)"),
        ("read per token at 0% hits", human_bytes(d["bytes_per_token_cold"])),
    ]
    for i, (how, layers) in enumerate(d["expert_compute"].items()):
        rows.append(("expert compute" if i == 0 else "", f"{how} ({layers_text(layers)})"))
    for i, (how, layers) in enumerate(d.get("compute_at_load", {}).get("blocks", {}).items()):
        title = f"as loaded ({d['compute_at_load']['kernels']} kernels)"
        rows.append((title if i == 0 else "", f"{how} ({layers_text(layers)})"))
    if d["not_streamable"]:
        rows.append(("streaming", f"no: {d['not_streamable']}"))
    memory = d["memory"]
    rows += (
        [tuple(r) for r in memory["rows"]]
        if "rows" in memory
        else [("memory budget", f"does not fit: {memory['refused']}")]
    )
    rows += [("", f"also read: {o}") for o in memory.get("other_limits", [])]
    for k, v in rows:
        print(f"{k:>26}: {v}")
    return ExitCode.OK


def loaded_compute(path, kernels: str) -> dict:
    """Load the model as `run` would (no tokenizer, no expert cache) and read back the compute
    path load() chose for each block (engine/runtime/compute_paths.py)."""
    from flashmoe.engine.runtime.compute_paths import compute_paths
    from flashmoe.engine.runtime.loader import load

    lm = load(path, kernels=kernels, expert_cache=0, load_tokenizer=False)
    try:
        return {"kernels": lm.kernels, "blocks": compute_paths(lm)}
    finally:
        lm.close()


def cmd_verify(args) -> int:
    from pathlib import Path

    from flashmoe.engine.experts.layout import read_manifest, verify
    from flashmoe.engine.runtime.loader import EXPERTS_DIR, read_config

    root = Path(resolve_model(model_arg(args)))  # no MODEL: the demo, as `run` uses it
    read_config(root)
    if not (root / EXPERTS_DIR).exists():
        from flashmoe.engine.runtime.info import describe

        describe(root)  # checks every safetensors header
        print(f"{root}: direct-mode folder (no checksums); headers and sizes are consistent", file=sys.stderr)
        return ExitCode.OK
    layers = read_manifest(root / EXPERTS_DIR)
    bad = verify(
        root / EXPERTS_DIR, layers, progress=lambda l: Progress()(f"layer {l.layer}", layers.index(l) + 1, len(layers))
    )
    for layer, expert, path in bad:
        error(f"{path}: layer {layer} expert {expert}: checksum mismatch (corrupted)")
    if bad:
        return ExitCode.MODEL
    n = sum(l.num_experts for l in layers)
    print(f"{root}: all {n} experts in {len(layers)} layers match the manifest", file=sys.stderr)
    return ExitCode.OK


def cmd_demo(args) -> int:
    if args.rebuild:
        from flashmoe.engine.formats.demo import ensure_demo

        from .paths import ensure_home

        ensure_home()
        print(ensure_demo(progress=Progress(), rebuild=True))
        return ExitCode.OK
    print(resolve_model(None))
    return ExitCode.OK
