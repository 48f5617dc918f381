"""New FP8 KV scales for a pool that holds entries (a streaming rollout's kept KV across an
update, `KVCache.rescale`): the entries of every head whose scale changed are re-quantised from
the old power-of-two scale to the new one, the other heads' bytes stay, and the scales tensor
keeps its address. Where neither scale takes an entry out of the format's normal range, the
re-quantised byte equals quantising the original value with the new scale directly (rounding
commutes with a power-of-two factor); everywhere it is ``fp8(fp8(x / old) * old / new)``,
checked element by element."""

from __future__ import annotations

import torch

from tandem.rl.generator.kv_cache import KVCache, KVQuant
from tests.rollout.test_lora_refill import ARGS  # a 2-layer model with 2 KV heads

F8 = torch.float8_e4m3fn


def _fp8(x: torch.Tensor) -> torch.Tensor:
    """Round to e4m3 with saturation at +-448, by hand."""
    return x.clamp(-448.0, 448.0).to(F8)


def test_rescale_requantises_the_changed_heads_and_keeps_the_others():
    old = torch.full((2, 2, 2), 2.0**-4)  # [L, K/V, Hkv]
    new = old.clone()
    new[0, 0, 1] = 2.0**-3  # a larger scale: low bits may go
    new[1, 1, 0] = 2.0**-6  # a smaller one: entries may saturate
    cache = KVCache(ARGS, 3, 4, torch.float32, torch.device("cpu"), KVQuant(F8, scales=old.clone()))
    gen = torch.Generator().manual_seed(0)
    # magnitudes in [0.02, 1.5]: x / s in e4m3's normal range for every scale used here
    x = torch.empty(cache.data.shape).uniform_(0.02, 1.5, generator=gen)
    x *= torch.randint(0, 2, x.shape, generator=gen) * 2 - 1
    x[0, 0, 0, 0, 1, :2] = torch.tensor([1e-4, -3e-4])  # subnormal under the larger scale
    x[1, 1, 0, 0, 0, :2] = torch.tensor([7.9, -7.5])  # past 448 under the smaller one
    for layer in range(2):
        for kv in range(2):
            for h in range(2):
                cache.data[layer, kv, :, :, h] = _fp8(x[layer, kv, :, :, h] / old[layer, kv, h])
    before, address = cache.data.clone(), cache.scales.data_ptr()
    assert cache.rescale(new) == 2
    assert cache.scales.data_ptr() == address and torch.equal(cache.scales, new)
    for layer in range(2):
        for kv in range(2):
            for h in range(2):
                got = cache.data[layer, kv, :, :, h].view(torch.uint8)
                was = before[layer, kv, :, :, h]
                if new[layer, kv, h] == old[layer, kv, h]:
                    assert torch.equal(got, was.view(torch.uint8))
                    continue
                ratio = float(old[layer, kv, h] / new[layer, kv, h])
                naive = _fp8(was.float() * ratio).view(torch.uint8)
                assert torch.equal(got, naive)
                direct = _fp8(x[layer, kv, :, :, h] / new[layer, kv, h]).view(torch.uint8)
                normal = x[layer, kv, :, :, h].abs() >= 0.02
                normal &= x[layer, kv, :, :, h].abs() <= 1.5
                assert torch.equal(got[normal], direct[normal])
    assert cache.data[1, 1, 0, 0, 0, :2].float().tolist() == [448.0, -448.0]  # saturated


def test_an_unchanged_scale_moves_nothing():
    s = torch.full((2, 2, 2), 2.0**-5)
    cache = KVCache(ARGS, 2, 4, torch.float32, torch.device("cpu"), KVQuant(F8, scales=s))
    cache.data.copy_(_fp8(torch.linspace(-3, 3, cache.data.numel()).view(cache.data.shape)))
    before = cache.data.clone()
    assert cache.rescale(s.clone()) == 0
    assert torch.equal(cache.data.view(torch.uint8), before.view(torch.uint8))
