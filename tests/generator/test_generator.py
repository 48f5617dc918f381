"""The generator against a naive loop that recomputes the full sequence each token.

Headline property (keep forever): the log-prob the generator reports for each
sampled token equals the one the training forward computes for the same
sequence (fp32 CPU, <= 1e-5).
"""

import copy
import random

import pytest
import torch

from tandem.models.flavors import get_flavor
from tandem.models.transformer import Transformer
from tandem.parallel.generation_layout import GenerationCopy, GenerationLayout
from tandem.rl.generator.engine import GenerationSettings, Generator, stop_strings_check
from tandem.rl.generator.sequence import SamplingParams


@pytest.fixture(scope="module")
def model(device):
    args = get_flavor("debug-qwen3")
    m = Transformer(args)
    m.init_weights(seed=0)
    # Sharpen the distribution a little so greedy paths are not all-ties.
    return m.to(device).eval()  # the conformance suite's --device (the CPU by default)


def naive_greedy(model, prompt, max_tokens, eos=()):
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(max_tokens):
            logits = model(torch.tensor([ids], device=next(model.parameters()).device))[0, -1]
            tok = int(logits.argmax())
            ids.append(tok)
            if tok in eos:
                break
    return ids[len(prompt) :]


def train_logprobs(model, prompt, completion):
    """log p(token) for each completion token from one full training forward."""
    ids = torch.tensor([prompt + completion], device=next(model.parameters()).device)
    with torch.no_grad():
        logp = torch.log_softmax(model(ids)[0].float(), dim=-1).cpu()  # [S, V]
    pos = torch.arange(len(prompt) - 1, len(prompt) + len(completion) - 1)
    return logp[pos, torch.tensor(completion)]


def assert_same_samples(ref, out, atol=1e-5):
    """Pairs of completions (or sequences): equal tokens, raw log-probs within ``atol``."""
    for a, b in zip(ref, out, strict=True):
        assert a.token_ids == b.token_ids
        torch.testing.assert_close(
            torch.tensor(list(b.raw_logprobs)),
            torch.tensor(list(a.raw_logprobs)),
            atol=atol,
            rtol=0,
        )


def flat(groups):
    return [c for g in groups for c in g]


PROMPTS = [
    [5, 9, 2],
    [7],
    list(range(10, 47)),
    [3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3],
    [100, 200],
]


@pytest.mark.conformance
@pytest.mark.parametrize("sharing", [True, False])
@pytest.mark.parametrize(
    "block_size,num_blocks,budget", [(4, 512, 64), (16, 64, 2048), (4, 14, 16)]
)
def test_greedy_equals_naive_loop(model, sharing, block_size, num_blocks, budget):
    settings = GenerationSettings(
        block_size=block_size,
        num_blocks=num_blocks,
        max_num_batched_tokens=budget,
        prefix_sharing=sharing,
        max_model_len=96,
    )
    gen = Generator(model, settings)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    out = gen.generate(PROMPTS, params, n=3)
    for i, p in enumerate(PROMPTS):
        ref = naive_greedy(model, p, 12)
        for c in out[i]:
            assert c.token_ids == ref
            assert c.finish_reason == "length"
    assert gen.pool_is_free()
    if num_blocks == 14:  # pool too small for the batch: preemption by recompute happened
        assert gen.stats.preemptions > 0


@pytest.mark.conformance
def test_logprobs_match_training_forward(model):
    gen = Generator(
        model, GenerationSettings(block_size=8, num_blocks=128, max_num_batched_tokens=32)
    )
    params = SamplingParams(temperature=1.0, max_tokens=20, seed=1234, ignore_eos=True)
    out = gen.generate(PROMPTS, params, n=2)
    worst = 0.0
    for i, p in enumerate(PROMPTS):
        for c in out[i]:
            ref = train_logprobs(model, p, c.token_ids)
            got = torch.tensor(c.raw_logprobs)
            worst = max(worst, (ref - got).abs().max().item())
            # at temperature 1 with no truncation the sampled distribution is the raw one
            assert torch.allclose(torch.tensor(c.logprobs), got, atol=1e-6)
    assert worst <= 1e-5, worst
    assert gen.pool_is_free()


