"""Image prompts through rollout and update: the generator's log-probs against the update's
recomputation (packed micro-batches, shared prompts, preemption), bit for bit under
``rl.exact``; the same M-RoPE positions object in both phases; the tower once per prompt.

The reference is the other phase, as in tests/generator/test_exact_gap.py: the generator
(paged prefill over the images, decode) against `recompute_logprobs` on micro-batches made
by `attach_images`. Without exact mode the comparison differs in the last bits (asserted:
the test measures something).
"""

from __future__ import annotations

import pytest
import torch

from tandem.kernels import batch_invariant
from tandem.models.hf import load_args, load_model
from tandem.models.tokenizer import Tokenizer
from tandem.rl.data.images import VisionData
from tandem.rl.data.prompts import encode_prompts
from tandem.rl.generator.engine import GenerationSettings, Generator
from tandem.rl.generator.sequence import SamplingParams
from tandem.rl.rollout.types import RolloutSample
from tandem.rl.update.loss import completion_tensors, recompute_logprobs
from tandem.rl.update.packing import pack_micro_batches
from tandem.rl.update.vision import attach_images
from tests.fixtures import write_hf_vlm
from tests.models.test_vlm import noise_image


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    folder = write_hf_vlm(tmp_path_factory.mktemp("vlm"), seed=6)
    d = tmp_path_factory.mktemp("img")
    # the last two: equal token ids, other pixels
    sizes = [(130, 90), (60, 150), (112, 84), (90, 90), (90, 90)]
    for i, (w, h) in enumerate(sizes):
        noise_image(w, h, 40 + i).save(d / f"{i}.png")

    def row(*names, text="Describe."):
        parts = [{"type": "image", "image": f"{n}.png"} for n in names] + [
            {"type": "text", "text": text}
        ]
        return {"messages": [{"role": "user", "content": parts}], "answer": ""}

    rows = [
        row(0),
        row(1, 2, text="Compare."),
        {"prompt": "Text only.", "answer": ""},
        row(3),
        row(4),
    ]
    prompts, _ = encode_prompts(
        rows,
        Tokenizer.from_dir(folder),
        source=str(d / "x.jsonl"),
        prompt_field="prompt",
        messages_field="messages",
        answer_field="answer",
        max_prompt_tokens=400,
        vision=VisionData.for_model(load_args(folder), str(d / "x.jsonl")),
    )
    assert prompts[3].token_ids == prompts[4].token_ids and len(prompts) == 5
    return load_model(folder).eval(), prompts


def _rollout(model, prompts, *, num_blocks=512, budget=64):
    gen = Generator(
        model,
        GenerationSettings(
            block_size=4, num_blocks=num_blocks, max_num_batched_tokens=budget, max_model_len=400
        ),
    )
    params = [
        SamplingParams(temperature=1.0, max_tokens=10, ignore_eos=True, seed=100 * i)
        for i in range(len(prompts))
    ]
    out = gen.generate(
        [p.token_ids for p in prompts], params, n=3, images=[p.images for p in prompts]
    )
    samples = [
        RolloutSample(
            group=g,
            prompt_ids=p.token_ids,
            completion_ids=c.token_ids,
            loss_mask=c.sampled_mask,
            gen_logprobs=list(c.raw_logprobs),
            finish_reason=c.finish_reason,
            text="",
            row={},
            images=p.images,
        )
        for g, (p, comps) in enumerate(zip(prompts, out))
        for c in comps
    ]
    runs, preempted = gen.stats.extra["vision_tower_runs"], gen.stats.preemptions
    gen.close()
    return samples, runs, preempted


def _gap(model, samples, budget, share):
    mask, gen_logp, width = completion_tensors(samples, torch.device("cpu"))
    mbs = pack_micro_batches(
        samples, list(range(len(samples))), budget, torch.device("cpu"), share_prompts=share
    )
    mbs = [attach_images(mb, samples, model.args.vision.image_token_id) for mb in mbs]
    calls = []
    real = model.visual.forward
    model.visual.forward = lambda *a: calls.append(1) or real(*a)
    try:
        logp = recompute_logprobs(model, samples, mbs, width, torch.device("cpu"), chunk_tokens=7)
    finally:
        model.visual.forward = real
    diff = (logp - gen_logp).abs() * mask
    return float(diff.max()), int((diff > 0).sum()), int(mask.sum()), mbs, len(calls)


@pytest.mark.parametrize("case", ["packed", "shared_prompts", "preemption"])
def test_exact_gap_is_zero_with_images(setup, case):
    model, prompts = setup
    kw = {"preemption": dict(num_blocks=60, budget=24)}.get(case, {})
    with batch_invariant.exact_mode():
        samples, runs, preempted = _rollout(model, prompts, **kw)
        gap, differ, tokens, mbs, tower = _gap(model, samples, 400, share=case == "shared_prompts")
    # the four prompts with images, once each (three samples apiece, preemptions or not)
    assert runs == 4
    assert tokens == 150 and len(mbs) > 1
    if case == "preemption":
        assert preempted > 0
    if case == "shared_prompts":
        # a unit per prompt: the two prompts with equal token ids stay apart
        assert sum(mb.images.take is None for mb in mbs if mb.images is not None) == len(
            [mb for mb in mbs if mb.images is not None]
        )
    assert tower == sum(1 for mb in mbs if mb.images is not None for _ in mb.images.groups)
    assert gap == 0.0 and differ == 0, (gap, differ)


def test_without_exact_the_same_comparison_differs(setup):
    model, prompts = setup
    samples, _, _ = _rollout(model, prompts)
    gap, differ, _, _, _ = _gap(model, samples, 400, share=False)
    assert 0 < gap < 1e-4 and differ > 0


def test_update_uses_the_rollouts_positions_and_one_tower_pass_per_prompt(setup):
    """Unshared packing puts a prompt's three samples in three documents of one micro-batch:
    the tower still runs once for it, and each document's positions are the prompt's own."""
    model, prompts = setup
    samples, _, _ = _rollout(model, prompts[:2])
    (mb,) = pack_micro_batches(samples, list(range(len(samples))), 10_000, torch.device("cpu"))
    attach_images(mb, samples, model.args.vision.image_token_id)
    assert len(mb.images.groups) == 2 and mb.images.take is not None
    for k, i in enumerate(mb.rows):
        s, p = samples[i], len(samples[i].prompt_ids)
        row, last = divmod(mb.offsets[k][0], mb.tokens.shape[1])
        start = last - p + 1
        assert torch.equal(mb.positions[:, row, start : start + p], s.images.positions)
        assert torch.equal(
            mb.positions[:, row, start + p : start + p + 3],
            (torch.arange(p, p + 3) + s.images.delta).expand(3, -1),
        )
