"""Rows with images (OpenAI message parts) in jsonl and parquet: token ids, pixels and M-RoPE
positions equal transformers' processor and model; a missing or undecodable image is one bad
row named by file, line and image (exit 3 under ``data.on_bad_row = "error"``).
"""

from __future__ import annotations

import base64
import io
import json
import os
import struct
import subprocess
import sys
import time
import zlib

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from PIL import Image

from tandem.models.hf import load_args
from tandem.models.image_processor import MAX_IMAGE_BYTES, MAX_IMAGE_PIXELS, open_image
from tandem.models.tokenizer import Tokenizer, build_char_tokenizer
from tandem.rl.data.images import VisionData
from tandem.rl.data.loading import DataError, load_rows
from tandem.rl.data.prompts import encode_prompts
from tandem.rl.data.sft import IGNORE, build_sft_data
from tests.fixtures import hf_vlm_reference, write_hf_vlm
from tests.models.test_vlm import noise_image

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return write_hf_vlm(tmp_path_factory.mktemp("vlm"), seed=2)


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    """Two PNGs on disk beside the data files (rows name them relatively)."""
    d = tmp_path_factory.mktemp("data")
    (d / "img").mkdir()
    noise_image(130, 90, 0).save(d / "img" / "a.png")
    noise_image(60, 150, 1).save(d / "img" / "b.png")
    return d


def _uri(image: Image.Image) -> str:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def _row(*images, question="Which colour?", answer="red"):
    content = [{"type": "image", "image": im} for im in images] + [
        {"type": "text", "text": question}
    ]
    return {"messages": [{"role": "user", "content": content}], "answer": answer}


def _encode(rows, folder, source, on_bad_row="skip", max_prompt_tokens=512):
    args = load_args(folder)
    return encode_prompts(
        rows,
        Tokenizer.from_dir(folder),
        source=source,
        prompt_field="prompt",
        messages_field="messages",
        answer_field="answer",
        max_prompt_tokens=max_prompt_tokens,
        on_bad_row=on_bad_row,
        vision=VisionData.for_model(args, source),
    )


def _reference(folder, row, base_dir, generation_prompt=True):
    """transformers' processor on the same row (images decoded from the same sources)."""
    from transformers import PreTrainedTokenizerFast, Qwen2_5_VLProcessor
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
    from transformers.processing_utils import ProcessorMixin

    from tandem.models.image_processor import open_image

    class ImageTextProcessor(Qwen2_5_VLProcessor):
        def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
            self.image_token, self.video_token = "<|image_pad|>", "<|video_pad|>"
            self.image_token_id = tokenizer.convert_tokens_to_ids(self.image_token)
            self.video_token_id = tokenizer.convert_tokens_to_ids(self.video_token)
            ProcessorMixin.__init__(self, image_processor, tokenizer, chat_template=chat_template)

    proc = ImageTextProcessor(
        Qwen2VLImageProcessorPil.from_pretrained(folder),
        PreTrainedTokenizerFast.from_pretrained(folder),
    )
    tok = Tokenizer.from_dir(folder)
    images = [
        open_image(p["image"], str(base_dir))
        for m in row["messages"]
        for p in m["content"]
        if "image" in p
    ]
    text = tok.apply_chat_template(row["messages"], add_generation_prompt=generation_prompt)
    return proc(text=[text], images=images, return_tensors="pt")


def test_jsonl_rows_with_paths_and_data_uris_equal_the_processor(folder, data_dir):
    rows = [
        _row("img/a.png"),
        _row(_uri(noise_image(70, 70, 5)), "img/b.png", question="Compare."),
        {"prompt": "No picture here.", "answer": "x"},
    ]
    path = data_dir / "train.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    prompts, skipped = _encode(load_rows(str(path)), folder, str(path))
    assert skipped == {} and len(prompts) == 3 and prompts[2].images is None
    ref = hf_vlm_reference(folder)
    for p, row in zip(prompts[:2], rows):
        enc = _reference(folder, row, data_dir)
        assert p.token_ids == enc["input_ids"][0].tolist()
        pixels, grid = p.images.pixels()
        assert torch.equal(pixels, enc["pixel_values"]) and torch.equal(grid, enc["image_grid_thw"])
        expected, delta = ref.model.get_rope_index(
            enc["input_ids"], enc["mm_token_type_ids"], enc["image_grid_thw"]
        )
        assert torch.equal(p.images.positions, expected[:, 0]) and p.images.delta == delta.item()


