"""Split mode end to end (torchrun, 3 CPU ranks: rank 0 generates, ranks 1 and 2 train).

- ``max_staleness = 0`` with ``rl.exact`` reproduces the 2-rank synchronous run: the same samples
  token for token (the trainers' dumped rollouts against the synchronous ranks') and the same
  losses, bit for bit;
- ``max_staleness = 1, 2`` on a long-tail workload with a slow generator: no sample trains more
  than S versions after its first token, versions only grow along a completion, completions
  span weight syncs, every prompt trains once;
- after every weight sync the generators hold the trainers' weights: the checksum the run
  checks (and logs) equals one computed here from the checkpointed weights;
- kill -9 of the generator and of a trainer under torchrun --max-restarts: the run finishes
  with every prompt trained exactly once and the bound held;
- a hung generator fails the run within the watchdog's limit (the hang dumps name it).
"""

import json
import os
import signal
import subprocess
import time

import pytest
import torch

from tandem.parallel.checksum import MOD, box_checksum
from tandem.rl.config.schema import ConfigError, load_config
from tandem.rl.recipes.rl_split import check_split_settings
from tests.fixtures import (
    assert_same_as_synchronous,
    held_out_end,
    quickstart_cmd,
    rollout_dumps,
    train_run,
)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LONG_TAIL = {"TANDEM_INJECT_LENGTHS": "1.2:2:40", "TANDEM_INJECT_GEN_DELAY": "0:0.003"}
SPLIT = ("--rollout.mode=split", "--rollout.gen_ranks=1")
STALE = (
    "--rollout.max_tokens=40",
    "--rollout.suspended_kv=recompute",
    "--checkpoint.interval=2",
    "--checkpoint.keep_last=3",
)


def _cmd(dump, steps, nproc, restarts=4):
    return quickstart_cmd(dump, steps, nproc, restarts)


def _env(env):
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT, **(env or {})}


