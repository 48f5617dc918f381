"""Qwen2.5-VL against transformers: pixel values, token ids, M-RoPE positions, logits,
grads, HF I/O.

The reference is transformers' ``Qwen2_5_VLForConditionalGeneration`` and its processor
(``Qwen2VLImageProcessorPil``, the Pillow image processor, with the tokenizer) on tiny random
folders (tests/fixtures.py: every parameter randomised, a 3-block tower with windowed and
full-attention blocks).
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from PIL import Image

from tandem.models.hf import load_args, load_model, save_hf
from tandem.models.image_processor import ImageProcessor, open_image
from tandem.models.rope import mrope_positions
from tandem.models.tokenizer import Tokenizer
from tandem.models.vl_template import IMAGE_PAD, expand_image_tokens
from tandem.models.vlm import ImageInputs, VisionLanguageModel
from tests.fixtures import hf_vlm_reference, write_hf_vlm

TOL = 1e-4


def noise_image(width: int, height: int, seed: int, mode: str = "RGB") -> Image.Image:
    g = np.random.default_rng(seed)
    image = Image.fromarray(g.integers(0, 256, (height, width, 3), dtype=np.uint8))
    if mode == "RGBA":  # a transparent left half: composited on white
        alpha = np.full((height, width), 255, dtype=np.uint8)
        alpha[:, : width // 2] = g.integers(0, 256, (height, width // 2), dtype=np.uint8)
        image = image.copy()
        image.putalpha(Image.fromarray(alpha))
        return image
    return image.convert(mode)


@pytest.fixture(scope="module", params=["untied", "tied"])
def folder(request, tmp_path_factory):
    return write_hf_vlm(
        tmp_path_factory.mktemp(f"vlm-{request.param}"), seed=5, tie=request.param == "tied"
    )


@pytest.fixture(scope="module")
def hf_processor(folder):
    """transformers' Qwen2.5-VL processor for images and text (its video processor needs
    torchvision)."""
    from transformers import PreTrainedTokenizerFast, Qwen2_5_VLProcessor
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
    from transformers.processing_utils import ProcessorMixin

    class ImageTextProcessor(Qwen2_5_VLProcessor):
        def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
            self.image_token, self.video_token = IMAGE_PAD, "<|video_pad|>"
            self.image_token_id = tokenizer.convert_tokens_to_ids(self.image_token)
            self.video_token_id = tokenizer.convert_tokens_to_ids(self.video_token)
            ProcessorMixin.__init__(self, image_processor, tokenizer, chat_template=chat_template)

    return ImageTextProcessor(
        image_processor=Qwen2VLImageProcessorPil.from_pretrained(folder),
        tokenizer=PreTrainedTokenizerFast.from_pretrained(folder),
    )


def _prompt(tok: Tokenizer, images: list[Image.Image], question: str) -> str:
    content = [{"type": "image", "image": f"img{i}"} for i in range(len(images))] + [
        {"type": "text", "text": question}
    ]
    if len(images) == 2:  # text between the two images
        content = [content[0], {"type": "text", "text": "and"}, content[1], content[2]]
    return tok.apply_chat_template(
        [{"role": "user", "content": content}], add_generation_prompt=True
    )


def _ours(folder, tok: Tokenizer, proc: ImageProcessor, text: str, images: list[Image.Image]):
    """Token ids, M-RoPE positions [3, S] and image inputs the way Tandem builds them."""
    image_id = tok.token_to_id(IMAGE_PAD)
    ids = expand_image_tokens(
        tok.encode(text), [proc.num_tokens(im.width, im.height) for im in images], image_id
    )
    groups = [proc(images)] if images else []
    grids = groups[0][1].tolist() if images else []
    positions, delta = mrope_positions(ids, grids, image_id, proc.merge_size)
    index = (torch.tensor(ids) == image_id).nonzero()[:, 0]
    return ids, positions, delta, ImageInputs(index, groups)


CASES = {  # (width, height) of each image of one prompt
    "one image": [(130, 90)],
    "two images, mixed sizes": [(60, 200), (112, 112)],
    "small image (upscaled to min_pixels)": [(20, 30)],
    "large image (downscaled to max_pixels)": [(640, 480)],
    "no image": [],
}


@pytest.mark.parametrize("case", sorted(CASES))
@torch.no_grad()
def test_inputs_and_logits_match_transformers(folder, hf_processor, case):
    tok, proc = Tokenizer.from_dir(folder), ImageProcessor.from_dir(folder)
    images = [noise_image(w, h, seed=i) for i, (w, h) in enumerate(CASES[case])]
    text = _prompt(tok, images, "What is in the picture?")
    enc = hf_processor(text=[text], images=images or None, return_tensors="pt")
    ids, positions, delta, inputs = _ours(folder, tok, proc, text, images)
    assert ids == enc["input_ids"][0].tolist()
    ref, ours = hf_vlm_reference(folder), load_model(folder)
    assert isinstance(ours, VisionLanguageModel)
    if images:
        assert torch.equal(inputs.groups[0][0], enc["pixel_values"])  # bit for bit
        assert torch.equal(inputs.groups[0][1], enc["image_grid_thw"])
        hf_pos, hf_delta = ref.model.get_rope_index(
            enc["input_ids"], enc["mm_token_type_ids"], enc["image_grid_thw"]
        )
        assert torch.equal(positions, hf_pos[:, 0]) and delta == hf_delta.item()
    expected = ref(**enc).logits
    got = ours(torch.tensor([ids]), positions=positions[:, None], images=inputs)
    assert got.shape == expected.shape
    assert (got - expected).abs().max().item() <= TOL


@torch.no_grad()
def test_batch_of_prompts_with_and_without_images(folder):
    """Two prompts in one [2, S] batch (right-padded; two images in the first, none in the
    second) give each prompt's logits alone."""
    tok, proc = Tokenizer.from_dir(folder), ImageProcessor.from_dir(folder)
    model = load_model(folder)
    images = [noise_image(84, 140, 3), noise_image(150, 60, 4)]
    a = _ours(folder, tok, proc, _prompt(tok, images, "Count."), images)
    b = _ours(folder, tok, proc, _prompt(tok, [], "Just text."), [])
    s = max(len(a[0]), len(b[0]))
    tokens = torch.zeros(2, s, dtype=torch.long)
    positions = torch.zeros(3, 2, s, dtype=torch.long)
    for row, (ids, pos, _, _) in enumerate((a, b)):
        tokens[row, : len(ids)] = torch.tensor(ids)
        positions[:, row, : len(ids)] = pos
    batch = model(tokens, positions=positions, images=a[3])  # row 0's flat positions are its own
    for row, (ids, pos, _, inputs) in enumerate((a, b)):
        alone = model(torch.tensor([ids]), positions=pos[:, None], images=inputs)[0]
        assert (batch[row, : len(ids)] - alone).abs().max().item() <= 1e-5


