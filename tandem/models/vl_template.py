"""Prompts with images for Qwen2.5-VL-style models: chat template, special tokens, expansion.

A message's content may be a list of parts, ``{"type": "text", "text": ...}`` and
``{"type": "image", "image": ...}`` (the OpenAI / Hugging Face messages form). The chat
template writes each image as ``<|vision_start|><|image_pad|><|vision_end|>``;
`expand_image_tokens` then repeats each ``<|image_pad|>`` id as many times as the image
has LM rows, which is what Hugging Face's processor does to the text before tokenizing
(the pad is a special token, so expanding the ids gives the same ids).
`build_vl_char_tokenizer` writes the character tokenizer with these tokens and template,
for from-scratch models.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from tandem.models.tokenizer import Tokenizer, build_char_tokenizer

VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD = (
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
)
VL_SPECIAL_TOKENS = (VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD)

# ChatML with image parts (Qwen2-VL's format; "Picture N: " before each image with add_vision_id).
QWEN_VL_CHAT_TEMPLATE = (
    "{%- set ns = namespace(images=0) %}\n"
    "{%- for message in messages %}\n"
    "    {%- if loop.first and message['role'] != 'system' %}\n"
    "        {{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}\n"
    "    {%- endif %}\n"
    "    {{- '<|im_start|>' + message['role'] + '\\n' }}\n"
    "    {%- if message['content'] is string %}\n"
    "        {{- message['content'] }}\n"
    "    {%- else %}\n"
    "        {%- for part in message['content'] %}\n"
    "            {%- if part['type'] == 'image' or 'image' in part or 'image_url' in part %}\n"
    "                {%- set ns.images = ns.images + 1 %}\n"
    "                {%- if add_vision_id %}{{- 'Picture ' + ns.images | string + ': ' "
    "}}{%- endif %}\n                {{- '<|vision_start|><|image_pad|><|vision_end|>' }}\n"
    "            {%- elif 'text' in part %}\n"
    "                {{- part['text'] }}\n"
    "            {%- endif %}\n"
    "        {%- endfor %}\n"
    "    {%- endif %}\n"
    "    {{- '<|im_end|>\\n' }}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n"
    "    {{- '<|im_start|>assistant\\n' }}\n"
    "{%- endif %}\n"
)


def build_vl_char_tokenizer(path: str | Path, extra_chars: str = "") -> Tokenizer:
    """The character tokenizer (tandem/models/tokenizer.py) plus the vision tokens and template."""
    return build_char_tokenizer(
        path, extra_chars, special_tokens=VL_SPECIAL_TOKENS, chat_template=QWEN_VL_CHAT_TEMPLATE
    )


def expand_image_tokens(
    ids: Sequence[int], counts: Sequence[int], image_token_id: int
) -> list[int]:
    """Each image token of ``ids`` (one per image, in order) repeated ``counts[i]`` times;
    ValueError when the number of image tokens is not ``len(counts)``."""
    n = sum(1 for t in ids if t == image_token_id)
    if n != len(counts):
        raise ValueError(f"the prompt has {n} image placeholder(s) for {len(counts)} image(s)")
    out: list[int] = []
    left = iter(counts)
    for t in ids:
        out.extend([t] * next(left) if t == image_token_id else [t])
    return out