def test_parquet_rows_with_image_bytes(folder, data_dir, tmp_path):
    """A parquet file whose image parts hold the PNG bytes (a binary field) and whose text
    parts read back with ``image: null`` from the shared struct."""
    png = (data_dir / "img" / "a.png").read_bytes()
    part = pa.struct([("type", pa.string()), ("text", pa.string()), ("image", pa.binary())])
    msg = pa.struct([("role", pa.string()), ("content", pa.list_(part))])
    table = pa.table(
        {
            "messages": pa.array(
                [
                    [
                        {
                            "role": "user",
                            "content": [
                                {"type": "image", "text": None, "image": png},
                                {"type": "text", "text": "Which colour?", "image": None},
                            ],
                        }
                    ]
                ],
                type=pa.list_(msg),
            ),
            "answer": ["red"],
        }
    )
    path = tmp_path / "train.parquet"
    pq.write_table(table, path)
    rows = load_rows(str(path))
    prompts, skipped = _encode(rows, folder, str(path))
    assert skipped == {} and len(prompts) == 1
    enc = _reference(folder, _row("img/a.png"), data_dir)
    assert prompts[0].token_ids == enc["input_ids"][0].tolist()
    assert torch.equal(prompts[0].images.pixels()[0], enc["pixel_values"])


def _png_header(width, height):
    """A PNG of ``width`` x ``height`` 1-bit pixels holding a few bytes of data: its header
    alone says how much a decoder would inflate (a decompression bomb, made here in ~100 B)."""

    def chunk(kind, body):
        return (
            struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))
        )

    ihdr = struct.pack(">IIBBBBB", width, height, 1, 0, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", ihdr)
        + chunk(b"IDAT", zlib.compress(b"\0" * 64))
        + chunk(b"IEND", b"")
    )


@pytest.fixture(scope="module")
def hostile(data_dir):
    """Files a hostile data set can name: a FIFO, a 30000 x 30000 PNG (over Pillow's own limit)
    and a 9000 x 9000 one (under Pillow's, over ours)."""
    os.mkfifo(data_dir / "img" / "fifo.png")
    (data_dir / "img" / "bomb.png").write_bytes(_png_header(30000, 30000))
    (data_dir / "img" / "big.png").write_bytes(_png_header(9000, 9000))
    return data_dir


@pytest.mark.parametrize(
    "bad, reason",
    [
        ("img/missing.png", "image 1 of 1: image {d}/img/missing.png: No such file or directory"),
        ("/dev/zero", "image 1 of 1: image /dev/zero: a data file's image paths must be relative"),
        ("img/../../x.png", "image 1 of 1: image img/../../x.png: a data file's image paths"),
        ("img/fifo.png", "image 1 of 1: image {d}/img/fifo.png: not a regular file"),
        (
            "img/bomb.png",
            f"image 1 of 1: image {{d}}/img/bomb.png: over the limit of {MAX_IMAGE_PIXELS} pixels",
        ),
        (
            "img/big.png",
            f"image 1 of 1: image {{d}}/img/big.png: over the limit of {MAX_IMAGE_PIXELS} pixels",
        ),
        ("data:image/png;base64,AAAA", "image 1 of 1: a data: URI: not a decodable image"),
        (
            "data:image/png;base64,@@",
            "image 1 of 1: a data: URI image whose base64 does not decode",
        ),
    ],
)
def test_a_bad_image_is_one_bad_row_named_by_file_and_line(folder, hostile, tmp_path, bad, reason):
    data_dir = hostile
    reason = reason.format(d=data_dir)
    path = data_dir / f"bad-{abs(hash(bad))}.jsonl"
    path.write_text(json.dumps(_row("img/a.png")) + "\n" + json.dumps(_row(bad)) + "\n")
    t0 = time.monotonic()
    prompts, skipped = _encode(load_rows(str(path)), folder, str(path))
    assert time.monotonic() - t0 < 5  # refused before any large read or decode
    assert len(prompts) == 1 and len(skipped) == 1 and next(iter(skipped)).startswith(reason)
    with pytest.raises(DataError) as e:
        _encode(load_rows(str(path)), folder, str(path), on_bad_row="error")
    assert str(e.value).startswith(f"{path}:2: {reason}") and "\n" not in str(e.value)


