"""Which experts each token of a generated sequence was routed to (mixture-of-experts models).

The generator runs the trainer's own MoE blocks (tandem/models/moe.py), which record the
experts of every token of their last forward (``last_routing [T, k]``). After each
step the runner hands the step's token layout to `RoutingRecorder.record`, which
files each token's experts under (sequence, position), a later write replacing an
earlier one (a preempted sequence is recomputed). `completion` gives one sequence's
``[C, L, k]`` experts for the inputs that produce its C completion tokens (the last
prompt token, then every completion token but the last), the rows in the order the
update's recomputation reads them, so rollout and update routing can be compared
token by token (`moe/routing_mismatch`). The expert ids of a token are sorted.
"""

from __future__ import annotations

import torch
from torch import nn


def moe_blocks(model: nn.Module) -> list[nn.Module]:
    """The model's MoE blocks in layer order (through a generation layout's wrapper)."""
    out = []
    for layer in getattr(model, "layers", {}).values():
        moe = getattr(layer, "moe", None)
        if moe is not None:
            out.append(getattr(moe, "inner", moe))
    return out


class RoutingRecorder:
    def __init__(self, model: nn.Module) -> None:
        self.blocks = moe_blocks(model)
        self.by_seq: dict[int, dict[int, torch.Tensor]] = {}

    def record(self, seq_positions: list[tuple[int, int]]) -> None:
        """The last forward's tokens were ``seq_positions`` (seq_id, position) in row order."""
        if not self.blocks or not seq_positions:
            return
        # [T, L, k]
        ids = torch.stack([b.last_routing[: len(seq_positions)] for b in self.blocks], dim=1)
        ids = ids.sort(dim=-1).values.to(torch.int16).cpu()
        for row, (seq, pos) in enumerate(seq_positions):
            self.by_seq.setdefault(seq, {})[pos] = ids[row]

    def completion(
        self, seq_id: int, num_prompt_tokens: int, num_completion_tokens: int
    ) -> torch.Tensor | None:
        """``[C, L, k]`` int16 experts of the inputs at positions ``P-1 .. P+C-2``, -1 in the rows
        never computed for this sequence (a prompt token its group computed once, for another
        member); None for a dense model."""
        rows = self.by_seq.pop(seq_id, {})
        if not self.blocks:
            return None
        missing = torch.full((len(self.blocks), self.blocks[0].top_k), -1, dtype=torch.int16)
        want = range(num_prompt_tokens - 1, num_prompt_tokens + num_completion_tokens - 1)
        return torch.stack([rows.get(p, missing) for p in want]) if want else None
