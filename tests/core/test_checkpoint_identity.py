"""A checkpoint knows its model, and DCP's own exceptions end in one line.

A resume whose model differs from the checkpoint's (by parameter name or global shape,
read from DCP's .metadata) exits 8 with one line naming the first difference, before
anything is loaded, trained or pruned. DCP wraps what goes wrong inside it (SIGINT
included) in ``CheckpointException``, a BaseException: a save or load that fails is one
line (exit 8), and SIGINT during a save exits 130.
"""

import os
import signal
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn as nn

from tandem.parallel.distributed import init_distributed
from tandem.rl.core import checkpoint_sums as sums_mod
from tandem.rl.core.checkpoint import Checkpointer, CheckpointError, committed_steps
from tandem.rl.core.checkpoint_sums import SUMS
from tests.fixtures import sigint_default

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT}


def _model(*sizes, seed=0):
    torch.manual_seed(seed)
    layers = [nn.Linear(a, b) for a, b in zip(sizes, sizes[1:])]
    m = nn.Sequential(*layers)
    return m, torch.optim.AdamW(m.parameters(), lr=0.1)


@pytest.mark.parametrize(
    "sizes, message",
    [
        ((64, 32, 2), "model.0.bias is [64] there and [32] here (2 more parameters differ)"),
        ((64, 64), "the checkpoint's model.1.bias is not in this model (1 more parameters differ)"),
        (
            (64, 64, 2, 2),
            "model.2.bias of this model is not in the checkpoint (1 more parameters differ)",
        ),
    ],
)
def test_load_of_another_model_names_the_difference_and_loads_nothing(tmp_path, sizes, message):
    init_distributed(force_cpu=True)
    ck = Checkpointer(str(tmp_path))
    ck.save(2, *_model(64, 64, 2), {"step": 2})
    m, opt = _model(*sizes, seed=1)
    before = {k: v.clone() for k, v in m.state_dict().items()}
    with pytest.raises(CheckpointError) as e:
        Checkpointer(str(tmp_path)).load(2, m, opt)
    assert str(e.value).startswith(
        f"checkpoint {tmp_path / 'step-2'} was written by another model: {message}; "
    )
    assert e.value.exit_status == 8 and "\n" not in str(e.value)
    assert all(torch.equal(v, before[k]) for k, v in m.state_dict().items())
    # an extra part (a critic) is compared too
    main, critic = _model(64, 64, 2), _model(8, 1)
    ck.save(4, *main, {"step": 4}, extras={"critic": critic})
    with pytest.raises(CheckpointError, match=r"critic.model.0.bias is \[1\] there and \[2\] here"):
        Checkpointer(str(tmp_path)).load(4, *_model(64, 64, 2), extras={"critic": _model(8, 2)})
    Checkpointer(str(tmp_path)).load(4, *_model(64, 64, 2), extras={"critic": _model(8, 1)})


def test_dcp_exceptions_are_one_line_and_sigint_in_a_save_is_keyboard_interrupt(
    tmp_path, monkeypatch
):
    init_distributed(force_cpu=True)
    ck = Checkpointer(str(tmp_path))
    m, opt = _model(64, 64, 2)
    ck.save(2, m, opt, {"step": 2})
    # same parameters, another optimizer: DCP itself finds the missing optimizer keys
    sgd = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
    m(torch.randn(3, 64)).sum().backward()
    sgd.step()
    with pytest.raises(
        CheckpointError,
        match=r"^checkpoint .*step-2: cannot be loaded into this model: "
        r"RuntimeError: Missing key in checkpoint "
        r"state_dict: optim",
    ):
        Checkpointer(str(tmp_path)).load(2, m, sgd)
    real = sums_mod.HashingWriter.write_data

    def write_then(error):
        def write_data(self, plan, planner):
            fut = real(self, plan, planner)
            if error is KeyboardInterrupt:
                os.kill(os.getpid(), signal.SIGINT)  # Python raises KeyboardInterrupt here
            raise error("disk on fire")

        return write_data

    monkeypatch.setattr(sums_mod.HashingWriter, "write_data", write_then(OSError))
    with pytest.raises(
        CheckpointError,
        match=r"^checkpoint step-4: writing failed; .*step-4.partial is left "
        r"uncommitted: OSError: disk on fire$",
    ):
        ck.save(4, m, opt, {"step": 4})
    monkeypatch.setattr(sums_mod.HashingWriter, "write_data", write_then(KeyboardInterrupt))
    with pytest.raises(KeyboardInterrupt):
        ck.save(4, m, opt, {"step": 4})
    assert committed_steps(str(tmp_path)) == [2] and ck.verify(2) is None


