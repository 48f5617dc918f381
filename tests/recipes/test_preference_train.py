"""Preference data and the dpo recipe: held-out learning, precompute == online reference,
2-rank run + resume on 1 rank, and configs/dpo.toml through train.py."""

import json
import math
import os
import shutil
import subprocess
import sys

import pytest
import torch

from tandem.models.tokenizer import build_char_tokenizer
from tandem.parallel.distributed import init_distributed
from tandem.rl.config.schema import ConfigError, load_config
from tandem.rl.data.loading import DataError
from tandem.rl.data.preference import (
    build_preference_data,
    collate_pairs,
    load_preference_data,
    tokenize_response,
)
from tandem.rl.recipes import run as run_recipe

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DPO_TOML = os.path.join(ROOT, "configs", "dpo.toml")
FAST = [
    "--data.path=synthetic:sorting",
    "--data.synthetic_rows=128",
    "--training.batch_size=32",
    "--training.micro_batch_size=16",
    "--optimizer.lr=3e-3",
    "--lr_schedule.warmup_steps=2",
    "--metrics.loggers=[]",
    "--checkpoint.enable=false",
    "--checkpoint.export_hf_at_end=false",
]


@pytest.fixture
def one_thread():
    """Two shared cores: one intra-op thread per process is several times faster than two."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _run(dump, *overrides, config=DPO_TOML):
    cfg = load_config(config, [*FAST, f"--job.dump_folder={dump}", *overrides])
    assert run_recipe(cfg, init_distributed(force_cpu=True)) == 0
    return [json.loads(line) for line in open(os.path.join(dump, "metrics.jsonl"))]


# ---------------------------------------------------------------------- data
@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return build_char_tokenizer(tmp_path_factory.mktemp("tok"))


def _write(path, rows):
    with open(path, "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")


def test_pairs_mask_only_the_response_and_share_the_context(tok, tmp_path):
    ctx = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "yo"},
        {"role": "user", "content": "2+2?"},
    ]
    rows = [
        {"prompt": "2+2?", "chosen": "4", "rejected": "5"},
        # whole conversations stored in chosen/rejected: the repeated context is stripped
        {
            "messages": ctx,
            "chosen": ctx + [{"role": "assistant", "content": "4"}],
            "rejected": ctx + [{"role": "assistant", "content": "five"}],
        },
        # no context field: the common leading turns are the context
        {
            "chosen": ctx + [{"role": "assistant", "content": "4"}],
            "rejected": ctx + [{"role": "assistant", "content": "3"}],
        },
    ]
    # (mixed row shapes in one list: `datasets` would refuse them in one file)
    pairs, skipped = build_preference_data(rows, tok, source="mem", max_length=512)
    assert len(pairs) == 3 and not skipped
    for pair, reply in zip(pairs, ("4", "4", "4")):
        c = pair.chosen
        trained = tok.decode([t for t, m in zip(c.input_ids, c.loss_mask) if m])
        # the earlier assistant turn "yo" is context, untrained
        assert trained == reply + "<|im_end|>\n"
        n_ctx = c.loss_mask.index(1)
        assert pair.rejected.input_ids[:n_ctx] == c.input_ids[:n_ctx]
    # the same tokens the reward-model scorer will build for this prompt and reply
    assert tokenize_response(ctx, "4", tok).input_ids == pairs[1].chosen.input_ids
    batch = collate_pairs(pairs[:2], tok.pad_token_id)
    assert batch["tokens"].shape[0] == 4 and batch["lengths"].tolist()[0] == len(
        pairs[0].chosen.input_ids
    )
    # chosen first, then rejected
    assert batch["lengths"].tolist()[2] == len(pairs[0].rejected.input_ids)


def test_bad_rows_counted_or_named(tok, tmp_path):
    rows = [
        {"prompt": "a", "chosen": "x", "rejected": "y"},
        {"prompt": "a", "chosen": "x", "rejected": None},
        {"prompt": "a", "chosen": "same", "rejected": "same"},
        {"prompt": None, "chosen": "x", "rejected": "y"},
        {"prompt": "a", "chosen": "x" * 400, "rejected": "y"},
        {"prompt": "b", "chosen": "", "rejected": "y"},
    ]
    path = str(tmp_path / "bad.jsonl")
    _write(path, rows)
    data = load_preference_data(path, tok, max_length=128)
    assert len(data.train) == 1
    assert dict(data.skipped) == {
        "missing field 'rejected'": 1,
        "chosen equals rejected": 1,
        "missing field: neither 'messages' nor 'prompt'": 1,
        "longer than max_length": 1,
        "empty chosen": 1,
    }
    with pytest.raises(DataError, match=r"bad\.jsonl:2: missing field 'rejected'"):  # file:line
        load_preference_data(path, tok, max_length=128, on_bad_row="error")
    _write(path, rows[:1] * 9 + rows[1:2])
    held = load_preference_data(path, tok, max_length=128, eval_fraction=0.3, seed=1)
    assert len(held.train) + len(held.eval) == 9 and len(held.eval) >= 2
    with pytest.raises(DataError, match=r"bad\.jsonl:10: "):
        # held-out split still names the file's line
        load_preference_data(
            path, tok, max_length=128, on_bad_row="error", eval_fraction=0.3, seed=1
        )


def test_config_checks(tmp_path):
    with pytest.raises(
        ConfigError, match="preference.loss: unknown preference loss 'dpx'; did you mean 'dpo'"
    ):
        load_config(DPO_TOML, ["--preference.loss=dpx"])
    cfg = load_config(
        DPO_TOML, [*FAST, f"--job.dump_folder={tmp_path}", "--preference.reference=none"]
    )
    with pytest.raises(ConfigError, match="loss 'dpo' needs reference log-probs"):
        run_recipe(cfg, init_distributed(force_cpu=True))


# ---------------------------------------------------------------------- training
def test_dpo_learns_held_out_preferences(tmp_path, one_thread):
    rows = _run(tmp_path / "dpo", "--training.steps=12")
    first, last = rows[0], rows[-1]
    # policy == reference at step 1: every implicit reward is 0, a tie (accuracy 0.5, loss log 2)
    assert first["accuracy"] == 0.5 and abs(first["loss"] - math.log(2)) < 1e-6
    # held-out lists (the task's test split) were never trained on; a sign-flipped loss reads ~0.03
    # here
    assert last["eval/accuracy"] >= 0.85, last
    assert last["eval/margin"] > 0.1 and last["eval/loss"] < math.log(2) - 0.05, last
    assert last["eval/chosen_reward"] > 0 > last["eval/rejected_reward"]
    assert all(k in last for k in ("grad_norm", "lr", "margin", "chosen_logp", "rejected_logp"))


def test_precompute_reference_equals_online(tmp_path, one_thread):
    steps = ["--training.steps=3", "--lr_schedule.warmup_steps=0"]
    pre = _run(
        tmp_path / "pre", *steps, "--preference.reference=precompute", "--training.eval_interval=1"
    )
    onl = _run(
        tmp_path / "onl", *steps, "--preference.reference=online", "--training.eval_interval=0"
    )
    assert pre[0]["loss"] == pytest.approx(math.log(2), abs=1e-7)
    for a, b in zip(pre, onl):  # also: evaluating every step does not perturb training
        for key in ("loss", "margin", "chosen_reward", "rejected_reward", "grad_norm"):
            assert a[key] == pytest.approx(b[key], rel=1e-6, abs=1e-7), (a["step"], key)
    assert pre[-1]["loss"] < pre[0]["loss"] - 0.02  # by step 3 the reference matters
    assert pre[-1]["eval/loss"] == pytest.approx(onl[-1]["eval/loss"], rel=1e-6)


@pytest.mark.parametrize(
    "loss,extra",
    [
        ("ipo", ["--preference.beta=0.5"]),
        ("simpo", ["--preference.beta=2.0", "--preference.reference=none"]),
    ],
)
def test_other_losses_train(tmp_path, one_thread, loss, extra):
    rows = _run(tmp_path / loss, "--training.steps=6", f"--preference.loss={loss}", *extra)
    assert rows[-1]["loss"] < rows[0]["loss"] and rows[-1]["eval/accuracy"] >= 0.75, rows[-1]


@pytest.mark.slow
def test_two_ranks_then_resume_on_one(tmp_path, one_thread):
    """The same run on 2 ranks and on 1 rank agrees; a 2-rank checkpoint resumes on 1 rank."""
    two = str(tmp_path / "two")
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node=2",
        os.path.join(ROOT, "train.py"),
        "--config",
        DPO_TOML,
        *FAST,
        "--training.steps=4",
        "--checkpoint.enable=true",
        "--checkpoint.interval=2",
        "--checkpoint.export_hf_at_end=true",
        f"--job.dump_folder={two}",
    ]
    r = subprocess.run(
        cmd,
        cwd=ROOT,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    ref = [json.loads(line) for line in open(os.path.join(two, "metrics.jsonl"))]
    resumed = str(tmp_path / "resumed")
    shutil.copytree(two, resumed)
    for p in ("checkpoints/step-4", "hf", "metrics.jsonl"):
        shutil.rmtree(os.path.join(resumed, p)) if os.path.isdir(
            os.path.join(resumed, p)
        ) else os.remove(os.path.join(resumed, p))
    rows = _run(
        resumed,
        "--training.steps=4",
        "--checkpoint.enable=true",
        "--checkpoint.interval=2",
        "--checkpoint.export_hf_at_end=true",
    )
    assert [row["step"] for row in rows] == [3, 4]
    for a, b in zip(ref[2:], rows):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5) and a["accuracy"] == b["accuracy"]
    assert ref[-1]["eval/accuracy"] == rows[-1]["eval/accuracy"]
    from safetensors.torch import load_file

    ha, hb = (load_file(os.path.join(d, "hf", "model.safetensors")) for d in (two, resumed))
    assert ha.keys() == hb.keys() and all(torch.allclose(ha[k], hb[k], atol=1e-5) for k in ha)


def test_dpo_toml_runs_through_train_py(tmp_path):
    dump = str(tmp_path / "run")
    r = subprocess.run(
        [
            sys.executable,
            os.path.join(ROOT, "train.py"),
            "--config",
            DPO_TOML,
            "--training.steps=2",
            f"--job.dump_folder={dump}",
        ],
        cwd=ROOT,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    rows = [json.loads(line) for line in open(os.path.join(dump, "metrics.jsonl"))]
    assert [row["step"] for row in rows] == [1, 2] and "eval/accuracy" in rows[-1]
    assert os.path.exists(os.path.join(dump, "hf", "model.safetensors"))
    assert os.path.exists(os.path.join(dump, "checkpoints", "step-2", "COMMITTED"))
