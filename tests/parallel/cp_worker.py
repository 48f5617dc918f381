"""torchrun worker for tests/parallel/test_context_parallel.py: context parallelism against cp = 1.

``torchrun --standalone --nproc-per-node N tests/parallel/cp_worker.py --out F --layouts a,b``
runs each named layout (`LAYOUTS`) in turn: the policy (tandem/rl/update/policy.py, FSDP2 over
``dp_shard x cp``) on packed variable-length samples (shared prompts, documents of 4 to 56
tokens, boundaries anywhere in the split), and beside it, on every rank, a plain
single-process copy of the same weights running the same samples at cp = 1 (no FSDP2, no
split). Per layout rank 0 writes the worst relative errors (max abs error / max abs value) of
the local logits of every micro-batch, the completion tokens' log-probs and entropy, and,
for each policy loss and aggregation of `LOSSES`, the step's loss and every parameter's
gradient. ``exact`` compares the log-probs bitwise with ``rl.exact``'s kernels on; ``memory``
measures the bytes one micro-batch's forward saves for backward (the activations) at cp = 1
and 2; ``guard`` records the errors of a broken split. ``F`` gets ``{name: record}``
(torch.save).
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

sys.path.insert(
    0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
)  # the repository root

from tandem.kernels import batch_invariant  # noqa: E402
from tandem.models.args import ModelArgs  # noqa: E402
from tandem.models.attention import CausalAttention  # noqa: E402
from tandem.models.transformer import Transformer  # noqa: E402
from tandem.parallel.ac import clean_fqn  # noqa: E402
from tandem.parallel.cp import ContextSplitError  # noqa: E402
from tandem.parallel.distributed import init_distributed  # noqa: E402
from tandem.parallel.mesh import Degrees, build_mesh, dp_rank, subgroup  # noqa: E402
from tandem.rl.algorithms import (
    AGGREGATIONS,
    KL_ESTIMATORS,
    POLICY_LOSSES,
    PolicyLossConfig,
    make_norm,
)  # noqa: E402
from tandem.rl.core.modeling import BuildSpec  # noqa: E402
from tandem.rl.rollout.types import RolloutSample  # noqa: E402
from tandem.rl.update.cp_batch import local_row  # noqa: E402
from tandem.rl.update.loss import (
    LossInputs,
    LossSpec,
    completion_tensors,
    micro_batch_loss,
    recompute_logprobs,
    token_logprobs,
)
from tandem.rl.update.packing import pack_micro_batches
from tandem.rl.update.policy import FlatPolicy  # noqa: E402

ARGS = ModelArgs(
    model_type="qwen3",
    vocab_size=211,
    hidden_size=32,
    intermediate_size=64,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=8,
    rope_theta=1e4,
)
CPU = torch.device("cpu")
BUDGET = 48  # tokens per rank per micro-batch: the 12 samples fill several
LAYOUTS = {  # name -> (degrees, cp_style, share_prompts[, activation checkpointing])
    "cp2_ulysses": (Degrees(cp=2), "ulysses", True),
    "cp2_ring_ac_full": (
        Degrees(cp=2),
        "ring",
        True,
        "full",
    ),  # the backward recomputes each block's ring
    "cp2_ring": (Degrees(cp=2), "ring", True),
    "cp2_ring_unshared": (Degrees(cp=2), "ring", False),
    "cp2_dp2_ulysses": (Degrees(dp_shard=2, cp=2), "ulysses", True),
    "cp2_dp2_ring": (Degrees(dp_shard=2, cp=2), "ring", True),
    "cp2_hsdp2_ring": (Degrees(dp_replicate=2, cp=2), "ring", False),
    "cp4_ulysses": (Degrees(cp=4), "ulysses", True),  # 2 KV heads, cp = 4: each repeated once
    "cp4_ring": (Degrees(cp=4), "ring", True),
}
LOSSES = {  # name -> (policy loss, its config, aggregation, entropy coefficient, KL coefficient)
    "ppo_token_mean": ("ppo_clip", PolicyLossConfig(), "token_mean", 0.01, 0.05),
    "gspo_seq_mean_token_mean": (
        "gspo",
        PolicyLossConfig(seq_clip_low=0.02, seq_clip_high=0.02),
        "seq_mean_token_mean",
        0.0,
        0.0,
    ),
    "dr_grpo_seq_mean_token_sum_norm": (
        "ppo_clip",
        PolicyLossConfig(),
        "seq_mean_token_sum_norm",
        0.0,
        0.0,
    ),
    "reinforce_seq_mean_token_sum": (
        "reinforce",
        PolicyLossConfig(),
        "seq_mean_token_sum",
        0.0,
        0.0,
    ),
}


def samples(n: int = 12) -> list[RolloutSample]:
    """Pairs of samples sharing a prompt, every length different (the same on every rank)."""
    g = torch.Generator().manual_seed(5)
    out = []
    for i in range(n):
        if i % 2 == 0:
            prompt = torch.randint(
                1, ARGS.vocab_size, (int(torch.randint(3, 20, (1,), generator=g)),), generator=g
            )
        c = int(torch.randint(1, 38, (1,), generator=g))
        comp = torch.randint(1, ARGS.vocab_size, (c,), generator=g).tolist()
        out.append(
            RolloutSample(
                group=i // 2,
                prompt_ids=prompt.tolist(),
                completion_ids=comp,
                loss_mask=[j % 7 != 3 for j in range(c)],
                gen_logprobs=[-5.0] * c,
                finish_reason="stop",
                text="",
                row={"id": i},
            )
        )
    return out


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-12)) if b.numel() else 0.0


def full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def build(
    degrees: Degrees, style: str, share: bool, ac: str = "none"
) -> tuple[FlatPolicy, Transformer, dict]:
    mesh = build_mesh(degrees, CPU)
    policy = FlatPolicy(
        ARGS,
        mesh,
        CPU,
        path=None,
        seed=0,
        spec=BuildSpec(activation_checkpoint=ac),
        is_main=dist.get_rank() == 0,
        micro_batch_tokens=BUDGET,
        chunk_tokens=16,
        share_prompts=share,
        cp_style=style,
    )
    state = policy.full_state()
    ref = Transformer(ARGS)
    ref.load_state_dict(state)
    return (
        policy,
        ref,
        {
            "mesh": mesh,
            "dp_group": subgroup(mesh, ("dp_replicate", "dp_shard")),
            "dp": degrees.dp,
            "dp_rank": dp_rank(mesh),
        },
    )


def run_layout(name: str) -> dict:
    degrees, style, share, *ac = LAYOUTS[name]
    policy, ref, m = build(degrees, style, share, *ac)
    every = samples()
    mine = every[m["dp_rank"] :: m["dp"]]  # this data-parallel rank's samples
    rows = list(range(len(mine)))
    rec: dict = {"cp_effective": [], "logits": 0.0}
    policy.eval()
    # logits of every micro-batch, this rank's positions against the unsplit row
    for mb in policy.micro_batches(mine, rows):
        r = local_row(policy.cp, mb)
        with torch.no_grad():
            got = policy.model(r.tokens, positions=r.positions, attn=r.attn)  # [B, S/cp, V]
            want = ref(mb.tokens, positions=mb.positions, attn=mb.attention())  # [B, S, V]
        split = policy.cp.split(mb.tokens.shape[1])
        real = split.shard(mb.doc_ids) >= 0
        rec["logits"] = max(rec["logits"], rel(got[real], split.shard(want)[real]))
    rec["cp_effective"] = policy.cp_metrics()["update/cp_effective"]
    # log-probs and entropy of the completion tokens, against cp = 1 on the same micro-batches
    ref_mbs = pack_micro_batches(mine, rows, BUDGET * degrees.cp, CPU, share_prompts=share)
    lp, ent, lp_ref, ent_ref = [], [], [], []
    with torch.no_grad():
        for mb in policy.micro_batches(mine, rows):  # the padding micro-batches too (collectives)
            a, b = token_logprobs(
                policy.model, mb, with_entropy=True, chunk_tokens=16, cp=policy.split
            )
            if mb.rows:
                lp.append(a)
                ent.append(b)
        for mb in ref_mbs:
            a, b = token_logprobs(ref, mb, with_entropy=True, chunk_tokens=16)
            lp_ref.append(a)
            ent_ref.append(b)
    rec["logp_values"] = torch.cat(lp)  # Ulysses against ring, directly
    rec["logprobs"] = rel(torch.cat(lp), torch.cat(lp_ref))
    rec["entropy"] = rel(torch.cat(ent), torch.cat(ent_ref))
    rec["old_logp"] = rel(
        policy.logprobs(mine, 40), recompute_logprobs(ref, mine, ref_mbs, 40, CPU, 16)
    )
    rec["losses"] = {k: loss_case(k, policy, ref, every, m) for k in LOSSES}
    return rec


def loss_case(
    key: str, policy: FlatPolicy, ref: Transformer, every: list[RolloutSample], m: dict
) -> dict:
    """One step's loss and gradients for the rank's samples against cp = 1 on all of them."""
    pl, pcfg, agg, ent_coef, kl_coef = LOSSES[key]
    g = torch.Generator().manual_seed(11)
    mask, gen, width = completion_tensors(every, CPU)
    adv = (
        torch.randn(len(every), 1, generator=g) + 0.1 * torch.randn(mask.shape, generator=g)
    ) * mask
    with torch.no_grad():
        base = recompute_logprobs(
            ref,
            every,
            pack_micro_batches(every, list(range(len(every))), 10**6, CPU),
            width,
            CPU,
            16,
        )
    old = base - 0.03 * torch.rand(mask.shape, generator=g)  # ratios away from 1, some clipped
    ref_logp = base + 0.05 * torch.randn(mask.shape, generator=g) if kl_coef else None
    spec = LossSpec(
        policy_loss=POLICY_LOSSES.get(pl),
        policy_cfg=pcfg,
        aggregation=AGGREGATIONS.get(agg),
        kl_estimator=KL_ESTIMATORS.get("k3") if kl_coef else None,
        kl_coef=kl_coef,
        entropy_coef=ent_coef,
        chunk_tokens=16,
    )
    idx = list(range(m["dp_rank"], len(every), m["dp"]))

    def inputs(rows: list[int]) -> LossInputs:
        return LossInputs(
            mask=mask[rows],
            old_logp=old[rows],
            advantages=adv[rows],
            gen_logp=gen[rows],
            ref_logp=ref_logp[rows] if ref_logp is not None else None,
        )

    policy.train()
    for p in policy.parameters():
        p.grad = None
    norm = make_norm(mask[idx], constant=40.0, group=m["dp_group"])
    mine = [every[i] for i in idx]
    sums = policy.accumulate(mine, list(range(len(mine))), inputs(idx), spec, norm, width)
    loss = sums.loss * float(policy.counts_stats)
    dist.all_reduce(loss)
    got = {clean_fqn(n): full(p.grad) for n, p in policy.model.named_parameters()}  # ac: no wrapper
    # the reference: every sample, one process, cp = 1
    ref.zero_grad(set_to_none=True)
    all_rows = list(range(len(every)))
    ref_norm = make_norm(mask, constant=40.0)
    ref_loss = 0.0
    for mb in pack_micro_batches(every, all_rows, BUDGET, CPU, share_prompts=policy.share_prompts):
        if not mb.rows:
            continue
        lo, _ = micro_batch_loss(ref, mb, inputs(all_rows), spec, ref_norm, width)
        lo.backward()
        ref_loss += lo.item()
    grads = {n: rel(got[n], p.grad) for n, p in ref.named_parameters()}
    return {
        "loss": loss.item(),
        "ref_loss": ref_loss,
        "grad": max(grads.values()),
        "worst": max(grads, key=grads.get),
        "grads_checked": len(grads),
    }


def run_exact() -> dict:
    """rl.exact's batch-invariant kernels: Ulysses at cp = 2 against cp = 1, bit for bit."""
    batch_invariant.enable()
    try:
        policy, ref, _ = build(Degrees(cp=2), "ulysses", True)
        every = samples()
        rows = list(range(len(every)))
        with torch.no_grad():
            got = torch.cat(
                [
                    token_logprobs(
                        policy.model, mb, with_entropy=False, chunk_tokens=16, cp=policy.split
                    )[0]
                    for mb in policy.micro_batches(every, rows)
                ]
            )
            want = torch.cat(
                [
                    token_logprobs(ref, mb, with_entropy=False, chunk_tokens=16)[0]
                    for mb in pack_micro_batches(every, rows, 2 * BUDGET, CPU, share_prompts=True)
                ]
            )
        return {
            "equal": bool(torch.equal(got, want)),
            "differ": int((got != want).sum()),
            "n": got.numel(),
        }
    finally:
        batch_invariant.disable()


