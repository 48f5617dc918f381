"""Rows with images: OpenAI-style message parts -> token ids with image tokens + `PromptImages`.

A message's ``content`` is a string or a list of parts, ``{"type": "text", "text": ...}``
and ``{"type": "image", "image": ...}`` where the image is a path (relative paths are read
from the folder of the data file), a ``data:image/...;base64,`` URI, raw bytes (a parquet
``binary`` field) or a ``{"bytes": ..., "path": ...}`` record (a datasets ``Image`` column).
Every image is decoded when its row is read: a missing or undecodable image makes the
row bad (counted and skipped, or a DataError naming the file, line and image under
``data.on_bad_row = "error"``, exit 3), never a failure mid-run.

`VisionData` is what a vision-language policy needs to turn such a row into the model's
input: the image processor (how many rows each image becomes), the image token, and the
folder relative paths start from. Text models get None, and a row with image parts is then
a bad row ("image parts need a vision-language model").
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from tandem.models.image_processor import ImageProcessor, open_image
from tandem.models.rope import mrope_positions
from tandem.models.vlm import PromptImages
from tandem.rl.data.loading import IMAGE_KEYS, is_image_part


@dataclass
class VisionData:
    processor: ImageProcessor
    image_token_id: int
    base_dir: str | None = None

    @classmethod
    def for_model(cls, args: Any, data_path: str | None) -> VisionData | None:
        """None for a text model; else the policy's processor and image token, relative image
        paths read from ``data_path``'s folder (or ``data_path`` itself when it is a folder)."""
        if getattr(args, "vision", None) is None:
            return None
        base = None
        if data_path and not data_path.startswith("synthetic:"):
            base = (
                data_path
                if os.path.isdir(data_path)
                else os.path.dirname(os.path.abspath(data_path))
            )
        return cls(args.vision.processor, args.vision.image_token_id, base)


def clean_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Parts without the None-valued keys a parquet struct column fills in (a text part
    read back with ``image: None``), so the chat template sees what the row meant."""
    out = []
    for m in messages:
        if isinstance(m.get("content"), list):
            m = {
                **m,
                "content": [{k: v for k, v in p.items() if v is not None} for p in m["content"]],
            }
        out.append(m)
    return out


def prepare_messages(
    messages: list[dict[str, Any]], vision: VisionData | None
) -> list[dict[str, Any]]:
    """The conversation to render: parts cleaned (`clean_messages`); for a text model, text
    parts joined into a string, and image parts a ValueError."""
    messages = clean_messages(messages)
    if vision is not None:
        return messages
    if image_sources(messages):
        raise ValueError(
            "image parts need a vision-language model (model.path of a Qwen2.5-VL folder)"
        )
    return [
        {**m, "content": "".join(p["text"] for p in m["content"])}
        if isinstance(m.get("content"), list)
        else m
        for m in messages
    ]


def image_sources(messages: list[dict[str, Any]]) -> list[Any]:
    """The images of a conversation, in order of appearance."""
    out = []
    for m in messages:
        if isinstance(m.get("content"), list):
            for p in m["content"]:
                if is_image_part(p):
                    src = next((p[k] for k in IMAGE_KEYS if p.get(k) is not None), None)
                    out.append(src["url"] if isinstance(src, dict) and "url" in src else src)
    return out


def with_images(
    messages: list[dict[str, Any]], ids: list[int], vision: VisionData | None, *aligned: list[Any]
) -> tuple[list[int], PromptImages | None, list[list[Any]]]:
    """Expand each image token of ``ids`` into its image's rows and lay out the M-RoPE
    positions; ``aligned`` lists (e.g. a loss mask) repeat their value at an image token.
    Returns (ids, images or None for a text row, aligned lists); ValueError for a bad row."""
    sources = image_sources(messages)
    if not sources or vision is None:  # `prepare_messages` refused images for a text model
        return ids, None, list(aligned)
    sizes = []
    for i, src in enumerate(sources):
        try:
            image = open_image(src, vision.base_dir)
            sizes.append(vision.processor.grid(image.width, image.height))
        except ValueError as e:
            raise ValueError(f"image {i + 1} of {len(sources)}: {e}") from None
    counts = [t * h * w // vision.processor.merge_size**2 for t, h, w in sizes]
    n_pad = sum(1 for t in ids if t == vision.image_token_id)
    if n_pad != len(sources):
        raise ValueError(
            f"the chat template wrote {n_pad} image placeholder(s) for "
            f"{len(sources)} image(s) (a template without image parts?)"
        )
    out: list[int] = []
    lists: list[list[Any]] = [[] for _ in aligned]
    left = iter(counts)
    for j, t in enumerate(ids):
        k = next(left) if t == vision.image_token_id else 1
        out += [t] * k
        for dst, src in zip(lists, aligned):
            dst += [src[j]] * k
    positions, delta = mrope_positions(
        out, sizes, vision.image_token_id, vision.processor.merge_size
    )
    return (
        out,
        PromptImages(sources, sizes, positions, delta, vision.processor, vision.base_dir),
        lists,
    )


def release_images(items: list[Any]) -> None:
    """Drop the cached pixels of the images the given prompts or samples carry."""
    for it in items:
        if getattr(it, "images", None) is not None:
            it.images.release()
