"""scripts/slurm/train_hetero.sbatch under stand-ins for srun, scontrol and torchrun: the CPU
component runs tandem-envd, the GPU component's torchrun agents get its addresses; no token is
one line and exit 2. (A real heterogeneous Slurm job was not run.)"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "slurm" / "train_hetero.sbatch"


def _stub(bin_dir: Path, name: str, body: str) -> None:
    path = bin_dir / name
    path.write_text("#!/bin/bash\n" + body)
    path.chmod(0o755)


def _run(tmp_path: Path, token: str | None) -> tuple[subprocess.CompletedProcess, Path]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    log = tmp_path / "calls.log"
    _stub(
        bin_dir,
        "scontrol",
        f'echo "scontrol $*" >> {log}\n'
        'case "$3" in gpu-x) printf "gpu-a\\ngpu-b\\n";; cpu-x) printf "cpu-a\\ncpu-b\\n";; esac\n',
    )
    _stub(  # the CPU component stands for a long-lived envd; the GPU one runs its command
        bin_dir,
        "srun",
        f'echo "srun $*" >> {log}\n'
        'if [[ "$1" == --het-group=1 ]]; then exec sleep 300; fi\n'
        'while [[ "$1" == --* ]]; do shift; done\nexec "$@"\n',
    )
    _stub(bin_dir, "torchrun", f'echo "torchrun $*" >> {log}\nexit 0\n')
    env = {
        **os.environ,
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "SLURM_JOB_ID": "77",
        "SLURM_JOB_NODELIST_HET_GROUP_0": "gpu-x",
        "SLURM_JOB_NODELIST_HET_GROUP_1": "cpu-x",
        "SLURM_NNODES_HET_GROUP_0": "2",
        "SLURM_CPUS_PER_TASK_HET_GROUP_1": "64",
        "SLURM_CPUS_PER_TASK": "4",
        "TANDEM_DUMP_FOLDER": str(tmp_path / "dump"),
    }
    env.pop("TANDEM_ENVD_TOKEN", None)
    if token is not None:
        env["TANDEM_ENVD_TOKEN"] = token
    r = subprocess.run(
        ["bash", str(SCRIPT), "configs/quickstart_agentic.toml", "--training.steps=3"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    return r, log


def test_hetero_job_starts_envd_on_the_cpu_nodes_and_points_the_trainers_at_it(tmp_path):
    r, log = _run(tmp_path, "tok")
    assert r.returncode == 0, r.stdout + r.stderr
    calls = log.read_text().splitlines()
    (envd,) = [c for c in calls if c.startswith("srun --het-group=1")]
    assert envd.endswith("python -m tandem.rl.workers.envd --host 0.0.0.0 --port 7000 --workers 64")
    (train,) = [c for c in calls if c.startswith("torchrun")]
    args = train.split()
    for want in (
        "--nnodes=2",
        "--rdzv-endpoint=gpu-a:29500",
        "--env.workers=cpu-a:7000,cpu-b:7000",
        "--reward.workers=cpu-a:7000,cpu-b:7000",
        "--training.steps=3",
    ):
        assert want in args, (want, train)
    assert "tandem-envd on cpu-a:7000,cpu-b:7000" in r.stdout


def test_hetero_job_without_a_token_is_one_line_and_exit_2(tmp_path):
    r, log = _run(tmp_path, None)
    assert r.returncode == 2 and not log.exists()
    assert r.stderr.startswith("error: TANDEM_ENVD_TOKEN is not set")
    assert len(r.stderr.strip().splitlines()) == 1
