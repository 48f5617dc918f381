"""The compiled decode step (tandem/rl/generator/compiled_decode.py) against the eager one.

The eager mirror step is the reference: it is itself checked against the page gather and
the training forward (test_generator.py). One tiny model compiles one dynamic graph, shared
by the slow test's cases (about 15-40 s of inductor compile on 2 loaded cores).
"""

import json

import pytest
import torch

from tandem.kernels import batch_invariant
from tandem.models.flavors import get_flavor
from tandem.models.transformer import Transformer
from tandem.rl.generator import compiled_decode as cd
from tandem.rl.generator.engine import GenerationSettings, Generator
from tandem.rl.generator.sampler import hash_uniforms
from tandem.rl.generator.sequence import SamplingParams

# prompt lengths 1-60: contexts cross the width step (64) while the batch shrinks
PROMPTS = [[7], [5, 9, 2], list(range(10, 47)), list(range(100, 160)), [3] * 17]


@pytest.fixture(scope="module")
def model():
    m = Transformer(get_flavor("debug-qwen3"))
    m.init_weights(seed=0)
    return m.eval()


def _settings(**kw):
    return GenerationSettings(block_size=8, num_blocks=256, max_num_batched_tokens=64, **kw)


def _run(model, compile_decode, params, n=2):
    gen = Generator(model, _settings(compile_decode=compile_decode))
    out = gen.generate(PROMPTS, params, n=n)
    return [c for g in out for c in g], gen.runner.compiled


@pytest.mark.slow
def test_compiled_decode_samples_what_eager_samples(model, tmp_path, monkeypatch):
    """Greedy and seeded sampling: the same tokens, log-probs within 1e-5, over batches of
    10 down to 1 row (padded to 2) and widths of 64 and 128; the compiled noise's bits; and
    auto's measurement."""
    greedy = [SamplingParams(temperature=0.0, max_tokens=8 + 5 * i) for i in range(len(PROMPTS))]
    sampled = [
        SamplingParams(temperature=1.0, top_k=20, max_tokens=12 + 3 * i, seed=11 + i)
        for i in range(len(PROMPTS))
    ]
    for params in (greedy, sampled):
        ref, none = _run(model, False, params)
        out, compiled = _run(model, True, params)
        assert none is None and compiled is not None
        assert compiled.steps > 20 and {w for _, w in compiled.shapes} == {64, 128}
        assert len({b for b, _ in compiled.shapes}) > 3  # several batch sizes, one graph
        for a, b in zip(ref, out, strict=True):
            assert a.token_ids == b.token_ids
            torch.testing.assert_close(
                torch.tensor(b.raw_logprobs), torch.tensor(a.raw_logprobs), atol=1e-5, rtol=0
            )

    # The sampler's compiled noise uniforms: the very bits, so tokens never change by them.
    for rows, vocab in ((3, 512), (17, 1000), (40, 4099)):
        keys = torch.randint(0, 2**32, (rows, 2), dtype=torch.int64)
        assert torch.equal(cd.compiled_uniforms()(keys, vocab), hash_uniforms(keys, vocab))

    # The step is not bit for bit, which is why rl.exact keeps the eager step.
    args = model.args
    rows = torch.randn(args.num_layers, 2, 4, args.num_kv_heads, 64, args.head_dim)
    ids, lengths = torch.tensor([1, 2, 3, 4]), torch.tensor([5, 17, 40, 63])
    with torch.inference_mode():
        eager = cd._step(model, ids, lengths, lengths, rows, args.head_dim**-0.5)[0]
        compiled = cd.compiled_step()(model, ids, lengths, lengths, rows, args.head_dim**-0.5)[0]
    torch.testing.assert_close(compiled, eager, atol=1e-4, rtol=0)
    assert not torch.equal(compiled, eager), "bit for bit now: rl.exact could compile"

    # auto measures once, keeps the figures, and decides by them
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    steps = 10**7  # repays any compile a faster step has
    decided = cd.choose(model, args.head_dim**-0.5, steps)
    entry = json.loads((tmp_path / "tandem" / "compile_decode.json").read_text())[
        cd.machine_key(model)
    ]
    assert entry["compile_s"] > 0 and entry["eager_ms"] > 0 and entry["compiled_ms"] > 0
    saved = (entry["eager_ms"] - entry["compiled_ms"]) * steps / 1e3
    assert decided == (saved > entry["compile_s"])


def test_auto_compiles_only_where_it_pays(model, tmp_path, monkeypatch):
    """A run too short to repay any compile measures nothing and compiles nothing; a kept
    measurement decides by saved seconds (eager - compiled ms x steps) against compile
    seconds."""
    monkeypatch.setattr(cd, "compiled_step", lambda: pytest.fail("compiled"))
    path = tmp_path / "m.json"
    assert cd.choose(model, 0.125, decode_steps=10, path=path) is False
    assert not path.exists()
    key = cd.machine_key(model)
    path.write_text(json.dumps({key: dict(eager_ms=10.0, compiled_ms=6.0, compile_s=20.0)}))
    assert cd.choose(model, 0.125, decode_steps=4000, path=path) is False  # saves 16 s
    assert cd.choose(model, 0.125, decode_steps=6000, path=path) is True  # saves 24 s


def test_exact_and_moe_keep_the_eager_step(model):
    """rl.exact (batch-invariant kernels) and MoE models never take the compiled step, even
    when it is asked for; a process that never chose compiles nothing."""
    with batch_invariant.exact_mode():
        gen = Generator(model, _settings(compile_decode=True))
    assert gen.runner.compiled is None
    moe = Transformer(get_flavor("debug-qwen3-moe"))
    moe.init_weights(seed=0)
    assert cd.supported(moe) is not None
    assert Generator(moe.eval(), _settings(compile_decode=True)).runner.compiled is None
    assert cd.process_choice()[0] is False
    assert Generator(model, _settings()).runner.compiled is None


def test_a_step_that_does_not_compile_runs_eagerly(model, monkeypatch):
    """A model the compiler cannot take (here: a compile that raises) falls back to the eager
    step at its first decode step, with the eager step's tokens; the noise to the eager
    hash."""

    def fails(*args):
        raise RuntimeError("cannot trace")

    monkeypatch.setattr(cd, "compiled_step", lambda: fails)
    params = [SamplingParams(temperature=0.0, max_tokens=6)] * 5  # greedy: no noise
    ref, _ = _run(model, False, params)
    out, compiled = _run(model, True, params)
    assert compiled.failed and compiled.steps == 0
    assert [c.token_ids for c in out] == [c.token_ids for c in ref]
    monkeypatch.setattr(cd, "_UNIFORMS", fails)  # the noise likewise: the eager hash's bits
    keys = torch.randint(0, 2**32, (3, 2), dtype=torch.int64)
    assert torch.equal(cd.compiled_uniforms()(keys, 64), hash_uniforms(keys, 64))


def test_setting_is_checked():
    with pytest.raises(ValueError, match="compile_decode: expected true, false or 'auto'"):
        cd.set_compile_decode("yes")
