"""SFT of a Qwen2.5-VL folder on rows with images, two ranks under torchrun.

Rank 0's micro-batches hold image rows, rank 1's text rows only: the run completes with the
tower trainable (the text rank's blank tower pass keeps the gradient collectives in step) and
with it frozen (the default: the tower's weights come out unchanged). The first step's loss
equals transformers' cross-entropy of the same rows.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from tandem.models.hf import load_args
from tandem.models.tokenizer import Tokenizer
from tandem.rl.data.images import VisionData
from tandem.rl.data.loading import load_rows
from tandem.rl.data.sft import IGNORE, build_sft_data
from tests.fixtures import hf_vlm_reference, write_hf_vlm
from tests.models.test_vlm import noise_image

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _rows(d):
    rows = []
    for i in range(4):
        if i % 2 == 0:  # rank 0's rows (batch 2, no shuffle: rank r takes row 2 * step + r)
            noise_image(70 + 30 * i, 90, i).save(d / f"{i}.png")
            user = [
                {"type": "image", "image": f"{i}.png"},
                {"type": "text", "text": f"Picture {i}?"},
            ]
        else:
            user = f"Question {i}?"
        rows.append(
            {
                "messages": [
                    {"role": "user", "content": user},
                    {"role": "assistant", "content": f"answer {i}"},
                ]
            }
        )
    (d / "sft.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return d / "sft.jsonl"


def _train(folder, data, dump, *extra):
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node=2",
        os.path.join(ROOT, "train.py"),
        f"--model.path={folder}",
        f"--data.path={data}",
        "--data.max_length=256",
        "--data.pack=false",
        "--data.shuffle=false",
        "--training.steps=2",
        "--training.batch_size=2",
        "--training.micro_batch_size=1",
        "--optimizer.lr=1e-2",
        "--lr_schedule.warmup_steps=0",
        "--checkpoint.enable=false",
        "--metrics.loggers=[]",
        f"--job.dump_folder={dump}",
        *extra,
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
    return [json.loads(line) for line in open(dump / "metrics.jsonl")]


@torch.no_grad()
def _reference_loss(folder, data, rows_idx) -> float:
    """transformers' token-mean cross-entropy over the trained tokens of the given rows."""
    tok = Tokenizer.from_dir(folder)
    sft = build_sft_data(
        load_rows(str(data)),
        tok,
        source=str(data),
        max_length=256,
        pack=False,
        vision=VisionData.for_model(load_args(folder), str(data)),
    )
    ref = hf_vlm_reference(folder)
    total, count = 0.0, 0
    for i in rows_idx:
        row = sft.rows[i]
        kw = {}
        if row.images[0] is not None:
            pixels, grid = row.images[0].pixels()
            kw = dict(
                pixel_values=pixels,
                image_grid_thw=grid,
                mm_token_type_ids=(torch.tensor([row.tokens]) == ref.config.image_token_id).int(),
            )
        logits = ref(input_ids=torch.tensor([row.tokens]), **kw).logits[0]
        targets = torch.tensor(row.targets)
        keep = targets != IGNORE
        total += torch.nn.functional.cross_entropy(
            logits[keep], targets[keep], reduction="sum"
        ).item()
        count += int(keep.sum())
    return total / count


@pytest.mark.slow
def test_vlm_sft_two_ranks_images_on_one_only(tmp_path):
    folder = write_hf_vlm(tmp_path / "vlm", seed=4)
    data = _rows(tmp_path)
    src = load_file(folder / "model.safetensors")
    for train_vision in (True, False):
        dump = tmp_path / f"run-{train_vision}"
        metrics = _train(folder, data, dump, f"--model.train_vision={str(train_vision).lower()}")
        assert len(metrics) == 2
        assert abs(metrics[0]["loss"] - _reference_loss(folder, data, [0, 1])) < 1e-4
        out = load_file(dump / "hf" / "model.safetensors")
        tower = [k for k in src if k.startswith("visual.")]
        changed = [k for k in tower if not torch.equal(src[k], out[k])]
        assert (len(changed) > len(tower) // 2) if train_vision else not changed, changed
        assert not torch.equal(
            src["model.layers.0.mlp.up_proj.weight"], out["model.layers.0.mlp.up_proj.weight"]
        )
        assert (dump / "hf" / "preprocessor_config.json").is_file()
        assert load_args(dump / "hf") == load_args(folder)
