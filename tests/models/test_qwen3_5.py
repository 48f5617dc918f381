"""Qwen3.5 (gated DeltaNet beside gated full attention) against transformers' Qwen3.5.

A tiny random folder written by transformers' ``Qwen3_5ForCausalLM`` (fp32; four layers:
three gated DeltaNet, 2 key / 4 value heads, a 4-tap convolution, then one gated full-attention
layer with RoPE on a quarter of each head; every norm, ``A_log`` and ``dt_bias`` random) loads
with logits and gradients within 1e-4 of transformers, packed rows equal each sequence alone,
the folder exports bit for bit, and the in-house generator (paged K/V for the full layer, a
per-sequence recurrent state for the others) gives transformers' greedy tokens and the
log-probs of the model's full forward re-run at every step.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tandem.models import (
    get_flavor,
    load_model,
)
from tandem.models.args import ModelArgs
from tandem.models.linear_attention import GatedDeltaNet
from tests.fixtures import TINY_VOCAB, hf_reference
from tests.models.family_checks import (
    assert_export_bit_exact,
    assert_gradients_match,
    assert_greedy_equals_generate,
    assert_packed_rows_equal_alone,
    exact_quickstart_unchanged,
    tokens,
    write_random_folder,
)

TOL = 1e-4


SIZES = dict(  # both tiny folders' attention, DeltaNet and vocabulary
    vocab_size=TINY_VOCAB,
    hidden_size=64,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    linear_conv_kernel_dim=4,
    linear_key_head_dim=8,
    linear_value_head_dim=12,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    max_position_embeddings=256,
    eos_token_id=[355],
    pad_token_id=0,
)


def tiny_config(**overrides):
    from transformers import Qwen3_5TextConfig

    return Qwen3_5TextConfig(**{**SIZES, "intermediate_size": 96, **overrides})


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return write_random_folder(tmp_path_factory.mktemp("qwen3_5"), tiny_config(), seed=3)


# ------------------------------------------------------------------ transformers parity
@torch.no_grad()
def test_logits_match_transformers(folder):
    ref, ours = hf_reference(folder), load_model(folder)
    a = ours.args
    assert a.layer_types == ["linear_attention"] * 3 + ["full_attention"]
    assert a.rope_dim == 4 and a.linear.conv_dim == 2 * 16 + 48
    assert isinstance(ours.layers["0"].attention, GatedDeltaNet)
    x = tokens(2, 24)
    want = ref(x).logits
    assert (ours(x) - want).abs().max().item() <= TOL
    # the output gate and the convolution matter: without them the logits differ
    other = load_model(folder)
    other.layers["3"].attention.gated = False
    other.layers["3"].attention.wq.weight.data = other.layers["3"].attention.wq.weight[:64]
    assert (other(x) - want).abs().max().item() > 1e-3
    other = load_model(folder)
    other.layers["0"].attention.conv1d.weight.data[..., :3] = 0
    assert (other(x) - want).abs().max().item() > 1e-3


def test_packed_rows_equal_separate_sequences(folder):
    """Two documents in one row (the recurrence restarts at the second), and a prompt shared
    by two branches (each branch continues the prompt's state), equal to transformers on each
    sequence alone."""
    assert_packed_rows_equal_alone(folder, TOL)


def test_gradients_match_transformers(folder):
    """The same loss through both models: every parameter's gradient (the convolution,
    ``A_log``, ``dt_bias``, the gated norms, the gated query) equals transformers'."""
    grads = assert_gradients_match(folder, TOL)
    assert grads["model.layers.0.linear_attn.A_log"].abs().sum() > 0


def test_export_bit_exact_and_transformers_reads_it(folder, tmp_path):
    cfg = assert_export_bit_exact(folder, tmp_path / "export", TOL)
    assert cfg["model_type"] == "qwen3_5_text" and cfg["linear_num_value_heads"] == 4
    assert cfg["rope_parameters"]["partial_rotary_factor"] == 0.25


