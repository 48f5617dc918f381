"""Colocated asynchronous rollout, one process: suspending sequences through an update.

- the generation copy refilled in place equals a fresh build, in the same tensors;
- KV offloaded to host memory and back: the same tokens and log-probs, bit for bit, as a
  generator that never stopped; KV freed and recomputed (same weights): the same tokens;
- every token carries the version of the phase that sampled it, and a group restored from
  a checkpoint's records samples on exactly as one that never left the generator.
"""

import dataclasses
import random
from types import SimpleNamespace

import pytest
import torch

from tandem.kernels.cpu_linear import OneDNNLinear, onednn_linear_available
from tandem.models.flavors import get_flavor
from tandem.models.transformer import Transformer
from tandem.parallel.generation_layout import GenerationCopy, GenerationLayout
from tandem.rl.config.rl_schema import RolloutConfig
from tandem.rl.data.prompts import Prompt
from tandem.rl.generator.engine import GenerationSettings, Generator
from tandem.rl.generator.sequence import SamplingParams
from tandem.rl.rollout.inflight import Flight
from tandem.rl.rollout.streaming_groups import StreamingGenerator

TOK = SimpleNamespace(eos_token_ids=[], decode=lambda ids, skip_special_tokens=False: "")


def _model(seed):
    m = Transformer(get_flavor("debug-qwen3"))
    m.init_weights(seed=seed)
    return m.eval()


def _prompts(n=3, seed=0):
    r = random.Random(seed)
    return [[r.randrange(3, 500) for _ in range(r.randrange(3, 9))] for _ in range(n)]


@pytest.mark.parametrize("onednn", [False, True])
def test_refill_in_place_equals_a_fresh_build(onednn):
    policy = _model(0)
    copy = GenerationCopy(
        policy, policy.args, GenerationLayout(), torch.device("cpu"), cpu_onednn=onednn
    )
    gen, _ = copy.build()
    ptrs = {k: v.data_ptr() for k, v in gen.state_dict().items()}
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(0.01 * torch.randn_like(p))
    copy.refill(gen)
    fresh, _ = copy.build()
    got, want = gen.state_dict(), fresh.state_dict()
    assert got.keys() == want.keys()
    assert any("wqkv" in k for k in got) == (onednn and onednn_linear_available())  # fused
    for k in got:
        assert torch.equal(got[k], want[k]), k
        assert got[k].data_ptr() == ptrs[k], k  # the same tensors, written in place
    packed = [m for m in gen.modules() if isinstance(m, OneDNNLinear) and m.packed is not None]
    assert all(m.packed[1] == m.weight._version for m in packed)  # repacked: the new weights


def _generate(model, prompts, pause_after=None, how=None):
    """Greedy-free sampling of 2 samples per prompt, 14 tokens each (EOS ignored); ``how``
    ("offload" | "recompute") suspends the KV after ``pause_after`` steps and brings it back."""
    settings = GenerationSettings(num_blocks=64, block_size=4, max_num_seqs=16, max_model_len=64)
    gen = Generator(model, settings)
    params = SamplingParams(temperature=1.0, max_tokens=14, ignore_eos=True)
    groups = [
        gen.add(p, dataclasses.replace(params, seed=100 + i), n=2) for i, p in enumerate(prompts)
    ]
    steps = 0
    while gen.scheduler.has_unfinished():
        gen.step()
        steps += 1
        if steps == pause_after:
            if how == "offload":
                gen.offload_kv()
                gen.restore_kv()
            else:
                gen.release_kv()
                gen.reacquire_kv()
    return [s for g in groups for s in g]


@pytest.mark.parametrize("how", ["offload", "recompute"])
def test_suspended_kv_continues_the_same_samples(how):
    model, prompts = _model(1), _prompts()
    ref = _generate(model, prompts)
    got = _generate(model, prompts, pause_after=6, how=how)
    for a, b in zip(ref, got, strict=True):
        assert a.token_ids == b.token_ids
        if how == "offload":  # the same K/V values back: bit for bit
            assert a.raw_logprobs == b.raw_logprobs
        else:  # recomputed K/V (a prefill instead of decode steps): float noise
            torch.testing.assert_close(
                torch.tensor(b.raw_logprobs), torch.tensor(a.raw_logprobs), atol=1e-5, rtol=0
            )


def _rcfg(kv):
    return RolloutConfig(
        temperature=1.0, max_tokens=14, block_size=4, kv_cache_gb=0.01, suspended_kv=kv
    )


