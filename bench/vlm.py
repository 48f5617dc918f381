"""Vision-language models on CPU: one RL step of the VLM quickstart and the tower's share of it,
and image preprocessing against transformers' processor.

Run from the repository root::

    python -m bench.vlm                        # both parts
    python -m bench.vlm --part preprocess      # images per second only

``step``: one GRPO step of configs/quickstart_vlm.toml's shape on its policy
(assets/quickstart-vlm-policy), in one process: the rollout (``--prompts`` shapes pictures x
``--samples`` samples of up to 8 tokens through the generator, the tower once per prompt)
and the update (the samples packed into micro-batches of 2048 tokens, forward and backward
with the tower trainable, as ``model.train_vision = true`` runs it; the quickstart's own
frozen tower skips the tower's backward; here the pixels ask for a gradient, so the tower's
backward hook fires when its backward ends, at the cost of one small extra product).
``tower`` is the time spent inside the tower's
forward and backward, ``share`` = tower / phase. Milliseconds: medians of ``--repeats``
steps after one warm-up.

``preprocess``: images per second of `tandem.models.image_processor.ImageProcessor` and of
transformers' ``Qwen2VLImageProcessorPil`` on the same decoded images (the quickstart's
56 x 56 pictures, and 640 x 480 noise pictures at Qwen2.5-VL's default pixel budget);
``ratio`` = ours / transformers'. Both produce the same values (tests/models/test_vlm.py).
Record results in docs/performance.md.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import numpy as np
import torch
from PIL import Image

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
POLICY = os.path.join(ROOT, "assets", "quickstart-vlm-policy")


class TowerClock:
    """Wall time inside the tower's forward and backward (hooks; CPU, so no syncs needed)."""

    def __init__(self, tower: torch.nn.Module) -> None:
        self.seconds, self._t = 0.0, 0.0
        tower.register_forward_pre_hook(lambda *_: self._start())
        tower.register_forward_hook(lambda *_: self._stop())
        tower.register_full_backward_pre_hook(lambda *_: self._start())
        tower.register_full_backward_hook(lambda *_: self._stop())

    def _start(self) -> None:
        self._t = time.perf_counter()

    def _stop(self) -> None:
        self.seconds += time.perf_counter() - self._t


def bench_step(path: str, prompts: int, samples: int, repeats: int) -> None:
    from tandem.models.hf import load_args, load_model
    from tandem.models.tokenizer import Tokenizer
    from tandem.rl.data.images import VisionData
    from tandem.rl.data.prompts import encode_prompts
    from tandem.rl.data.tasks import make_task_rows
    from tandem.rl.generator.engine import GenerationSettings, Generator
    from tandem.rl.generator.sequence import SamplingParams
    from tandem.rl.rollout.types import RolloutSample
    from tandem.rl.update.loss import token_logprobs
    from tandem.rl.update.packing import pack_micro_batches
    from tandem.rl.update.vision import attach_images

    tok, args = Tokenizer.from_dir(path), load_args(path)
    rows = make_task_rows("shapes", prompts * (repeats + 1), 0, "train")
    encoded, _ = encode_prompts(
        rows,
        tok,
        source="bench",
        prompt_field="prompt",
        messages_field="messages",
        answer_field="answer",
        max_prompt_tokens=120,
        vision=VisionData.for_model(args, None),
    )
    model = load_model(path)
    clock = TowerClock(model.visual)
    times: dict[str, list[float]] = {
        k: [] for k in ("rollout", "rollout tower", "update", "update tower")
    }
    for r in range(repeats + 1):
        batch = encoded[r * prompts : (r + 1) * prompts]
        model.eval()
        clock.seconds, t0 = 0.0, time.perf_counter()
        gen = Generator(
            model,
            GenerationSettings(block_size=16, num_blocks=512, max_model_len=128, seed=r),
            eos_token_ids=tok.eos_token_ids,
        )
        out = gen.generate(
            [p.token_ids for p in batch],
            SamplingParams(temperature=1.0, max_tokens=8),
            n=samples,
            images=[p.images for p in batch],
        )
        gen.close()
        rollout, rollout_tower = time.perf_counter() - t0, clock.seconds
        rs = [
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
            for g, (p, comps) in enumerate(zip(batch, out))
            for c in comps
        ]
        model.train()
        clock.seconds, t0 = 0.0, time.perf_counter()
        for mb in pack_micro_batches(
            rs, list(range(len(rs))), 2048, torch.device("cpu"), share_prompts=True
        ):
            attach_images(mb, rs, args.vision.image_token_id)
            for pixels, _ in mb.images.groups:  # the tower's backward then ends with its input's
                pixels.requires_grad_(True)  # gradient, where the backward hook reads the clock
            logp, _ = token_logprobs(model, mb, with_entropy=True)
            logp.sum().backward()
        model.zero_grad(set_to_none=True)
        for p in batch:
            p.images.release()
        if r:  # the first step warms up
            for k, v in zip(
                times, (rollout, rollout_tower, time.perf_counter() - t0, clock.seconds)
            ):
                times[k].append(v * 1e3)
    med = {k: statistics.median(v) for k, v in times.items()}
    total, tower = med["rollout"] + med["update"], med["rollout tower"] + med["update tower"]
    print(f"VLM quickstart step ({prompts} prompts x {samples} samples, {path}):")
    print(f"{'phase':<10}{'ms':>10}{'tower ms':>10}{'share':>8}")
    for phase in ("rollout", "update"):
        print(
            f"{phase:<10}{med[phase]:>10.1f}{med[phase + ' tower']:>10.1f}"
            f"{med[phase + ' tower'] / med[phase]:>8.3f}"
        )
    print(f"{'step':<10}{total:>10.1f}{tower:>10.1f}{tower / total:>8.3f}")