# ------------------------------------------------------------------ generator
def test_generator_greedy_equals_transformers_generate(folder):
    """Chunked prefill (a 19-token prompt in 16-token steps) and two samples a prompt, the
    second continuing a copy of the first's recurrent state after the shared prompt. (The
    prompts' greedy continuations avoid the tokenizer's pad id 353, an eos id that ``generate``
    with ``min_new_tokens`` may not choose: [7] and [3] * 9 meet it, and are checked below.)"""
    assert_greedy_equals_generate(folder, [[5, 9, 2], list(range(10, 29)), [6] * 9])


# 7 blocks of 4: sequences get preempted; one sequence at a time: one state slot, so the second
# sample of a prompt finds none free at the fork and prefills the prompt alone
@pytest.mark.parametrize("num_blocks, max_num_seqs", [(128, 256), (7, 256), (128, 1)])
@torch.no_grad()
def test_generator_equals_the_full_forward_rerun_each_step(folder, num_blocks, max_num_seqs):
    """Greedy tokens and temperature-1 log-probs of every sampled token equal the model's full
    forward re-run on the whole sequence at each step (within 1e-4; a one-token prompt too, with
    a pool so small that sequences are preempted and recompute their state, and with no slot
    to fork into); every block and state slot is free at the end."""
    from tandem.rl.generator.engine import GenerationSettings, Generator
    from tandem.rl.generator.sequence import SamplingParams

    model = load_model(folder).eval()
    prompts = [[7], [5, 9, 2, 8], list(range(30, 41))]
    settings = GenerationSettings(
        block_size=4,
        num_blocks=num_blocks,
        max_num_batched_tokens=8,
        max_model_len=24,
        max_num_seqs=max_num_seqs,
    )
    gen = Generator(model, settings)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    out = gen.generate(prompts, params, n=2)
    assert gen.pool_is_free()
    if num_blocks == 7:
        assert gen.stats.preemptions > 0
    else:  # the prompts' tokens before the last: prefilled once a group, or once a sample
        assert gen.stats.prefill_tokens == 13 * (2 if max_num_seqs == 1 else 1)
    for p, group in zip(prompts, out, strict=True):
        seq, lps = list(p), []
        for _ in range(8):
            logits = model(torch.tensor([seq]))[0, -1].log_softmax(-1)
            seq.append(int(logits.argmax()))
            lps.append(float(logits[seq[-1]]))
        for c in group:
            assert c.token_ids == seq[len(p) :], p
            assert max(abs(a - b) for a, b in zip(c.raw_logprobs, lps)) <= TOL, p


@pytest.mark.parametrize("how", ["offload", "recompute"])
@torch.no_grad()
def test_suspended_sequences_continue_the_same_samples(folder, how):
    """Sampling (temperature 1, seeded) suspended after 5 steps, as colocated async RL does
    through an update: with the pool and states offloaded and restored, the samples are the
    uninterrupted run's bit for bit; with both released (every sequence recomputes its K/V and
    its recurrent state from its tokens), the same tokens, log-probs within 1e-5."""
    from tandem.rl.generator.engine import GenerationSettings, Generator
    from tandem.rl.generator.sequence import SamplingParams

    model = load_model(folder).eval()

    def run(pause: bool) -> list:
        settings = GenerationSettings(block_size=4, num_blocks=64, max_model_len=40)
        gen = Generator(model, settings)
        seqs = []
        for i, p in enumerate([[5, 9, 2, 7], list(range(20, 31))]):
            params = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True, seed=10 * i)
            seqs += gen.add(p, params, n=2)
        for step in range(1, 100):
            if not gen.scheduler.has_unfinished():
                break
            gen.step()
            if pause and step == 5:
                if how == "offload":
                    gen.offload_kv()
                    gen.restore_kv()
                else:
                    gen.release_kv()
                    gen.reacquire_kv()
        assert gen.pool_is_free()
        return seqs

    for a, b in zip(run(False), run(True), strict=True):
        assert a.token_ids == b.token_ids
        if how == "offload":
            assert a.raw_logprobs == b.raw_logprobs
        else:
            torch.testing.assert_close(
                torch.tensor(b.raw_logprobs), torch.tensor(a.raw_logprobs), atol=1e-5, rtol=0
            )


