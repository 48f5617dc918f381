"""Image preprocessing for Qwen2.5-VL, with Pillow: the pixel values Hugging Face's processor makes.

An image is converted to RGB (transparency composited on white), resized with Pillow's
bicubic filter so both sides are multiples of ``patch_size * merge_size`` and the area lies
in ``[min_pixels, max_pixels]`` (aspect ratio kept as nearly as possible), rescaled by 1/255
(in float64, then float32) and normalised by the folder's mean and std (both through one
table of the 256 values per channel: the same arithmetic, once per value), and cut into
``patch_size`` patches, each repeated over ``temporal_patch_size`` frames and flattened
channel-major; each ``merge_size x merge_size`` block of patches is contiguous, in row-major
order of the blocks. Settings come from the folder's ``preprocessor_config.json``. The
values equal transformers' ``Qwen2VLImageProcessorPil`` bit for bit
(tests/models/test_vlm.py); transformers is not imported.
"""

from __future__ import annotations

import base64
import binascii
import io
import json
import math
import os
import stat
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image, UnidentifiedImageError

CONFIG_FILE = "preprocessor_config.json"
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


def smart_resize(
    height: int, width: int, factor: int, min_pixels: int, max_pixels: int
) -> tuple[int, int]:
    """The resized (height, width): multiples of ``factor``, area within the bounds."""
    if max(height, width) / min(height, width) > 200:
        raise ValueError(f"image of {width}x{height} pixels: aspect ratio over 200")
    h, w = round(height / factor) * factor, round(width / factor) * factor
    if h * w > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h = max(factor, math.floor(height / beta / factor) * factor)
        w = max(factor, math.floor(width / beta / factor) * factor)
    elif h * w < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h, w = math.ceil(height * beta / factor) * factor, math.ceil(width * beta / factor) * factor
    return h, w


