"""The recurrent-state cache of linear-attention layers (Qwen3.5's gated DeltaNet).

Beside the paged KV pool (which the full-attention layers use as any model's), each sequence
holds one slot (`tandem.rl.generator.block_manager.StateSlots`) of two tensors per linear
layer: the last ``conv_kernel - 1`` inputs of its convolution ``[K-1, C]`` (the model's dtype)
and the delta rule's state ``[Hv, Dk, Dv]`` (fp32, as the rule keeps it). A step's chunk
continues its slot's state, or starts from zeros when it is the sequence's first chunk (a new
sequence, or one preempted and recomputing), and leaves its state there for the next; a fork
(the n samples of a prompt) copies the leader's slot. `StepState` is what the model's
`GatedDeltaNet` reads and writes through the step's `PagedAttention` (``linear_state``).
"""

from __future__ import annotations

from typing import Any

import torch


class RecurrentState:
    """Every linear layer's state for ``num_slots`` sequences (see the module docstring)."""

    def __init__(self, args: Any, num_slots: int, dtype: torch.dtype, device: torch.device):
        lin = args.linear
        linear = [i for i in range(args.num_layers) if args.is_linear_layer(i)]
        self.index = {layer: i for i, layer in enumerate(linear)}  # layer id -> row
        n = len(linear)
        self.conv = torch.zeros(
            n, num_slots, lin.conv_kernel - 1, lin.conv_dim, dtype=dtype, device=device
        )  # [Ll, slots, K-1, C]
        self.matrix = torch.zeros(
            n,
            num_slots,
            lin.num_value_heads,
            lin.key_head_dim,
            lin.value_head_dim,
            dtype=torch.float32,
            device=device,
        )  # [Ll, slots, Hv, Dk, Dv]
        self._shapes = ((self.conv.shape, self.conv.dtype), (self.matrix.shape, torch.float32))

    @staticmethod
    def bytes_per_sequence(args: Any, dtype: torch.dtype) -> int:
        """One sequence's state over every linear layer, in bytes."""
        conv, matrix = args.linear.state_numel()
        layers = sum(args.is_linear_layer(i) for i in range(args.num_layers))
        return layers * (conv * torch.empty((), dtype=dtype).element_size() + matrix * 4)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.conv, self.matrix))

    def copy_slots(self, pairs: list[tuple[int, int]]) -> None:
        """Forks: copy slot src into dst in every layer (before the step's forward)."""
        if not pairs:
            return
        src = torch.tensor([p[0] for p in pairs], device=self.conv.device)
        dst = torch.tensor([p[1] for p in pairs], device=self.conv.device)
        self.conv[:, dst] = self.conv[:, src]
        self.matrix[:, dst] = self.matrix[:, src]

    def step(self, slots: list[int], fresh: list[bool]) -> StepState:
        """The state of one step's chunks, in row order (``fresh``: the sequence's first)."""
        device = self.conv.device
        return StepState(
            self,
            torch.tensor(slots, dtype=torch.long, device=device),
            torch.tensor(fresh, dtype=torch.bool, device=device),
        )

    def to(self, device: torch.device | str) -> None:
        """Move both tensors (offloading through an update, and back)."""
        self.conv, self.matrix = self.conv.to(device), self.matrix.to(device)

    def release(self) -> None:
        """Free the tensors (every sequence was preempted: each starts from zeros again)."""
        self.conv, self.matrix = self.conv.new_empty(0), self.matrix.new_empty(0)

    def reacquire(self, device: torch.device) -> None:
        (cs, cd), (ms, md) = self._shapes
        self.conv = torch.zeros(cs, dtype=cd, device=device)
        self.matrix = torch.zeros(ms, dtype=md, device=device)


class StepState:
    """One step's view: ``load(layer)`` gives ``(conv [N, K-1, C], matrix [N, Hv, Dk, Dv])``
    for the step's N chunks (zeros for fresh ones), ``store`` writes the states after them."""

    def __init__(self, cache: RecurrentState, slots: torch.Tensor, fresh: torch.Tensor) -> None:
        self.cache, self.slots, self.fresh = cache, slots, fresh

    def load(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        i = self.cache.index[layer_id]
        conv = self.cache.conv[i].index_select(0, self.slots)
        matrix = self.cache.matrix[i].index_select(0, self.slots)
        fresh = self.fresh
        conv = torch.where(fresh[:, None, None], torch.zeros_like(conv), conv)
        return conv, torch.where(fresh[:, None, None, None], torch.zeros_like(matrix), matrix)

    def store(self, layer_id: int, conv: torch.Tensor, matrix: torch.Tensor) -> None:
        i = self.cache.index[layer_id]
        self.cache.conv[i].index_copy_(0, self.slots, conv.to(self.cache.conv.dtype))
        self.cache.matrix[i].index_copy_(0, self.slots, matrix.float())