def test_seeded_sampling_independent_of_batch(model):
    params = SamplingParams(
        temperature=0.9, top_k=50, top_p=0.95, max_tokens=10, seed=77, ignore_eos=True
    )
    alone = Generator(model, GenerationSettings(num_blocks=64)).generate([PROMPTS[0]], params)[0][0]
    others = SamplingParams(temperature=1.0, max_tokens=7, seed=5, ignore_eos=True)
    gen = Generator(
        model, GenerationSettings(block_size=4, num_blocks=256, max_num_batched_tokens=16)
    )
    batch = gen.generate([PROMPTS[2], PROMPTS[0], PROMPTS[1]], [others, params, others])
    assert batch[1][0].token_ids == alone.token_ids
    assert batch[1][0].logprobs == pytest.approx(alone.logprobs, abs=1e-5)


def test_eos_and_stop_strings(model):
    ref = naive_greedy(model, PROMPTS[0], 12)
    eos = ref[3]
    gen = Generator(model, GenerationSettings(num_blocks=64), eos_token_ids=[eos])
    c = gen.generate([PROMPTS[0]], SamplingParams(temperature=0.0, max_tokens=12))[0][0]
    assert c.token_ids == ref[: ref.index(eos) + 1] and c.finish_reason == "stop"
    # stop string: decode ids as characters of their own, stop on the text of token 2..3
    decode = lambda ids: "".join(chr(65 + (t % 26)) for t in ids)  # noqa: E731
    target = decode(ref[1:3])
    gen = Generator(model, GenerationSettings(num_blocks=64))
    c = gen.generate(
        [PROMPTS[0]],
        SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
        stop_check=stop_strings_check(decode, [target]),
    )[0][0]
    assert target in decode(c.token_ids) and c.finish_reason == "stop"
    assert len(c.token_ids) <= ref.index(ref[2]) + 1 + 2
    assert gen.pool_is_free()


def test_multi_turn_pause_append_resume(model):
    """A paused sequence keeps its KV; appended tokens are unmasked context; others continue."""
    gen = Generator(model, GenerationSettings(block_size=4, num_blocks=128))
    greedy = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    a = gen.add(PROMPTS[0], greedy)[0]
    b = gen.add(PROMPTS[1], SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True))[0]
    while a.num_generated < 3:
        gen.step()
    gen.pause(a)
    before = b.num_generated
    for _ in range(4):
        gen.step()
    assert b.num_generated == before + 4 and a.num_generated == 3  # b progressed while a waited
    env = [11, 12, 13]
    gen.append(a, env)
    gen.resume(a)
    while not a.is_finished:
        gen.step()
    first3 = a.token_ids[len(PROMPTS[0]) : len(PROMPTS[0]) + 3]
    assert first3 == naive_greedy(model, PROMPTS[0], 3)
    ctx = PROMPTS[0] + first3 + env
    assert a.token_ids[len(ctx) :] == naive_greedy(model, ctx, 3)
    assert a.completion_sampled_mask == [True] * 3 + [False] * 3 + [True] * 3
    # log-probs across the turn still match the training forward on the whole context
    comp = a.completion_token_ids
    ref = train_logprobs(model, PROMPTS[0], comp)
    sampled = torch.tensor(a.completion_sampled_mask)
    assert torch.allclose(ref[sampled], torch.tensor(a.raw_logprobs), atol=1e-5)
    while gen.scheduler.has_unfinished():
        gen.step()
    assert gen.pool_is_free()


def test_abort_frees_a_sequence_and_the_others_continue_as_alone(model):
    """`Generator.abort` (what the endpoint's Abort command and an expired async group use):
    the aborted sequence's blocks, routing record and stop check go; the other sequence
    samples exactly what it samples alone."""
    gen = Generator(model, GenerationSettings(block_size=4, num_blocks=128))
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    a = gen.add(PROMPTS[0], greedy, stop_check=lambda s: False)[0]
    b = gen.add(PROMPTS[1], greedy)[0]
    for _ in range(3):
        gen.step()
    gen.abort(a)
    assert a.seq_id not in gen._stop_check and a.seq_id not in gen.runner.routing.by_seq
    while gen.scheduler.has_unfinished():
        gen.step()
    assert b.completion_token_ids == naive_greedy(model, PROMPTS[1], 8)
    assert gen.pool_is_free()


