"""The RL loop on FSDP2, TP and PP layouts of the same 2 CPU ranks (gloo).

With 2 ranks the three layouts see the same prompts with the same sampling
seeds (a data-parallel rank's prompts are split over its model-parallel ranks
in the order the pure data-parallel layout would deal them), so a whole run —
rollouts, old / reference log-probs, two epochs of updates, the KL-in-reward
advantage — must agree across layouts up to fp32 reduction order. A DCP
checkpoint written on one layout resumes on another with the very same weights.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from tandem.models.args import ModelArgs
from tandem.parallel.mesh import Degrees
from tandem.rl.config.schema import ConfigError
from tandem.rl.update.policy import check_layout
from tests.fixtures import hf_weights as _weights

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
POLICY = os.path.join(ROOT, "assets", "quickstart-policy")
LAYOUTS = {"fsdp2": [], "tp2": ["--parallel.tp=2"], "pp2": ["--parallel.pp=2"]}


def _run(dump: str, steps: int, extra: list[str]) -> list[dict]:
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node=2",
        os.path.join(ROOT, "train.py"),
        "--config",
        os.path.join(ROOT, "configs", "quickstart.toml"),
        f"--model.path={POLICY}",
        f"--job.dump_folder={dump}",
        f"--training.steps={steps}",
        "--rl.prompts_per_step=16",
        "--rl.eval_prompts=16",
        "--rl.eval_samples=0",
        "--training.eval_interval=0",
        "--rl.epochs=2",
        "--rl.kl_coef=0.01",
        "--rl.kl_mode=reward",
        "--metrics.loggers=[]",
        "--checkpoint.interval=100",
        *extra,
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT}
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    path = os.path.join(dump, "metrics.jsonl")  # none when a resumed run had no step left
    return [json.loads(line) for line in open(path)] if os.path.exists(path) else []


def _worst_rel(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max() / a[k].abs().max()) for k in a)


@pytest.mark.slow
def test_layouts_agree_and_checkpoints_move_between_them(tmp_path):
    runs = {name: _run(str(tmp_path / name), 2, extra) for name, extra in LAYOUTS.items()}
    ref = runs["fsdp2"]
    for name, rows in runs.items():
        for a, b in zip(rows, ref, strict=True):
            # the same samples (rewards equal exactly), the same update up to reduction order
            assert a["reward/total"] == b["reward/total"], name
            assert abs(a["grad_norm"] - b["grad_norm"]) <= 1e-4 * b["grad_norm"], (
                name,
                a["grad_norm"],
                b["grad_norm"],
            )
            assert abs(a["kl"] - b["kl"]) <= 1e-3 * b["kl"] + 1e-9, (name, a["kl"], b["kl"])
            # generation copy == update layout (fp32): float noise on average; the max is one
            # rare token's rounding, which moves with the CPU's kernels
            assert a["gap/abs_mean"] < 2e-6 and a["gap/abs_max"] < 5e-4, name
            assert a["response/length_mean"] == b["response/length_mean"], name
        # the last step's held-out eval is greedy (eval_samples=0) from the generation copy gathered
        # out of each layout's updated shards: the same answers on every layout
        assert rows[-1]["eval/accuracy"] == ref[-1]["eval/accuracy"], name
        assert rows[-1]["reshard/gb"] > 0, name  # the gather into the generation copy is measured
        assert (
            _worst_rel(_weights(str(tmp_path / name)), _weights(str(tmp_path / "fsdp2"))) < 1e-4
        ), name

    # fsdp2's step-2 checkpoint loaded on tp2 / pp2 (nothing left to train): the same weights, bit
    # for bit
    for name in ("tp2", "pp2"):
        dump = tmp_path / f"from-fsdp2-{name}"
        shutil.copytree(tmp_path / "fsdp2" / "checkpoints", dump / "checkpoints")
        _run(str(dump), 2, LAYOUTS[name])
        assert _worst_rel(_weights(str(dump)), _weights(str(tmp_path / "fsdp2"))) == 0.0, name

    # pp2's checkpoint (per-stage parameters and optimizer state) continues on fsdp2 as on pp2
    cont = {}
    for name in ("fsdp2", "pp2"):
        dump = tmp_path / f"from-pp2-{name}"
        shutil.copytree(tmp_path / "pp2" / "checkpoints", dump / "checkpoints")
        cont[name] = _run(str(dump), 3, LAYOUTS[name])
        assert [r["step"] for r in cont[name]] == [3]
    assert (
        _worst_rel(
            _weights(str(tmp_path / "from-pp2-fsdp2")), _weights(str(tmp_path / "from-pp2-pp2"))
        )
        < 1e-4
    )


def _args(**kw) -> ModelArgs:
    base = dict(
        model_type="qwen3",
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
    )
    return ModelArgs(**{**base, **kw})


@pytest.mark.parametrize(
    "degrees, schedule, needle",
    [
        (
            Degrees(tp=4, dp_shard=1),
            "1F1B",
            "parallel.tp: tensor parallel degree tp=4 must divide num_kv_heads=2",
        ),
        (
            Degrees(pp=4),
            "1F1B",
            "parallel.pp: pipeline parallel pp=4 needs at least 4 layers, model has num_layers=2",
        ),
        (
            Degrees(pp=2),
            "Interleaved1F1B",
            "parallel.pp: pipeline parallel pp=2 x 2 virtual stages needs at least 4 layers",
        ),
    ],
)
def test_bad_layout_is_one_config_error_line(degrees, schedule, needle):
    with pytest.raises(ConfigError) as e:
        check_layout(_args(), degrees, schedule)
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_layout_that_fits_passes():
    check_layout(_args(num_layers=4), Degrees(tp=2, pp=2), "Interleaved1F1B")