@dataclass
class ImageProcessor:
    """A folder's image preprocessing (``preprocessor_config.json``; HF key names)."""

    patch_size: int = 14
    temporal_patch_size: int = 2
    merge_size: int = 2
    min_pixels: int = 56 * 56
    max_pixels: int = 28 * 28 * 1280
    image_mean: list[float] = field(default_factory=lambda: list(CLIP_MEAN))
    image_std: list[float] = field(default_factory=lambda: list(CLIP_STD))
    rescale_factor: float = 1 / 255
    resample: int = 3  # Pillow's BICUBIC

    @classmethod
    def from_dir(cls, path: str | os.PathLike[str]) -> ImageProcessor:
        """Read ``preprocessor_config.json`` (ValueError naming the file when unusable)."""
        file = Path(path) / CONFIG_FILE
        if not file.is_file():
            raise FileNotFoundError(
                f"no {CONFIG_FILE} in {path} (a vision-language folder needs one)"
            )
        try:
            cfg = json.loads(file.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ValueError(f"{file}: not valid JSON ({e})") from None
        for key in ("do_resize", "do_rescale", "do_normalize", "do_convert_rgb"):
            if cfg.get(key) is False:
                raise ValueError(f"{file}: {key} = false is not supported")
        size = cfg.get("size") or {}
        return cls(
            patch_size=cfg.get("patch_size", 14),
            temporal_patch_size=cfg.get("temporal_patch_size", 2),
            merge_size=cfg.get("merge_size", 2),
            min_pixels=cfg.get("min_pixels") or size.get("shortest_edge") or 56 * 56,
            max_pixels=cfg.get("max_pixels") or size.get("longest_edge") or 28 * 28 * 1280,
            image_mean=list(cfg.get("image_mean", CLIP_MEAN)),
            image_std=list(cfg.get("image_std", CLIP_STD)),
            rescale_factor=cfg.get("rescale_factor", 1 / 255),
            resample=int(cfg.get("resample", 3)),
        )

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write ``preprocessor_config.json`` (what transformers' processor reads too)."""
        cfg = {
            **asdict(self),
            "size": {"shortest_edge": self.min_pixels, "longest_edge": self.max_pixels},
            "do_resize": True,
            "do_rescale": True,
            "do_normalize": True,
            "do_convert_rgb": True,
            "image_processor_type": "Qwen2VLImageProcessor",
            "processor_class": "Qwen2_5_VLProcessor",
        }
        (Path(path) / CONFIG_FILE).write_text(json.dumps(cfg, indent=2) + "\n")

    @property
    def factor(self) -> int:
        return self.patch_size * self.merge_size

    def grid(self, width: int, height: int) -> tuple[int, int, int]:
        """The (t, h, w) patch grid of an image of this size."""
        h, w = smart_resize(height, width, self.factor, self.min_pixels, self.max_pixels)
        return 1, h // self.patch_size, w // self.patch_size

    def num_tokens(self, width: int, height: int) -> int:
        """LM rows (image tokens) of an image of this size."""
        t, h, w = self.grid(width, height)
        return t * h * w // self.merge_size**2

    def preprocess(self, image: Image.Image) -> tuple[torch.Tensor, tuple[int, int, int]]:
        """One image -> (pixels ``[h * w, C * T * P * P]`` float32, grid (1, h, w))."""
        rgb = to_rgb(image)
        h, w = smart_resize(rgb.height, rgb.width, self.factor, self.min_pixels, self.max_pixels)
        if (h, w) != (rgb.height, rgb.width):
            rgb = rgb.resize((w, h), resample=self.resample)
        x = torch.from_numpy(np.asarray(rgb).copy()).permute(2, 0, 1)  # [C, H, W] uint8
        x = self._table().gather(1, x.reshape(3, -1).long()).view(x.shape)  # [C, H, W] float32
        p, m, c = self.patch_size, self.merge_size, x.shape[0]
        gh, gw = h // p, w // p
        # [gh/m, gw/m, m, m, C, P, P]
        blocks = x.view(c, gh // m, m, p, gw // m, m, p).permute(1, 4, 2, 5, 0, 3, 6)
        frames = blocks.unsqueeze(5).expand(*blocks.shape[:5], self.temporal_patch_size, p, p)
        return frames.reshape(gh * gw, -1), (1, gh, gw)

    def _table(self) -> torch.Tensor:
        """``[3, 256]``: every channel value rescaled (float64, then float32) and normalised
        (float32), the operations HF applies per pixel, done once per value instead."""
        key = (self.rescale_factor, tuple(self.image_mean), tuple(self.image_std))
        if getattr(self, "_lut_key", None) != key:
            v = (torch.arange(256, dtype=torch.float64) * self.rescale_factor).float()  # [256]
            mean = torch.tensor(self.image_mean, dtype=torch.float32)[:, None]
            std = torch.tensor(self.image_std, dtype=torch.float32)[:, None]
            self._lut, self._lut_key = (v[None, :] - mean) / std, key
        return self._lut

    def __call__(self, images: list[Image.Image]) -> tuple[torch.Tensor, torch.Tensor]:
        """Several images -> (pixels ``[N, patch_dim]``, grid_thw ``[I, 3]``), in order."""
        parts = [self.preprocess(im) for im in images]
        return torch.cat([p for p, _ in parts]), torch.tensor(
            [g for _, g in parts], dtype=torch.long
        )


def to_rgb(image: Image.Image) -> Image.Image:
    """RGB; an image with transparency is composited on white first (as HF's processor does)."""
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        return Image.alpha_composite(
            Image.new("RGBA", rgba.size, (255, 255, 255, 255)), rgba
        ).convert("RGB")
    return image.convert("RGB")


# Limits of `open_image` (docs/vision.md): what one image may cost before it is a bad row.
MAX_IMAGE_BYTES = 32 << 20  # a file, data: URI or bytes field: 32 MiB
MAX_IMAGE_PIXELS = 1 << 25  # width x height, read from the header before decoding: 33.5 M


def open_image(source: Any, base_dir: str | None = None) -> Image.Image:
    """Decode an image from a path, a ``data:`` URI, raw bytes or a ``{"bytes": ..., "path":
    ...}`` record (a datasets ``Image`` column); fully loaded, so a truncated file fails here.
    ValueError says why in one line.

    Bounded, whatever the row says: with a ``base_dir`` (the data file's folder) a path must
    be relative and stay inside it (no absolute path, no ``..``); only a regular file is read
    (not ``/dev/zero``, a FIFO or a folder); at most ``MAX_IMAGE_BYTES`` are read and at most
    ``MAX_IMAGE_PIXELS`` decoded (the size comes from the header: a decompression bomb is
    refused before it is inflated)."""
    if isinstance(source, dict):
        source = source.get("bytes") or source.get("path")
    if isinstance(source, (bytes, bytearray)):
        data, what = bytes(source), f"{len(source)} image bytes"
    elif isinstance(source, str) and source.startswith("data:"):
        head, _, payload = source.partition(",")
        if ";base64" not in head:
            raise ValueError("a data: URI image must be base64 (data:image/png;base64,...)")
        if len(payload) > MAX_IMAGE_BYTES * 4 // 3 + 4:
            raise ValueError(f"a data: URI image over {MAX_IMAGE_BYTES} bytes")
        try:
            data = base64.b64decode(payload, validate=True)
        except binascii.Error:
            raise ValueError("a data: URI image whose base64 does not decode") from None
        what = "a data: URI"
    elif isinstance(source, str) and source:
        path = _image_path(source, base_dir)
        data, what = _read_file(path), f"image {path}"
    else:
        raise ValueError(
            f"an image must be a path, a data: URI or bytes, got {type(source).__name__}"
        )
    if len(data) > MAX_IMAGE_BYTES:
        raise ValueError(f"{what}: over {MAX_IMAGE_BYTES} bytes")
    with warnings.catch_warnings():
        warnings.simplefilter("error", Image.DecompressionBombWarning)
        try:
            image = Image.open(io.BytesIO(data))  # reads the header only
        except (Image.DecompressionBombError, Image.DecompressionBombWarning) as e:
            raise ValueError(f"{what}: over the limit of {MAX_IMAGE_PIXELS} pixels ({e})") from None
        except _DECODE_ERRORS as e:
            raise _undecodable(what, e) from None
        if image.width * image.height > MAX_IMAGE_PIXELS:
            raise ValueError(
                f"{what}: over the limit of {MAX_IMAGE_PIXELS} pixels "
                f"({image.width} x {image.height})"
            )
        try:
            image.load()
        except _DECODE_ERRORS as e:
            raise _undecodable(what, e) from None
    return image


_DECODE_ERRORS = (
    UnidentifiedImageError,
    OSError,
    SyntaxError,
    ValueError,
)


def _undecodable(what: str, e: BaseException) -> ValueError:
    why = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return ValueError(f"{what}: not a decodable image ({why})")


def _image_path(source: str, base_dir: str | None) -> str:
    """``source`` under ``base_dir``; ValueError for an absolute path or one that leaves it."""
    if base_dir is None:
        return source
    if os.path.isabs(source) or os.path.normpath(source).split(os.sep)[0] == "..":
        raise ValueError(
            f"image {source}: a data file's image paths must be relative to its folder "
            f"({base_dir}) and stay inside it"
        )
    return os.path.join(base_dir, source)


def _read_file(path: str) -> bytes:
    """At most ``MAX_IMAGE_BYTES + 1`` bytes of a regular file (opened without blocking, so a
    FIFO is refused rather than waited on)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError as e:
        raise ValueError(f"image {path}: {e.strerror}") from None
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise ValueError(f"image {path}: not a regular file")
        try:
            return f.read(MAX_IMAGE_BYTES + 1)
        except OSError as e:
            raise ValueError(f"image {path}: {e.strerror}") from None
