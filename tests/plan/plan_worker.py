"""torchrun worker for tests/plan/test_plan.py: what a CPU run actually allocates, per layout.

``torchrun --standalone --nproc-per-node 2 tests/plan/plan_worker.py --out F --layouts a,b``
builds, for each named training layout (`LAYOUTS`, and `MOE_LAYOUTS` with an MoE model and
parallel.ep), the policy (tandem/rl/update/policy.py) and measures on every rank: the local bytes of
its parameter shards; what the run counts as resident through the rollout and the auto
``rollout.tp`` it chooses from that (tandem/rl/rollout/sampling.py); the tensors one micro-batch's
forward saves for backward (`saved_bytes`); gradient and AdamW state bytes after one
optimizer step; the generation shard of `GenerationCopy.build()` (``reshard/gb``) for each
generation degree; and the KV pool of a `Generator` sized the way the rollout sizes it.
Rank 0 writes ``{layout: [record per rank]}`` to ``F`` (torch.save).
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import traceback

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

# the repository root
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from tandem.models.args import ModelArgs  # noqa: E402
from tandem.parallel.distributed import init_distributed  # noqa: E402
from tandem.parallel.generation_layout import (
    GenerationCopy,  # noqa: E402
    make_layout,  # noqa: E402
)
from tandem.parallel.mesh import Degrees, build_mesh  # noqa: E402
from tandem.parallel.reshard import held  # noqa: E402
from tandem.rl.algorithms import AGGREGATIONS, POLICY_LOSSES, make_norm  # noqa: E402
from tandem.rl.config.rl_schema import RLConfig, RolloutConfig  # noqa: E402
from tandem.rl.core.modeling import BuildSpec  # noqa: E402
from tandem.rl.core.optim import build_optimizer  # noqa: E402
from tandem.rl.generator.engine import Generator  # noqa: E402
from tandem.rl.rollout.sampling import (  # noqa: E402
    choose_rollout_tp,
    generator_settings,
    rank_resident_bytes,
)
from tandem.rl.rollout.types import RolloutSample  # noqa: E402
from tandem.rl.update.loss import LossInputs, LossSpec, completion_tensors, token_logprobs  # noqa: E402
from tandem.rl.update.policy import build_policy  # noqa: E402

# ~4.2 MB of fp32 weights; vocabulary 1001 (uneven over 2 ranks)
ARGS = ModelArgs(
    model_type="qwen3",
    vocab_size=1001,
    hidden_size=128,
    intermediate_size=384,
    num_layers=4,
    num_heads=4,
    num_kv_heads=2,
    head_dim=32,
    rope_theta=1e6,
)
LAYOUTS = {  # name -> (training degrees, activation checkpointing)
    "fsdp2": (Degrees(dp_shard=2), "none"),
    "fsdp2_full": (Degrees(dp_shard=2), "full"),
    "tp2": (Degrees(tp=2), "none"),
    "pp2": (Degrees(pp=2), "none"),
}
# a Qwen3-MoE of about the same size: 8 experts (2 per token) in layers 1-3, layer 0 dense
MOE_ARGS = ARGS.replace(
    model_type="qwen3_moe",
    num_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=96,
    norm_topk_prob=True,
    mlp_only_layers=[0],
)
MOE_LAYOUTS = {  # name -> (training degrees, activation checkpointing, parallel.ep)
    "moe_ep2_full": (Degrees(dp_shard=2), "full", 2),
    "moe_fsdp2": (Degrees(dp_shard=2), "none", 1),
    "moe_ep2": (Degrees(dp_shard=2), "none", 2),
    # experts split by hidden features (tandem/parallel/moe_tp.py)
    "moe_tp2": (Degrees(tp=2), "none", 1),
}
MICRO_BATCH_TOKENS, SEQ_LEN = 256, 48
# the rollout's KV sizing: (kv_cache_gb, max_num_seqs, max_tokens): one limited by the budget, one
# by the sequences
KV_CASES = [(0.0005, 64, 24), (1.0, 6, 24)]
PROMPTS_PER_STEP, NUM_SAMPLES, MAX_PROMPT = 8, 2, 16
# what the run counts as staying through the rollout, with these models beside the policy
RESIDENT_CASES = {
    "policy": {},
    "offloaded": {"offload_optimizer": True},
    "ref_critic": {"reference": True, "critic": True},
}
# the auto rollout.tp the run chooses (2 ranks, 1 or 2 per node) on devices of these sizes,
# KV pool budget 0.5 MB
DEVICE_BYTES, AUTO_KV_GB = (8e6, 11e6, 14e6, 20e6, 1e9), 0.0005


def samples() -> list[RolloutSample]:
    """Eight samples of uneven lengths (packed rows, segment attention), the same on every rank."""
    g = torch.Generator().manual_seed(3)
    out = []
    for i in range(8):
        p = torch.randint(1, 1000, (6 + i,), generator=g).tolist()
        c = torch.randint(1, 1000, (20 + 2 * i,), generator=g).tolist()
        out.append(
            RolloutSample(
                group=i // 2,
                prompt_ids=p,
                completion_ids=c,
                loss_mask=[True] * len(c),
                gen_logprobs=[-1.0] * len(c),
                finish_reason="stop",
                text="",
                row={"id": i},
            )
        )
    return out


def _storage(t: torch.Tensor):
    """(data pointer, storage) of a tensor's own storage; (0, None) where it has none."""
    if isinstance(t, DTensor):
        t = t._local_tensor
    try:
        st = t.untyped_storage()
        return st.data_ptr(), st
    except (RuntimeError, NotImplementedError):  # wrapper subclasses, freed FSDP2 storages
        return 0, None


