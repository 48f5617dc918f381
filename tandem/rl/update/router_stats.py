"""Mixture-of-experts routing statistics of the update phase (`moe/*` metrics).

`RoutingCheck` (below) compares the rollout's routing with the update's.

`RouterStats.observe(model)` reads what each MoE block recorded in its last
forward (tandem/models/moe.py: ``tokens_per_expert``, ``aux_loss``, ``z_loss``) and adds
it up; `metrics(group)` sums the counts over the data-parallel ranks and returns,
per layer, ``moe/expert_load_max_over_mean/<layer>`` (the busiest expert's tokens
over the mean: 1 is perfect balance, ``E / k`` every token on the same ``k``),
and the mean ``moe/aux_loss`` and ``moe/z_loss``; then starts over. Empty for a
dense model.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from tandem.models.moe import moe_layers
from tandem.rl.rollout.types import RolloutSample


class RouterStats:
    def __init__(self) -> None:
        self.counts: dict[str, torch.Tensor] = {}
        self.losses = torch.zeros(3, dtype=torch.float64)  # aux sum, z sum, observations

    @torch.no_grad()
    def observe(self, model: nn.Module) -> None:
        layers = moe_layers(model)
        for key, moe in layers.items():
            if moe.tokens_per_expert is None:
                continue
            c = moe.tokens_per_expert.detach().double().cpu()
            self.counts[key] = self.counts[key] + c if key in self.counts else c
            self.losses += torch.tensor(
                [float(moe.aux_loss), float(moe.z_loss), 1.0], dtype=torch.float64
            )

    def metrics(self, group: dist.ProcessGroup | None, device: torch.device) -> dict[str, float]:
        """Collective over ``group`` (every rank of it calls, each with the same layers)."""
        if not self.counts:
            return {}
        keys = sorted(self.counts, key=int)
        flat = torch.cat([torch.stack([self.counts[k] for k in keys]).reshape(-1), self.losses]).to(
            device
        )
        if dist.is_initialized():
            dist.all_reduce(flat, group=group)
        n = len(keys) * self.counts[keys[0]].numel()
        counts = flat[:n].view(len(keys), -1)
        counts = counts.cpu()
        aux, z, seen = flat[n:].tolist()
        out = {
            f"moe/expert_load_max_over_mean/{k}": float(c.max() / c.mean().clamp(min=1e-9))
            for k, c in zip(keys, counts)
        }
        out.update({"moe/aux_loss": aux / max(seen, 1.0), "moe/z_loss": z / max(seen, 1.0)})
        self.counts, self.losses = {}, torch.zeros(3, dtype=torch.float64)
        return out


class RoutingCheck:
    """Rollout vs update routing, token by token (`moe/routing_mismatch`).

    Armed with the step's samples (their ``routing``: the experts the generator chose,
    tandem/rl/generator/routing.py), it reads, after each update forward with the rollout's
    weights, the experts every MoE block chose for the inputs that predict the
    completion tokens (``mb.comp_index``) and counts the (token, layer) pairs whose
    expert sets differ. Tokens the rollout did not record for a sample (-1) are not
    compared."""

    def __init__(self) -> None:
        self.samples: list[RolloutSample] | None = None
        self.stats = torch.zeros(2, dtype=torch.float64)  # differing pairs, compared pairs

    def arm(self, samples: list[RolloutSample]) -> None:
        self.samples = samples if any(s.routing is not None for s in samples) else None

    def disarm(self) -> None:
        self.samples = None

    @torch.no_grad()
    def observe(self, model: nn.Module, mb) -> None:  # noqa: ANN001 - tandem.rl.update.packing.MicroBatch
        if self.samples is None or not mb.rows:
            return
        layers = list(moe_layers(model).values())
        if not layers:
            return
        # [K, L, k]
        upd = (
            torch.stack([m.last_routing for m in layers], dim=1)[mb.comp_index]
            .sort(dim=-1)
            .values.cpu()
        )
        gen = torch.full_like(upd, -1)
        rows, cols = mb.comp_row.cpu(), mb.comp_col.cpu()
        for r, j in enumerate(mb.rows):
            routing = self.samples[j].routing
            if routing is not None:
                sel = rows == r
                gen[sel] = routing[cols[sel]].to(upd.dtype)
        valid = gen[..., 0] >= 0  # [K, L]
        differ = (gen != upd).any(dim=-1) & valid
        self.stats += torch.tensor([float(differ.sum()), float(valid.sum())], dtype=torch.float64)

    def metrics(self, group: dist.ProcessGroup | None, device: torch.device) -> dict[str, float]:
        """Collective over ``group``; empty when nothing was compared on any rank."""
        self.samples = None
        t = self.stats.to(device)
        if dist.is_initialized():
            dist.all_reduce(t, group=group)
        self.stats = torch.zeros(2, dtype=torch.float64)
        differ, compared = t.tolist()
        return (
            {"moe/routing_mismatch": differ / compared, "moe/routing_compared": compared}
            if compared
            else {}
        )