def _run(dump, *extra, env=None, steps=4, nproc=3):
    r = subprocess.run(
        [*_cmd(dump, steps, nproc), *extra],
        cwd=ROOT,
        env=_env(env),
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return [json.loads(line) for line in open(os.path.join(dump, "metrics.jsonl"))]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    base = tmp_path_factory.mktemp("split")
    return {
        "sync": (base / "sync", _run(base / "sync", "--rl.exact=true", nproc=2)),
        "s0": (base / "s0", _run(base / "s0", "--rl.exact=true", *SPLIT)),
        "s1": (
            base / "s1",
            _run(base / "s1", *SPLIT, "--rollout.max_staleness=1", *STALE, env=LONG_TAIL, steps=6),
        ),
        "s2": (
            base / "s2",
            _run(base / "s2", *SPLIT, "--rollout.max_staleness=2", *STALE, env=LONG_TAIL, steps=6),
        ),
    }


@pytest.mark.slow
def test_staleness_zero_split_reproduces_the_synchronous_run(runs):
    assert_same_as_synchronous(
        runs["sync"],
        runs["s0"],
        4 * 16 * 8,
        ("loss", "grad_norm", "entropy", "reward/total", "gap/abs_mean", "accuracy"),
    )


@pytest.mark.slow
def test_hsdp_trainers_sample_and_learn_as_the_synchronous_run(runs, tmp_path):
    """Four trainers in HSDP (2 replicas of 2 FSDP2 shards) beside the generator: at S = 0 with
    rl.exact the same tokens as the synchronous 2-rank run (the generator's sampling keys on the
    prompt, not on the rank that trains it), the same log-probs (bit for bit at step 1) and the
    same update up to the reduction order of four ranks instead of two."""
    dump = tmp_path / "hsdp"
    rows = _run(dump, "--rl.exact=true", *SPLIT, "--parallel.dp_replicate=2", nproc=5)
    sync_dump, sync = runs["sync"]
    key = lambda r: (r["step"], r["prompt"], r["completion_ids"])  # noqa: E731
    a = sorted(rollout_dumps(sync_dump), key=key)
    b = sorted(rollout_dumps(dump, (0, 1, 2, 3)), key=key)
    assert len(a) == len(b) == 4 * 16 * 8
    for x, y in zip(a, b):
        assert (x["step"], x["prompt"], x["completion_ids"]) == (
            y["step"],
            y["prompt"],
            y["completion_ids"],
        )
        if x["step"] == 1:  # the starting weights: bit for bit
            assert x["gen_logprobs"] == y["gen_logprobs"]
        else:  # weights updated through another reduction order
            assert y["gen_logprobs"] == pytest.approx(x["gen_logprobs"], rel=1e-4, abs=1e-5)
        assert y["versions"] == [y["step"] - 1] * len(y["versions"])
    for r, s in zip(rows, sync, strict=True):
        assert r["reward/total"] == s["reward/total"] and r["async/staleness_max"] == 0
        for k in ("loss", "grad_norm", "entropy", "gap/abs_mean"):
            assert r[k] == pytest.approx(s[k], rel=1e-5, abs=1e-7), (r["step"], k)


@pytest.mark.slow
def test_a_resume_onto_two_generators_is_the_synchronous_run(runs, tmp_path):
    """Steps 1-2 on 1 generator + 2 trainers, then steps 3-4 resumed from its checkpoint on
    2 generators + 2 trainers (the prompt stream dealt over two generators from the saved
    cursor on): at S = 0 with rl.exact the four steps are the synchronous run's, sample for
    sample and bit for bit, and every prompt trains once (the run's own ledger check)."""
    dump = tmp_path / "moved"
    flags = ("--rl.exact=true", "--rollout.mode=split", "--checkpoint.interval=2")
    _run(dump, *flags, "--rollout.gen_ranks=1", steps=2, nproc=3)
    rows = _run(dump, *flags, "--rollout.gen_ranks=2", steps=4, nproc=4)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert_same_as_synchronous(
        runs["sync"], (dump, rows), 4 * 16 * 8, ("loss", "grad_norm", "entropy", "reward/total")
    )


@pytest.mark.slow
def test_a_critic_a_reference_and_a_teacher_train_on_the_trainers(tmp_path):
    """Split mode builds what trains beside the policy on the trainers, as the one RL recipe
    does colocated: PPO's critic (GAE, no warm-up), a KL reference and an on-policy
    distillation teacher in one run. At S = 0 with rl.exact it equals the synchronous run,
    samples and every logged number of the update, bit for bit."""
    flags = (
        "--rl.exact=true",
        "--rl.num_samples=4",
        "--rl.kl_coef=0.05",
        "--critic.warmup_steps=0",
        '--distill.teachers=["assets/quickstart-teacher"]',
    )

    def run(dump, nproc, *extra):
        cmd = [*quickstart_cmd(dump, 2, nproc, config="quickstart_ppo.toml"), *flags, *extra]
        r = subprocess.run(cmd, cwd=ROOT, env=_env(None), capture_output=True, text=True)
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
        return [json.loads(line) for line in open(os.path.join(dump, "metrics.jsonl"))]

    sync = run(tmp_path / "sync", 2)
    split = run(tmp_path / "split", 3, *SPLIT)
    keys = ("loss", "grad_norm", "kl", "critic/value_mse", "critic/grad_norm", "distill/reverse_kl")
    assert all(r["kl"] > 0 or r["step"] == 1 for r in sync) and all(
        r["grad_norm"] > 0 for r in sync
    )
    assert_same_as_synchronous((tmp_path / "sync", sync), (tmp_path / "split", split), 128, keys)


def _bound_held(dump, s, steps):
    samples = rollout_dumps(dump)
    stale = [r["step"] - 1 - min(r["versions"]) for r in samples]  # the version trained: step - 1
    assert max(stale) <= s, max(stale)
    for r in samples:
        assert r["versions"] == sorted(r["versions"]) and max(r["versions"]) <= r["step"] - 1
        assert len(r["versions"]) == len(r["completion_ids"])
    ledger = [json.loads(line) for line in open(dump / "ledger.jsonl")]
    assert [row["step"] for row in ledger] == list(range(1, steps + 1))
    positions = [p for row in ledger for p in row["positions"]]
    assert len(positions) == len(set(positions)) == steps * 16  # every prompt trained once
    return samples, stale


@pytest.mark.slow
@pytest.mark.parametrize("s", [1, 2])
def test_the_staleness_bound_holds_with_a_slow_generator(runs, s):
    dump, rows = runs[f"s{s}"]
    samples, stale = _bound_held(dump, s, 6)
    assert len(samples) == 6 * 16 * 8 and max(stale) > 0  # the bound was used
    assert any(len(set(r["versions"])) > 1 for r in samples)  # completions spanned a sync
    assert max(r["async/staleness_max"] for r in rows) == max(stale)
    assert sum(r["async/suspended"] for r in rows) > 0


def _checksum(path):
    """The bridge checksum of a checkpoint's weights (tied embeddings counted once)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(path, path + ".pt")
    model = torch.load(path + ".pt", weights_only=False)["model"]
    if torch.equal(model["output.weight"], model["tok_embeddings.weight"]):
        del model["output.weight"]
    return sum(box_checksum(k, t, (0,) * t.dim(), tuple(t.shape)) for k, t in model.items()) % MOD


@pytest.mark.slow
def test_after_every_sync_the_generator_holds_the_trainers_weights(runs):
    dump, rows = runs["s1"]
    for step in (2, 4, 6):  # the weights each checkpoint saved are those the step's sync sent
        assert rows[step - 1]["split/sync_checksum"] == _checksum(
            str(dump / "checkpoints" / f"step-{step}")
        )
    assert len({r["split/sync_checksum"] for r in rows}) == 6  # a new version every step


@pytest.mark.slow
@pytest.mark.parametrize("rank", [0, 2])  # the generator, a trainer
def test_kill_minus_9_of_either_side_trains_every_prompt_once(tmp_path, rank):
    dump = tmp_path / "killed"
    r = subprocess.run(
        [*_cmd(dump, 6, 3), *SPLIT, "--rollout.max_staleness=1", *STALE],
        cwd=ROOT,
        env=_env({**LONG_TAIL, "TANDEM_INJECT_KILL": f"5:{rank}"}),
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert (dump / "fault" / f"killed-step-5-rank-{rank}").is_file(), r.stdout[-2000:]
    assert "resumed from" in r.stdout and "at step 4" in r.stdout, r.stdout[-2000:]
    saved = json.load(open(dump / "checkpoints" / "step-4" / "trainer.json"))["rollout"]
    assert saved["admission"]["flights"]  # it resumed with groups in flight
    _bound_held(dump, 1, 6)


def _rank_pid(launcher, rank):
    """The pid of the torchrun worker of global rank ``rank`` (a child of ``launcher``)."""
    for d in filter(str.isdigit, os.listdir("/proc")):
        try:
            ppid = int(open(f"/proc/{d}/stat").read().rsplit(")", 1)[1].split()[1])
            env = open(f"/proc/{d}/environ", "rb").read().split(b"\0")
        except OSError:
            continue
        if ppid == launcher and f"RANK={rank}".encode() in env:
            return int(d)
    raise AssertionError(f"no worker of rank {rank} under {launcher}")


@pytest.mark.slow
def test_a_hung_generator_fails_within_the_watchdog_limit(tmp_path):
    """The generator stops answering mid-run (SIGSTOP: its own watchdog is frozen too); the
    trainers' watchdogs end the run within fault.hang_timeout_s, long before the process
    groups' 600 s timeout."""
    dump = tmp_path / "hung"
    p = subprocess.Popen(
        [*_cmd(dump, 8, 3, restarts=0), *SPLIT, "--fault.hang_timeout_s=15"],
        cwd=ROOT,
        env=_env({}),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    stopped = None
    try:
        for line in p.stdout:
            if line.startswith("step 2/8"):
                stopped = _rank_pid(p.pid, 0)
                os.kill(stopped, signal.SIGSTOP)
                t0 = time.monotonic()
                break
        assert stopped is not None
        p.stdout.read()
        p.wait(timeout=300)
        took = time.monotonic() - t0
    finally:
        if stopped is not None:
            for sig in (signal.SIGCONT, signal.SIGKILL):
                try:
                    os.kill(stopped, sig)
                except ProcessLookupError:
                    pass
        p.kill()
    assert p.returncode != 0
    assert took < 90, took
    for rank in (1, 2):  # both trainers, waiting on the generator (wherever the stop caught it:
        # its samples, the sync, or the shell's collectives between steps)
        hang = json.load(open(dump / "hang" / f"rank-{rank}.json"))
        assert (hang["exit_status"], hang["timeout_s"]) == (6, 15.0), hang["reason"]
        assert hang["idle_s"] >= 15.0
    assert not (dump / "hang" / "rank-0.json").exists()  # the frozen rank wrote nothing


def _config(*overrides):
    path = os.path.join(ROOT, "configs", "quickstart.toml")
    return load_config(path, ["rollout.mode=split", "rollout.gen_ranks=1", *overrides])


@pytest.mark.parametrize(
    "override, line",
    [
        (
            "env.kind=http",
            "rollout.mode: rollout.mode = 'split' does not run with env.kind = \"http\"",
        ),
        (
            "rl.offload_optimizer=true",
            "rollout.mode: rollout.mode = 'split' does not run with rl.offload_optimizer",
        ),
    ],
)
def test_split_mode_refuses_what_it_has_not_run_in_one_line(override, line):
    """Two of the table's split rows (every row: tests/config/test_composes.py) at config load,
    and the one split check of its own: a trainer must be left."""
    with pytest.raises(ConfigError) as e:
        _config(override)
    assert str(e.value).startswith(line) and "\n" not in str(e.value)
    with pytest.raises(ConfigError, match="^rollout.gen_ranks: 3 leaves no trainer rank of the 3$"):
        check_split_settings(_config("rollout.gen_ranks=3"), 3)
    check_split_settings(_config(), 3)  # the defaults run


def test_gen_ranks_belongs_to_split_mode():
    path = os.path.join(ROOT, "configs", "quickstart.toml")
    with pytest.raises(ConfigError, match="rollout.gen_ranks: 1 with rollout.mode = 'sync'"):
        load_config(path, ["rollout.gen_ranks=1"])
    with pytest.raises(ConfigError, match="rollout.gen_ranks: 0 with rollout.mode = 'split'"):
        load_config(path, ["rollout.mode=split"])
    assert _config("rollout.max_staleness=2").rollout.max_staleness == 2


@pytest.mark.slow
def test_quickstart_split_learns(tmp_path):
    """configs/quickstart_split.toml as shipped (60 steps, S = 1): held-out accuracy from 0.527
    to at least 0.9, with most samples trained one version stale (90-97% in the runs so far).
    The timing of each sync decides which tokens a version samples, so runs differ: 0.93 to
    0.978 in nine runs (docs/async.md). S = 0 is the synchronous run bit for bit (the test
    above), so its learning needs no run of its own."""
    rows, out = train_run(
        os.path.join(ROOT, "configs", "quickstart_split.toml"), tmp_path / "qs", 3, timeout=1200
    )
    end = held_out_end(out, "0.527")
    assert end >= 0.9, end
    assert max(row["async/staleness_max"] for row in rows) == 1
    stale = sum(row["async/staleness_1"] for row in rows)
    fresh = sum(row["async/staleness_0"] for row in rows)
    assert stale > 0.5 * (stale + fresh), (stale, fresh)
