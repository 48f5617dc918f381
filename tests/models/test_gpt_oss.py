"""GPT-OSS against transformers' ``GptOssForCausalLM`` and hand-written formulas.

A tiny random folder written by transformers (fp32; three layers: a 4-token sliding window,
full, sliding; sinks, q/k/v/o, router and expert biases all random; YaRN RoPE) loads with
logits and gradients within 1e-4 of transformers, exports bit for bit, and the in-house
generator's greedy tokens equal transformers' ``generate`` on prompts longer than the window.
The sink formula and the window mask are checked against a naive loop written here, and with
rl.exact two quickstart steps have a gap of 0.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from tandem.kernels.sink_attention import (
    paged_sink_attention,
    paged_sink_attention_exact,
    sink_attention,
)
from tandem.models import (
    get_flavor,
    load_model,
)
from tandem.models.args import ModelArgs
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
WINDOW = 4


def tiny_config(**overrides):
    from transformers import GptOssConfig

    kw = dict(
        vocab_size=TINY_VOCAB,
        hidden_size=64,
        intermediate_size=32,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_local_experts=4,
        num_experts_per_tok=2,
        sliding_window=WINDOW,
        max_position_embeddings=256,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 150000.0,
            "factor": 4.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": False,
            "original_max_position_embeddings": 64,
        },
        eos_token_id=[355],
        pad_token_id=0,
    )
    return GptOssConfig(**{**kw, **overrides})


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return write_random_folder(tmp_path_factory.mktemp("gpt_oss"), tiny_config(), seed=3)


# ------------------------------------------------------------------ transformers parity
@torch.no_grad()
def test_logits_match_transformers(folder):
    ref, ours = hf_reference(folder), load_model(folder)
    a = ours.args
    assert a.model_type == "gpt_oss" and a.attention_sinks and a.sliding_window == WINDOW
    assert [a.window(i) for i in range(3)] == [WINDOW, None, WINDOW]
    assert a.rope_scaling["rope_type"] == "yarn"
    x = tokens(2, 24)
    got, want = ours(x), ref(x).logits
    assert (got - want).abs().max().item() <= TOL
    # the windowed layers matter: the same model with full attention everywhere differs
    full = load_model(folder)
    for block in full.layers.values():
        block.attention.window = None
    assert (full(x) - want).abs().max().item() > 1e-3


def test_packed_rows_equal_separate_sequences(folder):
    """Two documents in one row (DocumentAttention), and a prompt shared by two branches
    (SegmentAttention and DocumentAttention with branch ids), each equal to transformers on
    the sequence alone: the window counts positions, not row indices."""
    assert_packed_rows_equal_alone(folder, TOL)


def test_gradients_match_transformers(folder):
    """The same loss through both models: every parameter's gradient (sinks, biases, the
    de-interleaved experts) equals transformers' under the HF names."""
    grads = assert_gradients_match(folder, TOL)
    assert grads["model.layers.0.self_attn.sinks"].abs().sum() > 0


def test_export_bit_exact_and_transformers_reads_it(folder, tmp_path):
    cfg = assert_export_bit_exact(folder, tmp_path / "export", TOL)
    assert cfg["layer_types"] == ["sliding_attention", "full_attention", "sliding_attention"]


# ------------------------------------------------------------------ generator
def test_generator_greedy_equals_transformers_generate(folder):
    """Prompts shorter and longer than the window, chunked prefill, two samples a prompt."""
    assert_greedy_equals_generate(folder, [[5, 9, 2], [7], list(range(10, 29)), [3] * 9])


# ------------------------------------------------------------------ the RL loop
@pytest.mark.slow  # a train.py subprocess under rl.exact
def test_quickstart_rl_steps_train_every_gpt_oss_tensor_with_gap_zero(folder, tmp_path):
    """Two GRPO steps on the folder with rl.exact: every sampled token's rollout log-prob
    equals the update's recomputation bitwise (windows and sinks in both phases' batch-invariant
    attention), routing agrees, and every exported tensor moved (sinks, biases and the last
    layer's experts included)."""
    assert exact_quickstart_unchanged(folder, tmp_path) == []


