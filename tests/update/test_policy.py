"""`FlatPolicy.accumulate` on an MoE model: the router's auxiliary and z losses reach the gradient.

One rank (gloo, FSDP2 over a 1-rank mesh), a tiny random MoE (debug-qwen3-moe, fp32) and a
few packed micro-batches. The reference is a plain copy of the model outside FSDP2: per
micro-batch, the policy loss's gradient plus the gradient of the router losses written out
here from the routers' inputs (captured by hooks) and autograd on the formulas:

    aux = E * sum_e (top-k hits of e / T) * mean_t softmax(logits)[t, e]
    z   = mean_t logsumexp(logits_t)^2
    router = mean over layers of (aux_coef * aux + z_coef * z) over the real (not padding)
             tokens, divided by the micro-batch count

Each coefficient alone is tested, so each term is shown to arrive.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from tandem.models import Transformer, get_flavor
from tandem.parallel.mesh import Degrees, build_mesh
from tandem.rl.algorithms import AGGREGATIONS, POLICY_LOSSES, PolicyLossConfig, make_norm
from tandem.rl.core.modeling import BuildSpec
from tandem.rl.rollout.types import RolloutSample
from tandem.rl.update.loss import LossInputs, LossSpec, completion_tensors, micro_batch_loss
from tandem.rl.update.packing import pack_micro_batches
from tandem.rl.update.policy import FlatPolicy

CPU = torch.device("cpu")
BUDGET = 40  # tokens per micro-batch: 8 samples of 8..23 tokens -> several micro-batches


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory):
    path = tmp_path_factory.mktemp("pg") / "init"
    dist.init_process_group("gloo", init_method=f"file://{path}", rank=0, world_size=1)
    yield build_mesh(Degrees(), CPU)
    dist.destroy_process_group()


def _samples() -> list[RolloutSample]:
    g = torch.Generator().manual_seed(0)
    out = []
    for i in range(8):
        p, c = (
            int(torch.randint(5, 15, (1,), generator=g)),
            int(torch.randint(3, 9, (1,), generator=g)),
        )
        out.append(
            RolloutSample(
                group=i // 4,
                prompt_ids=torch.randint(3, 500, (p,), generator=g).tolist(),
                completion_ids=torch.randint(3, 500, (c,), generator=g).tolist(),
                loss_mask=[True] * c,
                gen_logprobs=[-6.0] * c,
                finish_reason="length",
                text="",
                row={},
            )
        )
    return out


def _hand_router_loss(logits: torch.Tensor, k: int, aux_coef: float, z_coef: float) -> torch.Tensor:
    """aux_coef * aux + z_coef * z of one layer from its router logits [T, E] (see the module
    docstring)."""
    t, e = logits.shape
    m = logits.max(-1, keepdim=True).values.detach()
    ex = torch.exp(logits - m)
    p = ex / ex.sum(-1, keepdim=True)  # [T, E]
    hits = torch.zeros(e)
    for row in logits.detach():
        hits[row.topk(k).indices] += 1
    aux = e * ((hits / t) * p.mean(0)).sum()
    lse = torch.log(ex.sum(-1)) + m[:, 0]  # [T]
    return aux_coef * aux + z_coef * (lse**2).mean()


def _full(g: torch.Tensor) -> torch.Tensor:
    return g.full_tensor() if isinstance(g, DTensor) else g


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp(min=1e-30))


@pytest.mark.parametrize("aux_coef, z_coef", [(0.1, 0.0), (0.0, 0.1)], ids=["aux", "z"])
def test_router_losses_reach_the_gradient(one_rank, aux_coef, z_coef):
    args = get_flavor("debug-qwen3-moe").replace(
        router_aux_loss_coef=aux_coef, router_z_loss_coef=z_coef
    )
    policy = FlatPolicy(
        args,
        one_rank,
        CPU,
        path=None,
        seed=0,
        spec=BuildSpec(),
        is_main=True,
        micro_batch_tokens=BUDGET,
        chunk_tokens=16,
    )
    ref = Transformer(args)
    ref.load_state_dict(policy.full_state())
    samples = _samples()
    rows = list(range(len(samples)))
    mask, gen_logp, width = completion_tensors(samples, CPU)
    adv = torch.randn(mask.shape, generator=torch.Generator().manual_seed(1)) * mask
    spec = LossSpec(
        policy_loss=POLICY_LOSSES.get("ppo_clip"),
        policy_cfg=PolicyLossConfig(),
        aggregation=AGGREGATIONS.get("token_mean"),
        kl_estimator=None,
        kl_coef=0.0,
        entropy_coef=0.0,
    )
    norm = make_norm(mask)

    def inputs() -> LossInputs:
        return LossInputs(
            mask=mask,
            old_logp=None,
            advantages=adv,
            gen_logp=gen_logp,
            ref_logp=None,
            seen_logp=torch.zeros_like(mask),
        )

    policy.train()
    policy.accumulate(samples, rows, inputs(), spec, norm, width)
    got = {n: _full(p.grad) for n, p in policy.model.named_parameters()}

    # the reference: the same micro-batches through the plain copy, router losses by hand
    params = dict(ref.named_parameters())
    router_in: list[torch.Tensor] = []
    for layer in ref.layers.values():
        layer.moe.gate.register_forward_hook(lambda mod, inp, out: router_in.append(inp[0]))
    mbs = pack_micro_batches(samples, rows, BUDGET, CPU)
    assert len(mbs) >= 3
    pol = {n: torch.zeros_like(p) for n, p in params.items()}
    rtr = {n: torch.zeros_like(p) for n, p in params.items()}
    inp = inputs()
    padded = 0
    for mb in mbs:
        router_in.clear()
        loss, _ = micro_batch_loss(ref, mb, inp, spec, norm, width)
        gates = [layer.moe.gate.weight for layer in ref.layers.values()]
        # the padding of a packed row is not routed into the losses
        real = (mb.doc_ids >= 0).reshape(-1)
        padded += int(not real.all())
        router = torch.stack(
            [
                _hand_router_loss(x[real] @ w.T, args.num_experts_per_tok, aux_coef, z_coef)
                for x, w in zip(router_in, gates, strict=True)
            ]
        ).mean() / len(mbs)
        for acc, term in ((pol, loss), (rtr, router)):
            grads = torch.autograd.grad(
                term, list(params.values()), retain_graph=True, allow_unused=True
            )
            for n, g in zip(params, grads, strict=True):
                if g is not None:
                    acc[n] += g

    assert padded > 0  # some micro-batch has padding (which the router losses leave out)
    assert got.keys() == params.keys()
    for n in params:
        assert _rel(got[n], pol[n] + rtr[n]) < 1e-5, n
    for key in ref.layers:  # the router term is a visible part of each router's gradient
        n = f"layers.{key}.moe.gate.weight"
        assert _rel(got[n], pol[n]) > 1e-2, (n, _rel(got[n], pol[n]))