def test_gradients_match_transformers(folder, hf_processor):
    """A trained forward (tower included): the loss's gradients equal transformers' for the
    tower's and the LM's parameters."""
    from tandem.models.hf import hf_to_tandem

    tok, proc = Tokenizer.from_dir(folder), ImageProcessor.from_dir(folder)
    images = [noise_image(100, 70, 7), noise_image(56, 56, 8)]
    text = _prompt(tok, images, "Which is larger?")
    enc = hf_processor(text=[text], images=images, return_tensors="pt")
    ids, positions, _, inputs = _ours(folder, tok, proc, text, images)
    ref, ours = hf_vlm_reference(folder), load_model(folder)
    targets = torch.tensor([ids[1:] + [0]])
    ref.train()  # no dropout in either model
    torch.nn.functional.cross_entropy(ref(**enc).logits[0], targets[0]).backward()
    torch.nn.functional.cross_entropy(
        ours(torch.tensor([ids]), positions=positions[:, None], images=inputs)[0], targets[0]
    ).backward()
    ref_grads = hf_to_tandem(
        {n: p.grad for n, p in ref.named_parameters() if p.grad is not None}, ours.args
    )
    got = dict(ours.named_parameters())
    checked = 0
    for name, g in ref_grads.items():
        if name == "output.weight" and ours.args.tie_word_embeddings:
            continue  # the one tied tensor: compared as tok_embeddings
        scale = g.abs().max().item() + 1e-6
        assert (got[name].grad - g).abs().max().item() <= 1e-4 * max(scale, 1.0), name
        checked += 1
    assert checked > 60 and any(n.startswith("visual.blocks.0.") for n in ref_grads)


