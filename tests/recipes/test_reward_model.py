"""Scalar-head model folders, the reward_model recipe, and RewardModelScorer."""

import json
import math
import os
import statistics
import subprocess
import sys

import pytest
import torch
from safetensors import safe_open

from tandem.models.flavors import get_flavor
from tandem.models.hf import save_hf
from tandem.models.tokenizer import build_char_tokenizer
from tandem.models.transformer import Transformer
from tandem.models.value_head import (
    ScalarHeadModel,
    initial_scalar_state,
    load_scalar_model,
    save_scalar_model,
)
from tandem.parallel.distributed import init_distributed
from tandem.rl.config.schema import load_config
from tandem.rl.data.preference import SYNTHETIC_PAIRS
from tandem.rl.recipes import run as run_recipe
from tandem.rl.recipes.reward_model import EXPORT_DIR
from tandem.rl.rollout.reward_model import RewardModelScorer

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RM_TOML = os.path.join(ROOT, "configs", "reward_model.toml")


@pytest.fixture
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def test_folder_roundtrip_trunk_init_and_transformers_agree(tmp_path):
    args = get_flavor("debug-qwen3")
    tok = build_char_tokenizer(tmp_path / "tok")
    # trunk from a policy HF folder: same weights, fresh head, no lm_head kept
    policy = Transformer(args)
    policy.init_weights(3)
    save_hf(policy.state_dict(), args, tmp_path / "policy", tokenizer=tok)
    state = initial_scalar_state(args, str(tmp_path / "policy"), seed=0)
    assert torch.equal(
        state["trunk.layers.1.feed_forward.w2.weight"], policy.layers["1"].feed_forward.w2.weight
    )
    assert (
        not any(k.startswith("trunk.output") for k in state)
        and state["score.bias"].abs().sum() == 0
    )

    model = ScalarHeadModel(args)
    model.load_state_dict(state)
    model.reset_rope()
    save_scalar_model(model.state_dict(), args, tmp_path / "rm", tokenizer=tok)
    with safe_open(tmp_path / "rm" / "model.safetensors", framework="pt") as f:
        names = set(f.keys())
    assert {"score.weight", "score.bias", "model.embed_tokens.weight"} <= names
    assert all(n.startswith(("model.", "score.")) for n in names)
    config = json.loads((tmp_path / "rm" / "config.json").read_text())
    assert (
        config["architectures"] == ["Qwen3ForSequenceClassification"] and config["num_labels"] == 1
    )
    back = load_scalar_model(tmp_path / "rm")
    assert all(
        torch.equal(a, b) for a, b in zip(model.state_dict().values(), back.state_dict().values())
    )

    # an RM folder is an HF sequence-classification folder: transformers gives the same last-token
    # scores
    from transformers import AutoModelForSequenceClassification

    hf = AutoModelForSequenceClassification.from_pretrained(
        tmp_path / "rm", dtype=torch.float32
    ).eval()
    ids = torch.tensor(
        [
            tok.encode("<|im_start|>user\nhello<|im_end|>\n"),
            tok.encode("<|im_start|>user\nbye!!<|im_end|>\n"),
        ]
    )
    with torch.no_grad():
        ours = back(ids)[:, -1]
        theirs = hf(input_ids=ids).logits.squeeze(-1)
    assert torch.allclose(ours, theirs, atol=1e-5), (ours, theirs)


def test_reward_model_learns_and_scorer_reproduces_the_trainer(tmp_path, one_thread):
    dump = str(tmp_path / "rm")
    cfg = load_config(
        RM_TOML,
        [
            "--data.synthetic_rows=128",
            "--training.steps=12",
            "--training.batch_size=32",
            "--training.micro_batch_size=16",
            "--optimizer.lr=1e-3",
            "--metrics.loggers=[]",
            "--checkpoint.enable=false",
            f"--job.dump_folder={dump}",
        ],
    )
    assert run_recipe(cfg, init_distributed(force_cpu=True)) == 0
    rows = [json.loads(line) for line in open(os.path.join(dump, "metrics.jsonl"))]
    last = rows[-1]
    # held-out lists from the task's test split; chance is 0.5
    assert last["eval/accuracy"] >= 0.85 and last["eval/loss"] < math.log(2) - 0.2, last
    assert last["eval/chosen_score"] > last["eval/rejected_score"]

    scorer = RewardModelScorer(os.path.join(dump, EXPORT_DIR), "cpu", batch_size=7)
    pairs = SYNTHETIC_PAIRS.get("sorting")(64, cfg.job.seed, "test")  # the trainer's held-out pairs
    prompts = [p["prompt"] for p in pairs]
    chosen = scorer.score(prompts, [p["chosen"] for p in pairs])
    rejected = scorer.score(prompts, [p["rejected"] for p in pairs])
    assert statistics.fmean(chosen) == pytest.approx(last["eval/chosen_score"], rel=1e-5, abs=1e-6)
    assert statistics.fmean(rejected) == pytest.approx(
        last["eval/rejected_score"], rel=1e-5, abs=1e-6
    )
    acc = statistics.fmean(
        1.0 if c > r else 0.5 if c == r else 0.0 for c, r in zip(chosen, rejected)
    )
    assert acc == last["eval/accuracy"]

    # a message-list prompt is the same query as its string form; empty replies score; lengths must
    # match
    msgs = [{"role": "user", "content": prompts[0]}]
    assert scorer.score([msgs], [pairs[0]["chosen"]]) == pytest.approx([chosen[0]], abs=1e-6)
    assert len(scorer.score([prompts[0]], [""])) == 1
    with pytest.raises(ValueError, match="2 prompts but 1 completions"):
        scorer.score(prompts[:2], ["x"])