def _phases(kv, seeds, steps_per_phase, restore_at=None):
    """Run a StreamingGenerator through phases, suspending between them; phase v's weights are
    ``_model(seeds[v])``, refilled in place into one generation copy as the recipe does. At
    ``restore_at`` its state goes through a new StreamingGenerator (a checkpoint)."""
    prompts = [Prompt(i, p, {}) for i, p in enumerate(_prompts())]
    flights = {i: Flight(i, i, 0, 1000 + 17 * i) for i in range(len(prompts))}
    policy = _model(seeds[0])
    copy = GenerationCopy(policy, policy.args, GenerationLayout(), torch.device("cpu"))
    gen_model = None
    sg = StreamingGenerator(TOK, _rcfg(kv), max_prompt=16, max_seqs=12)
    counts = []  # per phase: tokens each sequence had at its end
    for v, (seed, k) in enumerate(zip(seeds, steps_per_phase)):
        policy.load_state_dict(_model(seed).state_dict())
        if gen_model is None:
            gen_model, _ = copy.build()
        else:
            copy.refill(gen_model)
        if v == restore_at:
            state = sg.state()
            sg = StreamingGenerator(TOK, _rcfg(kv), max_prompt=16, max_seqs=12)
            sg.restore(state, flights, prompts)
        sg.resume(gen_model)
        if v == 0:
            for f in flights.values():
                sg.add(f, prompts[f.row], 2)
        for _ in range(k):
            if sg.busy():
                sg.step()
        sg.suspend(v)
        counts.append(
            {(p, j): s.num_generated for p, g in sg.groups.items() for j, s in enumerate(g.seqs)}
        )
    return {p: sg.take(p) for p in sorted(sg.complete())}, counts


def _train_logprobs(model, s):
    ids = torch.tensor([s.prompt_ids + s.completion_ids])
    with torch.no_grad():
        logp = torch.log_softmax(model(ids)[0].float(), dim=-1)
    pos = torch.arange(len(s.prompt_ids) - 1, len(ids[0]) - 1)
    return logp[pos, torch.tensor(s.completion_ids)]


@pytest.mark.parametrize("kv", ["keep", "offload", "recompute"])
def test_every_token_carries_the_version_of_the_phase_that_sampled_it(kv):
    seeds = (2, 3, 4, 5)
    samples, counts = _phases(kv, seeds, [5, 4, 3, 40])
    assert sorted(samples) == [0, 1, 2] and all(len(g) == 2 for g in samples.values())
    models = [_model(seed) for seed in seeds]
    for p, group in samples.items():
        for j, s in enumerate(group):
            assert len(s.versions) == len(s.completion_ids) == 14
            # the phase boundaries: tokens up to counts[v] were sampled by version v
            bounds = [0] + [counts[v][(p, j)] for v in range(len(seeds))]
            want = [v for v in range(len(seeds)) for _ in range(bounds[v + 1] - bounds[v])]
            assert s.versions == want, (p, j)
            assert s.first_version == 0 and s.last_version == max(want)
            # and those weights sampled them: with the KV recomputed at every resume, each token's
            # log-prob is its version's full forward (kept KV mixes versions: only phase 0's)
            for v in sorted(set(want)) if kv == "recompute" else [0]:
                at = torch.tensor([x == v for x in want])
                want_lp = _train_logprobs(models[v], s)[at]
                got_lp = torch.tensor(s.gen_logprobs)[at]
                torch.testing.assert_close(got_lp, want_lp, atol=1e-5, rtol=0)
    versions = {v for g in samples.values() for s in g for v in s.versions}
    assert versions == {0, 1, 2, 3}  # every phase sampled some


def test_a_group_restored_from_a_checkpoint_samples_on_like_one_that_stayed():
    seeds = (6, 6, 6)  # the same weights in every phase
    stayed, _ = _phases("recompute", seeds, [6, 5, 40])
    restored, _ = _phases("recompute", seeds, [6, 5, 40], restore_at=1)
    assert stayed.keys() == restored.keys()
    for p in stayed:
        for a, b in zip(stayed[p], restored[p], strict=True):
            assert a.completion_ids == b.completion_ids and a.versions == b.versions
            torch.testing.assert_close(
                torch.tensor(b.gen_logprobs), torch.tensor(a.gen_logprobs), atol=1e-5, rtol=0
            )
