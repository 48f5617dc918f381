"""A vision-language model (Qwen2.5-VL): the vision tower feeding the same `Transformer`.

`VisionLanguageModel` is a `Transformer` (the same LM, the same parameter names, so
every plan, reshard and checkpoint that addresses ``layers`` / ``tok_embeddings`` /
``output`` applies unchanged) with one more module, ``visual``
(tandem/models/vision.py). Its forward embeds the token ids, writes the images' rows over
the image tokens' embeddings, and runs the LM on those hidden states with M-RoPE
positions ``[3, B, S]`` (tandem/models/rope.py). The caller says where the rows go
(`ImageInputs.index`) and gives either the pixels, one group per prompt (under ``rl.exact``
the tower runs once per group, so a prompt's rows are the same bits whatever else shares the
batch), or rows computed earlier (the generator computes a prompt's rows once for its samples).

When the tower is trainable and a forward has no image, it runs on one blank image and
adds zero times the result, so every data-parallel rank's backward reaches the tower's
parameters and the gradient collectives stay in step (a rank with text rows only never
waits for the others).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from tandem.kernels import batch_invariant
from tandem.models.args import ModelArgs
from tandem.models.image_processor import ImageProcessor, open_image
from tandem.models.transformer import Transformer
from tandem.models.vision import VisionTransformer


@dataclass
class ImageInputs:
    """The images of one forward: where their rows go and how to get the rows.

    ``index [R]``: flat positions (into the ``[B * S]`` tokens) of the image tokens, in
    the order of the rows; ``groups``: ``(pixels [N, patch_dim], grid_thw [I, 3])`` per
    prompt, whose rows, concatenated (and picked by ``take [R]`` when a prompt appears
    more than once), fill ``index``; or ``embeds [R, D]`` given.
    """

    index: torch.Tensor
    groups: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)
    embeds: torch.Tensor | None = None
    take: torch.Tensor | None = None

    def to(self, device: torch.device | str) -> ImageInputs:
        return ImageInputs(
            self.index.to(device),
            [(p.to(device), g) for p, g in self.groups],
            None if self.embeds is None else self.embeds.to(device),
            None if self.take is None else self.take.to(device),
        )


@dataclass(eq=False)
class PromptImages:
    """The images of one prompt (or training example) and its M-RoPE positions.

    Made once when the prompt is built (tandem/rl/data/images.py) and carried, the same
    object, by every sample of it: the generator's prefill and the update's forward read
    the same ``positions``. Pixels are decoded and preprocessed on demand (`pixels`) and
    kept until `release`; ``rows`` holds the tower's output while a generator shares it
    among the prompt's samples.
    """

    sources: list[Any]  # what `open_image` reads: paths, data: URIs, bytes
    grids: list[tuple[int, int, int]]  # patch grid (t, h, w) per image
    positions: torch.Tensor  # [3, P] M-RoPE positions of the prompt's tokens
    delta: int  # a later token at index i sits at i + delta on every axis
    processor: ImageProcessor
    base_dir: str | None = None  # relative image paths are read from here
    rows: torch.Tensor | None = None
    _pixels: tuple[torch.Tensor, torch.Tensor] | None = field(default=None, repr=False)

    @property
    def num_rows(self) -> int:
        """LM rows (image tokens) of all the images."""
        m = self.processor.merge_size**2
        return sum(t * h * w // m for t, h, w in self.grids)

    def pixels(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(pixels ``[N, patch_dim]``, grid_thw ``[I, 3]``), decoded once until `release`."""
        if self._pixels is None:
            with torch.inference_mode(False):
                # kept for a later forward with autograd (the generator's is not)
                pixels, grid = self.processor([open_image(s, self.base_dir) for s in self.sources])
            if grid.tolist() != [list(g) for g in self.grids]:
                raise ValueError(
                    "an image changed size since the prompt was built: "
                    f"{grid.tolist()} != {self.grids}"
                )
            self._pixels = (pixels, grid)
        return self._pixels

    def release(self) -> None:
        """Drop the cached pixels and rows (they are made again on demand)."""
        self._pixels, self.rows = None, None

    def positions_at(self, index: torch.Tensor) -> torch.Tensor:
        """``[3, *index.shape]`` M-RoPE positions of token indices (any later index allowed)."""
        p = self.positions.shape[1]
        pos = self.positions.to(index.device)
        inside = pos[:, index.clamp(max=p - 1)]
        return torch.where(index < p, inside, index + self.delta)

    def __getstate__(self) -> dict[str, Any]:  # pickled between ranks without caches
        return {**self.__dict__, "rows": None, "_pixels": None}


