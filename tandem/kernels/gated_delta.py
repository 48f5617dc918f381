"""The gated delta rule (Gated DeltaNet, Yang et al. 2024; Qwen3.5's linear-attention layers),
as a PyTorch reference: one token at a time, in fp32.

Per head a state ``S [Dk, Dv]`` carries the sequence: at token ``t``, with query ``q_t``, key
``k_t`` (both L2-normalised, the query then scaled by ``1/sqrt(Dk)``), value ``v_t``, decay
``g_t <= 0`` (a log) and write strength ``beta_t`` in (0, 1),

    S   <- exp(g_t) * S                        (forget)
    S   <- S + k_t (beta_t (v_t - S^T k_t))^T  (the delta rule: replace what k_t reads)
    o_t  = S^T q_t

Keys and queries may have fewer heads than values (grouped like GQA: value head ``h`` reads
key head ``h // (Hv / Hk)``). ``initial_state`` continues a sequence (a generator's
recurrent cache) and the final state is returned for the next call; ``reset [B, S]`` bool
starts a new sequence at those tokens (the state is zeroed before them), so documents
packed into one row stay apart. This is the definition a chunked or Triton form must equal;
no such kernel exists here yet (the model that uses it, Qwen3.5, is follow-up work:
docs/models.md).
"""

from __future__ import annotations

import torch

from tandem.kernels.batch_invariant import lane_aligned


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``x / sqrt(sum(x^2) + eps)`` over the last dim (the released models' epsilon)."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def gated_delta_rule(
    q: torch.Tensor,  # [B, S, Hk, Dk]
    k: torch.Tensor,  # [B, S, Hk, Dk]
    v: torch.Tensor,  # [B, S, Hv, Dv]
    g: torch.Tensor,  # [B, S, Hv], log decay (<= 0)
    beta: torch.Tensor,  # [B, S, Hv], in (0, 1)
    initial_state: torch.Tensor | None = None,  # [B, Hv, Dk, Dv]
    reset: torch.Tensor | None = None,  # [B, S] bool
    normalize_qk: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:  # ([B, S, Hv, Dv] in v's dtype, [B, Hv, Dk, Dv] fp32)
    """The outputs of every token and the state after the last (see the module docstring)."""
    b, s, hk, dk = k.shape
    hv, dv = v.shape[-2:]
    dtype = v.dtype
    if hv % hk:
        raise ValueError(f"value heads {hv} must be a multiple of key heads {hk}")
    q, k = q.float(), k.float()
    if normalize_qk:
        q, k = l2_normalize(q), l2_normalize(k)
    q = q * dk**-0.5
    if hv != hk:
        q, k = q.repeat_interleave(hv // hk, dim=2), k.repeat_interleave(hv // hk, dim=2)
    v, beta = v.float(), beta.float()
    forget = lane_aligned(torch.exp, g.float())  # [B, S, Hv]
    state = (
        q.new_zeros(b, hv, dk, dv) if initial_state is None else initial_state.float()
    )  # [B, Hv, Dk, Dv]
    out = [q.new_zeros(b, 0, hv, dv)]
    for t in range(s):
        if reset is not None:
            state = state * (~reset[:, t]).to(state.dtype)[:, None, None, None]
        state = state * forget[:, t][..., None, None]
        k_t = k[:, t]  # [B, Hv, Dk]
        read = (state * k_t[..., None]).sum(dim=-2)  # S^T k: [B, Hv, Dv]
        delta = (v[:, t] - read) * beta[:, t][..., None]  # [B, Hv, Dv]
        state = state + k_t[..., None] * delta[..., None, :]
        out.append((state * q[:, t][..., None]).sum(dim=-2)[:, None])  # S^T q: [B, 1, Hv, Dv]
    return torch.cat(out, dim=1).to(dtype), state