def _live_tensors() -> list[torch.Tensor]:
    """Every tensor the collector tracks. ``type(o)`` and not ``isinstance``: isinstance on a dead
    ``weakref.proxy`` raises ReferenceError (seen on CI after torch.distributed had been
    imported)."""
    return [o for o in gc.get_objects() if issubclass(type(o), torch.Tensor)]


def saved_bytes(model: torch.nn.Module, run) -> int:
    """Bytes of the distinct storages ``run()`` saves for backward (autograd's saved tensors, and
    the selective-checkpoint cache, which Python holds), parameters excluded, read after it ends."""
    before = {id(o) for o in _live_tensors()}
    seen: dict[int, object] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        ptr, st = _storage(t)
        seen[ptr] = st
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = run()
    for o in _live_tensors():
        if id(o) not in before and o.device.type != "meta":
            ptr, st = _storage(o)
            seen.setdefault(ptr, st)
    params = {_storage(p)[0] for p in model.parameters()}
    total = sum(st.nbytes() for ptr, st in seen.items() if ptr and ptr not in params)
    del out
    return total


def _loss_inputs(batch: list[RolloutSample], policy) -> tuple[LossInputs, LossSpec, object, int]:
    mask, gen_logp, width = completion_tensors(batch, torch.device("cpu"))
    adv = torch.linspace(-1, 1, len(batch))[:, None].expand_as(mask).contiguous()
    r = RLConfig()
    spec = LossSpec(
        policy_loss=POLICY_LOSSES.get("ppo_clip"),
        policy_cfg=r,
        aggregation=AGGREGATIONS.get("token_mean"),
        kl_estimator=None,
        kl_coef=0.0,
        entropy_coef=0.0,
        vocab_parallel=policy.vocab_parallel,
    )
    inp = LossInputs(
        mask=mask,
        old_logp=None,
        advantages=adv,
        gen_logp=gen_logp,
        ref_logp=None,
        seen_logp=torch.zeros_like(mask),
    )
    return inp, spec, make_norm(mask), width


def layout_spec(name: str) -> tuple[ModelArgs, Degrees, str, int]:
    """(model, training degrees, activation checkpointing, parallel.ep) of a named layout."""
    if name in MOE_LAYOUTS:
        return (MOE_ARGS, *MOE_LAYOUTS[name])
    return (ARGS, *LAYOUTS[name], 1)