def test_reward_model_toml_runs_through_train_py(tmp_path):
    dump = str(tmp_path / "run")
    r = subprocess.run(
        [
            sys.executable,
            os.path.join(ROOT, "train.py"),
            "--config",
            RM_TOML,
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
    assert os.path.exists(os.path.join(dump, EXPORT_DIR, "model.safetensors"))
    assert os.path.exists(os.path.join(dump, EXPORT_DIR, "tokenizer.json"))


def test_reward_model_as_rl_reward_source(tmp_path, one_thread):
    """A reward-model folder scores rollouts in the RL loop, mixed with a rule-based reward."""
    from tandem.rl.core.metrics import MetricsLogger
    from tandem.rl.fault import Watchdog
    from tandem.rl.recipes.base import Runtime
    from tandem.rl.recipes.rl import RLRecipe
    from tandem.rl.rewards.registry import REWARDS

    rm_dump = str(tmp_path / "rm")
    cfg = load_config(
        RM_TOML,
        [
            "--data.synthetic_rows=64",
            "--training.steps=2",
            "--metrics.loggers=[]",
            "--checkpoint.enable=false",
            f"--job.dump_folder={rm_dump}",
        ],
    )
    assert run_recipe(cfg, init_distributed(force_cpu=True)) == 0
    folder = os.path.join(rm_dump, EXPORT_DIR)
    policy = os.path.join(ROOT, "assets", "quickstart-policy")
    rl_dump = str(tmp_path / "rl")
    cfg = load_config(
        os.path.join(ROOT, "configs", "quickstart.toml"),
        [
            f"--model.path={policy}",
            f"--job.dump_folder={rl_dump}",
            "--training.steps=1",
            "--rl.prompts_per_step=4",
            "--rl.num_samples=2",
            "--rl.eval_prompts=4",
            "--reward.functions=exact_match",
            "--reward.num_workers=0",
            f"--reward.reward_model={folder}",
            "--reward.reward_model_weight=0.5",
            "--checkpoint.enable=false",
            "--metrics.loggers=[]",
        ],
    )
    info = init_distributed(force_cpu=True)
    trainer = RLRecipe(
        cfg,
        Runtime(
            info, rl_dump, Watchdog(rl_dump, 0, info.rank), MetricsLogger(rl_dump, enabled=False)
        ),
    )
    batch = trainer.rollout.batch(0)  # the first step's rollout phase
    samples, scores, metrics = batch.samples, batch.scores, batch.metrics
    trainer.close()
    scorer = RewardModelScorer(folder, "cpu")
    rm = scorer.score([s.row["messages"] for s in samples], [s.text for s in samples])
    rule = [REWARDS.get("exact_match")(s.text, s.row) for s in samples]
    want = torch.tensor([r + 0.5 * m for r, m in zip(rule, rm)])
    torch.testing.assert_close(scores, want, atol=1e-5, rtol=1e-5)
    assert metrics["reward/reward_model/mean"] == pytest.approx(statistics.fmean(rm), abs=1e-5)
    assert run_recipe(cfg, info) == 0
    row = json.loads(open(os.path.join(rl_dump, "metrics.jsonl")).readline())
    assert "reward/reward_model/mean" in row and "reward/exact_match/mean" in row


def test_bad_reward_model_folder_is_a_setup_error(tmp_path):
    r = subprocess.run(
        [
            sys.executable,
            os.path.join(ROOT, "train.py"),
            "--config",
            os.path.join(ROOT, "configs", "quickstart.toml"),
            "--training.steps=1",
            f"--job.dump_folder={tmp_path}",
            f"--reward.reward_model={tmp_path / 'missing'}",
        ],
        cwd=ROOT,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 4 and "reward.reward_model" in r.stderr, r.stderr[-2000:]
