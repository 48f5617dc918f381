"""Batched token sampling with per-request seeds and exact log-probs.

One call samples a token for every row of ``logits [N, V]``. Per row:
temperature, then top-k, then top-p (over the top-k renormalised
distribution), then min-p (relative to the top probability, so it does not
care about renormalisation); the surviving logits are renormalised and sampled
by an exponential race, ``argmax(log p - log E)`` with ``E ~ Exp(1)`` i.i.d.,
which is an exact sample of ``p`` (the Gumbel-max trick).

Randomness: the noise of row i is a counter-based hash of ``step_keys[i] =
(seed, index of the token being sampled)`` and the vocabulary id, computed with
int64 tensor ops. It depends on nothing else, so a row samples the same token
alone or in any batch, after preemption and recompute, and on CPU or GPU given
the same logits. (A per-row ``torch.Generator`` would give the same guarantee
at the cost of one kernel launch per row.) The uniforms have 23 bits.

Returned log-probs: ``logprobs`` under the distribution actually sampled from
(0 for greedy rows: a point mass), ``raw_logprobs`` from ``log_softmax`` of the
raw logits (temperature 1, no truncation), for importance ratios and KL.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Callable

import torch

from tandem.kernels import batch_invariant
from tandem.kernels.sampling_noise import noise_in_one_pass, use_one_pass_noise
from tandem.rl.generator.sequence import SamplingParams

_M32 = 0xFFFFFFFF
_M64 = (1 << 64) - 1
_NOISE_CHUNK_ELEMS = 1 << 24  # bounds the int64 temporaries of the noise hash


def truncation_mask(
    logits: torch.Tensor, top_k: list[int], top_p: list[float], min_p: list[float]
) -> torch.Tensor:
    """Which tokens each row keeps after top-k, then top-p, then min-p. Returns bool [N, V].

    logits [N, V] are already temperature-scaled. top-k keeps exactly k tokens
    (ties broken by vocabulary order); top-p keeps the smallest prefix, by
    descending probability, whose mass reaches p; min-p keeps tokens with
    prob >= min_p * max prob. 0, 1 and 0 switch them off; the paths taken
    depend only on these Python values, so there is no host sync.
    """
    n, v = logits.shape
    device = logits.device
    keep = torch.ones(n, v, dtype=torch.bool, device=device)
    use_k = any(0 < k < v for k in top_k)
    use_p = any(p < 1 for p in top_p)
    if use_k or use_p:
        sorted_logits, order = logits.sort(dim=-1, descending=True, stable=True)  # [N, V]
        ranks = torch.arange(v, device=device)
        k = torch.tensor([k if 0 < k < v else v for k in top_k], device=device)
        keep_sorted = ranks[None, :] < k[:, None]  # [N, V]
        if use_p:
            probs = torch.softmax(sorted_logits.masked_fill(~keep_sorted, float("-inf")), dim=-1)
            mass_before = torch.cumsum(probs, dim=-1) - probs  # exclusive prefix mass [N, V]
            mass_before[:, 0] = 0.0  # the top token always survives
            p = torch.tensor(top_p, dtype=probs.dtype, device=device)[:, None]
            keep_sorted &= (mass_before < p) | (p >= 1)
        keep = torch.empty_like(keep_sorted).scatter_(1, order, keep_sorted)
    if any(m > 0 for m in min_p):
        probs = torch.softmax(logits.masked_fill(~keep, float("-inf")), dim=-1)  # [N, V]
        m = torch.tensor(min_p, dtype=probs.dtype, device=device)[:, None]
        keep &= probs >= m * probs.amax(dim=-1, keepdim=True)
    return keep


def _row_keys(step_keys: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Two 32-bit words per (seed, index), from a cryptographic hash (stable across runs)."""
    words = []
    for seed, index in step_keys:
        digest = hashlib.blake2b(
            struct.pack("<QQ", seed & _M64, index & _M64), digest_size=8
        ).digest()
        key = int.from_bytes(digest, "little")
        words.append((key & _M32, key >> 32))
    return words


