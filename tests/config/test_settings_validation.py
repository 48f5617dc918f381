"""Settings that used to fail late (a traceback mid-run, or a silent run that learns nothing)
fail at validation with one line naming the key (exit 2)."""

import os
import subprocess
import sys

import pytest

from tandem.rl.algorithms import POLICY_LOSSES
from tandem.rl.config.schema import ConfigError, load_config

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# rl recipe, an HF folder (assets/quickstart-policy)
QUICKSTART = os.path.join(ROOT, "configs", "quickstart.toml")


@pytest.mark.parametrize(
    "override, message",
    [
        ("optimizer.lr=inf", "optimizer.lr: must be a finite number, got inf"),
        ("optimizer.lr=nan", "optimizer.lr: must be a finite number, got nan"),
        ("optimizer.betas=[0.9, nan]", "optimizer.betas[1]: must be a finite number, got nan"),
        ("rollout.temperature=-inf", "rollout.temperature: must be a finite number, got -inf"),
        ("reward.weights=[inf]", "reward.weights[0]: must be a finite number, got inf"),
        ("rollout.max_num_seqs=0", "rollout.max_num_seqs: must be >= 1, got 0"),
        ("rollout.max_num_batched_tokens=0", "rollout.max_num_batched_tokens: must be >= 1, got 0"),
        ("rollout.kv_cache_gb=0", "rollout.kv_cache_gb: must be > 0, got 0.0"),
        ("advanced.logprob_chunk_tokens=0", "advanced.logprob_chunk_tokens: must be >= 1, got 0"),
        (
            "advanced.pp_microbatches=-1",
            "advanced.pp_microbatches: must be >= 0 (0 = the pp degree), got -1",
        ),
        (
            'rollout.stop=["</a>", ""]',
            "rollout.stop: stop strings must not be empty, got ['</a>', '']",
        ),
        ("rl.eval_samples=-1", "rl.eval_samples: must be >= 0 (0 = one greedy completion), got -1"),
        ("job.seed=4294967296", "job.seed: must be in [0, 2**32), got 4294967296"),
        (
            "job.seed=18446744073709551616",
            "job.seed: must be in [0, 2**32), got 18446744073709551616",
        ),
        # 2 layers x (K, V) x 16 tokens x 2 KV heads x head dim 16 x 4 bytes = 8192 bytes per block
        (
            "rollout.kv_cache_gb=1e-6 rollout.dtype=float32",
            "rollout.kv_cache_gb: 1e-06 GB holds no KV block of this model (one block of 16 "
            "tokens takes 8.19e-06 GB in float32); raise it",
        ),
    ],
)
def test_bad_setting_is_one_line_naming_the_key(override, message):
    with pytest.raises(ConfigError) as e:
        load_config(QUICKSTART, override.split(" ") if "=[" not in override else [override])
    assert str(e.value) == message


@pytest.mark.parametrize("advantage", ["grpo", "dr_grpo", "rloo"])
def test_one_sample_under_a_group_relative_advantage_is_rejected(advantage):
    with pytest.raises(
        ConfigError,
        match=r"rl.num_samples: 1 completion per prompt under "
        rf"rl.advantage = '{advantage}'.*"
        "every advantage would be 0",
    ):
        load_config(QUICKSTART, ["rl.num_samples=1", f"rl.advantage={advantage}"])
    # a per-sample estimator learns from one sample
    cfg = load_config(
        QUICKSTART, ["rl.num_samples=1", "rl.advantage=reinforce_pp", "job.seed=4294967295"]
    )
    assert (cfg.rl.num_samples, cfg.job.seed) == (1, 2**32 - 1)


def test_kv_budget_is_checked_for_a_from_scratch_flavor_too():
    with pytest.raises(ConfigError, match=r"rollout.kv_cache_gb: 1e-09 GB holds no KV block"):
        load_config(
            QUICKSTART,
            [
                "model.path=none",
                "model.flavor=debug-qwen3",
                "model.tokenizer=builtin:char",
                "rollout.kv_cache_gb=1e-9",
            ],
        )


def test_dump_folder_that_is_a_file_or_under_one(tmp_path):
    f = tmp_path / "afile"
    f.write_text("x")
    with pytest.raises(ConfigError) as e:
        load_config(QUICKSTART, [f"job.dump_folder={f}"])
    assert str(e.value) == f"job.dump_folder: {f} is a file, not a folder"
    with pytest.raises(ConfigError) as e:
        load_config(QUICKSTART, [f"job.dump_folder={f}/run"])
    assert str(e.value) == f"job.dump_folder: {f}/run is under {f}, a file, not a folder"
    assert (
        load_config(QUICKSTART, [f"job.dump_folder={tmp_path}/new/run"]).job.dump_folder
        == f"{tmp_path}/new/run"
    )
    assert not (tmp_path / "new").exists()  # validation creates nothing


