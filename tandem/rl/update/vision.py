"""A vision-language policy's micro-batches: the rollout's M-RoPE positions and image inputs.

`attach_images` turns a packed `MicroBatch` (tandem/rl/update/packing.py) into the model's
input for a policy with a vision tower: each packed document (a sample, or with shared
prompts a prompt and its branches) takes the `PromptImages` its samples carry, the very
object the generator read its positions from, so rollout and update use the same
positions; its image tokens take the prompt's image rows (the tower once per prompt in the
micro-batch); every token gets its ``[3]`` M-RoPE position. Text samples keep their
positions on all three axes.
"""

from __future__ import annotations

from tandem.models.vlm import vision_batch
from tandem.rl.rollout.types import RolloutSample
from tandem.rl.update.packing import MicroBatch


def attach_images(mb: MicroBatch, samples: list[RolloutSample], image_token_id: int) -> MicroBatch:
    """``mb`` with ``positions [3, B, S]`` and ``images`` set (in place; returned)."""
    width = mb.tokens.shape[1]
    docs = {}
    for k, i in enumerate(mb.rows):
        if samples[i].images is None:
            continue
        row, col = divmod(mb.offsets[k][0], width)  # the sample's last prompt token
        docs[(row, int(mb.doc_ids[row, col]))] = samples[i].images
    positions, images = vision_batch(mb.tokens, mb.positions, mb.doc_ids, docs, image_token_id)
    mb.positions, mb.images = positions, None if images is None else images.to(mb.tokens.device)
    return mb
