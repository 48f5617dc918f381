"""The one table of what composes (tandem/rl/config/composes.py), row by row.

Each row is tried both ways from the quickstart config: with both of its features on, the
check refuses with exactly the row's line; with either feature alone, that row is silent. The
settings that turn a feature on are written here by hand, independently of the table's own
tests of them, so a feature whose test reads the wrong key fails here. The same table is
what config load runs (one end-to-end case below) and what docs/config.md shows.
"""

from __future__ import annotations

import ast
import os
from pathlib import Path
from types import SimpleNamespace

import pytest

from tandem.models.hf import load_args
from tandem.rl.config.composes import FEATURES, REFUSALS, Facts, check_composes
from tandem.rl.config.schema import ConfigError, load_config
from tandem.rl.core.configlib import apply_override, split_override

ROOT = Path(__file__).resolve().parents[2]
QUICKSTART = str(ROOT / "configs" / "quickstart.toml")
TEXT = SimpleNamespace(vision=None, num_experts=0)  # a dense text model's ModelArgs, as facts
QUICK_ARGS = load_args(str(ROOT / "assets" / "quickstart-policy"))

# feature -> (config overrides, facts beyond the config) that turn it on
ON: dict[str, tuple[list[str], dict]] = {
    "A": (["rollout.mode=colocated_async"], {}),
    "S": (["rollout.mode=split", "rollout.gen_ranks=1"], {}),
    "L": (["lora.rank=4"], {}),
    "F": (["rollout.kv_dtype=fp8_e4m3"], {}),
    "C": (["parallel.cp=2"], {}),
    "V": ([], {"args": SimpleNamespace(vision=object(), num_experts=0)}),
    "H": (["env.kind=http", "reward.functions=[]"], {}),
    "M": ([], {"args": SimpleNamespace(vision=None, num_experts=8)}),
    "gpt_oss": ([], {"args": SimpleNamespace(vision=None, num_experts=0, model_type="gpt_oss")}),
    "mla": ([], {"args": SimpleNamespace(vision=None, num_experts=0, model_type="deepseek_v3")}),
    "qwen3_5": ([], {"args": SimpleNamespace(vision=None, num_experts=0, linear=object())}),
    "T": (["parallel.tp=2"], {}),
    "P": (["parallel.pp=2"], {}),
    "E": (["env.name=tool"], {}),
    "D": (["rl.dynamic_sampling=true"], {}),
    "K": (["rl.advantage=gae"], {}),
    "R": (["rl.kl_coef=0.1"], {}),
    "O": (['distill.teachers=["assets/quickstart-policy"]'], {}),
    "X": (["rl.exact=true"], {}),
    "ep": (["parallel.ep=2"], {}),
    "dp_replicate": (["parallel.dp_replicate=2"], {}),
    "rollout_tp": (["rollout.tp=2"], {}),
    "weight_quant": (["rollout.weight_dtype=w4a16"], {}),
    # the quickstart policy's q projection: 64 rows, 32 per rank, cut by 128-row blocks
    "cut_blocks": (["rollout.weight_dtype=fp8_block", "rollout.tp=2"], {"args": QUICK_ARGS}),
    "quantize_update": (["rollout.weight_dtype=fp8_block", "rl.quantize_update=true"], {}),
    "mismatch_contract": (["rl.max_mismatch_kl=0.015"], {}),
    "partial_group": (["rollout.tp=2"], {"world": 4}),
    "ring_cp": (["parallel.cp=2", "parallel.cp_style=ring"], {}),
    "accelerator": ([], {"device": "cuda"}),
    "expert_lora": (["lora.rank=4", 'lora.targets=["q", "experts"]'], {}),
    "lora_dropout": (["lora.rank=4", "lora.dropout=0.1"], {}),
    "xtok_teachers": ([], {"cross_tokenizer": True}),
    "reward_model": (['reward.reward_model="assets/quickstart-policy"'], {}),
    "offload_optimizer": (["rl.offload_optimizer=true"], {}),
    "share_prompts": (["advanced.share_prompts=true"], {}),
    "rollback": (["fault.on_nonfinite=rollback"], {}),
    "no_checkpoints": (["checkpoint.enable=false"], {}),
    "env_workers": (['env.workers=["127.0.0.1:9000"]'], {}),
    "rl": ([], {}),
    "not_rl": (["training.recipe=sft"], {}),
    "rm_recipe": (["training.recipe=reward_model"], {}),
}


