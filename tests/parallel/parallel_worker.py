"""torchrun worker for tests/parallel/test_parallel_equivalence.py and bench/parallel_layouts.py.

``torchrun --standalone --nproc-per-node N tests/parallel/parallel_worker.py --out F --layouts a,b``
runs each named layout in turn: one GRPO-style AdamW update step on one fixed
batch followed by a second forward/backward (its loss checks the updated, still
sharded weights), the model built on meta, parallelized (tandem.parallel.parallelize / parallel.pp),
materialised and loaded with the reference weights. Rank 0 also runs the same
steps on a plain single-process copy and writes ``{"reference": {family: ...},
"layouts": {name: ...}}`` to ``F`` (torch.save): both losses, the full gradients of
the update step, the full weights after it, the worst disagreement between
ranks holding the same parameter, and the wall time of the update step (forward, backward,
optimizer).

Loss: ``-(adv * logp * mask).sum() / mask.sum()`` over the *global* batch (plus
an optional entropy bonus), with ``logp`` from tandem/parallel/loss.py. Each
data-parallel rank takes ``B / dp`` rows and scales its share by ``dp`` because
FSDP2 averages gradients over data-parallel ranks (tandem/parallel/fsdp.py).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import traceback
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, distribute_tensor

# the repository root
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from tandem.models.args import ModelArgs  # noqa: E402
from tandem.models.transformer import Transformer  # noqa: E402
from tandem.parallel.ac import clean_fqn  # noqa: E402
from tandem.parallel.distributed import init_distributed  # noqa: E402
from tandem.parallel.loss import vocab_parallel_entropy, vocab_parallel_token_logprobs  # noqa: E402
from tandem.parallel.mesh import Degrees, build_mesh, dp_rank  # noqa: E402
from tandem.parallel.parallelize import parallelize  # noqa: E402
from tandem.parallel.pp import build_pipeline  # noqa: E402
from tandem.parallel.tp import apply_tp  # noqa: E402

BATCH, SEQ, STEPS, LR = 4, 16, 2, 1e-2

FAMILIES: dict[str, ModelArgs] = {
    "qwen3": ModelArgs(
        model_type="qwen3",
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        num_layers=4,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        rope_theta=1e6,
    ),
    "qwen3-tied": ModelArgs(
        model_type="qwen3",
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        rope_theta=1e6,
        tie_word_embeddings=True,
    ),
    # 4 experts, 2 per token: the fixed batch's 64 (token, expert) rows reach every expert
    "qwen3-moe": ModelArgs(
        model_type="qwen3_moe",
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        rope_theta=1e6,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        norm_topk_prob=True,
    ),
    "qwen2": ModelArgs(
        model_type="qwen2",
        vocab_size=96,
        hidden_size=32,
        intermediate_size=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        rope_theta=1e6,
    ),
    "llama": ModelArgs(
        model_type="llama",
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=4,
        rope_theta=5e5,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8,
        },
    ),
}
# qwen2 with 4 experts (2 per token), a gated shared expert, and layer 1 dense (mixed blocks)
FAMILIES["qwen2-moe"] = FAMILIES["qwen2"].replace(
    model_type="qwen2_moe",
    num_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    shared_expert_intermediate_size=48,
    mlp_only_layers=[1],
)


@dataclass(frozen=True)
class Layout:
    degrees: Degrees
    family: str = "qwen3"
    schedule: str | None = None  # pipeline schedule when degrees.pp > 1
    n_microbatches: int = 2
    ac: str = "none"
    sequence_parallel: bool = True
    entropy_coef: float = 0.0
    ep: int = 1  # expert parallelism (MoE families)


LAYOUTS: dict[str, Layout] = {
    # 2 ranks
    "fsdp2": Layout(Degrees(dp_shard=2)),
    "fsdp2_ac_full": Layout(Degrees(dp_shard=2), ac="full"),
    "tp2": Layout(Degrees(tp=2)),
    "tp2_ac_selective": Layout(Degrees(tp=2), ac="selective"),
    "tp2_qwen2_entropy": Layout(Degrees(tp=2), family="qwen2", entropy_coef=0.05),
    "tp2_llama_nosp": Layout(Degrees(tp=2), family="llama", sequence_parallel=False),
    "tp2_qwen3_tied": Layout(Degrees(tp=2), family="qwen3-tied"),
    "pp2_1f1b": Layout(Degrees(pp=2), schedule="1F1B"),
    "pp2_gpipe": Layout(Degrees(pp=2), schedule="GPipe", n_microbatches=4),
    "pp2_interleaved": Layout(Degrees(pp=2), schedule="Interleaved1F1B"),
    "pp2_qwen3_tied": Layout(Degrees(pp=2), family="qwen3-tied", schedule="1F1B"),
    # 4 ranks
    "fsdp2_tp2": Layout(Degrees(dp_shard=2, tp=2), entropy_coef=0.05),
    "pp2_fsdp2": Layout(Degrees(pp=2, dp_shard=2), schedule="1F1B"),
    "hsdp2x2": Layout(Degrees(dp_replicate=2, dp_shard=2)),
    "pp2_tp2": Layout(Degrees(pp=2, tp=2), schedule="1F1B"),
    # mixture of experts: FSDP2 gathering the experts, then experts sharded (EP) over the FSDP2
    # ranks
    "fsdp2_moe": Layout(Degrees(dp_shard=2), family="qwen3-moe"),
    "fsdp2_ep2_moe": Layout(Degrees(dp_shard=2), family="qwen3-moe", ep=2),
    "fsdp4_ep4_moe": Layout(Degrees(dp_shard=4), family="qwen3-moe", ep=4),
    "fsdp4_ep2_moe": Layout(Degrees(dp_shard=4), family="qwen3-moe", ep=2),
    "hsdp2x2_ep2_moe": Layout(Degrees(dp_replicate=2, dp_shard=2), family="qwen3-moe", ep=2),
    # MoE under TP (tandem/parallel/moe_tp.py): experts split by hidden features, every rank routing
    # all tokens
    "tp2_moe": Layout(Degrees(tp=2), family="qwen3-moe"),
    "tp2_qwen2_moe_nosp": Layout(Degrees(tp=2), family="qwen2-moe", sequence_parallel=False),
    "fsdp2_tp2_qwen2_moe": Layout(Degrees(dp_shard=2, tp=2), family="qwen2-moe"),
    # attention TP, experts EP x TP
    "fsdp2_tp2_ep2_qwen2_moe": Layout(Degrees(dp_shard=2, tp=2), family="qwen2-moe", ep=2),
}


# ------------------------------------------------------------------ fixed data and weights
def reference_state_dict(args: ModelArgs, seed: int = 0) -> dict[str, torch.Tensor]:
    """Deterministic random weights (norms 1 + noise, biases noise) — identical on every rank."""
    model = Transformer(args)
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name, p in model.state_dict().items():
        noise = torch.randn(p.shape, generator=gen)
        if "norm" in name:
            out[name] = 1.0 + 0.1 * noise
        elif name.endswith("bias"):
            out[name] = 0.1 * noise
        else:
            out[name] = 0.15 * noise
    if args.tie_word_embeddings:
        out["output.weight"] = out["tok_embeddings.weight"]
    return out


def fixed_batch(vocab: int, seed: int = 1) -> dict[str, torch.Tensor]:
    """tokens [B, S] inputs, next-token targets, a prompt/padding mask and per-token advantages."""
    gen = torch.Generator().manual_seed(seed)
    seq = torch.randint(0, vocab, (BATCH, SEQ + 1), generator=gen)
    mask = torch.ones(BATCH, SEQ)
    mask[:, :3] = 0.0  # prompt
    for row in range(BATCH):
        pad = (0, 2, 5, 1)[row % 4]
        if pad:
            mask[row, SEQ - pad :] = 0.0
    adv = torch.randn(BATCH, 1, generator=gen) + 0.1 * torch.randn(BATCH, SEQ, generator=gen)
    return {"inputs": seq[:, :-1], "targets": seq[:, 1:], "mask": mask, "adv": adv}


def token_loss(
    output: torch.Tensor, t: dict[str, torch.Tensor], *, scale: float, entropy_coef: float = 0.0
) -> torch.Tensor:
    """This shard's share of the global loss: ``scale * sum(...)`` with scale = dp /
    global tokens."""
    logp = vocab_parallel_token_logprobs(output, t["targets"])  # [b, S]
    loss = -(t["adv"] * logp * t["mask"]).sum()
    if entropy_coef:
        loss = loss - entropy_coef * (vocab_parallel_entropy(output) * t["mask"]).sum()
    return loss * scale


def make_optimizer(params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
    """AdamW; eps is large on purpose. One Adam step moves a weight by about
    ``lr * g / (|g| + eps)``, whose slope in g is up to ``lr / eps``: with eps=1e-8
    a gradient of ~1e-8 (there are some) turns fp32 reduction-order noise into a
    1e-4 weight difference. eps=1e-3 bounds that slope so a 1e-5 comparison of
    the updated weights is meaningful; the gradients are compared directly too."""
    return torch.optim.AdamW(params, lr=LR, eps=1e-3, weight_decay=0.1, foreach=False)


def run_reference(family: str, entropy_coef: float) -> dict[str, Any]:
    """The same steps on one process with a plain unsharded model."""
    args = FAMILIES[family]
    model = Transformer(args)
    model.load_state_dict(reference_state_dict(args))
    batch = fixed_batch(args.vocab_size)
    opt = make_optimizer(list(model.parameters()))
    n_tok = float(batch["mask"].sum())
    losses, grads = [], {}
    for step in range(STEPS):
        opt.zero_grad()
        logits = model(batch["inputs"])  # [B, S, V]
        loss = token_loss(logits, batch, scale=1.0 / n_tok, entropy_coef=entropy_coef)
        losses.append(float(loss.detach()))
        loss.backward()
        if step == 0:
            grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
            opt.step()
            weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    return {"losses": losses, "grads": grads, "weights": weights}


# ------------------------------------------------------------------ one parallel layout
@torch.no_grad()
def load_full_weights(module: torch.nn.Module, full: dict[str, torch.Tensor]) -> None:
    """Copy full tensors into (possibly DTensor-sharded) parameters, no communication."""
    for name, p in module.named_parameters():
        src = full[clean_fqn(name)].to(p.device)
        if isinstance(p, DTensor):
            src = distribute_tensor(src, p.device_mesh, p.placements, src_data_rank=None).to_local()
            p.to_local().copy_(src)
        else:
            p.copy_(src)


def full_params(modules: list[torch.nn.Module], grads: bool) -> dict[str, torch.Tensor]:
    """name -> full tensor (weights or grads) for every parameter this rank holds (collective)."""
    out = {}
    for module in modules:
        for name, p in module.named_parameters():
            t = p.grad if grads else p.detach()
            if t is None:
                continue
            fqn = clean_fqn(name)
            if fqn == "output.weight" and module.args.tie_word_embeddings:
                fqn = "tok_embeddings.weight"  # the last stage's copy of a tied weight (pipeline)
            # full_tensor() of a Replicate DTensor aliases the local tensor: clone.
            out[fqn] = (t.full_tensor() if isinstance(t, DTensor) else t).clone()
    return out


def run_layout(layout: Layout, device: torch.device, steps: int = STEPS) -> dict[str, Any]:
    args = FAMILIES[layout.family]
    deg = layout.degrees
    mesh = build_mesh(deg, device)
    full = reference_state_dict(args)
    batch = fixed_batch(args.vocab_size)
    dp, rows = deg.dp, BATCH // deg.dp
    r0 = dp_rank(mesh) * rows
    local = {k: v[r0 : r0 + rows].to(device) for k, v in batch.items()}
    scale = dp / float(batch["mask"].sum())  # global token count, known to every rank

    def prepare(module: torch.nn.Module) -> torch.nn.Module:
        parallelize(
            module, mesh, sequence_parallel=layout.sequence_parallel, ac=layout.ac, ep=layout.ep
        )
        module.to_empty(device=device)
        load_full_weights(module, full)
        return module

    with torch.device("meta"):
        meta = Transformer(args)
    pipe = None
    if deg.pp > 1:
        loss_fn = lambda out, t, **kw: token_loss(out, t, **kw)  # noqa: E731

        def factory() -> torch.nn.Module:
            with torch.device("meta"):
                return Transformer(args)

        # GPipe exercises the factory form of build_pipeline, the others the meta model.
        pipe = build_pipeline(
            factory if layout.schedule == "GPipe" else meta,
            mesh["pp"],
            layout.schedule,
            layout.n_microbatches,
            loss_fn,
            device=device,
            parallelize_fn=prepare,
        )
        modules = pipe.modules
    else:
        modules = [prepare(meta)]
    opt = make_optimizer([p for m in modules for p in m.parameters()])
    targets = {k: local[k] for k in ("targets", "mask", "adv")}
    kw = {"scale": scale, "entropy_coef": layout.entropy_coef}
    shares, times = [], []
    for step in range(steps):
        opt.zero_grad()
        t0 = time.perf_counter()
        if pipe is not None:
            losses = pipe.step(local["inputs"], targets=targets, loss_kwargs=kw)
            pipe.sync_tied_grads()
            share = float(sum(x.detach() for x in losses)) / dp if pipe.has_last_stage else None
        else:
            loss = token_loss(modules[0](local["inputs"]), targets, **kw)
            loss.backward()
            share = float(loss.detach()) / dp
        opt.step()
        times.append(time.perf_counter() - t0)
        shares.append(share)
        if step == 0:
            placements_ok = all(
                p.grad.placements == p.placements
                for m in modules
                for p in m.parameters()
                if isinstance(p, DTensor) and p.grad is not None
            )
        if step == 0:  # the update step under test (grads are read after opt.step, unchanged)
            grads = full_params(modules, grads=True)
            weights = full_params(modules, grads=False)
    # Who contributes a loss share: one tp rank of each dp rank, on the last stage.
    counts = mesh["tp"].get_local_rank() == 0
    later = sorted(times[1:]) or times
    return {
        "shares": shares if counts else [None] * steps,
        "grads": grads,
        "weights": weights,
        "grad_placements_ok": placements_ok,
        "time_s": later[len(later) // 2],  # median step time after the first (warm-up) step
    }


def merge(results: list[dict[str, Any]]) -> dict[str, Any]:
    """Rank 0: sum loss shares over ranks; union of parameters; worst cross-rank mismatch."""
    steps = len(results[0]["shares"])
    losses = [
        sum(r["shares"][s] for r in results if r["shares"][s] is not None) for s in range(steps)
    ]
    merged: dict[str, Any] = {"losses": losses, "time_s": max(r["time_s"] for r in results)}
    worst = 0.0
    for kind in ("grads", "weights"):
        out: dict[str, torch.Tensor] = {}
        for r in results:
            for n, t in r[kind].items():
                if n in out:
                    worst = max(worst, float((out[n] - t).abs().max()))
                else:
                    out[n] = t
        merged[kind] = out
    merged["rank_mismatch"] = worst
    merged["grad_placements_ok"] = all(r["grad_placements_ok"] for r in results)
    return merged


def check_errors(device: torch.device) -> dict[str, str]:
    """Bad settings must raise ValueError with one line; returns name -> message."""
    out = {}
    world = dist.get_world_size()
    bad = FAMILIES["qwen3"].replace(num_heads=6, num_kv_heads=3, head_dim=16)
    mesh = build_mesh(Degrees(tp=world), device)
    with torch.device("meta"):
        model = Transformer(bad)
    try:
        apply_tp(model, mesh["tp"])
        out["tp_heads"] = "no error"
    except ValueError as e:
        out["tp_heads"] = str(e)
    return out


def _use_small_model() -> None:
    """Bench only: a ~30M-parameter qwen3 and a bigger batch (no reference is run)."""
    global BATCH, SEQ
    BATCH, SEQ = 8, 512
    FAMILIES["qwen3"] = FAMILIES["qwen3"].replace(
        vocab_size=8192,
        hidden_size=512,
        intermediate_size=1536,
        num_layers=8,
        num_heads=8,
        num_kv_heads=4,
        head_dim=64,
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--layouts", required=True, help="comma-separated names from LAYOUTS")
    parser.add_argument("--errors", action="store_true", help="also run the bad-settings checks")
    parser.add_argument("--steps", type=int, default=STEPS, help="steps per layout (bench: more)")
    parser.add_argument(
        "--device", default="cpu", choices=("cpu", "auto"), help="auto: accelerator if any"
    )
    parser.add_argument(
        "--size", default="tiny", choices=("tiny", "small"), help="bench: a bigger qwen3"
    )
    opts = parser.parse_args()
    if opts.size == "small":
        _use_small_model()
    info = init_distributed(force_cpu=opts.device == "cpu")
    torch.manual_seed(0)
    world = info.world_size
    result: dict[str, Any] = {
        "layouts": {},
        "reference": {},
        "failures": {},
        "device": info.device.type,
        "batch": BATCH,
        "seq": SEQ,
        "world": world,
    }
    for name in opts.layouts.split(","):
        layout = LAYOUTS[name]
        if layout.degrees.world_size != world:
            raise SystemExit(f"layout {name} needs {layout.degrees.world_size} ranks, have {world}")
        try:
            local = run_layout(layout, info.device, opts.steps)
        except Exception:  # keep going: the test reports which layout failed and why
            local = {"error": traceback.format_exc()}
        gathered: list[Any] = [None] * world
        dist.all_gather_object(gathered, local)
        if info.is_main:
            errors = [g["error"] for g in gathered if "error" in g]
            if errors:
                result["failures"][name] = errors[0]
                continue
            result["layouts"][name] = merge(gathered)
            ref_key = f"{layout.family}:{layout.entropy_coef}"
            if ref_key not in result["reference"] and opts.steps == STEPS and opts.size == "tiny":
                result["reference"][ref_key] = run_reference(layout.family, layout.entropy_coef)
            result["layouts"][name]["reference"] = ref_key
    if opts.errors:
        result["errors"] = check_errors(info.device)
    if info.is_main:
        torch.save(result, opts.out)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
