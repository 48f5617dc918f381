"""The RL recipe with a Qwen2.5-VL policy under torchrun: two ranks, one with image prompts
only and one with text prompts only, ``rl.exact``, the tower trainable or frozen.

The run completes its steps (the text rank's blank tower pass keeps the gradient collectives
in step; a length reward gives the samples different advantages), the rollout's log-probs equal the
update's recomputation bit for bit (``gap/abs_max`` 0 on every step), the tower ran once per image
prompt group in each rollout and evaluation, a frozen tower moved into the generation copy once and
was kept, and the exported folder loads in transformers (its tower changed only when trainable).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from tests.fixtures import hf_vlm_reference, write_hf_vlm
from tests.models.test_vlm import noise_image

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _rows(d, n):
    rows = []
    for i in range(n):
        if i % 2 == 0:  # stream position i goes to rank i % 2 (no shuffle, 2 prompts per step)
            noise_image(56 + 14 * (i % 3), 84, i).save(d / f"{i}.png")
            user = [{"type": "image", "image": f"{i}.png"}, {"type": "text", "text": "Colour?"}]
        else:
            user = f"Say {i}."
        rows.append({"messages": [{"role": "user", "content": user}], "answer": str(i % 4)})
    return rows


@pytest.mark.slow
@pytest.mark.parametrize("train_vision", [True, False])
def test_vlm_rl_two_ranks_images_on_one_exact(tmp_path, train_vision):
    folder = write_hf_vlm(tmp_path / "vlm", seed=8)
    train, evals = tmp_path / "train.jsonl", tmp_path / "eval.jsonl"
    train.write_text("".join(json.dumps(r) + "\n" for r in _rows(tmp_path, 8)))
    evals.write_text("".join(json.dumps(r) + "\n" for r in _rows(tmp_path, 4)))
    dump = tmp_path / "run"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node=2",
        os.path.join(ROOT, "train.py"),
        "--training.recipe=rl",
        f"--model.path={folder}",
        f"--model.train_vision={str(train_vision).lower()}",
        f"--data.path={train}",
        f"--data.eval_path={evals}",
        "--data.shuffle=false",
        "--data.max_length=192",
        "--training.steps=3",
        "--training.eval_interval=0",
        "--rl.prompts_per_step=2",
        "--rl.num_samples=3",
        "--rl.eval_prompts=4",
        "--rl.eval_samples=1",
        "--rl.exact=true",
        "--rollout.max_tokens=5",
        "--rollout.kv_cache_gb=0.01",
        "--reward.functions=test_len",
        "--reward.modules=tests.reward_helpers",
        "--reward.num_workers=1",
        "--optimizer.lr=1e-2",
        "--lr_schedule.warmup_steps=0",
        "--checkpoint.enable=false",
        "--metrics.loggers=[]",
        f"--job.dump_folder={dump}",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT}
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
    metrics = [json.loads(line) for line in open(dump / "metrics.jsonl")]
    steps = [m for m in metrics if "gap/abs_max" in m]
    assert len(steps) == 3
    for m in steps:
        assert m["gap/abs_max"] == 0.0 and m["gap/tokens_differ"] == 0.0
        # rank 0's one image prompt (3 samples); logged by rank 0
        assert m["rollout/vision_tower_runs"] == 1.0
        # a frozen tower moved once (the start's evaluation) and was kept: every step moves the LM
        # only
        assert (m["reshard/kept_gb"] > 0 and m["reshard/sent_gb"] < m["reshard/gb"]) != train_vision
    assert "eval/accuracy" in metrics[-1]
    out = dump / "hf"
    src, got = load_file(folder / "model.safetensors"), load_file(out / "model.safetensors")
    tower = [k for k in src if k.startswith("visual.")]
    assert all(torch.equal(src[k], got[k]) for k in tower) != train_vision
    assert not torch.equal(
        src["model.layers.0.mlp.up_proj.weight"], got["model.layers.0.mlp.up_proj.weight"]
    )
    hf_vlm_reference(out)  # transformers loads the export