def _train(dump, flavor, steps, *extra):
    cmd = [
        sys.executable,
        "train.py",
        f"--model.flavor={flavor}",
        "--model.tokenizer=builtin:char",
        "--data.path=synthetic:addition_small",
        "--data.synthetic_rows=64",
        "--data.max_length=64",
        f"--training.steps={steps}",
        "--training.batch_size=4",
        "--checkpoint.interval=2",
        "--metrics.loggers=[]",
        f"--job.dump_folder={dump}",
        *extra,
    ]
    return subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300)


# debug-llama3 is debug-qwen3 without the q/k norms: a subset of its parameter names
@pytest.mark.parametrize(
    "first, second, difference",
    [
        (
            "debug-qwen3",
            "debug-llama3",
            "the checkpoint's model.layers.0.attention.k_norm.weight is not in this model",
        ),
        (
            "debug-llama3",
            "debug-qwen3",
            "model.layers.0.attention.k_norm.weight of this model is not in the checkpoint",
        ),
    ],
)
def test_train_refuses_to_resume_another_models_checkpoint_and_prunes_nothing(
    tmp_path, first, second, difference
):
    dump = tmp_path / "run"
    assert _train(dump, first, 4).returncode == 0
    sums = {n: (dump / "checkpoints" / n / SUMS).read_text() for n in ("step-2", "step-4")}
    metrics = (dump / "metrics.jsonl").read_text()
    r = _train(dump, second, 8)
    assert r.returncode == 8, r.stderr[-2000:]
    assert r.stderr == (
        f"error: checkpoint {dump / 'checkpoints' / 'step-4'} was written by "
        f"another model: {difference} (3 more parameters differ); resume it with "
        "that model, or start over with checkpoint.resume=false "
        "checkpoint.overwrite=true (or another job.dump_folder)\n"
    )
    assert {n: (dump / "checkpoints" / n / SUMS).read_text() for n in sums} == sums
    assert sorted(os.listdir(dump / "checkpoints")) == ["step-2", "step-4"]
    assert (dump / "metrics.jsonl").read_text() == metrics


DRIVER = textwrap.dedent("""
    import os, signal, sys
    from tandem.rl.core import checkpoint_sums
    real = checkpoint_sums.HashingWriter.write_data
    def write_data(self, plan, planner):  # SIGINT in the middle of step-4's write
        fut = real(self, plan, planner)
        if str(self.path).endswith("step-4.partial"):
            os.kill(os.getpid(), signal.SIGINT)
        return fut
    checkpoint_sums.HashingWriter.write_data = write_data
    from tandem.train import cli
    sys.argv[0] = "train.py"
    cli()
""")


def test_sigint_during_a_save_exits_130_with_one_line(tmp_path):
    dump = tmp_path / "run"
    cmd = [
        sys.executable,
        "-c",
        DRIVER,
        "--model.flavor=debug-qwen3",
        "--model.tokenizer=builtin:char",
        "--data.path=synthetic:addition_small",
        "--data.synthetic_rows=64",
        "--data.max_length=64",
        "--training.steps=6",
        "--training.batch_size=4",
        "--checkpoint.interval=2",
        "--metrics.loggers=[]",
        f"--job.dump_folder={dump}",
    ]
    r = subprocess.run(
        cmd,
        cwd=ROOT,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=300,
        preexec_fn=sigint_default,
    )
    assert (r.returncode, r.stderr) == (
        130,
        "error: interrupted (SIGINT); the checkpoints committed so far are kept\n",
    )
    assert committed_steps(str(dump / "checkpoints")) == [2]
    assert Checkpointer(str(dump / "checkpoints")).verify(2) is None


def test_overwrite_unlinks_a_symlinked_checkpoint_and_never_follows_it(tmp_path, capsys):
    """checkpoint.overwrite with a step-N that is a symbolic link to another run's checkpoint:
    the link goes, what it points to stays (before: the real ones were deleted, then rmtree
    refused the link with a traceback)."""
    from tandem.rl.config.schema import CheckpointConfig
    from tandem.rl.core.checkpoint import resume_step

    init_distributed(force_cpu=True)
    mine, other = tmp_path / "run" / "checkpoints", tmp_path / "other" / "checkpoints"
    Checkpointer(str(mine)).save(2, *_model(8, 2), {"step": 2})
    Checkpointer(str(other)).save(2, *_model(8, 2), {"step": 2})
    before = (other / "step-2" / SUMS).read_text()
    os.symlink(other / "step-2", mine / "step-6")
    ck = Checkpointer(str(mine))
    assert resume_step(ck, CheckpointConfig(resume=False, overwrite=True), 10, True) is None
    assert os.listdir(mine) == [] and (other / "step-2" / SUMS).read_text() == before
    assert Checkpointer(str(other)).verify(2) is None
    assert "deleted the earlier run's checkpoints (step-2, step-6)" in capsys.readouterr().err