def saved_bytes(fn) -> int:
    """Bytes of the distinct storages that ``fn()``'s autograd graph saves for backward,
    parameters left out (the activations)."""
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor):
        if not (t.is_leaf and t.requires_grad) and not isinstance(t, DTensor):
            st = t.untyped_storage()
            seen[st.data_ptr()] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    del out
    return sum(seen.values())


def run_memory() -> dict:
    """Activation bytes of one long sample's forward: cp = 1 (FSDP2 over the 2 ranks) and cp = 2."""
    g = torch.Generator().manual_seed(9)
    long = [
        RolloutSample(
            group=0,
            prompt_ids=torch.randint(1, 200, (96,), generator=g).tolist(),
            completion_ids=torch.randint(1, 200, (4000,), generator=g).tolist(),
            loss_mask=[True] * 4000,
            gen_logprobs=[-5.0] * 4000,
            finish_reason="stop",
            text="",
            row={},
        )
    ]
    out = {}
    for name, degrees, style in (
        ("cp1", Degrees(dp_shard=2), "ulysses"),
        ("cp2_ulysses", Degrees(cp=2), "ulysses"),
        ("cp2_ring", Degrees(cp=2), "ring"),
    ):
        policy, _, _ = build(degrees, style, True)
        policy.train()
        (mb,) = policy.micro_batches(long, [0])
        out[name] = saved_bytes(
            lambda p=policy, mb=mb: token_logprobs(
                p.model, mb, with_entropy=True, chunk_tokens=256, cp=p.split
            )
        )
        out[name + "_tokens"] = mb.tokens.numel()
    return out