def _images(kind: str, n: int) -> list[Image.Image]:
    if kind == "quickstart":
        from tandem.models.image_processor import open_image
        from tandem.rl.data.tasks import make_task_rows

        rows = make_task_rows("shapes", n, 0, "train")
        return [open_image(r["messages"][0]["content"][0]["image"]) for r in rows]
    g = np.random.default_rng(0)
    return [Image.fromarray(g.integers(0, 256, (480, 640, 3), dtype=np.uint8)) for _ in range(n)]


def bench_preprocess(repeats: int) -> None:
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from tandem.models.image_processor import ImageProcessor

    print(f"{'images':<28}{'ours img/s':>12}{'hf img/s':>12}{'ratio':>8}")
    for kind, pixels, n in (
        ("quickstart", (56 * 56, 56 * 56), 256),
        ("640x480", (56 * 56, 28 * 28 * 1280), 16),
    ):
        ours = ImageProcessor(min_pixels=pixels[0], max_pixels=pixels[1])
        hf = Qwen2VLImageProcessorPil(min_pixels=pixels[0], max_pixels=pixels[1])
        images = _images(kind, n)
        rates = {}
        for name, fn in (
            ("ours", lambda: ours(images)),
            ("hf", lambda: hf(images=images, return_tensors="pt")),
        ):
            fn()
            runs = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                fn()
                runs.append(time.perf_counter() - t0)
            rates[name] = n / statistics.median(runs)
        label = f"{kind} ({n}, max {pixels[1]} px)"
        print(
            f"{label:<28}{rates['ours']:>12.1f}{rates['hf']:>12.1f}"
            f"{rates['ours'] / rates['hf']:>8.2f}"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--part", choices=("all", "step", "preprocess"), default="all")
    ap.add_argument("--model", default=POLICY)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--smoke", action="store_true", help="4 prompts x 2 samples, 2 repeats")
    a = ap.parse_args()
    if a.smoke:
        a.prompts, a.samples, a.repeats = 4, 2, 2
    from bench.header import print_header

    print_header("bench.vlm")
    torch.manual_seed(0)
    if a.part in ("all", "step"):
        bench_step(a.model, a.prompts, a.samples, a.repeats)
    if a.part in ("all", "preprocess"):
        bench_preprocess(a.repeats)


if __name__ == "__main__":
    main()
