"""The gated delta rule's PyTorch reference (tandem/kernels/gated_delta.py) against
transformers' two Qwen3.5 implementations (its per-token loop and its chunked form) and a
hand-expanded two-token case: values, final states, gradients, continuation from a state and
resets of packed rows."""

from __future__ import annotations

import pytest
import torch

from tandem.kernels.gated_delta import gated_delta_rule, l2_normalize


def _inputs(b=2, s=11, hk=2, hv=4, dk=8, dv=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k = torch.randn(b, s, hk, dk, generator=g), torch.randn(b, s, hk, dk, generator=g)
    v = torch.randn(b, s, hv, dv, generator=g)
    decay = -torch.nn.functional.softplus(torch.randn(b, s, hv, generator=g))
    beta = torch.rand(b, s, hv, generator=g)
    return q, k, v, decay, beta


def test_two_tokens_by_hand():
    """One head, Dk = Dv = 2, no normalisation: the update rule written out."""
    q = torch.tensor([[[[1.0, 0.0]], [[0.5, 2.0]]]])  # [1, 2, 1, 2]
    k = torch.tensor([[[[0.6, 0.8]], [[1.0, 0.0]]]])
    v = torch.tensor([[[[1.0, -1.0]], [[2.0, 3.0]]]])
    g = torch.tensor([[[-0.1], [-0.5]]])
    beta = torch.tensor([[[0.5], [0.25]]])
    out, state = gated_delta_rule(q, k, v, g, beta, normalize_qk=False)
    scale = 2**-0.5
    s1 = torch.outer(k[0, 0, 0], 0.5 * v[0, 0, 0])  # from zero: k (beta v)^T
    o1 = s1.T @ (q[0, 0, 0] * scale)
    s2 = torch.exp(torch.tensor(-0.5)) * s1
    s2 = s2 + torch.outer(k[0, 1, 0], 0.25 * (v[0, 1, 0] - s2.T @ k[0, 1, 0]))
    o2 = s2.T @ (q[0, 1, 0] * scale)
    torch.testing.assert_close(out[0, :, 0], torch.stack([o1, o2]))
    torch.testing.assert_close(state[0, 0], s2)


@pytest.mark.parametrize("form", ["recurrent", "chunk"])
def test_values_states_and_gradients_equal_transformers(form):
    from transformers.models.qwen3_5 import modeling_qwen3_5 as hf

    ref_fn = (
        hf.torch_recurrent_gated_delta_rule
        if form == "recurrent"
        else hf.torch_chunk_gated_delta_rule
    )
    ours_in = [t.double().requires_grad_() for t in _inputs()]
    ref_in = [t.detach().clone().requires_grad_() for t in ours_in]
    init = torch.randn(2, 4, 8, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    out, state = gated_delta_rule(*ours_in, initial_state=init)
    q, k, v, g, beta = ref_in
    ref_out, ref_state = ref_fn(
        q.float(), k.float(), v.float(), g=g.float(), beta=beta.float(), initial_state=init.float(),
        output_final_state=True, use_qk_l2norm_in_kernel=True,
    )  # fmt: skip
    torch.testing.assert_close(out.float(), ref_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(state.float(), ref_state, atol=1e-5, rtol=1e-5)
    w = torch.randn(out.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    (out.double() * w).sum().backward()
    (ref_out.double() * w).sum().backward()
    for a, b in zip(ours_in, ref_in, strict=True):
        torch.testing.assert_close(a.grad.float(), b.grad.float(), atol=1e-4, rtol=1e-4)


def test_continuation_and_packed_resets():
    """Two calls joined by the state equal one call; two sequences packed in a row with a reset
    at the second's start equal each alone."""
    q, k, v, g, beta = _inputs(b=1, s=12)
    whole, last = gated_delta_rule(q, k, v, g, beta)
    a, mid = gated_delta_rule(q[:, :5], k[:, :5], v[:, :5], g[:, :5], beta[:, :5])
    b, end = gated_delta_rule(
        q[:, 5:], k[:, 5:], v[:, 5:], g[:, 5:], beta[:, 5:], initial_state=mid
    )
    torch.testing.assert_close(torch.cat([a, b], dim=1), whole)
    torch.testing.assert_close(end, last)
    reset = torch.zeros(1, 12, dtype=torch.bool)
    reset[0, 5] = True
    packed, _ = gated_delta_rule(q, k, v, g, beta, reset=reset)
    alone, _ = gated_delta_rule(q[:, 5:], k[:, 5:], v[:, 5:], g[:, 5:], beta[:, 5:])
    torch.testing.assert_close(packed[:, :5], a)
    torch.testing.assert_close(packed[:, 5:], alone)
    torch.testing.assert_close(
        l2_normalize(torch.tensor([3.0, 4.0]), eps=0.0), torch.tensor([0.6, 0.8])
    )
