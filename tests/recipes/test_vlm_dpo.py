"""DPO of a Qwen2.5-VL folder on preference rows with images, two ranks under torchrun.

Rank 0's pairs have an image in their context, rank 1's none; the tower trains. The first
step's ``chosen_logp`` / ``rejected_logp`` (the mean summed response log-probs) equal
transformers' on the same pairs, and the run completes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from tandem.models.hf import load_args
from tandem.models.tokenizer import Tokenizer
from tandem.rl.data.images import VisionData
from tandem.rl.data.preference import load_preference_data
from tests.fixtures import hf_vlm_reference, write_hf_vlm
from tests.models.test_vlm import noise_image

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _rows(d):
    rows = []
    for i in range(4):
        if i % 2 == 0:  # rank 0 (batch 2, no shuffle)
            noise_image(84, 56 + 28 * i, i).save(d / f"{i}.png")
            ctx = [
                {
                    "role": "user",
                    "content": [
                        {"type": "image", "image": f"{i}.png"},
                        {"type": "text", "text": "Which colour?"},
                    ],
                }
            ]
        else:
            ctx = [{"role": "user", "content": f"Question {i}?"}]
        rows.append({"messages": ctx, "chosen": f"red {i}", "rejected": f"blue {i}{i}"})
    (d / "pairs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return d / "pairs.jsonl"


@torch.no_grad()
def _reference(folder, data) -> tuple[float, float]:
    """transformers' summed response log-probs of pairs 0 and 1, chosen and rejected means."""
    pairs = load_preference_data(
        str(data),
        Tokenizer.from_dir(folder),
        max_length=256,
        vision=VisionData.for_model(load_args(folder), str(data)),
    ).train[:2]
    ref = hf_vlm_reference(folder)
    sums = []
    for side in ("chosen", "rejected"):
        total = 0.0
        for p in pairs:
            ex = getattr(p, side)
            ids = torch.tensor([ex.input_ids])
            kw = {}
            if ex.images is not None:
                pixels, grid = ex.images.pixels()
                kw = dict(
                    pixel_values=pixels,
                    image_grid_thw=grid,
                    mm_token_type_ids=(ids == ref.config.image_token_id).int(),
                )
            logp = torch.log_softmax(ref(input_ids=ids, **kw).logits[0, :-1].float(), -1)
            tok = logp.gather(1, ids[0, 1:, None])[:, 0]
            total += tok[torch.tensor(ex.loss_mask[1:]).bool()].sum().item()
        sums.append(total / len(pairs))
    return sums[0], sums[1]


@pytest.mark.slow
def test_vlm_dpo_two_ranks_images_on_one(tmp_path):
    folder = write_hf_vlm(tmp_path / "vlm", seed=12)
    data = _rows(tmp_path)
    dump = tmp_path / "run"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node=2",
        os.path.join(ROOT, "train.py"),
        "--training.recipe=dpo",
        f"--model.path={folder}",
        "--model.train_vision=true",
        f"--data.path={data}",
        "--data.max_length=256",
        "--data.shuffle=false",
        "--training.steps=2",
        "--training.batch_size=2",
        "--training.micro_batch_size=1",
        "--training.eval_interval=0",
        "--preference.reference=precompute",
        "--optimizer.lr=1e-2",
        "--lr_schedule.warmup_steps=0",
        "--checkpoint.enable=false",
        "--metrics.loggers=[]",
        f"--job.dump_folder={dump}",
    ]
    r = subprocess.run(
        cmd,
        cwd=ROOT,
        env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT},
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    metrics = [json.loads(line) for line in open(dump / "metrics.jsonl") if "chosen_logp" in line]
    assert len(metrics) == 2
    chosen, rejected = _reference(folder, data)
    assert (
        abs(metrics[0]["chosen_logp"] - chosen) < 1e-3
        and abs(metrics[0]["rejected_logp"] - rejected) < 1e-3
    )
    # policy = reference at the first step
    assert abs(metrics[0]["loss"] - 0.6931471805599453) < 1e-6
    assert metrics[1]["loss"] != metrics[0]["loss"]
