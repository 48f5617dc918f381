"""A vision-language model's inputs for the generator's steps: M-RoPE positions and image rows.

A sequence whose prompt has images carries the prompt's `PromptImages` (``seq.images``,
the one object its group shares). Its token i takes the prompt's M-RoPE position while
i is in the prompt and ``i + delta`` after it; a text token's position is the same on the
three axes, so a step without image tokens (decode, a group member's last prompt token)
runs with 1-D positions, on every path (the decode mirror and CUDA graphs included). A
step that computes image tokens (a prefill chunk over the images) gets ``[3, T]`` positions
and the image rows in place of the tokens' embeddings. A prompt's rows are computed once,
by the model's tower, the first time any of its samples needs them, and kept until the
generator closes (a preempted sample recomputing its prompt reuses them): `tower_runs`
counts the tower's forwards.
"""

from __future__ import annotations

from typing import Any

import torch

from tandem.models.vlm import ImageInputs
from tandem.rl.generator.scheduler import ScheduledChunk


class VisionSteps:
    def __init__(self, model: Any) -> None:
        self.model = model
        self.image_id = model.args.vision.image_token_id
        self.tower_runs = 0
        self._held: list[Any] = []  # the PromptImages whose rows this generator computed

    def rows(self, images: Any, device: torch.device) -> torch.Tensor:
        """The prompt's image rows ``[R, D]``, from the tower the first time only."""
        if images.rows is None:
            pixels, grid = images.pixels()
            images.rows = self.model.image_rows([(pixels.to(device), grid)])
            self.tower_runs += 1
            self._held.append(images)
        return images.rows

    def _image_cols(self, c: ScheduledChunk) -> list[int]:
        """Columns of the chunk that are image tokens of the prompt (a sampled one is text)."""
        p = c.seq.num_prompt_tokens
        return [j for j, t in enumerate(c.token_ids) if t == self.image_id and c.start + j < p]

    def has_images(self, chunks: list[ScheduledChunk]) -> bool:
        return any(c.seq.images is not None and self._image_cols(c) for c in chunks)

    def rope_1d(self, chunks: list[ScheduledChunk]) -> list[int]:
        """Per token of the step, its position on every axis (a step without image tokens)."""
        out: list[int] = []
        for c in chunks:
            idx = torch.arange(c.start, c.end)
            out += (c.seq.images.positions_at(idx)[0] if c.seq.images is not None else idx).tolist()
        return out

    def inputs(
        self, chunks: list[ScheduledChunk], device: torch.device
    ) -> tuple[torch.Tensor, ImageInputs | None]:
        """M-RoPE positions ``[3, T]`` of the step's tokens and the image rows they take."""
        pos, index, rows = [], [], []
        at = 0
        for c in chunks:
            images, idx = c.seq.images, torch.arange(c.start, c.end)
            pos.append(images.positions_at(idx) if images is not None else idx.expand(3, -1))
            cols = self._image_cols(c) if images is not None else []
            if cols:
                # rows the earlier chunks took
                first = c.seq.token_ids[: c.start].count(self.image_id)
                rows.append(self.rows(images, device)[first : first + len(cols)])
                index += [at + j for j in cols]
            at += c.num_tokens
        positions = torch.cat(pos, dim=1).to(device)
        if not index:
            return positions, None
        return positions, ImageInputs(torch.tensor(index, device=device), embeds=torch.cat(rows))

    def release(self) -> None:
        """Drop the rows this generator computed (the rollout's memory goes back)."""
        for images in self._held:
            images.rows = None
        self._held = []