def run_layout(name: str) -> dict:
    args, degrees, ac, ep = layout_spec(name)
    dev = torch.device("cpu")
    mesh = build_mesh(degrees, dev)
    policy = build_policy(
        args,
        mesh,
        dev,
        pp_schedule="1F1B",
        pp_microbatches=0,
        seq_len=SEQ_LEN,
        micro_batch_tokens=MICRO_BATCH_TOKENS,
        chunk_tokens=64,
        path=None,
        seed=5,
        spec=BuildSpec(activation_checkpoint=ac, ep=ep),
        is_main=dist.get_rank() == 0,
    )
    batch = samples()
    rec: dict = {"params": sum(held(p)[0].numel() * 4 for p in policy.parameters())}
    if degrees.pp == 1:  # the flat policy: one packed micro-batch through the training forward
        mb = policy.micro_batches(batch, list(range(len(batch))))[0]
        policy.train()
        rec["act_tokens"] = mb.tokens.numel()
        rec["activations"] = saved_bytes(
            policy.model,
            lambda: token_logprobs(
                policy.model,
                mb,
                with_entropy=True,
                chunk_tokens=64,
                vocab_parallel=policy.vocab_parallel,
            ),
        )
        gc.collect()
    opt = build_optimizer(
        policy.state_module, lr=1e-3, betas=[0.9, 0.95], eps=1e-8, weight_decay=0.0
    )
    inp, spec, norm, width = _loss_inputs(batch, policy)
    policy.train()
    policy.accumulate(batch, list(range(len(batch))), inp, spec, norm, width)
    rec["grads"] = sum(
        held(p.grad)[0].numel() * 4 for p in policy.parameters() if p.grad is not None
    )
    opt.step()
    rec["optimizer"] = sum(
        held(v)[0].numel() * v.element_size()
        for st in opt.state.values()
        for v in st.values()
        if isinstance(v, torch.Tensor) and v.dim() > 0
    )
    opt.zero_grad(set_to_none=True)
    for case, flags in RESIDENT_CASES.items():
        rec[f"resident_{case}"] = rank_resident_bytes(policy, dev, **flags)
    for per_node in (1, 2):
        for mem in DEVICE_BYTES:
            rec[f"auto_tp_{per_node}_{mem:.0f}"] = choose_rollout_tp(
                0,
                RolloutConfig(kv_cache_gb=AUTO_KV_GB),
                args,
                torch.float32,
                world=dist.get_world_size(),
                devices_per_node=per_node,
                device_bytes=mem,
                resident=rec["resident_policy"],
            )
    policy.eval()
    for g in (1, 2):
        layout = make_layout(g, True)
        gen_model, metrics = GenerationCopy(policy.state_module, args, layout, dev).build(
            inference=False
        )
        rec[f"shard_{g}"] = metrics["reshard/gb"] * 1e9
        for j, (kv_gb, seqs, max_tokens) in enumerate(KV_CASES):
            rcfg = RolloutConfig(
                kv_cache_gb=kv_gb,
                max_num_seqs=seqs,
                max_tokens=max_tokens,
                block_size=4,
                cuda_graphs=False,
            )
            settings = generator_settings(rcfg, MAX_PROMPT, seed=0)
            pooled = PROMPTS_PER_STEP // dist.get_world_size() * g  # as _with_generator sizes it
            settings.max_num_seqs = min(settings.max_num_seqs, pooled * NUM_SAMPLES)
            gen = Generator(gen_model, settings)
            rec[f"kv_{g}_{j}"] = gen.cache.nbytes
            gen.close()
        del gen_model
    recs: list = [None] * dist.get_world_size()
    dist.all_gather_object(recs, rec)
    return recs


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--layouts", required=True)
    a = ap.parse_args()
    torch.manual_seed(0)
    init_distributed(force_cpu=True)
    results: dict = {}
    for name in a.layouts.split(","):
        try:
            results[name] = run_layout(name)
        except Exception:  # noqa: BLE001 - the test reports it
            results[name] = {"error": traceback.format_exc()}
            raise
    if dist.get_rank() == 0:
        torch.save(results, a.out)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
