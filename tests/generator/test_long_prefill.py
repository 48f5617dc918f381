"""A long prompt prefills in chunks: no model forward wider than ``max_num_batched_tokens``, and the
PyTorch paged attention scores a chunk against the context in slices (``_BATCHED_SCORE_LIMIT``),
with
the same greedy tokens and log-probs as one wide prefill and as the training forward."""

import torch

from tandem.kernels import paged_attention_torch as pa
from tandem.models.flavors import get_flavor
from tandem.models.transformer import Transformer
from tandem.rl.generator.engine import GenerationSettings, Generator
from tandem.rl.generator.sequence import SamplingParams


def test_a_3000_token_prompt_prefills_in_chunks(monkeypatch):
    args = get_flavor("debug-qwen3").replace(max_position_embeddings=4096)
    model = Transformer(args)
    model.init_weights(seed=0)
    model.eval()
    prompt = torch.randint(1, 500, (3000,), generator=torch.Generator().manual_seed(0)).tolist()
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    widths: list[int] = []
    model.layers["0"].register_forward_pre_hook(lambda mod, inp: widths.append(inp[0].shape[1]))
    wide = Generator(
        model, GenerationSettings(block_size=16, num_blocks=256, max_num_batched_tokens=4096)
    )
    (ref,) = wide.generate([prompt], params)[0]
    assert max(widths) == 3000
    widths.clear()
    monkeypatch.setattr(
        pa, "_BATCHED_SCORE_LIMIT", 4 * 3000 * 64
    )  # a slice of 64 query rows at most
    narrow = Generator(
        model, GenerationSettings(block_size=16, num_blocks=256, max_num_batched_tokens=256)
    )
    (got,) = narrow.generate([prompt], params)[0]
    assert (
        max(widths) == 256 and sum(w for w in widths if w > 1) == 3000
    )  # 12 chunks of <= 256, then decode
    assert got.token_ids == ref.token_ids
    torch.testing.assert_close(
        torch.tensor(got.raw_logprobs), torch.tensor(ref.raw_logprobs), atol=1e-5, rtol=0
    )
    with torch.no_grad():  # the training forward of the whole sequence agrees
        logp = torch.log_softmax(model(torch.tensor([prompt + got.token_ids]))[0].float(), -1)
    pos = torch.arange(len(prompt) - 1, len(prompt) + 3)
    train = logp[pos, torch.tensor(got.token_ids)]
    torch.testing.assert_close(torch.tensor(got.raw_logprobs), train, atol=1e-5, rtol=0)
