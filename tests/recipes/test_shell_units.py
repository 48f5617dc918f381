"""Pieces the training shell issue fixed, each checked against a written-out reference:
batch-wide advantage statistics over ranks, GSPO's clip keys, moved and ignored
config keys, and the one FSDP2 rule of the model builder."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tandem.rl.algorithms import ADVANTAGES, POLICY_LOSSES, AdvantageConfig, AdvantageInput
from tandem.rl.recipes import unused_settings
from tandem.rl.config.schema import ConfigError, load_config

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
QUICKSTART = os.path.join(ROOT, "configs", "quickstart.toml")
SFT = os.path.join(ROOT, "configs", "quickstart_sft.toml")


def _batch(seed: int = 0, n: int = 8, t: int = 6):
    g = torch.Generator().manual_seed(seed)
    scores = torch.randn(n, generator=g, dtype=torch.float64)
    mask = (torch.rand(n, t, generator=g) > 0.3).double()
    mask[:, 0] = 1.0
    values = torch.randn(n, t, generator=g, dtype=torch.float64)
    return scores, mask, values


def _advantages(name: str, scores, mask, values, reduce_sum=None):
    inp = AdvantageInput(scores=scores, mask=mask, values=values, reduce_sum=reduce_sum,
                         group_index=torch.arange(len(scores)) // 2)
    return ADVANTAGES.get(name)(inp, AdvantageConfig(gamma=0.9, lam=0.8)).advantages


def _rank_worker(rank: int, port: int, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    scores, mask, values = _batch()
    half = slice(rank * 4, rank * 4 + 4)

    def reduce_sum(t):
        t = t.clone()
        dist.all_reduce(t)
        return t

    for name in ("reinforce_pp", "gae"):
        adv = _advantages(name, scores[half], mask[half], values[half], reduce_sum)
        torch.save(adv, os.path.join(out_dir, f"{name}-{rank}.pt"))
    dist.destroy_process_group()


def test_batch_wide_advantages_do_not_depend_on_the_number_of_ranks(tmp_path):
    """REINFORCE++ and GAE whitening over the whole rollout batch: the same scores split over
    two gloo ranks give, row for row, the advantages one rank computes over all of them."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(_rank_worker, args=(port, str(tmp_path)), nprocs=2, start_method="spawn")
    scores, mask, values = _batch()
    for name in ("reinforce_pp", "gae"):
        whole = _advantages(name, scores, mask, values)
        split = torch.cat([torch.load(tmp_path / f"{name}-{r}.pt") for r in range(2)])
        torch.testing.assert_close(split, whole, rtol=1e-12, atol=1e-12)
        # and not what each half alone would give (the test would pass trivially otherwise)
        alone = torch.cat([_advantages(name, scores[h], mask[h], values[h]) for h in (slice(0, 4), slice(4, 8))])
        assert not torch.allclose(alone, whole)


def test_whitening_matches_the_written_out_formula():
    scores, mask, values = _batch(3)
    adv = _advantages("reinforce_pp", scores, mask, values)
    # G_t = sum_{k >= t} 0.9^(k - t) r_k over masked tokens, r = score at the last masked token
    ret = torch.zeros_like(mask)
    for i in range(len(scores)):
        pos = mask[i].nonzero().flatten().tolist()
        for j, t in enumerate(pos):
            ret[i, t] = scores[i] * 0.9 ** (len(pos) - 1 - j)
    sel = ret[mask.bool()]
    want = (ret - sel.mean()) / (sel.std() + 1e-6) * mask
    torch.testing.assert_close(adv, want)


def test_gspo_reads_its_own_clip_keys_and_rejects_the_token_ones():
    cfg = load_config(QUICKSTART, ["--rl.policy_loss=gspo", "--rl.seq_clip_low=1e-3", "--rl.seq_clip_high=2e-3"])
    pcfg = cfg.rl
    assert (pcfg.seq_clip_low, pcfg.seq_clip_high) == (1e-3, 2e-3)
    assert POLICY_LOSSES.cap("gspo", "uses") == ("seq_clip_low", "seq_clip_high")
    with pytest.raises(ConfigError, match=r"rl.clip_high: not used by rl.policy_loss = 'gspo'.*rl.seq_clip_low"):
        load_config(QUICKSTART, ["--rl.policy_loss=gspo", "--rl.clip_high=0.28"])
    with pytest.raises(ConfigError, match=r"rl.seq_clip_low: not used by rl.policy_loss = 'ppo_clip'"):
        load_config(QUICKSTART, ["--rl.seq_clip_low=1e-3"])