def _facts(*features: str) -> Facts:
    """The quickstart config with ``features`` on, set key by key (no config-load check)."""
    cfg = load_config(QUICKSTART)
    known = {"args": TEXT, "world": 2, "device": "cpu", "rollout_tp": None}
    for name in features:
        overrides, facts = ON[name]
        for item in overrides:
            apply_override(cfg, *split_override(item))
        known.update(facts)
    return Facts(cfg, **known)


def test_every_feature_has_settings_here():
    assert set(ON) == set(FEATURES)


def test_no_pair_is_listed_twice():
    pairs = [frozenset((r.a, r.b)) for r in REFUSALS]
    assert len(pairs) == len(set(pairs)), [p for p in pairs if pairs.count(p) > 1]


@pytest.mark.parametrize("row", REFUSALS, ids=[f"{r.a}-{r.b}" for r in REFUSALS])
def test_each_row_refuses_its_pair_and_nothing_alone(row):
    facts = _facts(row.a, row.b)
    assert FEATURES[row.a].on(facts) and FEATURES[row.b].on(facts)
    with pytest.raises(ConfigError) as e:
        check_composes(facts)
    assert str(e.value) == row.line()
    assert str(e.value).startswith(FEATURES[row.a].key + ": ") and "\n" not in str(e.value)
    for alone, other in ((row.a, row.b), (row.b, row.a)):
        facts = _facts(alone)
        if FEATURES[other].on(facts):  # the quickstart itself has it (the rl recipe)
            continue
        refused = [r for r in REFUSALS if FEATURES[r.a].on(facts) and FEATURES[r.b].on(facts)]
        assert row not in refused, (alone, refused)


def test_the_quickstart_uses_no_refused_pair():
    check_composes(_facts("rl"))


def test_unknown_facts_wait_for_the_later_check():
    """At config load the device and the model may be unknown: their rows stay silent."""
    facts = _facts("X").but(device=None)
    check_composes(facts)
    with pytest.raises(ConfigError, match=r"^rl\.exact: rl\.exact does not run with a device"):
        check_composes(facts.but(device="cuda"))


def test_config_load_runs_the_table():
    with pytest.raises(ConfigError) as e:
        load_config(QUICKSTART, ["rollout.kv_dtype=fp8_e4m3", "parallel.pp=2"])
    row = next(r for r in REFUSALS if {r.a, r.b} == {"F", "P"})
    assert str(e.value) == row.line()
    vlm = str(ROOT / "assets" / "quickstart-vlm-policy")
    if os.path.isdir(vlm):  # the model's facts come from its folder's config.json
        with pytest.raises(ConfigError, match="a vision-language model"):
            load_config(QUICKSTART, [f"model.path={vlm}", "lora.rank=4"])


_WORDS = ("so far", "has not run", "not supported yet", "does not run with", "only so far")


def test_no_pair_refusal_is_raised_outside_the_table():
    """A "not with X yet" line anywhere but composes.py is a second home for a rule: each
    ``raise`` and ``require(...)`` under tandem/rl is read for the words such a line uses."""
    bad = []
    for path in (ROOT / "tandem").rglob("*.py"):
        if path.name == "composes.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            call = isinstance(node, ast.Call) and getattr(node.func, "id", "") == "require"
            if not (isinstance(node, ast.Raise) or call):
                continue
            text = " ".join(
                n.value
                for n in ast.walk(node)
                if isinstance(n, ast.Constant) and isinstance(n.value, str)
            )
            config_error = call or "ConfigError" in ast.unparse(node)
            if config_error and any(w in text for w in _WORDS):
                bad.append(f"{path.relative_to(ROOT)}:{node.lineno}: {text[:80]}")
    assert not bad, bad
