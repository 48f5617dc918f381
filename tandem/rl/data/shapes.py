"""Coloured shapes drawn with Pillow: the pictures of the ``shapes`` synthetic task.

One filled circle, square or triangle of a named colour on a white square canvas, at a
given centre and size, as PNG bytes in a ``data:`` URI (a row carries its picture; no file
is written). Drawing is deterministic, so a row's picture is the same on every rank and run.
"""

from __future__ import annotations

import base64
import io

from PIL import Image, ImageDraw

SHAPES = ("circle", "square", "triangle")
COLOURS = {
    "red": (220, 30, 30),
    "green": (30, 160, 40),
    "blue": (40, 60, 220),
    "yellow": (230, 200, 20),
    "purple": (140, 40, 170),
    "black": (20, 20, 20),
}


def draw(shape: str, colour: str, cx: int, cy: int, size: int, canvas: int = 56) -> bytes:
    """PNG bytes of one ``shape`` of side / diameter ``size`` centred at (cx, cy)."""
    image = Image.new("RGB", (canvas, canvas), (255, 255, 255))
    pen = ImageDraw.Draw(image)
    h = size / 2
    box = (cx - h, cy - h, cx + h, cy + h)
    fill = COLOURS[colour]
    if shape == "circle":
        pen.ellipse(box, fill=fill)
    elif shape == "square":
        pen.rectangle(box, fill=fill)
    elif shape == "triangle":
        pen.polygon([(cx, cy - h), (cx - h, cy + h), (cx + h, cy + h)], fill=fill)
    else:
        raise ValueError(f"unknown shape {shape!r}; choose from {SHAPES}")
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


def data_uri(png: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(png).decode()
