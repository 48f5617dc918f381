"""Every CPU config in configs/ starts, trains and checkpoints the README's way.

Two steps each, one process (the exit status is then train.py's own). The
learning itself is tested elsewhere (test_rl_loop, test_ppo_distill,
test_reward_model, test_preference_train; test_agentic_rl runs
configs/quickstart_agentic.toml itself, test_opd_xtok the two OPD quickstarts);
this keeps the shipped files true.
"""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _train(config, dump, *extra):
    cmd = [
        sys.executable,
        "train.py",
        "--config",
        f"configs/{config}",
        f"--job.dump_folder={dump}",
        "--metrics.loggers=[]",
        *extra,
    ]
    r = subprocess.run(
        cmd,
        cwd=ROOT,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    return [json.loads(line) for line in open(os.path.join(dump, "metrics.jsonl"))]


@pytest.mark.slow
def test_quickstart_ppo_config(tmp_path):
    rows = _train(
        "quickstart_ppo.toml", tmp_path / "ppo", "--training.steps=2", "--rl.eval_prompts=8"
    )
    assert len(rows) == 2 and all("critic/value_mse" in r for r in rows)
    assert (tmp_path / "ppo" / "checkpoints" / "step-2").is_dir()


@pytest.mark.slow
def test_quickstart_opd_config(tmp_path):
    rows = _train(
        "quickstart_opd.toml", tmp_path / "opd", "--training.steps=2", "--rl.eval_prompts=8"
    )
    # the student's stray "!"
    assert len(rows) == 2 and all(r["distill/reverse_kl"] > 0.1 for r in rows)


@pytest.mark.slow
def test_reward_model_then_rlhf_configs(tmp_path):
    _train("reward_model.toml", tmp_path / "rm", "--training.steps=4")
    folder = tmp_path / "rm" / "reward_model"
    assert (folder / "config.json").is_file()
    rows = _train(
        "quickstart_rlhf.toml",
        tmp_path / "rlhf",
        "--training.steps=2",
        "--rl.eval_prompts=8",
        f"--reward.reward_model={folder}",
    )
    assert len(rows) == 2 and all("reward/reward_model/mean" in r for r in rows), rows[0].keys()


@pytest.mark.conformance
@pytest.mark.usefixtures("device")
def test_share_prompts_gives_the_same_run(tmp_path):
    """advanced.share_prompts (on by default without pipeline stages) packs each prompt once per
    micro-batch: the same run as without it (the token saving and exact gradients are
    checked in test_rl_loop)."""
    args = (
        "--training.steps=2",
        "--rl.eval_prompts=4",
        "--rl.prompts_per_step=8",
        "--checkpoint.enable=false",
    )
    plain = _train("quickstart.toml", tmp_path / "plain", *args, "--advanced.share_prompts=false")
    shared = _train("quickstart.toml", tmp_path / "shared", *args)
    for a, b in zip(plain, shared, strict=True):
        assert b["update/tokens"] == a["update/tokens"]  # the same completion tokens trained
        for key in ("grad_norm", "entropy", "reward/total", "gap/abs_mean"):
            assert abs(a[key] - b[key]) <= 1e-5 * max(1.0, abs(a[key])), (key, a[key], b[key])


def test_bad_env_settings_fail_at_start(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text(
        open(os.path.join(ROOT, "configs", "quickstart_agentic.toml"))
        .read()
        .replace('kwargs = { tools = ["python"],', 'kwargs = { toolz = ["python"],')
    )
    r = subprocess.run(
        [sys.executable, "train.py", "--config", str(bad), f"--job.dump_folder={tmp_path / 'out'}"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 2 and "env.kwargs" in r.stderr and "toolz" in r.stderr, r.stderr
    r = subprocess.run(
        [sys.executable, "train.py", "--config", "configs/quickstart.toml", "--env.name=toool"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 2 and "did you mean 'tool'" in r.stderr, r.stderr
