"""Low-bit weights (tandem/kernels/weight_quant.py) against hand-written expectations.

- each format's representable grid: e4m3's 254 finite values and e2m1's 8 magnitudes come back
  exactly; hand-computed midpoints round half to even;
- the scales: the power-of-two rule on hand-picked amaxes, the block shapes (128 x 128, 1 x 32,
  1 x 16), mxfp8's e8m0 byte, a hand-computed w4a16 row with both scale levels;
- the round trip of random weights within `error_bound`, and the bound itself not vacuous;
- `fake_quant` is what `QuantLinear` multiplies by, bit for bit, with a straight-through
  gradient; `QuantLinear.load` equals a fresh quantization; the resident bytes per format.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tandem.kernels import weight_quant as wq


def _e4m3_grid() -> torch.Tensor:
    """Every finite non-negative e4m3 value, from its bit patterns (0x00 .. 0x7E)."""
    return torch.arange(0, 0x7F, dtype=torch.uint8).view(torch.float8_e4m3fn).float()


def test_e4m3_grid_is_exact_with_scale_one() -> None:
    grid = _e4m3_grid()
    assert grid.numel() == 127 and grid.max().item() == 448.0
    w = torch.cat([grid, -grid[1:]]).view(1, -1)  # [1, 253]
    q = wq.quantize(w, "fp8_block")  # two 128-wide blocks, each holding +-448: scale 1
    assert q.scales.tolist() == [[1.0, 1.0]] and torch.equal(wq.dequantize(q), w)
    # mxfp8: 8 blocks of 32, each scaled by its own power of two <= 1, which moves the values
    # up the grid without leaving it: still exact
    q = wq.quantize(w, "mxfp8")
    assert q.scales.tolist() == [[116, 120, 124, 127, 116, 120, 124, 127]]
    assert torch.equal(wq.dequantize(q), w)


def test_e4m3_rounding_half_to_even_by_hand() -> None:
    # amax 448 (scale 1); in [1, 2) the e4m3 step is 1/8, in [256, 448] it is 32
    w = torch.tensor([[448.0, 1.0625, 1.1875, 1.0624, 272.0, 304.0, 0.0009765625, 0.0029296875]])
    expect = torch.tensor([[448.0, 1.0, 1.25, 1.0, 256.0, 320.0, 0.0, 0.00390625]])
    # 2**-10 is half the smallest subnormal 2**-9: ties to 0; 3 * 2**-10 ties to 2 * 2**-9
    for name in ("fp8_block", "mxfp8"):
        assert torch.equal(wq.dequantize(wq.quantize(w, name)), expect)


@pytest.mark.parametrize(
    "amax, scale, back",
    [
        (448.0, 1.0, 448.0),
        (449.0, 2.0, 448.0),  # 449 / 2 = 224.5: the step in [128, 256) is 16, so 224
        (896.0, 2.0, 896.0),
        (1.0, 2.0**-8, 1.0),
        (0.875, 2.0**-9, 0.875),
        (0.0, 2.0**-126, 0.0),
    ],
)
def test_power_of_two_scale_by_hand(amax: float, scale: float, back: float) -> None:
    # the smallest 2**k with amax <= 448 * 2**k (448 * 2**-9 = 0.875, 448 * 2**-8 = 1.75)
    w = torch.zeros(1, 32)
    w[0, 5] = amax
    q = wq.quantize(w, "mxfp8")
    assert wq.block_scales(q).item() == scale
    assert (
        q.scales.dtype == torch.uint8
        and q.scales.item() == round(torch.tensor(scale).log2().item()) + 127
    )
    assert wq.dequantize(q)[0, 5].item() == back


def test_block_shapes() -> None:
    w = torch.full((130, 130), 0.5)
    w[129, 3] = 448.0 * 4  # block (1, 0) of fp8_block; row 129's first 32 of mxfp8; its first 16
    fb = wq.quantize(w, "fp8_block")
    assert fb.scales.shape == (2, 2)
    assert fb.scales.tolist() == [[2.0**-9, 2.0**-9], [4.0, 2.0**-9]]
    mx = wq.quantize(w, "mxfp8")
    assert mx.scales.shape == (130, 5)  # ceil(130 / 32)
    assert wq.block_scales(mx)[129].tolist() == [4.0] + [2.0**-9] * 4
    assert wq.block_scales(mx)[128].tolist() == [2.0**-9] * 5
    f4 = wq.quantize(w, "w4a16")
    assert f4.scales.shape == (130, 9) and f4.values.shape == (130, 65)  # two codes a byte


def test_e2m1_grid_and_ties_by_hand() -> None:
    y = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 7.0, -6.0, -0.5, -0.1])
    expect = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 6.0, -6.0, -0.5, 0.0]
    assert wq.e2m1_values(wq.round_e2m1(y)).tolist() == expect
    mids = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])  # ties go to the even code
    assert wq.e2m1_values(wq.round_e2m1(mids)).tolist() == [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0]
    assert wq.round_e2m1(torch.tensor([-0.1])).item() == 0  # no negative zero code


def test_w4a16_two_level_scales_by_hand() -> None:
    # tensor amax 5.25 -> tensor scale 5.25 / (6 * 448) = 2**-9; block 0's scale
    # 5.25 / 6 / 2**-9 = 448 (e4m3 exact): step 448 * 2**-9 = 0.875 per grid unit; block 1's amax
    # 0.75 -> 64 -> 0.125 per grid unit
    b0 = [5.25, 0.875 * 1.5, 0.875 * 0.5, 0.4, -2.0] + [0.0] * 11
    b1 = [0.75, 0.3, -0.2, 0.0] + [0.0] * 12
    w = torch.tensor([b0 + b1])
    q = wq.quantize(w, "w4a16")
    assert q.tensor_scale.item() == 2.0**-9
    assert q.scales.float().tolist() == [[448.0, 64.0]]
    got = wq.dequantize(q)[0].tolist()
    # 0.4 / 0.875 = 0.457 -> 0.5; -2 / 0.875 = -2.29 -> -2; 0.3 / 0.125 = 2.4 -> 2; -0.2 -> -1.5
    assert got[:5] == [5.25, 1.3125, 0.4375, 0.4375, -1.75]
    assert got[16:20] == [0.75, 0.25, -0.1875, 0.0]
    assert all(v == 0.0 for v in got[5:16] + got[20:])


@pytest.mark.parametrize("name", list(wq.FORMATS))
def test_round_trip_within_bound(name: str) -> None:
    g = torch.Generator().manual_seed(3)
    w = torch.randn(150, 200, generator=g) * torch.logspace(-3, 1, 200)  # columns of every size
    err = (wq.dequantize(wq.quantize(w, name)) - w).abs()
    bound = wq.error_bound(w, name)
    assert (err <= bound).all()
    assert (err > 0).any() and (bound < w.abs().max()).all()  # a real, not vacuous, bound
    rel = (err.sum() / w.abs().sum()).item()
    assert rel < {"fp8_block": 0.1, "mxfp8": 0.04, "w4a16": 0.12}[name]


@pytest.mark.parametrize("name", list(wq.FORMATS))
def test_fake_quant_is_quant_linear_bit_for_bit(name: str) -> None:
    g = torch.Generator().manual_seed(4)
    w = (torch.randn(48, 40, generator=g) * 0.05).requires_grad_()
    b = torch.randn(48, generator=g)
    x = torch.randn(5, 40, generator=g)
    y_update = F.linear(x, wq.fake_quant(w, name), b)
    lin = wq.QuantLinear.of(name, w.detach(), b)
    assert torch.equal(lin(x), y_update)
    y_update.sum().backward()  # straight through: the gradient an unquantized w would get
    w_ref = w.detach().clone().requires_grad_()
    F.linear(x, w_ref, b).sum().backward()
    assert torch.equal(w.grad, w_ref.grad)
    assert torch.allclose(w.grad, x.sum(0).expand(48, 40), atol=1e-5)
    mod = torch.nn.Linear(40, 48)  # the update's module: same parameters, same state dict
    mod.load_state_dict({"weight": w.detach(), "bias": b})
    wq.fake_quant_linear(mod, name)
    assert list(mod.state_dict()) == ["weight", "bias"] and torch.equal(mod(x), lin(x))
    w2 = torch.randn(48, 40, generator=g)
    lin.load(w2)
    assert torch.equal(lin(x), wq.QuantLinear.of(name, w2, b)(x))
    wb, bb, xb = w2.bfloat16(), b.bfloat16(), x.bfloat16()  # a bf16 copy: dequantized to bf16
    assert torch.equal(
        wq.QuantLinear.of(name, wb, bb)(xb), F.linear(xb, wq.fake_quant(wb, name), bb)
    )


def test_resident_bytes_against_bf16() -> None:
    w = torch.randn(512, 512)
    bf16 = w.numel() * 2
    ratio = {n: bf16 / wq.quantize(w, n).nbytes() for n in wq.FORMATS}
    assert ratio["fp8_block"] > 1.99 and ratio["mxfp8"] > 1.9 and ratio["w4a16"] > 3.5
    for shape in [(1, 1), (3, 17), (130, 129), (256, 96)]:  # the planner's formula, measured
        for name, fmt in wq.FORMATS.items():
            q = wq.quantize(torch.randn(shape), name)
            assert wq.quantized_nbytes(shape, fmt) == q.nbytes(), (shape, name)


@pytest.mark.parametrize("name", list(wq.FORMATS))
def test_aligned_shards_quantize_as_the_whole(name: str) -> None:
    """A shard at a block-multiple offset, given the whole tensor's largest entry, gets exactly
    the whole weight's quantization of its entries (what rollout.tp > 1 relies on)."""
    g = torch.Generator().manual_seed(5)
    w = torch.randn(256, 256, generator=g) * torch.logspace(-3, 0, 256)
    whole = wq.dequantize(wq.quantize(w, name))
    amax = w.abs().amax()
    for dim in (0, 1):
        for part, piece in zip(w.chunk(2, dim), whole.chunk(2, dim)):  # 128 each: block-aligned
            assert torch.equal(wq.dequantize(wq.quantize(part, name, amax)), piece), (name, dim)
    if name == "w4a16":  # without the whole tensor's amax a shard has its own tensor scale
        part = w[:, :128]  # the smaller columns: its own amax is below the whole's
        assert not torch.equal(wq.dequantize(wq.quantize(part, name)), whole[:, :128])