# ------------------------------------------------------------------ Qwen3.5-MoE
@pytest.fixture(scope="module")
def moe_folder(tmp_path_factory) -> Path:
    """The same layers with the MoE block in each: 4 experts of 32 (2 a token), a gated
    shared expert of 48 (transformers' ``Qwen3_5MoeForCausalLM``)."""
    from transformers.models.qwen3_5_moe import Qwen3_5MoeTextConfig

    cfg = Qwen3_5MoeTextConfig(
        **SIZES,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=48,
        num_experts=4,
        num_experts_per_tok=2,
    )
    return write_random_folder(tmp_path_factory.mktemp("qwen3_5_moe"), cfg, seed=4)


def test_moe_logits_routing_and_export_match_transformers(moe_folder, tmp_path):
    """Logits within 1e-4 of transformers with the same experts for every token in every
    layer; the folder exports bit for bit (one tensor per expert, as transformers writes)."""
    ref, ours = hf_reference(moe_folder), load_model(moe_folder)
    assert ours.args.is_moe and ours.args.shared_expert_gated and ours.args.norm_topk_prob
    chosen = {}
    hooks = [
        ref.model.layers[i].mlp.gate.register_forward_hook(
            lambda m, i_, out, i=i: chosen.__setitem__(i, out[2])
        )
        for i in range(4)
    ]
    x = tokens(2, 20)
    with torch.no_grad():
        assert (ours(x) - ref(x).logits).abs().max().item() <= TOL
    for h in hooks:
        h.remove()
    for i in range(4):
        got = ours.layers[str(i)].moe.last_routing.sort(-1).values
        assert torch.equal(got, chosen[i].sort(-1).values), i
    cfg = assert_export_bit_exact(moe_folder, tmp_path / "export", TOL)
    assert cfg["model_type"] == "qwen3_5_moe_text" and "intermediate_size" not in cfg


def test_moe_generator_greedy_equals_transformers_generate(moe_folder):
    assert_greedy_equals_generate(moe_folder, [list(range(10, 29))])


# ------------------------------------------------------------------ the RL loop
@pytest.mark.slow  # a train.py subprocess under rl.exact
def test_quickstart_rl_steps_train_every_tensor_with_gap_zero(moe_folder, tmp_path):
    """Two GRPO steps on the MoE folder (DeltaNet, gated attention and the MoE block) with
    rl.exact: every sampled token's rollout log-prob equals the update's recomputation bitwise
    (the generator's chunks, forks and recurrent state against the update's packed documents),
    the experts chosen agree, and every exported tensor moved (every expert's included)."""
    assert exact_quickstart_unchanged(moe_folder, tmp_path) == []


def test_flavors_count_transformers_parameters():
    """debug-qwen3.5(-moe), qwen3.5-9b (8.95 B) and qwen3.5-35b-a3b (34.66 B) count what
    transformers' model of the same config.json holds; the config round-trips; a from-scratch
    model runs."""
    from transformers import AutoConfig, AutoModelForCausalLM

    for name in ("debug-qwen3.5", "qwen3.5-9b", "debug-qwen3.5-moe", "qwen3.5-35b-a3b"):
        args = get_flavor(name)
        with torch.device("meta"):
            hf = AutoModelForCausalLM.from_config(AutoConfig.for_model(**args.to_hf()))
        assert sum(p.numel() for p in hf.parameters()) == args.num_params(), name
        assert ModelArgs.from_hf(args.to_hf()) == args
    from tandem.models import Transformer

    model = Transformer(get_flavor("debug-qwen3.5"))
    model.init_weights(seed=0)
    assert model(tokens(1, 5)).isfinite().all()


def test_refuses_foreign_switches(folder):
    cfg = json.loads((folder / "config.json").read_text())
    with pytest.raises(ValueError, match="attention_bias=True"):
        ModelArgs.from_hf({**cfg, "attention_bias": True})
    with pytest.raises(ValueError, match="no linear-attention layers"):
        get_flavor("debug-qwen3").replace(layer_types=["linear_attention"] * 2)
    with pytest.raises(ValueError, match="cannot run linear-attention layers"):
        load_model(folder)(tokens(1, 4), attn=lambda *a, **k: None)