def _unwritable_folder(tmp_path):
    d = tmp_path / "ro"
    d.mkdir()
    d.chmod(0o555)
    if not os.access(d, os.W_OK):
        return str(d)
    if os.path.isdir("/proc/sys") and not os.access("/proc/sys", os.W_OK):
        # root ignores modes: a read-only mount
        return "/proc/sys"
    pytest.skip("no unwritable folder here (root on a system without a read-only mount)")


def test_dump_folder_in_an_unwritable_folder(tmp_path):
    ro = _unwritable_folder(tmp_path)
    with pytest.raises(ConfigError) as e:
        load_config(QUICKSTART, [f"job.dump_folder={ro}/run"])
    assert str(e.value) == (
        f"job.dump_folder: {ro}/run: cannot write in {ro} (no write "
        "permission, or a read-only file system)"
    )


def test_dump_folder_under_proc_is_a_config_error_before_anything_runs(tmp_path):
    """Permission bits let root write anywhere, but /proc refuses new entries: train.py and
    tandem-generate ended in a FileNotFoundError traceback; now one line, exit 2."""
    r = _train("/proc/tandem-run")
    assert (r.returncode, r.stderr) == (
        2,
        "error: job.dump_folder: /proc/tandem-run: cannot "
        "make a folder in /proc (No such file or directory)\n",
    )
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "1+1="}\n')
    cmd = [
        sys.executable,
        "-m",
        "tandem.generate",
        "--model",
        os.path.join(ROOT, "assets", "quickstart-policy"),
        "--input",
        str(prompts),
        "--output",
        "/proc/tandem-out.jsonl",
    ]
    r = subprocess.run(
        cmd,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": ROOT},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert (r.returncode, r.stderr) == (
        2,
        "error: --output: /proc: cannot make a folder in "
        "/proc (No such file or directory) (tandem-generate "
        "--help lists the flags)\n",
    )
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".tandem-write-check")]


def _train(dump, *extra):
    cmd = [
        sys.executable,
        os.path.join(ROOT, "train.py"),
        "--model.flavor=debug-qwen3",
        "--model.tokenizer=builtin:char",
        "--data.path=synthetic:addition_small",
        "--data.synthetic_rows=64",
        "--data.max_length=64",
        "--training.steps=2",
        "--training.batch_size=4",
        "--metrics.loggers=[]",
        f"--job.dump_folder={dump}",
        *extra,
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT}
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


def test_train_rejects_inf_lr_and_an_overflowing_seed_before_writing_anything(tmp_path):
    r = _train(tmp_path / "run", "--optimizer.lr=inf")
    assert (r.returncode, r.stderr) == (
        2,
        "error: optimizer.lr: must be a finite number, got inf\n",
    )
    r = _train(tmp_path / "run", "--job.seed=18446744073709551616")
    assert (r.returncode, r.stderr) == (
        2,
        "error: job.seed: must be in [0, 2**32), got 18446744073709551616\n",
    )
    assert not (tmp_path / "run").exists()
    r = _train(tmp_path / "run", f"--job.seed={2**32 - 1}")  # the largest seed trains
    assert r.returncode == 0, r.stderr[-2000:]
    assert os.path.isfile(tmp_path / "run" / "checkpoints" / "step-2" / "SHA256SUMS")


def test_gspo_reads_its_own_clip_keys_and_rejects_the_token_ones():
    cfg = load_config(
        QUICKSTART, ["--rl.policy_loss=gspo", "--rl.seq_clip_low=1e-3", "--rl.seq_clip_high=2e-3"]
    )
    pcfg = cfg.rl
    assert (pcfg.seq_clip_low, pcfg.seq_clip_high) == (1e-3, 2e-3)
    assert POLICY_LOSSES.cap("gspo", "uses") == ("seq_clip_low", "seq_clip_high")
    unused = r"rl.clip_high: not used by rl.policy_loss = 'gspo'.*rl.seq_clip_low"
    with pytest.raises(ConfigError, match=unused):
        load_config(QUICKSTART, ["--rl.policy_loss=gspo", "--rl.clip_high=0.28"])
    unused = r"rl.seq_clip_low: not used by rl.policy_loss = 'ppo_clip'"
    with pytest.raises(ConfigError, match=unused):
        load_config(QUICKSTART, ["--rl.seq_clip_low=1e-3"])
