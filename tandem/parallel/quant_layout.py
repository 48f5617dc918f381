"""Whether a low-bit format's blocks survive the generation layout's split (rollout.weight_dtype
with rollout.tp > 1; docs/low-precision.md).

A generation shard quantized alone equals the whole weight's quantization of its entries when
its offset along the split dimension is a multiple of the format's block there (and, for
w4a16, it is given the whole tensor's largest entry: tandem/parallel/quant_copy.py
`tensor_amax`). The projections split evenly, so that is ``(size / tp) % block == 0``.
"""

from __future__ import annotations

import torch

from tandem.kernels.weight_quant import WeightFormat
from tandem.models.args import ModelArgs
from tandem.models.quant_linear import is_target_weight
from tandem.models.vlm import make_model
from tandem.parallel.generation_layout import GenerationLayout, split_dim


def cut_block(args: ModelArgs, tp: int, fmt: WeightFormat) -> str | None:
    """The first projection whose ``tp`` shards cut ``fmt``'s blocks, said in one phrase, or
    None when every shard holds whole blocks."""
    if tp <= 1:
        return None
    layout = GenerationLayout(tp=tp)
    with torch.device("meta"):
        model = make_model(args)
    for name, p in model.named_parameters():
        dim = split_dim(name, layout) if is_target_weight(name) else None
        if dim is not None and (p.shape[dim] // tp) % fmt.block[dim]:
            what = ("rows", "inputs")[dim]
            return (
                f"{name} splits into {p.shape[dim] // tp} {what} per rank, not a multiple of "
                f"{fmt.name}'s {fmt.block[dim]}"
            )
    return None
