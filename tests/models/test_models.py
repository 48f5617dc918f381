"""Model numerics against transformers, the attention seam, init and ModelArgs."""

from __future__ import annotations

import pytest
import torch

from tandem.models import (
    FLAVORS,
    DocumentAttention,
    ModelArgs,
    SegmentAttention,
    Transformer,
    get_flavor,
    load_model,
    positions_from_doc_ids,
)
from tandem.models.rope import rope_inv_freq
from tandem.models.vlm import make_model
from tests.fixtures import FAMILIES, hf_reference, tiny_hf_config, write_hf_model

TOL = 1e-4


@pytest.fixture(scope="module", params=FAMILIES)
def hf_folder(request, tmp_path_factory):
    family = request.param
    return family, write_hf_model(tmp_path_factory.mktemp(family), family, seed=3)


def _tokens(b: int, s: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 360, (b, s), generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def test_logits_match_transformers(hf_folder):
    family, path = hf_folder
    ref, ours = hf_reference(path), load_model(path)
    x = _tokens(2, 48)
    expected = ref(x).logits
    got = ours(x)
    assert got.shape == expected.shape == (2, 48, 384)
    assert (got - expected).abs().max().item() <= TOL
    # Explicit, shifted positions (as the generator uses) go through the same RoPE path.
    pos = torch.arange(48).expand(2, 48) + torch.tensor([[5], [17]])
    expected = ref(x, position_ids=pos).logits
    assert (ours(x, positions=pos) - expected).abs().max().item() <= TOL
    if family == "qwen3-tied":
        assert ours.output.weight is ours.tok_embeddings.weight


@torch.no_grad()
def test_fused_projections_match_transformers(hf_folder):
    """The inference layout (q/k/v and gate/up fused, linears on oneDNN where PyTorch has it)
    gives transformers' logits, biases (qwen2) and tied heads included."""
    from tandem.kernels.cpu_linear import OneDNNLinear, onednn_linear_available, use_onednn_linears

    family, path = hf_folder
    # the second: no-op
    ref, ours = hf_reference(path), load_model(path).fuse_projections().fuse_projections()
    converted = use_onednn_linears(ours)
    keys = set(ours.state_dict())
    assert "layers.0.attention.wqkv.weight" in keys and "layers.0.feed_forward.w13.weight" in keys
    assert not any(
        k.endswith(("wq.weight", "wk.weight", "wv.weight", "w1.weight", "w3.weight")) for k in keys
    )
    assert ("layers.0.attention.wqkv.bias" in keys) == (family == "qwen2")
    if onednn_linear_available():
        assert converted == 4 * ours.args.num_layers + 1 and isinstance(ours.output, OneDNNLinear)
    x = _tokens(2, 48)
    pos = torch.arange(48).expand(2, 48) + torch.tensor([[5], [17]])
    assert (ours(x, positions=pos) - ref(x, position_ids=pos).logits).abs().max().item() <= TOL


@torch.no_grad()
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_tables_equal_transformers(hf_folder, dtype):
    _, path = hf_folder
    ref, ours = hf_reference(path), load_model(path)
    pos = torch.tensor([[0, 1, 2, 3, 100, 200, 255], [7, 6, 5, 4, 3, 2, 1]])
    x = torch.zeros(2, 7, 8, dtype=dtype)
    cos_ref, sin_ref = ref.model.rotary_emb(x, pos)
    cos, sin = ours.rope(pos, dtype)
    assert torch.equal(cos, cos_ref) and torch.equal(sin, sin_ref)


@torch.no_grad()
def test_llama3_rope_scaling_matters(tmp_path):
    """Guards the llama3 comparison: without the scaling, logits must move."""
    path = write_hf_model(tmp_path, "llama3", seed=1)
    ours = load_model(path)
    unscaled = Transformer(ours.args.replace(rope_scaling=None))
    unscaled.load_state_dict(ours.state_dict())
    assert not torch.equal(unscaled.rope.inv_freq, ours.rope.inv_freq)
    x = _tokens(1, 64)
    assert (ours(x) - unscaled(x)).abs().max().item() > 1e-3


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("weight_dtype", ["same", torch.float32])
def test_rms_norm_equals_the_written_out_formula(dtype, weight_dtype):
    """HF's order of operations (fp32 statistics, round, then the weight), values and
    gradients bit for bit, also with an fp32 weight on low-precision activations."""
    from tandem.models.transformer import RMSNorm

    torch.manual_seed(0)
    norm = RMSNorm(64, 1e-6).to(dtype if weight_dtype == "same" else weight_dtype)
    norm.weight.data.normal_()
    x = (torch.randn(3, 7, 64) * 3).to(dtype)
    a, b = x.clone().requires_grad_(), x.clone().requires_grad_()
    out = norm(a)
    h = b.float()
    ref = norm.weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + norm.eps)).to(dtype)
    assert torch.equal(out, ref)
    g = torch.randn_like(out)
    out.backward(g)
    w_grad, norm.weight.grad = norm.weight.grad.clone(), None
    ref.backward(g)
    assert torch.equal(a.grad, b.grad) and torch.equal(w_grad, norm.weight.grad)


