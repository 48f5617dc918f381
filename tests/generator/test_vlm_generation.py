"""The generator with image prompts against transformers' Qwen2.5-VL ``generate``.

Greedy completions of prompts with one image, two images of mixed sizes and none equal
transformers' (fp32), with prefix sharing, chunked prefill cutting through the images, a pool
small enough to preempt, and the decode mirror on or off; the sampled tokens' log-probs equal
a full forward of the finished sequence. The tower runs once per prompt group, preempted and
recomputed samples included.
"""

from __future__ import annotations

import os

import pytest
import torch

from tandem.models.hf import load_args, load_model
from tandem.models.tokenizer import Tokenizer
from tandem.parallel.generation_layout import inference_layout
from tandem.rl.data.images import VisionData
from tandem.rl.data.prompts import encode_prompts
from tandem.rl.generator.engine import GenerationSettings, Generator
from tandem.rl.generator.sequence import SamplingParams
from tests.fixtures import hf_vlm_reference, write_hf_vlm
from tests.models.test_vlm import noise_image

MAX_TOKENS = 10


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    folder = write_hf_vlm(tmp_path_factory.mktemp("vlm"), seed=9)
    d = tmp_path_factory.mktemp("img")
    for i, (w, h) in enumerate([(130, 90), (60, 150), (112, 84)]):
        noise_image(w, h, 20 + i).save(d / f"{i}.png")

    def user(*parts):
        return {
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {"type": "image", "image": p}
                        if p.endswith(".png")
                        else {"type": "text", "text": p}
                        for p in parts
                    ],
                }
            ],
            "answer": "",
        }

    rows = [
        user("0.png", "Describe."),
        user("1.png", "and", "2.png", "Compare them."),
        {"prompt": "Hi!", "answer": ""},
    ]
    prompts, skipped = encode_prompts(
        rows,
        Tokenizer.from_dir(folder),
        source=str(d / "x.jsonl"),
        prompt_field="prompt",
        messages_field="messages",
        answer_field="answer",
        max_prompt_tokens=400,
        vision=VisionData.for_model(load_args(folder), str(d / "x.jsonl")),
    )
    assert not skipped
    return folder, prompts


@torch.no_grad()
def _hf_greedy(folder, prompts) -> list[list[int]]:
    ref = hf_vlm_reference(folder)
    out = []
    for p in prompts:
        ids = torch.tensor([p.token_ids])
        kw = {}
        if p.images is not None:
            pixels, grid = p.images.pixels()
            kw = dict(
                pixel_values=pixels,
                image_grid_thw=grid,
                mm_token_type_ids=(ids == ref.config.image_token_id).int(),
            )
        seq = ref.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=MAX_TOKENS,
            do_sample=False,
            **kw,
        )
        out.append(seq[0, ids.shape[1] :].tolist())
    return out


@pytest.mark.parametrize("layout", ["plain", "inference", "no mirror"])
@pytest.mark.parametrize(
    "block_size,num_blocks,budget", [(4, 512, 2048), (4, 512, 16), (4, 40, 24)]
)
def test_greedy_equals_transformers(setup, layout, block_size, num_blocks, budget):
    folder, prompts = setup
    model = load_model(folder).eval()
    if layout == "inference":
        inference_layout(model)
    settings = GenerationSettings(
        block_size=block_size,
        num_blocks=num_blocks,
        max_num_batched_tokens=budget,
        max_model_len=400,
        decode_mirror=layout != "no mirror",
    )
    eos = load_args(folder).eos_token_id
    gen = Generator(model, settings, eos_token_ids=eos)
    out = gen.generate(
        [p.token_ids for p in prompts],
        SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS),
        n=3,
        images=[p.images for p in prompts],
    )
    expected = _hf_greedy(folder, prompts)
    for group, ref in zip(out, expected):
        for c in group:
            assert c.token_ids == ref
    # once per prompt with images, whatever the preemptions
    assert gen.stats.extra["vision_tower_runs"] == 2
    if num_blocks == 40:
        assert gen.stats.preemptions > 0
    gen.close()
    # the rows went with the generator
    assert all(p.images is None or p.images.rows is None for p in prompts)