def test_hf_export_round_trip(folder, tmp_path):
    """load -> save_hf -> transformers loads it with the same weights and config; reloading
    gives the same tensors bit for bit."""
    from transformers import Qwen2_5_VLConfig

    model = load_model(folder)
    args = load_args(folder)
    out = save_hf(model.state_dict(), args, tmp_path / "out", tokenizer=Tokenizer.from_dir(folder))
    assert load_args(out) == args
    again = load_model(out)
    for (n1, t1), (n2, t2) in zip(model.state_dict().items(), again.state_dict().items()):
        assert n1 == n2 and torch.equal(t1, t2), n1
    ref_src, ref_out = hf_vlm_reference(folder), hf_vlm_reference(out)
    src, exp = ref_src.state_dict(), ref_out.state_dict()
    assert src.keys() == exp.keys() and all(torch.equal(src[k], exp[k]) for k in src)
    cfg = Qwen2_5_VLConfig.from_pretrained(out)
    assert cfg.text_config.rope_parameters["mrope_section"] == [2, 3, 3]
    assert (
        cfg.vision_config.fullatt_block_indexes == [1]
        and cfg.image_token_id == args.vision.image_token_id
    )
    assert json.loads((out / "config.json").read_text())["architectures"] == [
        "Qwen2_5_VLForConditionalGeneration"
    ]


def test_flat_hub_config_loads(folder, tmp_path):
    """The hub's older config.json (text keys at the top, ``rope_scaling`` of type mrope,
    ``in_chans``) gives the same ModelArgs as transformers 5's nested one."""
    nested = json.loads((folder / "config.json").read_text())
    flat = {k: v for k, v in nested.items() if k != "text_config"}
    text = dict(nested["text_config"])
    rope = text.pop("rope_parameters")
    flat.update(
        text,
        model_type="qwen2_5_vl",
        rope_theta=rope["rope_theta"],
        rope_scaling={"type": "mrope", "mrope_section": rope["mrope_section"]},
    )
    vision = dict(flat["vision_config"])
    vision["in_chans"] = vision.pop("in_channels")
    flat["vision_config"] = vision
    (tmp_path / "config.json").write_text(json.dumps(flat))
    assert load_args(tmp_path).replace(vision=None, model_type="qwen2") == load_args(
        folder
    ).replace(vision=None, model_type="qwen2")
    (tmp_path / "preprocessor_config.json").write_text(
        (folder / "preprocessor_config.json").read_text()
    )
    assert load_args(tmp_path) == load_args(folder)


@pytest.mark.parametrize("layout", ["start", "end", "adjacent"])
def test_mrope_positions_match_get_rope_index(folder, layout):
    """Images at the very start, at the end, and two with only the vision markers between."""
    ref = hf_vlm_reference(folder)
    image = ref.config.image_token_id
    grids = [(1, 4, 6), (1, 8, 2)]
    first, second = [image] * 6, [image] * 4
    start, end = ref.config.vision_start_token_id, ref.config.vision_end_token_id
    ids = {
        "start": first + [5, 6, start] + second + [end, 7],
        "end": [5, 6, start] + first + [end, start] + second,
        "adjacent": [5, start] + first + [end, start] + second + [end, 9, 9],
    }[layout]
    positions, delta = mrope_positions(ids, grids, image, 2)
    types = (torch.tensor([ids]) == image).int()
    expected, hf_delta = ref.model.get_rope_index(torch.tensor([ids]), types, torch.tensor(grids))
    assert torch.equal(positions, expected[:, 0]) and delta == hf_delta.item()


@pytest.mark.parametrize("mode", ["RGBA", "L", "P", "CMYK"])
def test_pixels_of_other_modes_match_transformers(folder, mode, tmp_path):
    """Transparency composited on white, grey and palette images, read back from a PNG/JPEG file."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    image = noise_image(90, 66, 11, mode)
    file = tmp_path / ("x.jpg" if mode == "CMYK" else "x.png")
    image.save(file)
    decoded = open_image(str(file))
    expected = Qwen2VLImageProcessorPil.from_pretrained(folder)(
        images=[decoded], return_tensors="pt"
    )
    pixels, grid = ImageProcessor.from_dir(folder)([decoded])
    assert torch.equal(pixels, expected["pixel_values"]) and torch.equal(
        grid, expected["image_grid_thw"]
    )


@pytest.mark.parametrize("bad", ["missing", "truncated", "not an image", "bad base64"])
def test_unreadable_images_are_named(tmp_path, bad):
    good = tmp_path / "ok.png"
    noise_image(30, 30, 0).save(good)
    source = {
        "missing": str(tmp_path / "nope.png"),
        "truncated": good.read_bytes()[:60],
        "not an image": b"hello world",
        "bad base64": "data:image/png;base64,@@@@",
    }[bad]
    with pytest.raises(ValueError) as e:
        open_image(source)
    assert "\n" not in str(e.value) and ("nope.png" in str(e.value) or "image" in str(e.value))