def test_gspo_clip_range_reaches_the_loss():
    """A wider sequence clip range clips fewer tokens of the same batch."""
    from tandem.rl.algorithms import PolicyLossInput

    g = torch.Generator().manual_seed(0)
    logp = torch.randn(4, 5, generator=g, dtype=torch.float64) * 0.01
    old = logp + torch.randn(4, 5, generator=g, dtype=torch.float64) * 0.01
    inp = PolicyLossInput(logp=logp, old_logp=old, advantages=torch.ones(4, 5, dtype=torch.float64),
                          mask=torch.ones(4, 5, dtype=torch.float64), gen_logp=old)
    fracs = []
    for lo, hi in ((3e-4, 4e-4), (0.5, 0.5)):
        cfg = load_config(QUICKSTART, ["--rl.policy_loss=gspo", f"--rl.seq_clip_low={lo}", f"--rl.seq_clip_high={hi}"])
        out = POLICY_LOSSES.get("gspo")(inp, cfg.rl)
        fracs.append(out.metrics["clipped"].mean().item())
    assert fracs[0] > 0 and fracs[1] == 0


@pytest.mark.parametrize("key,new", [("rl.eval_interval", "training.eval_interval"),
                                     ("preference.eval_interval", "training.eval_interval"),
                                     ("model.dtype", "training.mixed_precision_param"),
                                     ("job.log_level", "never read"), ("optimizer.name", "AdamW")])
def test_moved_and_removed_keys_say_what_to_do(key, new):
    with pytest.raises(ConfigError) as e:
        load_config(QUICKSTART, [f"--{key}=1"])
    assert str(e.value).startswith(f"{key}: ") and new in str(e.value)


def test_keys_the_recipe_does_not_read_are_named():
    cfg = load_config(SFT, ["--rl.kl_coef=0.1", "--preference.beta=0.5", "--training.steps=3"])
    assert unused_settings(cfg) == ["rl.kl_coef", "preference.beta"]
    assert unused_settings(load_config(QUICKSTART)) == []


def test_one_fsdp_rule_for_every_model():
    """FSDP2 wraps a model when there are data-parallel ranks or when mixed precision is asked
    for, so a one-rank run (or pp x tp = world) on a GPU still computes in bfloat16; a
    one-rank float32 run is left unsharded."""
    from torch.distributed.fsdp import FSDPModule

    from tandem.models.flavors import get_flavor
    from tandem.models.transformer import Transformer
    from tandem.parallel.distributed import init_distributed
    from tandem.parallel.mesh import Degrees, build_mesh
    from tandem.parallel.parallelize import parallelize

    info = init_distributed(force_cpu=True)
    try:
        mesh = build_mesh(Degrees(pp=1, dp_replicate=1, dp_shard=1, tp=1), info.device)
        args = get_flavor("debug-qwen3")
        for dtype, sharded in (("float32", False), ("bfloat16", True)):
            with torch.device("meta"):
                model = Transformer(args)
            parallelize(model, mesh, param_dtype=dtype)
            assert isinstance(model, FSDPModule) is sharded
        with torch.device("meta"):
            model = Transformer(args)
        parallelize(model, mesh, cpu_offload=True)
        assert isinstance(model, FSDPModule)
        # and a bfloat16 forward through the one-rank FSDP2 unit computes in bfloat16
        with torch.device("meta"):
            model = Transformer(args)
        parallelize(model, mesh, param_dtype="bfloat16")
        model.to_empty(device="cpu")
        model.init_weights(0)
        model.reset_rope()
        seen = []
        model.layers["0"].attention.wq.register_forward_hook(lambda m, i, o: seen.append(o.dtype))
        model(torch.zeros(1, 4, dtype=torch.long))
        assert seen == [torch.bfloat16]
    finally:  # the next test module may set up a process group of its own
        dist.destroy_process_group()