def test_a_truncated_png_and_a_text_model_are_bad_rows(folder, data_dir, tmp_path):
    cut = data_dir / "img" / "cut.png"
    cut.write_bytes((data_dir / "img" / "a.png").read_bytes()[:200])
    prompts, skipped = _encode(
        [_row("img/cut.png"), _row("img/a.png")], folder, str(data_dir / "x.jsonl")
    )
    assert len(prompts) == 1 and next(iter(skipped)).startswith(
        f"image 1 of 1: image {cut}: not a decodable image"
    )
    text_tok = build_char_tokenizer(tmp_path / "tok")
    prompts, skipped = encode_prompts(
        [_row("img/a.png"), {"prompt": "hi", "answer": "x"}],
        text_tok,
        source="s",
        prompt_field="prompt",
        messages_field="messages",
        answer_field="answer",
        max_prompt_tokens=64,
    )
    # counted sans hint
    assert len(prompts) == 1 and skipped == {"image parts need a vision-language model": 1}


def test_sft_rows_with_images_train_the_reply_only(folder, data_dir):
    tok = Tokenizer.from_dir(folder)
    row = _row("img/a.png")
    row["messages"].append({"role": "assistant", "content": "red"})
    data = build_sft_data(
        [row, {"prompt": "1+1=", "completion": "2"}],
        tok,
        source=str(data_dir / "s.jsonl"),
        max_length=256,
        vision=VisionData.for_model(load_args(folder), str(data_dir / "s.jsonl")),
    )
    (packed,) = data.rows
    image = tok.token_to_id("<|image_pad|>")
    assert packed.doc_ids.count(0) > packed.images[0].num_rows and packed.images[1] is None
    # 130 x 90 -> 6 x 10 patches -> 15 rows
    assert packed.tokens.count(image) == packed.images[0].num_rows == 15
    trained = tok.decode(
        [t for t, g in zip(packed.tokens[1:] + [0], packed.targets) if g != IGNORE]
    )
    assert trained.startswith("red<|im_end|>") and "<|image_pad|>" not in trained
    # the whole chat, as transformers lays it out
    enc = _reference(folder, row, data_dir, generation_prompt=False)
    n = packed.doc_ids.count(0)
    assert packed.tokens[:n] == enc["input_ids"][0, :-1].tolist()
    expected = hf_vlm_reference(folder).model.get_rope_index(
        enc["input_ids"], enc["mm_token_type_ids"], enc["image_grid_thw"]
    )[0][:, 0]
    # every token's, the last (a target only) too
    assert torch.equal(packed.images[0].positions, expected)


def test_train_exits_3_naming_a_missing_image(folder, data_dir, tmp_path):
    row = _row("img/nothere.png")
    row["messages"].append({"role": "assistant", "content": "red"})
    path = data_dir / "sft-bad.jsonl"
    path.write_text(json.dumps(row) + "\n")
    cmd = [
        sys.executable,
        os.path.join(ROOT, "train.py"),
        f"--model.path={folder}",
        f"--data.path={path}",
        "--data.max_length=256",
        "--training.steps=1",
        "--training.batch_size=1",
        "--data.on_bad_row=error",
        "--metrics.loggers=[]",
        "--checkpoint.enable=false",
        f"--job.dump_folder={tmp_path / 'run'}",
    ]
    r = subprocess.run(
        cmd,
        cwd=ROOT,
        env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert (r.returncode, r.stderr) == (
        3,
        f"error: {path}:1: image 1 of 1: image {data_dir}"
        "/img/nothere.png: No such file or directory (set "
        "data.on_bad_row=skip to skip such rows)\n",
    )


def test_the_opener_bounds_what_it_reads_without_a_data_folder(tmp_path):
    """No base folder (tandem-generate's in-memory rows, synthetic data): paths are taken as
    given, but only regular files, at most MAX_IMAGE_BYTES of them."""
    with pytest.raises(ValueError, match="^image /dev/zero: not a regular file$"):
        open_image("/dev/zero")
    big = tmp_path / "big.png"
    with open(big, "wb") as f:
        f.truncate(MAX_IMAGE_BYTES + 1)  # sparse: nothing written
    with pytest.raises(ValueError, match=f"^image {big}: over {MAX_IMAGE_BYTES} bytes$"):
        open_image(str(big))
    ok = tmp_path / "ok.png"
    noise_image(20, 10, 3).save(ok)
    assert open_image(str(ok)).size == (20, 10)
    assert open_image("ok.png", str(tmp_path)).size == (20, 10)