@torch.no_grad()
def test_document_attention_equals_separate_docs():
    model = Transformer(get_flavor("debug-qwen3"))
    model.init_weights(seed=0)
    a, b = _tokens(1, 5, seed=1), _tokens(1, 7, seed=2)
    packed = torch.cat([a, b, torch.zeros(1, 3, dtype=torch.long)], dim=1)  # [1, 15]
    doc_ids = torch.tensor([[0] * 5 + [1] * 7 + [-1] * 3])
    positions = positions_from_doc_ids(doc_ids)
    assert positions.tolist() == [[0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 5, 6, 0, 1, 2]]
    out = model(packed, positions=positions, attn=DocumentAttention(doc_ids))  # [1, 15, V]
    assert torch.isfinite(out).all()
    assert (out[:, :5] - model(a)).abs().max().item() <= 1e-5
    assert (out[:, 5:12] - model(b)).abs().max().item() <= 1e-5
    # Without the mask the second document would see the first: results must differ.
    leaky = model(packed, positions=positions)
    assert (leaky[:, 5:12] - model(b)).abs().max().item() > 1e-3


def test_document_attention_mask_and_batch():
    doc_ids = torch.tensor([[0, 0, 1, 1, -1], [3, 3, 3, -1, -1]])
    mask = DocumentAttention(doc_ids).mask  # [2, 1, 5, 5]
    assert mask.shape == (2, 1, 5, 5)
    assert mask[0, 0].int().tolist() == [
        [1, 0, 0, 0, 0],
        [1, 1, 0, 0, 0],
        [0, 0, 1, 0, 0],
        [0, 0, 1, 1, 0],
        [0, 0, 0, 0, 1],
    ]
    assert mask[1, 0, 4].int().tolist() == [0, 0, 0, 1, 1]
    assert positions_from_doc_ids(doc_ids).tolist() == [[0, 1, 0, 1, 0], [0, 1, 2, 0, 1]]


def _segments_of(doc_ids, branch_ids):
    """Reference segment lists from the labels: per (doc, branch > 0) the doc's branch-0 positions
    then the branch's; a doc without branches is one segment. Built by brute force, not
    the packer."""
    flat_d, flat_b = doc_ids.reshape(-1).tolist(), branch_ids.reshape(-1).tolist()
    segs, src = [], {}
    for doc in sorted({d for d in flat_d if d >= 0}):
        prefix = [i for i, (d, b) in enumerate(zip(flat_d, flat_b)) if d == doc and b == 0]
        branches = sorted({b for d, b in zip(flat_d, flat_b) if d == doc and b > 0}) or [None]
        for k, br in enumerate(branches):
            own = [i for i, (d, b) in enumerate(zip(flat_d, flat_b)) if d == doc and b == br]
            seg = prefix + own
            for j, i in enumerate(seg):
                if k == 0 or j >= len(prefix):
                    src[i] = (len(segs), j)
            segs.append(seg)
    w = max(map(len, segs))
    gather = torch.tensor([s + [s[0]] * (w - len(s)) for s in segs])
    scatter = torch.tensor(
        [src[i][0] * w + src[i][1] if i in src else 0 for i in range(len(flat_d))]
    )
    return gather, scatter