def run_guard() -> dict:
    """A broken split: the whole row given to a split backend, and a forward that bypasses it."""
    policy, _, _ = build(Degrees(cp=2), "ring", True)
    every = samples()
    mb = policy.micro_batches(every, list(range(len(every))))[0]
    r = local_row(policy.cp, mb)
    out = {}
    with torch.no_grad():
        try:
            policy.model(
                mb.tokens, positions=mb.positions, attn=r.attn
            )  # unsplit tokens, split backend
            out["unsplit"] = "no error"
        except ContextSplitError as e:
            out["unsplit"] = str(e)
    policy, _, _ = build(
        Degrees(cp=2), "ring", True
    )  # a fresh model: the failed forward left FSDP2 mid-step
    r = local_row(policy.cp, mb)
    with torch.no_grad():
        policy.model(
            r.tokens, positions=r.positions, attn=CausalAttention()
        )  # the split backend bypassed
    try:
        r.check_calls(policy.model)
        out["bypassed"] = "no error"
    except ContextSplitError as e:
        out["bypassed"] = str(e)
    return out


SPECIAL = {"exact": run_exact, "memory": run_memory, "guard": run_guard}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--layouts", required=True)
    a = ap.parse_args()
    init_distributed()
    results: dict = {}
    for name in a.layouts.split(","):
        try:
            results[name] = SPECIAL[name]() if name in SPECIAL else run_layout(name)
        except Exception:  # noqa: BLE001  (recorded for the test to show; the others still run)
            results[name] = {"failure": traceback.format_exc()}
            print(
                f"rank {dist.get_rank()}: {name} failed:\n{results[name]['failure']}",
                file=sys.stderr,
                flush=True,
            )
        dist.barrier()
    if dist.get_rank() == 0:
        torch.save(results, a.out)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