# ------------------------------------------------------------------ formulas
def _naive(q, k, v, sinks, window, scale):
    """One query at a time: ``sum_j e^{s_j} v_j / (sum_j e^{s_j} + e^{sink})`` over the keys
    ``i - W < j <= i``. q [S, H, D], k/v [S, H, D] (one KV head per query head)."""
    s, h, _ = q.shape
    out = torch.zeros_like(q)
    for i in range(s):
        for head in range(h):
            lo = 0 if window is None else max(0, i - window + 1)
            e = [math.exp(float(q[i, head] @ k[j, head]) * scale) for j in range(lo, i + 1)]
            den = sum(e) + (0.0 if sinks is None else math.exp(float(sinks[head])))
            out[i, head] = sum(w * v[j, head] for w, j in zip(e, range(lo, i + 1))) / den
    return out


@pytest.mark.parametrize("window", [None, 3])
def test_sink_attention_and_paged_path_equal_the_naive_formula(window):
    g = torch.Generator().manual_seed(0)
    s, h, d = 7, 2, 8
    q, k, v = (torch.randn(s, h, d, generator=g, dtype=torch.float64) for _ in range(3))
    sinks = torch.randn(h, generator=g, dtype=torch.float64)
    want = _naive(q, k, v, sinks, window, d**-0.5)
    pos = torch.arange(s)
    allowed = (pos[:, None] >= pos[None, :]) & (
        True if window is None else (pos[:, None] - pos[None, :] < window)
    )
    got = sink_attention(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
        allowed, sinks, d**-0.5,
    )[0].transpose(0, 1)  # fmt: skip
    torch.testing.assert_close(got, want, atol=1e-12, rtol=0)
    # the paged path: the 7 tokens in blocks of 2 (table 3 1 0 2), the last 3 as new queries
    table = torch.tensor([[3, 1, 0, 2]], dtype=torch.int32)
    kc, vc = (
        torch.zeros(4, 2, h, d, dtype=torch.float64),
        torch.zeros(4, 2, h, d, dtype=torch.float64),
    )
    for i in range(s):
        kc[table[0, i // 2], i % 2], vc[table[0, i // 2], i % 2] = k[i], v[i]
    got = paged_sink_attention(
        q[4:], kc, vc, table, torch.tensor([0, 3]), torch.tensor([s]), d**-0.5, sinks, window
    )
    torch.testing.assert_close(got, want[4:], atol=1e-12, rtol=0)
    # rl.exact's batch-invariant form (fp32 inside) over the same pages
    got = paged_sink_attention_exact(
        q[4:].float(), kc.float(), vc.float(), table, torch.tensor([0, 3]), torch.tensor([s]),
        d**-0.5, sinks.float(), window,
    )  # fmt: skip
    torch.testing.assert_close(got, want[4:].float(), atol=1e-5, rtol=0)


# ------------------------------------------------------------------ flavors and bad input
def test_flavors_build_and_count_transformers_parameters():
    """debug-gpt-oss runs a forward; gpt-oss-20b's parameter count equals transformers'
    model of the same config.json (built on the meta device)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from tandem.models import Transformer

    m = Transformer(get_flavor("debug-gpt-oss"))
    m.init_weights(seed=0)
    assert m(tokens(1, 20)).shape == (1, 20, 512)
    args = get_flavor("gpt-oss-20b")
    cfg = AutoConfig.for_model(**args.to_hf())
    with torch.device("meta"):
        hf = AutoModelForCausalLM.from_config(cfg)
    assert sum(p.numel() for p in hf.parameters()) == args.num_params()
    assert ModelArgs.from_hf(args.to_hf()) == args


def test_a_backend_without_sinks_is_refused_by_name():
    """A backend that does not declare ``sinks_and_windows`` (here the FP8 rounding wrapper,
    refused with GPT-OSS in the composes table) fails with one line naming it."""
    from tandem.kernels.kv_quant import KVQuantAttention
    from tandem.models import CausalAttention, Transformer

    m = Transformer(get_flavor("debug-gpt-oss"))
    m.init_weights(seed=0)
    backend = KVQuantAttention(CausalAttention(), torch.float8_e4m3fn, None)
    with pytest.raises(ValueError, match="KVQuantAttention cannot run attention sinks"):
        m(tokens(1, 8), attn=backend)


def test_refuses_mxfp4_and_foreign_switches(folder):
    cfg = json.loads((folder / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "mxfp4"}
    with pytest.raises(ValueError, match="quantized with 'mxfp4'"):
        ModelArgs.from_hf(cfg)
    with pytest.raises(ValueError, match="no sliding layers, sinks"):
        get_flavor("debug-qwen3").replace(attention_sinks=True)
