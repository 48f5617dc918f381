"""Gated DeltaNet, Qwen3.5's linear-attention token mixer, around the attention-backend seam.

Per token: ``in_proj_qkv`` gives q, k and v side by side (``conv_dim`` channels), a depthwise
causal convolution of ``conv_kernel`` taps and SiLU mixes each channel with its previous
inputs, the gated delta rule (`tandem.kernels.gated_delta.gated_delta_rule`) runs q, k, v with
the decay ``g = -exp(A_log) * softplus(a + dt_bias)`` and the write strength
``beta = sigmoid(b)``, and a gated RMSNorm (``norm(o) * w * silu(z)``) and ``out_proj`` give
the output. The recurrence needs to know where each sequence starts, so the layer asks the
backend for its `Segments`: the flat ``[B * S]`` positions of each sequence in order (a
training backend's documents, a shared prompt followed by each of its branches, or a generator
step's chunks) as a padded ``[N, W]`` batch. A backend with a ``linear_state`` (the
generator's, tandem/rl/generator/recurrent_state.py) also gives each segment's state to
continue from (the last ``conv_kernel - 1`` inputs and the delta-rule matrix) and takes the
state after its last real token; padding after it runs with ``g = 0`` and ``beta = 0``, which
leave the state as it is. The convolution is its ``conv_kernel`` taps summed in order, so a
token's value does not depend on what else shares the batch, and under ``rl.exact`` every
exp / softplus / sigmoid / silu runs lane-aligned (`tandem.kernels.batch_invariant.lane_aligned`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tandem.kernels.batch_invariant import lane_aligned
from tandem.kernels.gated_delta import gated_delta_rule


@dataclass
class Segments:
    """Sequences of a flat ``[B * S]`` layout as a padded batch (see the module docstring)."""

    gather: torch.Tensor  # [N, W] flat positions, each sequence in order, padded at the end
    scatter: torch.Tensor  # [B * S] the position in the flat [N * W] whose output a token takes
    lengths: torch.Tensor | None = None  # [N] real tokens (None: no final state wanted)


def row_segments(b: int, s: int, device: torch.device) -> Segments:
    """Every row one sequence."""
    flat = torch.arange(b * s, device=device)
    return Segments(flat.view(b, s), flat)


def doc_segments(doc_ids: torch.Tensor, branch_ids: torch.Tensor | None = None) -> Segments:
    """The documents of packed rows (contiguous runs of one id; a run of padding is one too);
    with ``branch_ids``, each branch after its document's prefix (branch 0) is the prefix
    followed by that branch, and the prefix's outputs come from its first such segment. One
    host read of the ids."""
    b, s = doc_ids.shape
    docs = doc_ids.tolist()
    branches = branch_ids.tolist() if branch_ids is not None else None
    segs: list[list[int]] = []
    owner = [(0, 0)] * (b * s)  # flat position -> (segment, index in it)
    for r in range(b):
        j = 0
        while j < s:
            e = j
            while e < s and docs[r][e] == docs[r][j]:
                e += 1
            parts: dict[int, list[int]] = {}
            for c in range(j, e):
                parts.setdefault(branches[r][c] if branches else 0, []).append(r * s + c)
            prefix = parts.pop(0, [])
            for k, part in enumerate(parts.values() or [[]]):
                seg = prefix + part
                owned = seg if k == 0 else part
                first = len(prefix) if k else 0
                for n, pos in enumerate(owned):
                    owner[pos] = (len(segs), n + first)
                segs.append(seg)
            j = e
    w = max(len(x) for x in segs)
    gather = [x + [x[-1]] * (w - len(x)) for x in segs]
    scatter = [seg * w + n for seg, n in owner]
    device = doc_ids.device
    return Segments(torch.tensor(gather, device=device), torch.tensor(scatter, device=device))


def segments_of(attn: Any, b: int, s: int, device: torch.device) -> Segments:
    """The backend's `Segments` for a ``[B, S]`` forward; ValueError naming a backend that
    cannot say where its sequences start."""
    get = getattr(attn, "linear_segments", None)
    if get is None:
        raise ValueError(
            f"{type(attn).__name__} cannot run linear-attention layers (Qwen3.5); see the "
            "'What composes' table in docs/config.md"
        )
    return get(b, s, device)


class GatedRMSNorm(nn.Module):
    """``w * rmsnorm(x)`` (fp32 statistics, rounded to x's dtype) times ``silu(gate)``."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        h = self.weight * h.to(x.dtype)
        return (h * lane_aligned(F.silu, gate.float())).to(x.dtype)


class GatedDeltaNet(nn.Module):
    """See the module docstring; parameter names are HF's (``linear_attn.*`` on disk)."""

    def __init__(self, args: Any, layer_id: int) -> None:
        super().__init__()
        lin = args.linear
        self.layer_id, self.lin = layer_id, lin
        d, hv, c = args.hidden_size, lin.num_value_heads, lin.conv_dim
        self.in_proj_qkv = nn.Linear(d, c, bias=False)
        self.in_proj_z = nn.Linear(d, lin.value_dim, bias=False)
        self.in_proj_b = nn.Linear(d, hv, bias=False)
        self.in_proj_a = nn.Linear(d, hv, bias=False)
        self.conv1d = nn.Conv1d(c, c, lin.conv_kernel, groups=c, bias=False)  # weight [C, 1, K]
        self.dt_bias = nn.Parameter(torch.ones(hv))
        self.A_log = nn.Parameter(torch.zeros(hv))
        self.norm = GatedRMSNorm(lin.value_head_dim, args.rms_norm_eps)
        self.out_proj = nn.Linear(lin.value_dim, d, bias=False)
        self.wqkv = None  # no fused inference layout

    def fuse(self) -> None:
        """`Transformer.fuse_projections`' hook: the projections stay as they are."""

    @torch.no_grad()
    def init_weights(self, std: float, gen: torch.Generator | None) -> None:
        """The parts `Transformer.init_weights` does not reach (its linears it does): the
        convolution N(0, std), ``dt_bias`` 1, ``A_log`` log U(0.01, 16) as transformers does,
        the gated norm 1."""
        nn.init.normal_(self.conv1d.weight, std=std, generator=gen)
        nn.init.ones_(self.dt_bias)
        self.A_log.copy_(torch.empty_like(self.A_log).uniform_(0.01, 16, generator=gen).log())
        nn.init.ones_(self.norm.weight)

    def _conv(self, x: torch.Tensor, before: torch.Tensor | None) -> tuple[torch.Tensor, ...]:
        """SiLU of the causal depthwise convolution of ``x [N, W, C]`` continuing ``before
        [N, K-1, C]`` (zeros when None); returns it and the inputs with ``before`` in front."""
        k, (n, w, c) = self.lin.conv_kernel, x.shape
        if before is None:
            before = x.new_zeros(n, k - 1, c)
        padded = torch.cat([before.to(x.dtype), x], dim=1)  # [N, K-1+W, C]
        weight = self.conv1d.weight[:, 0]  # [C, K]
        out = padded[:, :w] * weight[:, 0]
        for j in range(1, k):
            out = out + padded[:, j : j + w] * weight[:, j]
        return lane_aligned(F.silu, out), padded

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn: Any
    ) -> torch.Tensor:
        b, s, _ = x.shape  # [B, S, D]
        lin = self.lin
        seg = segments_of(attn, b, s, x.device)
        n, w = seg.gather.shape
        idx = seg.gather.reshape(-1)

        def batch(t: torch.Tensor) -> torch.Tensor:  # [B, S, F] -> [N, W, F]
            return t.reshape(b * s, t.shape[-1]).index_select(0, idx).view(n, w, t.shape[-1])

        state = getattr(attn, "linear_state", None)
        conv0, rec0 = state.load(self.layer_id) if state is not None else (None, None)
        mixed, padded = self._conv(batch(self.in_proj_qkv(x)), conv0)  # [N, W, C]
        beta = lane_aligned(torch.sigmoid, batch(self.in_proj_b(x)))  # [N, W, Hv]
        a = batch(self.in_proj_a(x)).float()
        softplus = lane_aligned(F.softplus, a + self.dt_bias)
        g = -self.A_log.float().exp() * softplus  # [N, W, Hv]
        if seg.lengths is not None:  # padding leaves the state as it is
            real = (torch.arange(w, device=x.device)[None] < seg.lengths[:, None])[..., None]
            g, beta = g * real, beta * real
        kd, hk, hv = lin.key_dim, lin.num_key_heads, lin.num_value_heads
        q, k, v = mixed.split([kd, kd, lin.value_dim], dim=-1)
        out, final = gated_delta_rule(
            q.reshape(n, w, hk, -1),
            k.reshape(n, w, hk, -1),
            v.reshape(n, w, hv, -1),
            g,
            beta,
            initial_state=rec0,
        )  # [N, W, Hv, Dv], [N, Hv, Dk, Dv]
        if state is not None:
            take = seg.lengths[:, None] + torch.arange(lin.conv_kernel - 1, device=x.device)
            conv = padded.gather(1, take[..., None].expand(-1, -1, padded.shape[-1]))
            state.store(self.layer_id, conv, final)
        o = out.reshape(n * w, hv, -1).index_select(0, seg.scatter)  # [B*S, Hv, Dv]
        o = self.norm(o, self.in_proj_z(x).reshape(b * s, hv, -1))
        return self.out_proj(o.reshape(b, s, lin.value_dim))  # [B, S, D]