def _graph_settings(**kw):
    return GenerationSettings(
        block_size=4,
        num_blocks=kw.pop("num_blocks", 256),
        max_num_batched_tokens=24,
        max_model_len=96,
        **kw,
    )


@pytest.mark.parametrize("num_blocks", [256, 14])
def test_decode_graph_path_equals_eager(model, num_blocks):
    """The padded static-buffer decode path (what CUDA graphs replay), run without capture on CPU.

    5 prompts x n=3 = 15 rows pad to bucket 16; rows stop at different lengths
    (max_tokens per prompt), so later steps use smaller buckets; 14 blocks force
    preemption, so decode batches shrink and grow again.
    """
    params = [
        SamplingParams(temperature=1.0, max_tokens=4 + 3 * i, seed=7 + i, ignore_eos=True)
        for i in range(len(PROMPTS))
    ]
    eager = Generator(model, _graph_settings(num_blocks=num_blocks))
    ref = eager.generate(PROMPTS, params, n=3)
    padded = Generator(
        model, _graph_settings(num_blocks=num_blocks, cuda_graphs=True, graphs_capture=False)
    )
    out = padded.generate(PROMPTS, params, n=3)
    graphs = padded.runner.graphs
    assert graphs is not None and len(graphs._buckets) >= 3  # several bucket sizes were used
    assert_same_samples(flat(ref), flat(out))
    assert padded.pool_is_free()
    padded.close()
    assert padded.runner.graphs is None


def test_cuda_graphs_setting_is_eager_off_cuda(model):
    gen = Generator(model, _graph_settings(cuda_graphs=True))
    assert gen.runner.graphs is None  # CPU: the setting falls back to eager


def test_graph_capture_needs_the_triton_attention_path(model):
    """A captured decode graph cannot hold the PyTorch attention path's host reads, so with
    that path (kernels="torch", or advanced.kernels = torch) the runner does not capture; asking
    for capture on the CPU here would otherwise try CUDA streams."""
    gen = Generator(model, _graph_settings(cuda_graphs=True, graphs_capture=True, kernels="torch"))
    assert gen.runner.graphs is None
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    ref = Generator(model, _graph_settings()).generate(PROMPTS, params)
    assert_same_samples(flat(ref), flat(gen.generate(PROMPTS, params)))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_graphs_with_pytorch_attention_run_eagerly_on_gpu(model, kernels):
    """The torch kernels with cuda_graphs on: decode runs eagerly (it used to fail in capture)."""
    kernels("torch")
    m = Transformer(model.args).cuda()
    m.load_state_dict(model.state_dict())
    m.reset_rope()
    m.eval()
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    gen = Generator(m, _graph_settings(cuda_graphs=True))
    assert gen.runner.graphs is None
    out = gen.generate(PROMPTS, params, n=2)
    kernels(None)
    ref = Generator(m, _graph_settings()).generate(PROMPTS, params, n=2)
    assert_same_samples(flat(ref), flat(out), atol=1e-4)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_graph_decode_matches_eager_on_gpu(model):
    m = Transformer(model.args).cuda()
    m.load_state_dict(model.state_dict())
    m.reset_rope()
    m.eval()
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    ref = Generator(m, _graph_settings()).generate(PROMPTS, params, n=2)
    gen = Generator(m, _graph_settings(cuda_graphs=True))
    out = gen.generate(PROMPTS, params, n=2)
    assert gen.runner.graphs.replays > 0
    assert_same_samples(flat(ref), flat(out), atol=1e-4)
    assert gen.pool_is_free()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_inference_layout_keeps_greedy_tokens(model):
    """The CUDA rollout copy fuses q/k/v and gate/up (`inference_layout`); with decode graphs its
    greedy tokens equal the training layout's (fp32)."""
    cuda = torch.device("cuda")
    copy_ = GenerationCopy(copy.deepcopy(model).cuda(), model.args, GenerationLayout(), cuda)
    fused, _ = copy_.build()
    plain, _ = copy_.build(inference=False)
    assert fused.layers["0"].attention.wqkv is not None and plain.layers["0"].attention.wqkv is None
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    out = Generator(fused, _graph_settings(cuda_graphs=True)).generate(PROMPTS, params, n=2)
    ref = Generator(plain, _graph_settings(cuda_graphs=True)).generate(PROMPTS, params, n=2)
    assert_same_samples(flat(ref), flat(out), atol=1e-4)