@pytest.mark.parametrize("kv_heads", [2, 4])
def test_segment_attention_equals_document_attention(kv_heads):
    """Outputs and q/k/v gradients at real positions equal the masked version, with shared
    prefixes (branches), several documents per row, a document without branches, and padding."""
    doc_ids = torch.tensor([[0, 0, 0, 0, 0, 0, 0, 0, 1, 1], [2, 2, 2, 2, 3, 3, -1, -1, -1, -1]])
    branch_ids = torch.tensor([[0, 0, 0, 1, 1, 2, 2, 2, 0, 1], [0, 0, 0, 0, 0, 0, 0, 0, 0, 0]])
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 10, 4, 8, generator=g, requires_grad=True)
    k = torch.randn(2, 10, kv_heads, 8, generator=g, requires_grad=True)
    v = torch.randn(2, 10, kv_heads, 8, generator=g, requires_grad=True)
    real = (doc_ids >= 0)[..., None, None].float()
    weight = torch.randn(2, 10, 4, 8, generator=g) * real  # padding outputs are never read
    outs = []
    for attn in (
        DocumentAttention(doc_ids, branch_ids),
        SegmentAttention(*_segments_of(doc_ids, branch_ids)),
    ):
        out = attn(0, q, k, v)
        grads = torch.autograd.grad((out * weight).sum(), (q, k, v))
        outs.append((out * real, grads))
    (want, want_g), (got, got_g) = outs
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
    for a, b in zip(got_g, want_g):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)
    # the reference is not trivially equal: dropping the branch structure changes the result
    plain = (
        SegmentAttention(*_segments_of(doc_ids, torch.zeros_like(branch_ids)))(0, q, k, v) * real
    )
    assert (plain - want).abs().max() > 1e-2


@torch.no_grad()
def test_backend_seam_receives_layer_ids_and_shapes():
    args = get_flavor("debug-qwen3")
    model = Transformer(args)
    model.init_weights(seed=0)
    seen = []

    def spy(layer_id, q, k, v):
        seen.append((layer_id, tuple(q.shape), tuple(k.shape), tuple(v.shape)))
        return torch.zeros_like(q)

    out = model(_tokens(2, 6), attn=spy)
    hd = args.head_dim
    assert seen == [
        (i, (2, 6, 4, hd), (2, 6, 2, hd), (2, 6, 2, hd)) for i in range(args.num_layers)
    ]
    assert out.shape == (2, 6, args.vocab_size)


@torch.no_grad()
def test_init_weights_after_meta_to_empty():
    args = get_flavor("debug-qwen3")
    with torch.device("meta"):
        model = Transformer(args)
    model.to_empty(device="cpu")
    model.init_weights(seed=123)
    assert model.output.weight is model.tok_embeddings.weight  # still tied after to_empty
    assert torch.equal(model.rope.inv_freq, rope_inv_freq(args))
    attn = model.layers["0"].attention
    assert torch.equal(attn.q_norm.weight, torch.ones(args.head_dim))
    assert torch.equal(model.norm.weight, torch.ones(args.hidden_size))
    std = model.tok_embeddings.weight.std().item()
    assert 0.018 < std < 0.022
    twin = Transformer(args)
    twin.init_weights(seed=123)
    for (n, p), (_, q) in zip(model.state_dict().items(), twin.state_dict().items(), strict=True):
        assert torch.equal(p, q), n
    twin.init_weights(seed=124)
    assert not torch.equal(twin.tok_embeddings.weight, model.tok_embeddings.weight)
    assert torch.isfinite(model(_tokens(1, 9))).all()


def test_qkv_bias_zero_init_and_bf16_cast_keeps_fp32_rope():
    model = Transformer(get_flavor("tiny-qwen2"))
    model.init_weights(seed=0)
    assert torch.equal(
        model.layers["1"].attention.wq.bias, torch.zeros_like(model.layers["1"].attention.wq.bias)
    )
    model.to(torch.bfloat16)
    assert model.rope.inv_freq.dtype == torch.float32
    assert torch.equal(model.rope.inv_freq, rope_inv_freq(model.args))
    assert model(_tokens(1, 4)).dtype == torch.bfloat16


@torch.no_grad()
def test_pipeline_stages_compose_to_full_model():
    model = Transformer(get_flavor("tiny-llama3"))
    model.init_weights(seed=0)
    x = _tokens(2, 10)
    full = model(x)
    first, last = Transformer(model.args), Transformer(model.args)
    first.load_state_dict(model.state_dict())
    last.load_state_dict(model.state_dict())
    first.norm, first.output = None, None
    del first.layers["2"], first.layers["3"]
    last.tok_embeddings = None
    del last.layers["0"], last.layers["1"]
    hidden = first(x)  # [B, S, D] (no norm on the first stage)
    assert hidden.shape == (2, 10, model.args.hidden_size)
    assert torch.allclose(last(hidden), full, atol=1e-6, rtol=0)
    normed = model(x, return_hidden=True)
    assert torch.allclose(model.output(normed), full, atol=1e-6, rtol=0)


