"""A vision-language model (Qwen2.5-VL): the vision tower feeding the same `Transformer`.

`VisionLanguageModel` is a `Transformer` (the same LM, the same parameter names, so
every plan, reshard and checkpoint that addresses ``layers`` / ``tok_embeddings`` /
``output`` applies unchanged) with one more module, ``visual``
(tandem/models/vision.py). Its forward embeds the token ids, writes the images' rows over
the image tokens' embeddings, and runs the LM on those hidden states with M-RoPE
positions ``[3, B, S]`` (tandem/models/rope.py). The caller says where the rows go
(`ImageInputs.index`) and gives either the pixels, one group per prompt (the tower runs
once per group, so a prompt's rows are the same bits whatever else shares the batch), or
rows computed earlier (the generator computes a prompt's rows once for its samples).

When the tower is trainable and a forward has no image, it runs on one blank image and
adds zero times the result, so every data-parallel rank's backward reaches the tower's
parameters and the gradient collectives stay in step (a rank with text rows only never
waits for the others).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from tandem.models.args import ModelArgs
from tandem.models.transformer import Transformer
from tandem.models.vision import VisionTransformer


@dataclass
class ImageInputs:
    """The images of one forward: where their rows go and how to get the rows.

    ``index [R]``: flat positions (into the ``[B * S]`` tokens) of the image tokens, in
    the order of the rows; ``groups``: ``(pixels [N, patch_dim], grid_thw [I, 3])`` per
    prompt, whose rows, concatenated, fill ``index``; or ``embeds [R, D]`` given.
    """

    index: torch.Tensor
    groups: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)
    embeds: torch.Tensor | None = None

    def to(self, device: torch.device | str) -> ImageInputs:
        return ImageInputs(self.index.to(device), [(p.to(device), g) for p, g in self.groups],
                           None if self.embeds is None else self.embeds.to(device))


class VisionLanguageModel(Transformer):
    """``forward(x, *, positions, attn, return_hidden, head, images)``: x token ids ``[B, S]``
    (or hidden states, passed through), positions ``[3, B, S]`` with images (``[B, S]``
    text-only), the rest as `Transformer.forward`."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__(args)
        self.visual = VisionTransformer(args.vision)

    def image_rows(self, groups: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """``[R, D]``: the tower once per group, concatenated."""
        return torch.cat([self.visual(pixels, grid) for pixels, grid in groups])

    def _tower_trains(self) -> bool:
        return torch.is_grad_enabled() and any(p.requires_grad for p in self.visual.parameters())

    def embed(self, tokens: torch.Tensor, images: ImageInputs | None) -> torch.Tensor:
        """``[B, S]`` ids -> ``[B, S, D]`` input hidden states with the image rows in place."""
        h = self.tok_embeddings(tokens)
        if images is not None and images.index.numel():
            rows = images.embeds if images.embeds is not None else self.image_rows(images.groups)
            if rows.shape[0] != images.index.numel():
                raise ValueError(f"{rows.shape[0]} image rows for {images.index.numel()} image tokens")
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