def test_generation_copy_takes_the_rollout_dtype(model):
    """rollout.dtype: the copy's floating tensors are cast (auto: the update's compute dtype on
    CUDA, the parameters' own dtype elsewhere); its log-probs stay within bf16 rounding of the
    fp32 model's."""
    from tandem.rl.rollout.sampling import generation_dtype

    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert generation_dtype("auto", cuda, "bfloat16") is torch.bfloat16
    assert generation_dtype("auto", cpu, "bfloat16") is None
    assert generation_dtype("float32", cuda, "bfloat16") is torch.float32
    assert generation_dtype("bfloat16", cpu, "float32") is torch.bfloat16

    copy_ = GenerationCopy(model, model.args, GenerationLayout(), cpu, torch.bfloat16)
    gen_model, metrics = copy_.build()
    assert {p.dtype for p in gen_model.parameters()} == {torch.bfloat16}
    assert metrics["reshard/gb"] > 0
    ids = torch.tensor([PROMPTS[2]])
    with torch.no_grad():
        ref = torch.log_softmax(model(ids)[0].float(), -1)
        out = torch.log_softmax(gen_model(ids)[0].float(), -1)
    # bf16 rounding (0.005 measured) of weights and activations
    assert (out - ref).abs().max() < 0.02
    assert (out - ref).abs().max() > 0  # the cast happened


def test_cpu_inference_layout_keeps_tokens_and_logprobs(model):
    """The rollout copy's CPU layout: by default the training layout (plain linears, nothing
    fused); with ``rollout.cpu_onednn`` fused projections on oneDNN
    (tandem/parallel/generation_layout.py), whose greedy tokens are the naive loop's on the
    training model, sampled log-probs within 1e-5 of its training forward, and sampled tokens
    equal to the plain copy's."""
    from tandem.kernels.cpu_linear import OneDNNLinear, onednn_linear_available

    cpu = torch.device("cpu")
    default, _ = GenerationCopy(model, model.args, GenerationLayout(), cpu).build()
    assert default.layers["0"].attention.wqkv is None
    assert not any(isinstance(m, OneDNNLinear) for m in default.modules())
    copy_ = GenerationCopy(model, model.args, GenerationLayout(), cpu, cpu_onednn=True)
    fused, _ = copy_.build()
    plain, _ = copy_.build(inference=False)
    assert plain.layers["0"].attention.wqkv is None
    if not onednn_linear_available():
        pytest.skip("this PyTorch build has no oneDNN linear: the layout does not apply")
    assert fused.layers["0"].attention.wqkv is not None and isinstance(
        fused.layers["0"].feed_forward.w2, OneDNNLinear
    )
    settings = GenerationSettings(block_size=4, num_blocks=256, max_model_len=96)
    out = Generator(fused, settings).generate(
        PROMPTS, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    )
    for p, (c,) in zip(PROMPTS, out, strict=True):
        assert c.token_ids == naive_greedy(model, p, 12)
    params = SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True, seed=3)
    out = Generator(fused, settings).generate(PROMPTS, params, n=2)
    assert_same_samples(flat(Generator(plain, settings).generate(PROMPTS, params, n=2)), flat(out))
    for p, group in zip(PROMPTS, out, strict=True):
        for c in group:
            torch.testing.assert_close(
                torch.tensor(list(c.raw_logprobs)),
                train_logprobs(model, p, c.token_ids),
                atol=1e-5,
                rtol=0,
            )