# ---------------------------------------------------------------------- ModelArgs
@pytest.mark.parametrize("family", FAMILIES)
def test_args_from_hf_to_hf_round_trip(family):
    cfg = tiny_hf_config(family).to_dict()
    args = ModelArgs.from_hf(cfg)
    assert args.num_layers == 2 and args.num_kv_heads == 2
    assert args.qkv_bias == (family == "qwen2")
    assert args.qk_norm == family.startswith("qwen3")
    assert args.head_dim == (32 if family.startswith("qwen3") else 16)
    assert args.eos_token_id == [355, 353]
    if family == "llama3":
        assert args.rope_theta == 500000.0 and args.rope_scaling["rope_type"] == "llama3"
    else:
        assert args.rope_scaling is None
    assert ModelArgs.from_hf(args.to_hf()) == args


def test_args_from_hf_legacy_keys_and_derived_head_dim():
    legacy = {
        "model_type": "llama",
        "vocab_size": 100,
        "hidden_size": 48,
        "intermediate_size": 64,
        "num_hidden_layers": 1,
        "num_attention_heads": 6,
        "rope_theta": 5e5,
        "rope_scaling": {
            "type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
        },
        "max_position_embeddings": 1024,
        "eos_token_id": 7,
    }
    args = ModelArgs.from_hf(legacy)
    assert args.head_dim == 8 and args.num_kv_heads == 6 and args.eos_token_id == [7]
    assert args.rope_scaling["original_max_position_embeddings"] == 1024


@pytest.mark.parametrize(
    "scaling", [{"rope_type": "longrope", "factor": 4.0}, {"type": "linear", "factor": 2.0}]
)
def test_unsupported_rope_scaling_is_a_clear_error(scaling):
    cfg = tiny_hf_config("qwen2").to_dict()
    cfg.pop("rope_parameters", None)
    cfg["rope_scaling"] = scaling
    with pytest.raises(ValueError, match="unsupported rope scaling"):
        ModelArgs.from_hf(cfg)


def test_yarn_without_its_context_is_a_clear_error():
    cfg = tiny_hf_config("qwen2").to_dict()
    cfg.pop("rope_parameters", None)
    cfg["rope_scaling"] = {"rope_type": "yarn", "factor": 4.0}
    with pytest.raises(ValueError, match="yarn rope_scaling is missing"):
        ModelArgs.from_hf(cfg)


def test_args_validation_errors():
    with pytest.raises(ValueError, match="model_type"):
        ModelArgs(model_type="gpt2")
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        ModelArgs(num_heads=4, num_kv_heads=3)
    with pytest.raises(ValueError, match="qk_norm"):
        ModelArgs(model_type="llama", qk_norm=True)


@pytest.mark.parametrize("name", sorted(FLAVORS))
def test_flavors_num_params(name):
    args = get_flavor(name)
    with torch.device("meta"):  # the planning flavors (8B-70B) would not fit this machine's memory
        model = make_model(args)  # a vision-language flavor's tower counts too
    assert args.num_params() == sum(p.numel() for p in model.parameters())
    assert args.vocab_size >= 360  # fits build_char_tokenizer


def test_flops_per_token_formula():
    args = ModelArgs(
        model_type="llama",
        vocab_size=10,
        hidden_size=8,
        intermediate_size=16,
        num_layers=1,
        num_heads=2,
        num_kv_heads=1,
        tie_word_embeddings=True,
    )
    # matmul params: q 8*8 + k,v 2*8*4 + o 8*8 + mlp 3*8*16 + output 10*8 = 656
    assert args.flops_per_token(seq_len=3) == 6 * 656 + 12 * 1 * 2 * 4 * 3


def test_get_flavor_unknown_lists_names():
    with pytest.raises(KeyError, match="debug-qwen3"):
        get_flavor("huge")
    a = get_flavor("tiny-llama3")
    a.rope_scaling["factor"] = 1.0
    assert FLAVORS["tiny-llama3"].rope_scaling["factor"] == 8.0