def _mix32_(x: torch.Tensor) -> torch.Tensor:
    """In place: a 32-bit integer bijection with good avalanche (xorshift-multiply, 'lowbias32').

    x is int64 in [0, 2**32); each product wraps modulo 2**64 (two's complement),
    which leaves its low 32 bits exact. In place because the [N, V] temporaries
    of the out-of-place form cost more than the arithmetic.
    """
    x.bitwise_xor_(x >> 16)
    x.mul_(0x7FEB352D).bitwise_and_(_M32)
    x.bitwise_xor_(x >> 15)
    x.mul_(0x846CA68B).bitwise_and_(_M32)
    return x.bitwise_xor_(x >> 16)


def _mix32(x: torch.Tensor) -> torch.Tensor:
    return _mix32_(x.clone())


def hash_uniforms(keys: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """u in (0, 1) [n, V] fp32 of row keys [n, 2] (two 32-bit words in int64) and every
    vocabulary id: integer arithmetic and exact conversions only, so a compiled form of it
    (`tandem.rl.generator.compiled_decode.compiled_uniforms`) gives the same bits."""
    vocab = torch.arange(vocab_size, dtype=torch.int64, device=keys.device)[None, :]  # [1, V]
    k0, k1 = keys[:, 0:1], keys[:, 1:2]  # [n, 1] each
    h = (vocab + k0).bitwise_and_(_M32)  # [n, V]
    _mix32_(_mix32_(h).bitwise_xor_(k1))  # [n, V] in [0, 2**32)
    return (h >> 9).to(torch.float32).add_(0.5).mul_(2.0**-23)  # exact in fp32, inside (0, 1)


def exponential_noise(
    step_keys: list[tuple[int, int]],
    vocab_size: int,
    device: torch.device | str = "cpu",
    impl: str | None = None,
    uniforms: Callable[[torch.Tensor, int], torch.Tensor] = hash_uniforms,
) -> torch.Tensor:
    """E ~ Exp(1) i.i.d. per (row, token), a pure function of (seed, index, token). [N, V] fp32.

    ``impl="triton"`` (or ``advanced.kernels = "triton"``) computes it with
    `tandem.kernels.sampling_noise.noise_in_one_pass` instead (not yet timed on a GPU).
    ``uniforms``: `hash_uniforms` or a function giving its very bits (a compiled form).
    """
    keys = torch.tensor(_row_keys(step_keys), dtype=torch.int64, device=device).reshape(
        -1, 2
    )  # [N, 2]
    if use_one_pass_noise(keys, impl):
        return noise_in_one_pass(keys, vocab_size)
    out = torch.empty(keys.shape[0], vocab_size, dtype=torch.float32, device=device)
    rows = max(1, _NOISE_CHUNK_ELEMS // max(vocab_size, 1))
    for r in range(0, keys.shape[0], rows):
        out[r : r + rows] = uniforms(keys[r : r + rows], vocab_size).log_().neg_()
    return out


class Sampler:
    """One instance serves every step of a generator.

    The noise of a row is a pure function of its key, and a sequence asks for
    (seed, i), then (seed, i + 1), ... So when a step's keys are not all at hand,
    the noise for them and for the ``ahead - 1`` next indices of each is computed
    in one batch and kept (one such block at a time, at most ``budget`` elements):
    most of its cost is per call, not per row. The tokens are the same as without
    it; with a vocabulary too large for two rows of lookahead within the budget,
    each step computes its own noise.
    """

    def __init__(
        self,
        ahead: int = 8,
        budget: int = 1 << 21,
        uniforms: Callable[[torch.Tensor, int], torch.Tensor] = hash_uniforms,
    ) -> None:
        self.ahead, self.budget, self.uniforms = ahead, budget, uniforms
        self._row_of: dict[tuple[int, int], int] = {}  # key -> its row in the current block
        self._block: torch.Tensor | None = None  # [rows, V] noise of the current block

    def _noise(
        self, step_keys: list[tuple[int, int]], v: int, device: torch.device
    ) -> torch.Tensor:
        """Exp(1) noise [N, V] for these keys (see `exponential_noise`), a new tensor."""
        ahead = min(self.ahead, self.budget // max(len(step_keys) * v, 1))
        if ahead < 2:
            return exponential_noise(step_keys, v, device, uniforms=self.uniforms)
        block = self._block
        if (
            block is None
            or block.shape[1] != v
            or block.device != device
            or any(k not in self._row_of for k in step_keys)
        ):
            keys = [
                (seed, index + j) for seed, index in dict.fromkeys(step_keys) for j in range(ahead)
            ]
            self._block = block = exponential_noise(keys, v, device, uniforms=self.uniforms)
            self._row_of = {k: i for i, k in enumerate(keys)}
        return block.index_select(
            0, torch.tensor([self._row_of[k] for k in step_keys], device=device)
        )

    def sample(
        self, logits: torch.Tensor, params: list[SamplingParams], step_keys: list[tuple[int, int]]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Sample one token per row.

        logits [N, V] (cast to fp32), params and step_keys one per row; step_keys[i]
        = (seed, index the sampled token will have in its sequence). Returns
        tokens [N] long, logprobs [N] fp32 under the sampled distribution (0 for
        greedy rows) and raw_logprobs [N] fp32 (log_softmax of the raw logits).
        """
        n, v = logits.shape
        if len(params) != n or len(step_keys) != n:
            raise ValueError(
                f"Sampler.sample: {n} logit rows but {len(params)} params and "
                f"{len(step_keys)} step keys"
            )
        device = logits.device
        logits = logits.float()
        # rl.exact: per-row fixed order
        lse = batch_invariant.logsumexp if batch_invariant.enabled() else _logsumexp
        raw_logprobs = logits - lse(logits)[:, None]  # [N, V]
        greedy_rows = [p.greedy for p in params]  # temperature 0 or below MIN_TEMPERATURE
        if all(greedy_rows):
            tokens = logits.argmax(dim=-1)  # [N]
            logprobs = torch.zeros(n, dtype=torch.float32, device=device)
        else:
            # Rows at temperature 1 with no truncation sample from the raw distribution
            # itself, so a batch of only those skips the rescale and the mask (same values).
            plain = all((p.greedy or p.temperature == 1) and not _truncates(p, v) for p in params)
            if plain:
                dist_logprobs = raw_logprobs
            else:
                temps = torch.tensor(
                    [1.0 if p.greedy else p.temperature for p in params],
                    dtype=torch.float32,
                    device=device,
                )
                scaled = logits / temps[:, None]  # [N, V]
                keep = truncation_mask(
                    scaled,
                    [p.top_k for p in params],
                    [p.top_p for p in params],
                    [p.min_p for p in params],
                )
                masked = scaled.masked_fill(~keep, float("-inf"))
                dist_logprobs = masked - lse(masked)[:, None]  # [N, V]
            race = dist_logprobs - self._noise(step_keys, v, device).log_()  # [N, V]
            tokens = race.argmax(dim=-1)  # [N]
            greedy = torch.tensor(greedy_rows, device=device) if any(greedy_rows) else None
            if greedy is not None:
                tokens = torch.where(greedy, logits.argmax(dim=-1), tokens)
            logprobs = dist_logprobs.gather(1, tokens[:, None]).squeeze(1)
            if plain and greedy is None:  # the sampled distribution is the raw one
                return tokens, logprobs, logprobs.clone()
            if greedy is not None:
                logprobs = torch.where(greedy, torch.zeros_like(logprobs), logprobs)
        raw = raw_logprobs.gather(1, tokens[:, None]).squeeze(1)
        return tokens, logprobs, raw


def _logsumexp(x: torch.Tensor) -> torch.Tensor:
    return torch.logsumexp(x, dim=-1)


def _truncates(p: SamplingParams, vocab_size: int) -> bool:
    """Whether top-k, top-p or min-p removes any token for these params (see `truncation_mask`)."""
    return 0 < p.top_k < vocab_size or p.top_p < 1 or p.min_p > 0