@pytest.mark.parametrize("num_blocks", [256, 24])
def test_decode_mirror_equals_page_gather(model, num_blocks):
    """Decode steps on the contiguous mirror rows give the tokens and log-probs of the page gather.

    Prompts stop at different lengths, so rows move when a sequence finishes; prefill
    steps between decodes make rows refill from the pool; 24 blocks force preemption
    (recomputed sequences are refilled) and leave the mirror too big for some steps
    (those run on the page gather).
    """
    params = [
        SamplingParams(temperature=1.0, max_tokens=4 + 3 * i, seed=7 + i, ignore_eos=True)
        for i in range(len(PROMPTS))
    ]
    ref = Generator(model, _graph_settings(num_blocks=num_blocks, decode_mirror=False)).generate(
        PROMPTS, params, n=3
    )
    gen = Generator(model, _graph_settings(num_blocks=num_blocks))
    out = gen.generate(PROMPTS, params, n=3)
    mirror = gen.runner.mirror
    assert mirror is not None and mirror.steps >= 8 and mirror.moved > 0 and mirror.refilled > 0
    assert mirror.advanced > 0  # steps that advanced the last one's tensors in place
    if num_blocks == 24:
        assert gen.stats.preemptions > 0 and mirror.too_big > 0
    assert_same_samples(flat(ref), flat(out))
    assert gen.pool_is_free()


def test_decode_mirror_random_workloads(model):
    """24 random workloads (block sizes 1-16, pools small enough to preempt, token budgets that
    split steps, prefix sharing on and off, greedy / sampled / top-k rows, and one multi-turn
    episode per workload): the mirror gives the page gather's tokens and log-probs."""
    rng = random.Random(0)
    used = advanced = 0
    for _ in range(24):
        bs = rng.choice([1, 2, 4, 8, 16])
        prompts = [
            [rng.randrange(1, 300) for _ in range(rng.randint(1, 40))]
            for _ in range(rng.randint(1, 6))
        ]
        need = -(-(max(map(len, prompts)) + 40) // bs)
        kw = dict(
            block_size=bs,
            num_blocks=rng.choice([need + rng.randint(0, 3), 4 * need, 512]),
            max_num_batched_tokens=rng.choice([8, 16, 64, 2048]),
            prefix_sharing=rng.random() < 0.7,
            max_model_len=96,
        )
        params = [
            SamplingParams(
                temperature=rng.choice([0.0, 1.0, 0.7]),
                top_k=rng.choice([0, 20]),
                max_tokens=rng.randint(1, 30),
                seed=rng.randrange(1000),
                ignore_eos=True,
            )
            for _ in prompts
        ]
        n, env = rng.randint(1, 4), [rng.randrange(1, 300) for _ in range(rng.randint(1, 5))]
        runs = []
        for mirror in (False, True):
            gen = Generator(model, GenerationSettings(**kw, decode_mirror=mirror))
            out = gen.generate(prompts, params, n=n)
            # multi-turn: pause after 3 tokens, append an environment reply, finish
            seq = gen.add(
                prompts[0], SamplingParams(temperature=1.0, max_tokens=8, seed=5, ignore_eos=True)
            )[0]
            other = gen.add(
                prompts[-1], SamplingParams(temperature=1.0, max_tokens=12, seed=6, ignore_eos=True)
            )[0]
            while seq.num_generated < 3:
                gen.step()
            gen.pause(seq)
            gen.step()
            gen.append(seq, env)
            gen.resume(seq)
            while gen.scheduler.has_unfinished():
                gen.step()
            assert gen.pool_is_free()
            runs.append((out, seq, other, gen.runner.mirror))
        (ref, ref_seq, ref_other, _), (got, seq, other, mirror) = runs
        used, advanced = used + mirror.steps, advanced + mirror.advanced
        assert_same_samples(flat(ref) + [ref_seq, ref_other], flat(got) + [seq, other])
    assert used > 400  # the mirror served most decode steps (565 with this seed)
    assert advanced > 300  # most advanced the last step's tensors in place (409 with this seed)
