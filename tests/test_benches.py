"""Benches that cannot rot, and a peer comparison that stays like for like.

- Every ``bench/`` entry point (a file with a ``__main__`` block) runs at its smallest size
  (``--smoke``) and prints its header (command, date, commit, machine) and a table with the
  ratio against its reference; a bench broken by a change fails here. They run as
  subprocesses, three at a time, from one module-scoped fixture.
- bench/grpo_step.py's TRL worker has Tandem's settings on gradient checkpointing, dtype
  and optimizer (TRL 1.16 turns gradient checkpointing on by default, which made TRL
  recompute its forward while Tandem did not).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCHES = sorted(
    p.stem for p in (ROOT / "bench").glob("*.py") if '__name__ == "__main__"' in p.read_text()
)
# what each bench's table must show (a row with its ratio); a bench not listed: any table row
TABLES = {
    "async_modes": r"^split S=1" + r"\s+[\d.]+" * 6 + r"\s+\d+\s+[\d.]+$",
    "checkpoint": r"quickstart\s+106,880 .*\d\.\d\d\s+[\d.]+\s+[\d.]+\s*$",
    "context_parallel": r"^\s+1024\s+2\s+ring\s+[\d.]+\s+[\d.]+\s+[\d.]+\s+[\d.]+x\s+[\d.]+x",
    "decode_profile": r"step / floor = [\d.]+x",
    "exact_kernels": r"mm qkv 16,256,128\s+[\d.]+\s+[\d.]+\s+[\d.]+\s+\d+\s+0\s*$",
    "families": r"^debug-deepseek-v3\s+[\d.]+\s+[\d,]+\s+[\d,]+\s+[\d.]+x\s+[\d.]+x$",
    "fp8_kv": r"^\s+32\s+tight\s+fp8\s+[\d.]+\s+[\d.]+\s+\d+\s+\d+\s+[\d.]+x$",
    "generate": r"fixed\s+4\s+32\s+32 .*x\s+-\n(.|\n)*greedy\s+2\s+16 .*x\s+\d/2",
    "grpo_step": r"trl / tandem seconds per step: median [\d.]+x",
    "lora": r"quickstart: step time [\d.]+x, kept bytes [\d.]+x",
    "logprobs_memory": r"naive / chunked: peak [\d.]+x, time [\d.]+x",
    "moe": r"gemm\s+loop \(split\)\s+[\d.]+\s+[\d.]+\s+[\d.]+x(.|\n)*"
    r"layer\s+hf default: grouped_mm",
    "paged_attention": r"decode\s+4\s+64\s+1\s+[\d.]+",
    "parallel_layouts": r"tp2\s+2\s+qwen3\s+[\d.]+\s+\d+\s+-\s+[\d.]+x vs fsdp2",
    "report_size": r"^\s+2000\s+[\d.]+\s+[\d.]+\s+\d+\s+[\d.]+\s+[\d.]+$",
    "reshard": r"1\s+single\s+1\s+[\d.]+\s+[\d.]+\s+[\d.]+\s+[\d.]+\s+[\d.]+\s+[\d.]+\s+[\d.]+$",
    "restart": r"quickstart\s+[\d.]+\s+[\d.]+\s+[\d.]+\s+[\d.]+\s+[\d.]+$",
    "sampler_noise": r"^\s+4\s+[\d.]+\s+(-|[\d.]+)",
    "vlm": r"^quickstart \(\d+, max 3136 px\)\s+[\d.]+\s+[\d.]+\s+[\d.]+$",
    "weight_quant": r"^\s+w4a16\s+[\d.]+\s+[\d.]+\s+[\d.]+x\s+[\d.]+\s+[\d.]+x$",
    "serve": r"the same 4 episodes: HTTP / in-process seconds [\d.]+x; in-process / HTTP sampled "
    r"tokens per second [\d.]+x",
}
TIMEOUT_S = 900  # one bench on a loaded 2-core machine; each takes seconds on a quiet one


def _run(name: str) -> tuple[int, str, float]:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, (str(ROOT), os.environ.get("PYTHONPATH")))),
    }
    t0 = time.monotonic()
    r = subprocess.run(
        [sys.executable, "-m", f"bench.{name}", "--smoke"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )
    return r.returncode, r.stdout + r.stderr, time.monotonic() - t0


@pytest.fixture(scope="module")
def smoke_runs() -> dict[str, tuple[int, str, float]]:
    with ThreadPoolExecutor(3) as pool:  # subprocesses: torch imports and torchrun waits overlap
        runs = dict(zip(BENCHES, pool.map(_run, BENCHES)))
    print("bench smoke runs, seconds:", {k: round(v[2], 1) for k, v in runs.items()})
    return runs


def test_every_bench_is_checked():
    assert len(BENCHES) >= 18, BENCHES  # the glob found the entry points (bench/ was not moved)
    assert not set(TABLES) - set(BENCHES), (
        f"TABLES names benches that are gone: {set(TABLES) - set(BENCHES)}"
    )


@pytest.mark.parametrize("name", BENCHES)
def test_bench_runs_and_prints_its_table(name: str, smoke_runs: dict[str, tuple[int, str, float]]):
    rc, out, _ = smoke_runs[name]
    assert rc == 0, f"python -m bench.{name} --smoke exited {rc}:\n{out[-3000:]}"
    command = re.search(r"^# command: (.*)$", out, re.MULTILINE)
    assert command and command.group(1).endswith(f"python -m bench.{name} --smoke"), out[-3000:]
    for line in ("# date: ", "; commit: ", "# machine: ", "# torch "):
        assert line in out, f"bench.{name}: no header line {line!r}:\n{out[-3000:]}"
    pattern = TABLES.get(name, r"^\S.*\d\.\d")
    assert re.search(pattern, out, re.MULTILINE), (
        f"bench.{name}: no table row like {pattern!r}:\n{out[-3000:]}"
    )
    assert "settings differ" not in out, out[-3000:]  # grpo_step: TRL's row must be like for like


def test_grpo_bench_trl_settings_match_tandem(tmp_path: Path):
    """The TRL worker's GRPOConfig, as TRL resolves it, has Tandem's settings on gradient
    checkpointing (off in both, then on in both), dtype, autocast and optimizer; TRL's own
    default (the ``trl-default`` row) differs in checkpointing, which is what the test catches."""
    import torch
    from trl import GRPOConfig

    from bench import grpo_step
    from tandem.rl.core.optim import build_optimizer

    opt = build_optimizer(
        torch.nn.Linear(2, 2), lr=1e-3, betas=[0.9, 0.95], eps=1e-8, weight_decay=0.0
    )
    assert type(opt) is torch.optim.AdamW and opt.defaults["fused"]  # what tandem_settings says
    model_dir = data = None
    for ac in ("none", "full"):
        args = grpo_step.parse_args(["--smoke", "--device", "cpu", "--activation-checkpoint", ac])
        args.device = "cpu"
        if model_dir is None:
            model_dir, data = grpo_step.write_workload(str(tmp_path), args)
        ours = grpo_step.tandem_settings(
            grpo_step._tandem_config(model_dir, data, str(tmp_path), args), "cpu"
        )
        theirs = grpo_step.trl_resolved(GRPOConfig(**grpo_step.trl_settings(args, str(tmp_path))))
        assert theirs == ours
        assert ours["checkpointing"] is (ac == "full") and ours["dtype"] == "float32"
        assert ours["optimizer"] == "adamw_torch_fused" and not ours["autocast_bf16"]
    default = GRPOConfig(**grpo_step.trl_settings(args, str(tmp_path), default_checkpointing=True))
    assert grpo_step.trl_resolved(default)["checkpointing"] is True  # TRL 1.16's default
