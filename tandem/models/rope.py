"""Rotary position embeddings, computed the way Hugging Face computes them.

Frequencies are kept in fp32 and cos/sin are formed in fp32 from explicit
``positions [B, S]`` (packed sequences restart positions per document), then
cast to the activation dtype — the same order of operations as transformers'
Llama/Qwen rotary embedding, so bf16 logits agree with HF, not just fp32 ones.
Uses the "rotate half" layout (HF checkpoints' q/k weights are stored that way),
not the interleaved complex layout of the Meta reference code.

M-RoPE (Qwen2.5-VL, ``args.mrope_section``): positions are ``[3, B, S]`` (time, row,
column); the frequencies are cut into three sections, each rotated by its own axis.
Text tokens carry the same position on all three axes, which is plain RoPE, so text-only
input may pass ``[B, S]`` and gets the same values. `mrope_positions` lays out a prompt's
positions with its images as Hugging Face's ``get_rope_index`` does.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import nn

from tandem.models.args import ModelArgs, rope_type


def rope_inv_freq(args: ModelArgs, device: torch.device | str | None = None) -> torch.Tensor:
    """Inverse frequencies ``[head_dim // 2]`` (fp32), llama3-scaled when configured."""
    dim = args.rope_dim
    exponents = torch.arange(0, dim, 2, dtype=torch.int64, device=device).float() / dim  # [D/2]
    kind = rope_type(args.rope_scaling)
    if kind == "yarn":
        return _yarn_inv_freq(args.rope_theta, dim, args.rope_scaling, device)
    inv_freq = 1.0 / (args.rope_theta**exponents)
    if kind == "llama3":
        inv_freq = _llama3_scale(inv_freq, args.rope_scaling, args.max_position_embeddings)
    return inv_freq


def rope_attention_factor(args: ModelArgs) -> float:
    """What cos and sin are multiplied by: YaRN's ``0.1 * ln(factor) + 1`` (or the config's
    ``attention_factor``), 1 for the other variants."""
    scaling = args.rope_scaling or {}
    if rope_type(scaling) != "yarn":
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    factor = float(scaling["factor"])

    def mscale(m: float = 1.0) -> float:
        return 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0

    m, m_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
    return mscale(m) / mscale(m_all) if m and m_all else mscale()  # DeepSeek's: a ratio


def _yarn_inv_freq(
    theta: float, dim: int, scaling: dict, device: torch.device | str | None
) -> torch.Tensor:
    """YaRN (arXiv 2309.00071): frequencies that turn fewer than ``beta_slow`` times over the
    original context are divided by ``factor`` (interpolated), those turning more than
    ``beta_fast`` times are kept (extrapolated), and a linear ramp over the dimension index
    blends the two in between; ``truncate`` rounds the ramp's ends to whole dimensions."""
    factor = float(scaling["factor"])
    context = scaling["original_max_position_embeddings"]
    fast, slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1

    def dim_of(rotations: float) -> float:  # the dimension that turns `rotations` times
        return dim * math.log(context / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    lo, hi = dim_of(fast), dim_of(slow)
    if scaling.get("truncate", True):
        lo, hi = math.floor(lo), math.ceil(hi)
    lo, hi = max(lo, 0), min(hi, dim - 1)
    if lo == hi:
        hi += 0.001
    base = theta ** (torch.arange(0, dim, 2, device=device).float() / dim)  # [D/2]
    ramp = ((torch.arange(dim // 2, dtype=torch.float32, device=device) - lo) / (hi - lo)).clamp(
        0, 1
    )
    keep = 1 - ramp  # share of the extrapolated (unscaled) frequency
    return 1.0 / (factor * base) * (1 - keep) + 1.0 / base * keep


def _llama3_scale(inv_freq: torch.Tensor, scaling: dict, max_positions: int) -> torch.Tensor:
    """Llama-3.1 frequency scaling: keep high frequencies, divide low ones by ``factor``,
    and blend linearly (in 1/wavelength) in between."""
    factor = scaling["factor"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    context = scaling.get("original_max_position_embeddings", max_positions)
    low_freq_wavelen = context / low
    high_freq_wavelen = context / high
    wavelen = 2 * math.pi / inv_freq  # [D/2]
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (context / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, blended, scaled)


class RotaryEmbedding(nn.Module):
    """Holds ``inv_freq`` as a non-persistent fp32 buffer and turns positions into cos/sin.

    The buffer is recomputed whenever the module is materialised or converted
    (``to_empty`` from meta, ``.to(dtype)``, ``.cuda()``), so it is never left as
    uninitialised memory or rounded to bf16; ``reset()`` recomputes it explicitly.
    """

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.args = args
        self.register_buffer("inv_freq", rope_inv_freq(args), persistent=False)
        self.attention_factor = rope_attention_factor(args)

    def reset(self) -> None:
        self.inv_freq = rope_inv_freq(self.args, device=self.inv_freq.device)

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True):  # type: ignore[override]
        super()._apply(fn, recurse)
        if self.inv_freq.device.type != "meta":
            self.reset()
        return self

    def forward(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """positions ``[B, S]`` or, M-RoPE, ``[3, B, S]`` (int) -> (cos, sin), each
        ``[B, S, head_dim]`` in ``dtype``."""
        freqs = positions[..., None].float() * self.inv_freq.float()  # [(3,) B, S, D/2] fp32
        if positions.dim() == 3:
            if not self.args.mrope_section:
                raise ValueError("positions [3, B, S] need a model with M-RoPE (mrope_section)")
            parts = freqs.split(self.args.mrope_section, dim=-1)
            freqs = torch.cat([part[i % 3] for i, part in enumerate(parts)], dim=-1)  # [B, S, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [B, S, D]
        cos, sin = emb.cos(), emb.sin()
        if self.attention_factor != 1.0:  # YaRN
            cos, sin = cos * self.attention_factor, sin * self.attention_factor
        return cos.to(dtype), sin.to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """``[..., D]`` -> ``[-x2, x1]`` where x1, x2 are the two halves of the last dim."""
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x ``[B, S, H, D]``, cos/sin ``[B, S, D]`` -> rotated x ``[B, S, H, D]``."""
    cos, sin = cos.unsqueeze(2), sin.unsqueeze(2)  # [B, S, 1, D]
    return x * cos + rotate_half(x) * sin


def mrope_positions(
    token_ids: list[int], grids: list[tuple[int, int, int]], image_token_id: int, merge: int
) -> tuple[torch.Tensor, int]:
    """M-RoPE positions ``[3, P]`` of a prompt, and its ``delta``: a later token at index
    ``i`` sits at ``i + delta`` on every axis.

    ``grids`` are the (t, h, w) patch grids of the prompt's images, in order; each image
    is the next ``t * (h / merge) * (w / merge)`` image tokens. Text counts up by one on all
    axes; an image's tokens start at the next text position on every axis and add their
    frame (time), merged row and merged column; the text after it resumes past the larger
    of its two sides.
    """
    n = len(token_ids)
    out = torch.empty(3, n, dtype=torch.long)
    left = list(grids)
    i = pos = 0
    while i < n:
        if token_ids[i] != image_token_id:
            out[:, i] = pos
            i, pos = i + 1, pos + 1
            continue
        if not left:
            raise ValueError(f"image token at index {i} but only {len(grids)} image(s) given")
        t, h, w = left.pop(0)
        gh, gw = h // merge, w // merge
        count = t * gh * gw
        if token_ids[i : i + count] != [image_token_id] * count:
            raise ValueError(
                f"image at index {i} needs {count} image tokens in a row ({t}x{h}x{w} patches)"
            )
        out[0, i : i + count] = pos + torch.arange(t).repeat_interleave(gh * gw)
        out[1, i : i + count] = pos + torch.arange(gh).repeat_interleave(gw).repeat(t)
        out[2, i : i + count] = pos + torch.arange(gw).repeat(t * gh)
        i, pos = i + count, pos + max(gh, gw)
    if left:
        raise ValueError(f"{len(left)} image(s) left without image tokens")
    return out, int(out.max()) + 1 - n if n else 0
