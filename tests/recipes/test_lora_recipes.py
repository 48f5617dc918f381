"""LoRA in the sft, dpo and reward_model recipes (in-process, one CPU rank), and its config checks.

* DPO with rank-16 adapters reaches full DPO's held-out accuracy within 0.05, and its reference
  (the base with the adapters off) gives the same run precomputed or online;
* SFT from the quickstart policy with adapters lowers the held-out loss, and a second run that
  starts from the first one's ``hf-adapter/`` (``lora.adapter_path``) starts where it ended;
* a reward model trains adapters plus its new score head;
* bad ``[lora]`` settings are one ConfigError line.
"""

from __future__ import annotations

import json
import math
import os

import pytest
import torch
from safetensors.torch import load_file

from tandem.parallel.distributed import init_distributed
from tandem.rl.config.schema import ConfigError, load_config
from tandem.rl.recipes import run as run_recipe
from tests.fixtures import one_thread  # noqa: F401  (a fixture)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
POLICY = os.path.join(ROOT, "assets", "quickstart-policy")
PAIRS = [
    "--data.path=synthetic:sorting",
    "--data.synthetic_rows=128",
    "--training.batch_size=32",
    "--training.micro_batch_size=16",
    "--optimizer.lr=3e-3",
    "--lr_schedule.warmup_steps=2",
    "--metrics.loggers=[]",
    "--checkpoint.enable=false",
]


def _run(config: str, dump, *overrides: str) -> list[dict]:
    cfg = load_config(
        os.path.join(ROOT, "configs", config), [f"--job.dump_folder={dump}", *overrides]
    )
    assert run_recipe(cfg, init_distributed(force_cpu=True)) == 0
    return [json.loads(line) for line in open(os.path.join(dump, "metrics.jsonl"))]


@pytest.mark.slow
def test_dpo_with_lora_matches_full_dpo(tmp_path, one_thread):
    """20 steps of the debug DPO (sorted over unsorted replies, held-out lists); measured:
    full 0.938, LoRA 0.953 held-out accuracy, online == precompute."""
    steps = ("--training.steps=20", "--checkpoint.export_hf_at_end=false")
    full = _run("dpo.toml", tmp_path / "full", *PAIRS, *steps)
    lora = _run("dpo.toml", tmp_path / "lora", *PAIRS, *steps, "--lora.rank=16")
    online = _run(
        "dpo.toml",
        tmp_path / "online",
        *PAIRS,
        *steps,
        "--lora.rank=16",
        "--preference.reference=online",
    )
    # step 1: the adapters start at zero, so the policy is its reference (a tie: loss log 2)
    assert lora[0]["accuracy"] == 0.5 and abs(lora[0]["loss"] - math.log(2)) < 1e-6
    assert abs(lora[-1]["eval/accuracy"] - full[-1]["eval/accuracy"]) <= 0.05, (lora[-1], full[-1])
    assert lora[-1]["eval/accuracy"] >= 0.85
    for a, b in zip(lora, online, strict=True):
        # the base with the adapters off is the precomputed reference
        for key in ("loss", "margin", "grad_norm"):
            assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-7), (a["step"], key)


@pytest.mark.slow
def test_sft_lora_learns_and_continues_from_its_adapter(tmp_path, one_thread, capsys):
    """SFT on clean sums from the quickstart policy, which ends half its answers with "!": the
    adapters remove the habit (held-out loss falls); a run from the exported adapter starts
    where the first ended (the same held-out loss) and trains on."""
    common = (
        "--model.flavor=none",
        f"--model.path={POLICY}",
        "--model.tokenizer=none",
        "--training.steps=10",
        "--training.batch_size=8",
        "--training.micro_batch_size=8",
        "--data.eval_fraction=0.1",
        "--data.path=synthetic:addition_small?max_value=19",
        "--data.synthetic_rows=400",
        "--data.max_length=128",
        "--lr_schedule.warmup_steps=0",
        "--lora.rank=8",
        "--optimizer.lr=1e-3",
        "--checkpoint.enable=false",
    )
    first = _run("quickstart_sft.toml", tmp_path / "first", *common)
    said = capsys.readouterr().out
    start, end = float(said.split("eval loss at start: ")[1].split()[0]), first[-1]["eval/loss"]
    assert end < 0.7 * start, (start, end)
    adapter = tmp_path / "first" / "hf-adapter"
    assert (adapter / "adapter_config.json").is_file() and (
        tmp_path / "first" / "hf" / "config.json"
    ).is_file()
    _run(
        "quickstart_sft.toml",
        tmp_path / "second",
        *common,
        f"--lora.adapter_path={adapter}",
        "--training.steps=1",
    )
    assert f"eval loss at start: {end:.3f}" in capsys.readouterr().out  # not the base's {start:.3f}
    got, ref = (
        load_file(adapter / "adapter_model.safetensors"),
        load_file(tmp_path / "second" / "hf-adapter" / "adapter_model.safetensors"),
    )
    # and it trains on
    assert got.keys() == ref.keys() and any(not torch.equal(got[k], ref[k]) for k in ref)