def vision_batch(
    tokens: torch.Tensor,
    positions: torch.Tensor,
    doc_ids: torch.Tensor,
    images: dict[tuple[int, int], PromptImages],
    image_token_id: int,
) -> tuple[torch.Tensor, ImageInputs | None]:
    """M-RoPE positions ``[3, B, S]`` and the `ImageInputs` of a packed batch.

    ``tokens``, ``positions`` (per-document token indices) and ``doc_ids`` are ``[B, S]``;
    ``images[(row, doc)]`` the images of document ``doc`` of row ``row`` (documents without
    an entry are text: the same position on all axes). A document's image tokens (those
    inside the images' prompt: a sampled image token is text) take its images' rows in
    order; its tokens past the prompt continue at index + delta.
    """
    pos3 = positions.unsqueeze(0).expand(3, -1, -1).clone()  # [3, B, S]
    if not images:
        return pos3, None
    s = tokens.shape[1]
    # first: id(PromptImages) -> its first row in the tower's output
    index, groups, take, first = [], [], [], {}
    computed = 0  # rows the tower will output for the groups so far
    for (row, doc), pi in sorted(images.items(), key=lambda kv: kv[0]):
        sel = (doc_ids[row] == doc).nonzero()[:, 0]  # [n] columns of this document
        pos3[:, row, sel] = pi.positions_at(positions[row, sel])
        inside = positions[row, sel] < pi.positions.shape[1]
        cols = sel[(tokens[row, sel] == image_token_id) & inside]
        if cols.numel() != pi.num_rows:
            raise ValueError(
                f"document {doc} of row {row} has {cols.numel()} image tokens for "
                f"{pi.num_rows} image rows"
            )
        index.append(row * s + cols)
        if id(pi) not in first:
            # the tower runs once per prompt, however many of its samples are here
            first[id(pi)], computed = computed, computed + pi.num_rows
            groups.append(pi.pixels())
        take.append(torch.arange(first[id(pi)], first[id(pi)] + pi.num_rows))
    picks = torch.cat(take)
    once = picks.numel() == computed  # every prompt once: the rows are in order already
    return pos3, ImageInputs(
        torch.cat(index), groups, take=None if once else picks.to(tokens.device)
    )


class VisionLanguageModel(Transformer):
    """``forward(x, *, positions, attn, return_hidden, head, images)``: x token ids ``[B, S]``
    (or hidden states, passed through), positions ``[3, B, S]`` with images (``[B, S]``
    text-only), the rest as `Transformer.forward`."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__(args)
        self.visual = VisionTransformer(args.vision)

    def image_rows(self, groups: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """``[R, D]``: the groups' rows, concatenated. Under batch-invariant numerics
        (``rl.exact``) the tower runs once per group, so a prompt's rows are the same bits
        whatever else is in the batch (the generator runs it on one prompt); otherwise once
        on all of them (images never attend to each other: the same rows up to rounding)."""
        if batch_invariant.enabled() or len(groups) == 1:
            return torch.cat([self.visual(pixels, grid) for pixels, grid in groups])
        return self.visual(torch.cat([p for p, _ in groups]), torch.cat([g for _, g in groups]))

    def _tower_trains(self) -> bool:
        return torch.is_grad_enabled() and any(p.requires_grad for p in self.visual.parameters())

    def embed(self, tokens: torch.Tensor, images: ImageInputs | None) -> torch.Tensor:
        """``[B, S]`` ids -> ``[B, S, D]`` input hidden states with the image rows in place."""
        h = self.tok_embeddings(tokens)
        if images is not None and images.index.numel():
            rows = images.embeds if images.embeds is not None else self.image_rows(images.groups)
            if images.take is not None:
                rows = rows[images.take]
            if rows.shape[0] != images.index.numel():
                raise ValueError(
                    f"{rows.shape[0]} image rows for {images.index.numel()} image tokens"
                )
            flat = h.reshape(-1, h.shape[-1]).index_copy(0, images.index, rows.to(h.dtype))
            return flat.view_as(h)
        if self._tower_trains():  # keep the tower's gradient collectives in step (module docstring)
            a = self.visual.args
            blank = h.new_zeros(a.merge_unit, a.patch_dim)
            grid = torch.tensor([[1, a.spatial_merge_size, a.spatial_merge_size]])
            h = h + 0.0 * self.visual(blank, grid).sum()
        return h

    def forward(self, x: torch.Tensor, *, images: ImageInputs | None = None, **kw):  # type: ignore[override]
        if not x.is_floating_point() and self.tok_embeddings is not None:
            x = self.embed(x, images)
        return super().forward(x, **kw)

    def reset_rope(self) -> None:
        super().reset_rope()
        self.visual.reset_rope()

    @torch.no_grad()
    def init_weights(self, seed: int | None = None) -> None:
        super().init_weights(seed)
        device = self.visual.patch_embed.proj.weight.device
        gen = None
        if seed is not None and device.type != "meta":
            gen = torch.Generator(device=device).manual_seed(seed + 1)
        self.visual.init_weights(gen)


def make_model(args: ModelArgs) -> Transformer:
    """The model class ``args`` describes: a `VisionLanguageModel` or a text `Transformer`."""
    return VisionLanguageModel(args) if args.is_vlm else Transformer(args)
