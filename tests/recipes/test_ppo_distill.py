"""PPO with a critic and on-policy distillation (single and multi-teacher) in the RL loop.

Runs under torchrun on 2 ranks with the shipped quickstart policy:
- PPO (GAE + a value model from the policy's weights) raises the quickstart's
  exact-match reward (the policy drops its stray "!"), the critic's error falls during its
  warm-up (when the policy is frozen), and a run resumed from a checkpoint
  ends with the same policy and critic weights, bit for bit.
- OPD: with the teacher equal to the student the signal is 0 (up to float
  noise); a perturbed student moves towards its teacher (the reverse KL falls).
- MOPD: prompts routed by a data field; the teacher equal to the student has
  ~0 reverse KL on its prompts while the other teacher's is large, per teacher;
  a route value that names no teacher stops the run at start (exit 2).
"""

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

from tandem.models.hf import load_model, save_hf
from tandem.models.tokenizer import Tokenizer

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
POLICY = os.path.join(ROOT, "assets", "quickstart-policy")


def _run(dump, steps, *extra, policy=POLICY, check=True, torchrun=True):
    launch = (
        ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"] if torchrun else []
    )
    cmd = [
        sys.executable,
        *launch,
        os.path.join(ROOT, "train.py"),
        "--config",
        os.path.join(ROOT, "configs", "quickstart.toml"),
        f"--model.path={policy}",
        f"--job.dump_folder={dump}",
        f"--training.steps={steps}",
        "--rl.prompts_per_step=16",
        "--rl.eval_prompts=8",
        "--lr_schedule.warmup_steps=2",
        "--metrics.loggers=[]",
        "--reward.num_workers=0",
        *extra,
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT}
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    if check:
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
        return [json.loads(line) for line in open(os.path.join(dump, "metrics.jsonl"))], r.stdout
    return r


def _flat(path):
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(path, path + ".pt")
    return torch.load(path + ".pt", weights_only=False)


def _perturbed(folder, scale, seed=0):
    """The quickstart policy plus Gaussian noise on every weight matrix, as an HF folder."""
    model = load_model(POLICY)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim == 2:
                p.add_(scale * p.std() * torch.randn(p.shape, generator=g))
    save_hf(model.state_dict(), model.args, folder, tokenizer=Tokenizer.from_dir(POLICY))
    return str(folder)


PPO = (
    "--rl.advantage=gae",
    "--critic.lr=1e-3",
    "--critic.warmup_steps=2",
    "--optimizer.lr=5e-4",
    "--reward.functions=exact_match",
    "--checkpoint.interval=4",
)


@pytest.mark.slow
def test_ppo_with_critic_learns_and_resumes_exactly(tmp_path):
    full = str(tmp_path / "full")
    rows, _ = _run(full, 8, *PPO)
    mse = [r["critic/value_mse"] for r in rows]
    assert [r["critic/training_policy"] for r in rows] == [0.0, 0.0] + [1.0] * 6
    # the policy is frozen in warm-up
    assert rows[0]["grad_norm"] == 0.0 and rows[2]["grad_norm"] > 0
    assert mse[2] < 0.5 * mse[0], mse  # the critic fits the returns while the policy waits
    reward = [r["reward/exact_match/mean"] for r in rows]
    # a sign-flipped loss falls instead
    assert sum(reward[-2:]) / 2 > sum(reward[:2]) / 2 + 0.1, reward

    resumed = str(tmp_path / "resumed")
    shutil.copytree(full, resumed)
    shutil.rmtree(os.path.join(resumed, "checkpoints", "step-8"))
    rows2, out = _run(resumed, 8, *PPO)
    assert "at step 4" in out
    assert [r["critic/value_mse"] for r in rows2[4:]] == mse[4:]
    a, b = (
        _flat(os.path.join(full, "checkpoints", "step-8")),
        _flat(os.path.join(resumed, "checkpoints", "step-8")),
    )
    critic_keys = [k for k in a if k.startswith("critic")]
    assert critic_keys and a.keys() == b.keys()
    for k in a:
        if isinstance(a[k], torch.Tensor):
            assert torch.equal(a[k], b[k]), k


OPD = (
    "--rl.advantage=grpo",
    "--reward.functions=exact_match",
    "--optimizer.lr=3e-4",
    "--checkpoint.enable=false",
    "--rollout.max_tokens=6",
)


@pytest.mark.slow
def test_opd_signal_is_zero_for_self_and_pulls_a_student_to_its_teacher(tmp_path):
    rows, _ = _run(str(tmp_path / "self"), 2, *OPD, f"--distill.teachers={POLICY}")
    assert all(abs(r["distill/reverse_kl"]) < 1e-5 for r in rows), [
        r["distill/reverse_kl"] for r in rows
    ]
    student = _perturbed(tmp_path / "student", 0.15)
    rows, _ = _run(str(tmp_path / "opd"), 8, *OPD, f"--distill.teachers={POLICY}", policy=student)
    kl = [r["distill/reverse_kl"] for r in rows]
    assert kl[0] > 0.05 and sum(kl[-2:]) / 2 < 0.6 * sum(kl[:2]) / 2, kl


@pytest.mark.slow
def test_mopd_routes_each_prompt_to_its_teacher(tmp_path):
    data = tmp_path / "mixed.jsonl"
    with open(data, "w") as f:
        for i in range(64):
            a, b = i % 10, (i * 7) % 10
            f.write(
                json.dumps(
                    {
                        "id": f"p{i}",
                        "prompt": f"{a}+{b}=",
                        "answer": str(a + b),
                        "domain": "same" if i % 2 else "other",
                    }
                )
                + "\n"
            )
    other = _perturbed(tmp_path / "other", 0.6)
    args = (
        *OPD,
        f"--data.path={data}",
        "--data.eval_path=",
        f"--distill.teachers={POLICY},{other}",
        "--distill.names=same,other",
        "--distill.route_field=domain",
        "--rl.prompts_per_step=8",
    )
    rows, _ = _run(str(tmp_path / "mopd"), 1, *args)
    r = rows[0]
    assert abs(r["distill/same/reverse_kl"]) < 1e-5 and r["distill/other/reverse_kl"] > 0.05, r

    bad = tmp_path / "bad.jsonl"
    bad.write_text(data.read_text().replace('"domain": "other"', '"domain": "typo"', 1))
    # one process, so the exit status is train.py's own (torchrun reports any failure as 1)
    proc = _run(
        str(tmp_path / "bad"),
        1,
        *args[:-5],
        f"--data.path={bad}",
        *args[-4:],
        check=False,
        torchrun=False,
    )
    assert proc.returncode == 2 and "domain='typo'" in proc.stderr + proc.stdout, proc.stderr[
        -2000:
    ]
