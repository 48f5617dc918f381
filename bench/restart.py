"""Restart-to-first-step time of the RL trainer: a relaunch that resumes from a checkpoint.

    python -m bench.restart                      # quickstart policy and a ~100M model, 2 ranks, CPU
    python -m bench.restart --models quickstart --nproc 2

For each model: a first launch trains one step and checkpoints it (the
"fresh" run: launch to the end of its first step, nothing to load); a second
launch of the same command with ``--training.steps=2`` resumes from that
checkpoint and trains step 2 (the "restart" run). Times are wall clock from
``torchrun`` being started to the trainer's log line, so they include Python
and torch imports, process-group setup, model build, checkpoint load and one
step (rollout + update). The ~100M model is a randomly initialised Qwen3-shaped
HF folder written here with the quickstart's character tokenizer; both runs
use a small rollout (4 prompts x 2 samples, 6 tokens) and a one-prompt greedy
evaluation so the step itself is short.
Prints a table; the ratio column is restart over fresh.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

from bench.checkpoint import sizes

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
POLICY = os.path.join(ROOT, "assets", "quickstart-policy")


def model_folder(name: str, root: str) -> str:
    if name == "quickstart":
        return POLICY
    from tandem.models.hf import save_hf
    from tandem.models.tokenizer import Tokenizer
    from tandem.models.transformer import Transformer

    tok = Tokenizer.from_dir(POLICY)
    args = sizes(name)
    args.vocab_size = tok.vocab_size
    model = Transformer(args)
    model.init_weights(seed=0)
    folder = os.path.join(root, f"model-{name}")
    save_hf(model.state_dict(), args, folder, tokenizer=tok)
    return folder


def launch(path: str, dump: str, steps: int, nproc: int) -> dict[str, float]:
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc}",
        os.path.join(ROOT, "train.py"),
        "--config",
        os.path.join(ROOT, "configs", "quickstart.toml"),
        f"--model.path={path}",
        f"--job.dump_folder={dump}",
        f"--training.steps={steps}",
        "--checkpoint.interval=1",
        "--rl.prompts_per_step=4",
        "--rl.num_samples=2",
        "--rl.eval_prompts=1",
        "--rl.eval_samples=0",
        "--training.eval_interval=0",
        "--metrics.loggers=[]",
        "--reward.num_workers=0",
        "--checkpoint.export_hf_at_end=false",
    ]
    env = {
        **os.environ,
        "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 2) // nproc)),
        "PYTHONPATH": ROOT,
    }
    t0 = time.monotonic()
    p = subprocess.Popen(
        cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    out: dict[str, float] = {}
    lines = []
    assert p.stdout is not None
    for line in p.stdout:
        lines.append(line)
        if line.startswith("resumed from"):
            out["resumed_s"] = time.monotonic() - t0
            m = re.search(r"loaded in ([0-9.]+)s", line)
            out["load_s"] = float(m.group(1)) if m else float("nan")
        if line.startswith(f"step {steps}/{steps}"):
            out["first_step_s"] = time.monotonic() - t0
    if p.wait() != 0 or "first_step_s" not in out:
        raise SystemExit("".join(lines[-40:]))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="quickstart,100m")
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument(
        "--smoke",
        action="store_true",
        help="the quickstart policy on one rank (the test suite's run)",
    )
    a = ap.parse_args()
    if a.smoke:
        a.models, a.nproc = "quickstart", 1
    from bench.header import print_header

    print_header("bench.restart")
    root = tempfile.mkdtemp(prefix="tandem-restart-bench-")
    try:
        print(f"{a.nproc} rank(s), CPU; wall seconds from launch")
        print(
            f"{'model':<12}{'fresh: first step':>19}{'restart: resumed':>18}{'load':>7}"
            f"{'restart: first step':>21}{'ratio':>7}"
        )
        for name in a.models.split(","):
            path = model_folder(name, root)
            dump = os.path.join(root, f"run-{name}")
            fresh = launch(path, dump, 1, a.nproc)
            again = launch(path, dump, 2, a.nproc)
            print(
                f"{name:<12}{fresh['first_step_s']:>19.1f}{again['resumed_s']:>18.1f}"
                f"{again['load_s']:>7.2f}{again['first_step_s']:>21.1f}"
                f"{again['first_step_s'] / fresh['first_step_s']:>7.2f}",
                flush=True,
            )
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