@pytest.mark.slow
def test_compiled_decode_greedy_equals_transformers(setup):
    """The compiled decode step (advanced.compile_decode) on a vision-language model: its
    text-only decode steps (M-RoPE positions past the images) give transformers' tokens."""
    folder, prompts = setup
    model = load_model(folder).eval()
    settings = GenerationSettings(
        block_size=4, num_blocks=512, max_model_len=400, compile_decode=True
    )
    gen = Generator(model, settings, eos_token_ids=load_args(folder).eos_token_id)
    out = gen.generate(
        [p.token_ids for p in prompts],
        SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS),
        n=3,
        images=[p.images for p in prompts],
    )
    assert gen.runner.compiled is not None and gen.runner.compiled.steps > 0
    for group, ref in zip(out, _hf_greedy(folder, prompts)):
        assert all(c.token_ids == ref for c in group)


@torch.no_grad()
def test_sampled_logprobs_equal_a_full_forward(setup):
    """Sampling at temperature 1: every sampled token's raw log-prob equals the training
    forward of the whole sequence (M-RoPE positions through the prompt and past it)."""
    from tandem.models.vlm import vision_batch

    folder, prompts = setup
    model = load_model(folder).eval()
    gen = Generator(
        model, GenerationSettings(block_size=4, num_blocks=512, max_model_len=400, seed=3)
    )
    out = gen.generate(
        [p.token_ids for p in prompts],
        SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True),
        n=2,
        images=[p.images for p in prompts],
    )
    image_id = model.args.vision.image_token_id
    for p, group in zip(prompts, out):
        for c in group:
            ids = torch.tensor([p.token_ids + c.token_ids])
            pos = torch.arange(ids.shape[1])[None]
            docs = {(0, 0): p.images} if p.images is not None else {}
            pos3, images = vision_batch(ids, pos, torch.zeros_like(ids), docs, image_id)
            logp = torch.log_softmax(model(ids, positions=pos3, images=images)[0].float(), -1)
            n = len(p.token_ids)
            want = logp[torch.arange(n - 1, ids.shape[1] - 1), ids[0, n:]]
            torch.testing.assert_close(torch.tensor(c.raw_logprobs), want, atol=2e-5, rtol=0)


def test_tandem_generate_with_image_rows(setup, tmp_path, capsys):
    """`tandem-generate` on image rows (paths relative to the input file): greedy equals
    transformers'; a missing image exits 3 naming its line."""
    import json
    import shutil

    from tandem.generate import main

    folder, prompts = setup
    for path in {s for p in prompts if p.images is not None for s in p.images.sources}:
        shutil.copy(os.path.join(prompts[0].images.base_dir, path), tmp_path)
    rows = [
        {
            "id": "one",
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {"type": "image", "image": "0.png"},
                        {"type": "text", "text": "Describe."},
                    ],
                }
            ],
        },
        {
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {"type": "image", "image": "1.png"},
                        {"type": "text", "text": "and"},
                        {"type": "image", "image": "2.png"},
                        {"type": "text", "text": "Compare them."},
                    ],
                }
            ]
        },
        {"prompt": "Hi!"},
    ]
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text("".join(json.dumps(r) + "\n" for r in rows))
    flags = [
        "--model",
        str(folder),
        "--input",
        str(inp),
        "--output",
        str(out),
        "--kv-cache-gb",
        "0.01",
        "--temperature",
        "0",
        "--max-tokens",
        str(MAX_TOKENS),
        "--chat-template",
    ]
    assert main(flags) == 0
    got = [json.loads(line) for line in open(out)]
    assert [r["token_ids"] for r in got] == _hf_greedy(folder, prompts)
    assert [r["prompt_tokens"] for r in got] == [len(p.token_ids) for p in prompts]
    rows[1]["messages"][0]["content"][2]["image"] = "gone.png"
    inp.write_text("".join(json.dumps(r) + "\n" for r in rows))
    capsys.readouterr()
    assert main(flags) == 3
    assert capsys.readouterr().err == (
        f"error: {inp}:2: image 2 of 2: image {tmp_path}/gone.png: No such file or directory\n"
    )
