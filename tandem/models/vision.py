"""The Qwen2.5-VL vision tower: patches -> windowed ViT -> patch merger -> LM-width rows.

An image arrives as ``grid_t * grid_h * grid_w`` flattened patches (tandem/models/image_processor.py
lays them out as Hugging Face's processor does: each 2x2 block of patches that the merger fuses
is contiguous). The tower embeds them with one linear map (Hugging Face's ``Conv3d`` with
stride = kernel, as a matmul over the flattened patch), rotates q/k with a 2-D RoPE over
each patch's (row, column), runs ``depth`` pre-norm blocks of non-causal attention, most
inside windows of ``window_size`` pixels and the blocks in ``fullatt_block_indexes`` over the
whole image, then merges each 2x2 block into one row of the LM's hidden size. Images never
attend to each other. The tower knows nothing of parallelism or of the LM; it computes one
image at a time or several packed together with the same result (up to float rounding).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tandem.models.image_processor import ImageProcessor

INIT_STD = 0.02


@dataclass
class VisionArgs:
    """The ``vision_config`` of a Qwen2.5-VL folder, plus the special token ids the LM reads.

    HF key names (``in_chans`` of older folders is read as ``in_channels``). ``window_size``
    is in pixels: a window covers ``window_size // (patch_size * spatial_merge_size)`` merged
    rows and columns. ``processor``: how images are prepared for the tower (the folder's
    ``preprocessor_config.json``; its patch, frame and merge sizes are the tower's).
    """

    depth: int = 2
    hidden_size: int = 32
    intermediate_size: int = 64
    num_heads: int = 2
    in_channels: int = 3
    patch_size: int = 14
    temporal_patch_size: int = 2
    spatial_merge_size: int = 2
    window_size: int = 56
    out_hidden_size: int = 64
    fullatt_block_indexes: list[int] = dataclasses.field(default_factory=list)
    tokens_per_second: int = 2
    rope_theta: float = 10000.0
    image_token_id: int = 0
    video_token_id: int = 0
    vision_start_token_id: int = 0
    vision_end_token_id: int = 0
    processor: ImageProcessor = dataclasses.field(default_factory=ImageProcessor)

    def __post_init__(self) -> None:
        self.fullatt_block_indexes = sorted(int(i) for i in self.fullatt_block_indexes)
        p = self.processor
        if (p.patch_size, p.temporal_patch_size, p.merge_size) != (
            self.patch_size,
            self.temporal_patch_size,
            self.spatial_merge_size,
        ):
            raise ValueError(
                "the image processor's patch / temporal patch / merge sizes "
                f"({p.patch_size}, {p.temporal_patch_size}, {p.merge_size}) differ "
                f"from the vision tower's ({self.patch_size}, "
                f"{self.temporal_patch_size}, {self.spatial_merge_size})"
            )
        if self.hidden_size % self.num_heads or (self.hidden_size // self.num_heads) % 4:
            raise ValueError(
                f"vision hidden_size {self.hidden_size} / num_heads {self.num_heads}"
                " must be a multiple of 4 (the 2-D RoPE splits each head in four)"
            )
        if self.window_size % (self.patch_size * self.spatial_merge_size):
            raise ValueError(
                f"vision window_size {self.window_size} must be a multiple of "
                "patch_size x spatial_merge_size "
                f"({self.patch_size * self.spatial_merge_size})"
            )
        if any(not 0 <= i < self.depth for i in self.fullatt_block_indexes):
            raise ValueError(
                f"vision fullatt_block_indexes {self.fullatt_block_indexes} must lie "
                f"in [0, {self.depth})"
            )

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def patch_dim(self) -> int:
        """Values per flattened patch: channels x frames x pixels."""
        return self.in_channels * self.temporal_patch_size * self.patch_size**2

    @property
    def merge_unit(self) -> int:
        """Patches fused into one LM row."""
        return self.spatial_merge_size**2

    @classmethod
    def from_hf(
        cls, config: dict[str, Any], top: dict[str, Any], processor: ImageProcessor | None = None
    ) -> VisionArgs:
        """From a ``vision_config`` dict and the folder's top-level config (token ids);
        ``processor`` None: the defaults at the tower's patch sizes."""
        if config.get("hidden_act", "silu") != "silu":
            raise ValueError(
                f"unsupported vision hidden_act {config.get('hidden_act')!r}; only 'silu'"
            )
        rope = config.get("rope_parameters") or {}
        sizes = dict(
            patch_size=config.get("patch_size", 14),
            temporal_patch_size=config.get("temporal_patch_size", 2),
            merge_size=config.get("spatial_merge_size", 2),
        )
        return cls(
            processor=processor or ImageProcessor(**sizes),
            depth=config["depth"],
            hidden_size=config["hidden_size"],
            intermediate_size=config["intermediate_size"],
            num_heads=config["num_heads"],
            in_channels=config.get("in_channels", config.get("in_chans", 3)),
            patch_size=config.get("patch_size", 14),
            temporal_patch_size=config.get("temporal_patch_size", 2),
            spatial_merge_size=config.get("spatial_merge_size", 2),
            window_size=config.get("window_size", 112),
            out_hidden_size=config["out_hidden_size"],
            fullatt_block_indexes=list(config.get("fullatt_block_indexes", [])),
            tokens_per_second=config.get("tokens_per_second", 2),
            rope_theta=float(rope.get("rope_theta", 10000.0)),
            **{
                k: int(top[k])
                for k in (
                    "image_token_id",
                    "video_token_id",
                    "vision_start_token_id",
                    "vision_end_token_id",
                )
            },
        )

    def to_hf(self) -> dict[str, Any]:
        """The ``vision_config`` dict (transformers 5 key names)."""
        return {
            "model_type": "qwen2_5_vl_vision",
            "depth": self.depth,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_heads": self.num_heads,
            "in_channels": self.in_channels,
            "patch_size": self.patch_size,
            "temporal_patch_size": self.temporal_patch_size,
            "spatial_merge_size": self.spatial_merge_size,
            "window_size": self.window_size,
            "out_hidden_size": self.out_hidden_size,
            "fullatt_block_indexes": list(self.fullatt_block_indexes),
            "hidden_act": "silu",
            "tokens_per_second": self.tokens_per_second,
            "initializer_range": INIT_STD,
            "rope_parameters": {"rope_type": "axial", "rope_theta": self.rope_theta},
        }

    def token_ids(self) -> dict[str, int]:
        return {
            k: getattr(self, k)
            for k in (
                "image_token_id",
                "video_token_id",
                "vision_start_token_id",
                "vision_end_token_id",
            )
        }

    def num_params(self) -> int:
        d, m = self.hidden_size, self.hidden_size * self.merge_unit
        block = (
            2 * d
            + (3 * d * d + 3 * d)
            + (d * d + d)
            + 3 * d * self.intermediate_size
            + 2 * self.intermediate_size
            + d
        )
        merger = d + (m * m + m) + (m * self.out_hidden_size + self.out_hidden_size)
        return self.patch_dim * d + self.depth * block + merger


# ---------------------------------------------------------------------- layout of the patches
def patch_positions(grid_thw: torch.Tensor, merge: int) -> torch.Tensor:
    """``[N, 2]`` (row, column) of every patch, in the merger's block order (each merge x
    merge block contiguous), for ``grid_thw [I, 3]`` images; frames repeat the layout."""
    out = []
    for t, h, w in grid_thw.tolist():
        rows = torch.arange(h).view(h // merge, merge, 1, 1).expand(-1, -1, w // merge, merge)
        cols = torch.arange(w).view(1, 1, w // merge, merge).expand(h // merge, merge, -1, -1)
        # [h*w, 2]
        rc = torch.stack([rows.transpose(1, 2).flatten(), cols.transpose(1, 2).flatten()], dim=-1)
        out.append(rc.repeat(t, 1))
    return torch.cat(out)


def window_layout(
    grid_thw: torch.Tensor, args: VisionArgs
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Windowed attention's order of the merge blocks and the segments attention runs in.

    Returns ``order [M]`` (merge blocks of all images, window by window, row-major inside a
    window), ``window_ids [N]`` and ``image_ids [N]`` (per patch in that order: which window /
    which frame of which image it attends within). Edge windows are smaller, as in HF.
    """
    merge, side = (
        args.spatial_merge_size,
        args.window_size // (args.patch_size * args.spatial_merge_size),
    )
    order, windows, images = [], [], []
    start = n_windows = n_frames = 0
    for t, h, w in grid_thw.tolist():
        gh, gw = h // merge, w // merge
        idx = torch.arange(t * gh * gw).view(t, gh, gw)
        for f in range(t):
            for r0 in range(0, gh, side):
                for c0 in range(0, gw, side):
                    block = idx[f, r0 : r0 + side, c0 : c0 + side].flatten()
                    order.append(block + start)
                    windows.append(torch.full((block.numel() * args.merge_unit,), n_windows))
                    n_windows += 1
            images.append(torch.full((gh * gw * args.merge_unit,), n_frames))
            n_frames += 1
        start += t * gh * gw
    return torch.cat(order), torch.cat(windows), torch.cat(images)


# ---------------------------------------------------------------------- modules
class VisionRMSNorm(nn.Module):
    """RMSNorm with fp32 statistics, eps 1e-6 (the tower's norms and the merger's)."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps).to(x.dtype)


class PatchEmbed(nn.Module):
    """``[N, C*T*P*P]`` patches -> ``[N, D]``; the weight keeps HF's Conv3d shape ``[D, C,
    T, P, P]``."""

    def __init__(self, args: VisionArgs) -> None:
        super().__init__()
        p, t = args.patch_size, args.temporal_patch_size
        self.proj = nn.Module()
        self.proj.weight = nn.Parameter(torch.empty(args.hidden_size, args.in_channels, t, p, p))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.proj.weight
        return F.linear(x.to(w.dtype), w.reshape(w.shape[0], -1))


def segment_plan(ids: torch.Tensor) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Contiguous segments of ``ids [N]`` grouped by length: per length L an index ``[k, L]``
    of its k segments' positions, and the permutation ``[N]`` that puts the groups' outputs,
    concatenated, back in order. Attention then runs as one batched call per segment length,
    with no mask (a window or an image attends to itself only)."""
    n = ids.shape[0]
    cut = (ids[1:] != ids[:-1]).nonzero()[:, 0] + 1
    starts = torch.cat([cut.new_zeros(1), cut])
    lengths = torch.cat([cut, cut.new_tensor([n])]) - starts
    groups = [
        starts[lengths == size][:, None] + torch.arange(size, device=ids.device)
        for size in lengths.unique().tolist()
    ]
    return groups, torch.argsort(torch.cat([g.flatten() for g in groups]))


class VisionAttention(nn.Module):
    def __init__(self, args: VisionArgs) -> None:
        super().__init__()
        self.num_heads, self.head_dim = args.num_heads, args.head_dim
        self.qkv = nn.Linear(args.hidden_size, 3 * args.hidden_size, bias=True)
        self.proj = nn.Linear(args.hidden_size, args.hidden_size, bias=True)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        plan: tuple[list[torch.Tensor], torch.Tensor],
    ) -> torch.Tensor:
        # x [N, D]; cos/sin [N, Dh] fp32; plan: `segment_plan` of the segments attended within
        n = x.shape[0]
        q, k, v = self.qkv(x).view(n, 3, self.num_heads, self.head_dim).unbind(1)  # [N, H, Dh] each
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        groups, order = plan
        outs = [
            F.scaled_dot_product_attention(
                q[idx].transpose(1, 2),
                k[idx].transpose(1, 2),
                v[idx].transpose(1, 2),
                scale=self.head_dim**-0.5,
            )
            .transpose(1, 2)
            .reshape(-1, self.num_heads, self.head_dim)
            for idx in groups
        ]  # per segment length: [k * L, H, Dh]
        out = torch.cat(outs)[order]  # [N, H, Dh] back in order
        return self.proj(out.reshape(n, -1))


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """2-D RoPE in fp32 (as HF's vision tower), back to the input dtype; x [N, H, Dh]."""
    xf = x.float()
    half = xf.shape[-1] // 2
    rotated = torch.cat((-xf[..., half:], xf[..., :half]), dim=-1)
    return (xf * cos[:, None] + rotated * sin[:, None]).to(x.dtype)


class VisionMLP(nn.Module):
    """SwiGLU with biases, under HF's names: ``down(silu(gate x) * up x)``."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden)
        self.up_proj = nn.Linear(dim, hidden)
        self.down_proj = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class VisionBlock(nn.Module):
    def __init__(self, args: VisionArgs) -> None:
        super().__init__()
        self.norm1 = VisionRMSNorm(args.hidden_size)
        self.norm2 = VisionRMSNorm(args.hidden_size)
        self.attn = VisionAttention(args)
        self.mlp = VisionMLP(args.hidden_size, args.intermediate_size)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        plan: tuple[list[torch.Tensor], torch.Tensor],
    ) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos, sin, plan)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    """RMSNorm each patch, concatenate each merge block's patches, GELU MLP to the LM width."""

    def __init__(self, args: VisionArgs) -> None:
        super().__init__()
        self.width = args.hidden_size * args.merge_unit
        self.ln_q = VisionRMSNorm(args.hidden_size)
        self.mlp = nn.Sequential(
            nn.Linear(self.width, self.width),
            nn.GELU(),
            nn.Linear(self.width, args.out_hidden_size),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.ln_q(x).view(-1, self.width))


class VisionTransformer(nn.Module):
    """``forward(pixels [N, patch_dim], grid_thw [I, 3]) -> [N / merge_unit, out_hidden_size]``:
    the LM rows of the images in order (each image's rows in its merge blocks' row-major order)."""

    def __init__(self, args: VisionArgs) -> None:
        super().__init__()
        self.args = args
        self.patch_embed = PatchEmbed(args)
        self.blocks = nn.ModuleList(VisionBlock(args) for _ in range(args.depth))
        self.merger = PatchMerger(args)
        self.register_buffer("inv_freq", self._inv_freq(), persistent=False)

    def _inv_freq(self, device: torch.device | str | None = None) -> torch.Tensor:
        quarter = self.args.head_dim // 2  # each of row and column rotates half of the head
        return 1.0 / (
            self.args.rope_theta
            ** (torch.arange(0, quarter, 2, dtype=torch.float, device=device) / quarter)
        )

    def reset_rope(self, device: torch.device | str | None = None) -> None:
        """Recompute the RoPE buffer (non-persistent), on ``device`` or where it is."""
        self.inv_freq = self._inv_freq(device or self.inv_freq.device)

    def _apply(self, fn: Any, recurse: bool = True):  # type: ignore[override]
        super()._apply(fn, recurse)
        if self.inv_freq.device.type != "meta":
            self.reset_rope()  # never left uninitialised after to_empty, nor rounded by .to(dtype)
        return self

    def forward(self, pixels: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        a = self.args
        grid_thw = grid_thw.cpu()
        order, windows, images = window_layout(grid_thw, a)
        # [N]
        perm = (
            (order[:, None] * a.merge_unit + torch.arange(a.merge_unit)).flatten().to(pixels.device)
        )
        x = self.patch_embed(pixels)[perm]  # [N, D] in window order
        rc = patch_positions(grid_thw, a.spatial_merge_size).to(pixels.device)[perm]  # [N, 2]
        # [N, Dh/2]: rows' then columns' angles
        freqs = (rc[..., None].float() * self.inv_freq).flatten(1)
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos(), emb.sin()
        by_window, by_image = (
            segment_plan(windows.to(pixels.device)),
            segment_plan(images.to(pixels.device)),
        )
        for i, block in enumerate(self.blocks):
            x = block(x, cos, sin, by_image if i in a.fullatt_block_indexes else by_window)
        merged = self.merger(x)  # [M, out] in window order
        return merged[torch.argsort(order.to(pixels.device))]

    @torch.no_grad()
    def init_weights(self, gen: torch.Generator | None = None) -> None:
        """From-scratch init: N(0, 0.02) weights, zero biases, unit norms."""
        for module in self.modules():
            if isinstance(module, VisionRMSNorm):
                nn.init.ones_(module.weight)
            elif isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, mean=0.0, std=INIT_STD, generator=gen)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
        nn.init.normal_(self.patch_embed.proj.weight, mean=0.0, std=INIT_STD, generator=gen)
        self.reset_rope()
