"""LoRA adapters (and an FP8 KV pool) on a vision-language policy are refused in one line
(exit 2), not run untried.

The adapters' exports, reference and generation copy have not been tried with a tower, so
``[lora]`` with a Qwen2.5-VL folder stops before training: the model builder (every recipe;
SFT here) and the RL recipe's vision checks (before loading data) say so.
"""

from __future__ import annotations

import os
import subprocess
import sys

from tandem.rl.core import errors
from tests.fixtures import write_hf_vlm

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _train(dump, *args: str) -> subprocess.CompletedProcess:
    cmd = [
        sys.executable,
        os.path.join(ROOT, "train.py"),
        *args,
        "--training.steps=1",
        "--checkpoint.enable=false",
        "--metrics.loggers=[]",
        f"--job.dump_folder={dump}",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT}
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


def test_sft_refuses_lora_on_a_vision_language_model(tmp_path):
    folder = write_hf_vlm(tmp_path / "vlm", seed=3)
    r = _train(
        tmp_path / "run",
        "--training.recipe=sft",
        f"--model.path={folder}",
        "--data.path=synthetic:shapes",
        "--lora.rank=4",
    )
    assert r.returncode == errors.EXIT_CONFIG, r.stdout[-2000:] + r.stderr[-3000:]
    assert "model: a vision-language model does not run with LoRA" in r.stderr + r.stdout


def test_rl_refuses_lora_and_fp8_kv_on_a_vision_language_policy(tmp_path):
    r = _train(
        tmp_path / "run",
        "--config",
        os.path.join(ROOT, "configs", "quickstart_vlm.toml"),
        "--lora.rank=4",
        "--rollout.kv_dtype=fp8_e4m3",
    )
    assert r.returncode == errors.EXIT_CONFIG, r.stdout[-2000:] + r.stderr[-3000:]
    # the first refused pair of the table (tandem/rl/config/composes.py) is the line
    assert "model: a vision-language model does not run with an FP8 KV cache" in r.stderr + r.stdout