@pytest.mark.slow
def test_reward_model_trains_adapters_and_its_head(tmp_path, one_thread):
    rows = _run(
        "reward_model.toml",
        tmp_path / "rm",
        "--training.steps=20",
        "--data.synthetic_rows=128",
        "--lora.rank=16",
        "--optimizer.lr=3e-3",
        "--metrics.loggers=[]",
        "--checkpoint.enable=false",
    )
    assert rows[-1]["eval/accuracy"] >= 0.8, rows[-1]
    assert (tmp_path / "rm" / "reward_model" / "config.json").is_file()  # merged, as without LoRA


def test_bad_lora_settings_are_one_line(tmp_path):
    quick = os.path.join(ROOT, "configs", "quickstart_lora.toml")
    with pytest.raises(ConfigError, match=r"lora.targets: unknown \['qq'\]"):
        load_config(quick, ["--lora.targets=['q', 'qq']"])
    with pytest.raises(ConfigError, match="lora.adapter_path: no adapter_config.json in"):
        load_config(quick, [f"--lora.adapter_path={tmp_path}"])
    (tmp_path / "adapter_config.json").write_text(
        json.dumps(
            {"peft_type": "LORA", "r": 8, "lora_alpha": 16, "target_modules": ["q_proj", "v_proj"]}
        )
    )
    with pytest.raises(
        ConfigError, match=r"lora.adapter_path: lora has rank 16, but the adapter has r = 8"
    ):
        load_config(quick, [f"--lora.adapter_path={tmp_path}"])
    with pytest.raises(
        ConfigError, match=r"targets \[.*\], but the adapter's target_modules give \['q', 'v'\]"
    ):
        load_config(quick, [f"--lora.adapter_path={tmp_path}", "--lora.rank=8", "--lora.alpha=16"])
    (tmp_path / "adapter_config.json").write_text(
        json.dumps(
            {
                "peft_type": "LORA",
                "r": 8,
                "lora_alpha": 16,
                "target_modules": ["q_proj"],
                "use_dora": True,
            }
        )
    )
    with pytest.raises(ConfigError, match="use_dora = True is not supported"):
        load_config(quick, [f"--lora.adapter_path={tmp_path}"])
    with pytest.raises(
        ConfigError,
        match=r"^lora\.targets: LoRA on routed experts .* does not run with parallel\.ep > 1",
    ):
        load_config(
            os.path.join(ROOT, "configs", "quickstart_moe.toml"),
            ["--lora.rank=8", "--lora.targets=['experts']"],
        )
    with pytest.raises(ConfigError, match=r"^lora\.dropout: lora\.dropout > 0 does not run with"):
        load_config(quick, [f"--job.dump_folder={tmp_path / 'rl'}", "--lora.dropout=0.1"])


@pytest.mark.slow
def test_rl_with_expert_adapters_exports_the_merged_model(tmp_path, one_thread):
    """The MoE quickstart (EP off) with adapters on attention and on every routed expert: two RL
    steps, then hf/ (merged) gives the logits of the base plus the checkpoint's adapters."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    from tandem.models.hf import load_model
    from tandem.models.lora import LoraSpec, apply_lora

    dump = tmp_path / "moe"
    rows = _run(
        "quickstart_moe.toml",
        dump,
        "--parallel.ep=1",
        "--lora.rank=8",
        "--lora.targets=['q', 'k', 'v', 'o', 'experts']",
        "--training.steps=2",
        "--rl.prompts_per_step=8",
        "--rl.eval_prompts=8",
        "--rl.eval_samples=0",
        "--metrics.loggers=[]",
        "--checkpoint.interval=2",
    )
    assert [r["step"] for r in rows] == [1, 2] and all(r["gap/abs_mean"] < 1e-6 for r in rows)
    assert not (dump / "hf-adapter").exists()  # PEFT has no per-expert adapters: hf/ alone
    dcp_to_torch_save(dump / "checkpoints" / "step-2", tmp_path / "step-2.pt")
    adapters = torch.load(tmp_path / "step-2.pt", weights_only=False)["model"]
    assert any("experts.w2_lora_B" in k for k in adapters)
    ours = load_model(os.path.join(ROOT, "assets", "quickstart-moe-policy"))
    apply_lora(ours, LoraSpec(rank=8, alpha=32, targets=("q", "k", "v", "o", "experts")))
    ours.load_state_dict(adapters, strict=False)
    merged = load_model(dump / "hf")
    x = torch.randint(0, 300, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a, b = ours(x), merged(x)
    assert (a - b).abs().max() <= 1e-5 * max(1.0, b.abs().max().item())
    assert any(
        not torch.equal(v, adapters[k].new_zeros(v.shape))
        for k, v in adapters.items()
        if "lora_B" in k
    )
