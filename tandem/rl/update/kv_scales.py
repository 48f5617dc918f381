"""FP8 KV scales that follow the policy (``rollout.kv_dtype``; docs/low-precision.md).

With calibrated scales (``rollout.kv_scales = "calibrated"``) the rollout's FP8 pool divides
every key and value by one power-of-two scale per (layer, K or V, KV head). They come from
the trainer's own forward: after each update a no-grad forward of the policy, in the update
layout, over ``rollout.kv_calibration_tokens`` tokens per rank of the step's samples (prompt
and completion, with the new weights) records the largest ``|K|`` and ``|V|`` of each head
(`tandem.kernels.kv_quant.KVAmaxObserver`), reduced by a maximum over all ranks; the scale
follows a high-water mark of those amaxes that decays, ``max(decay * previous, new)``, so one
outlier fades over a few steps while a step's largest value always fits. Before any update
(the first rollout or evaluation of a run) the same forward reads a batch of training
prompts. No rollout runs on placeholder scales: `scales` refuses before the first
calibration, and the generator refuses a pool without them.

Every rank ends with the same whole ``[L, 2, Hkv]`` tensor: the generation layout takes its
own KV heads from it (`for_heads`), the update's tensor-parallel ranks theirs (`wrap`), and the
checkpoint keeps it (`state_dict`, in ``trainer.json``: fp32 values written as Python floats
come back bit for bit).

``rollout.kv_quantize_update`` (on by default): the update's and the reference's forwards
round K and V as the pool did, with the scales of the rollout they score (`wrap`, set as the
policies' ``kv_wrap``), so the train/generation gap stays at float noise. Per-token scales
(``"per_token"``) need no calibration: the update recomputes each token's scale from its own
K and V, as the pool's store did.
"""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist

from tandem.kernels import kv_quant as kvq
from tandem.models.args import ModelArgs
from tandem.rl.core.checkpoint import CheckpointError
from tandem.rl.rollout.types import RolloutSample

# the largest |K| or |V| a checkpoint may say a head saw: far above any working model's (fp16's
# largest value is 65504); an amax past it would scale every key and value to zero
AMAX_LIMIT = 1e5


class KVScales:
    def __init__(self, rcfg: Any, args: ModelArgs, tp: int = 1, tp_rank: int = 0) -> None:
        self.dtype = kvq.storage_dtype(rcfg.kv_dtype)
        self.per_token = rcfg.kv_scales == "per_token"
        self.decay, self.tokens = rcfg.kv_scale_decay, rcfg.kv_calibration_tokens
        self.match = rcfg.kv_quantize_update
        self.heads = h = args.num_kv_heads
        self.local = slice(tp_rank * h // tp, (tp_rank + 1) * h // tp)  # the update's TP heads
        self.amax = torch.zeros(args.num_layers, 2, h)  # the high-water mark, fp32, every head
        self.step = -1  # the first step whose rollout uses these scales; -1: never calibrated

    @classmethod
    def create(cls, rcfg: Any, args: ModelArgs, policy: Any, ref: Any = None) -> KVScales | None:
        """The run's scales for ``rollout.kv_dtype`` (None for ``auto``), set as the policy's and
        the reference's ``kv_wrap`` (`policy_wrap`)."""
        if rcfg.kv_dtype == "auto":
            return None
        kv = cls(rcfg, args, policy.tp, policy.tp_rank)
        for p in (policy, ref):
            if p is not None:
                p.kv_wrap = kv.policy_wrap()
        return kv

    @property
    def calibrated(self) -> bool:
        return self.per_token or self.step >= 0

    def scales(self) -> torch.Tensor | None:
        """``[L, 2, Hkv]`` fp32 powers of two (None with per-token scales); refuses before the
        first calibration."""
        if self.per_token:
            return None
        if self.step < 0:
            raise RuntimeError(
                "FP8 KV: the scales were never calibrated (a rollout never runs on default scales)"
            )
        return kvq.scale_from_amax(self.amax, self.dtype)

    def for_heads(self, tp: int, rank: int) -> torch.Tensor | None:
        """The scales of a generation shard's KV heads (rank ``rank`` of a group of ``tp``)."""
        s = self.scales()
        n = self.heads // tp
        return None if s is None else s[:, :, rank * n : (rank + 1) * n].contiguous()

    def wrap(self, inner: Any) -> kvq.KVQuantAttention:
        """An update forward's attention with K and V rounded as the pool rounds them (this
        rank's tensor-parallel heads)."""
        s = self.scales()
        return kvq.KVQuantAttention(inner, self.dtype, None if s is None else s[:, :, self.local])

    def policy_wrap(self) -> Any:
        """The policies' ``kv_wrap``: `wrap` under ``rollout.kv_quantize_update``, else None."""
        return self.wrap if self.match else None

    # ---- calibration ------------------------------------------------------------------

    @torch.no_grad()
    def _observe(self, policy: Any, samples: list[RolloutSample]) -> torch.Tensor:
        """Collective: the amax ``[L, 2, Hkv]`` of K and V over the first ``self.tokens`` tokens
        of ``samples`` (on every rank its own), the maximum over all ranks."""
        rows, used = [], 0
        for i, s in enumerate(samples):
            if used >= self.tokens:
                break
            rows.append(i)
            used += len(s.prompt_ids) + len(s.completion_ids)
        amax = torch.zeros(self.amax.shape, device=policy.device)
        was_training = policy.model.training
        policy.eval()
        for mb in policy.micro_batches(samples, rows):  # as many on every rank
            inner = mb.attention()
            if self.match and self.calibrated:  # the next layers see what the rollout's would
                inner = self.wrap(inner)
            real = mb.doc_ids >= 0 if mb.rows else torch.zeros_like(mb.doc_ids, dtype=torch.bool)
            observe = kvq.KVAmaxObserver(inner, amax, self.local.start, mask=real)  # not padding
            policy.model(mb.tokens, positions=mb.positions, attn=observe, head=lambda h, w: None)
        if was_training:
            policy.train()
        if dist.is_initialized():
            dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=policy.group)
        return amax.cpu()

    def calibrate(
        self, policy: Any, samples: list[RolloutSample], next_step: int
    ) -> dict[str, float]:
        """Collective: new scales from the policy's forward over ``samples`` (its weights now),
        for the rollouts from ``next_step`` on; the ``kv/`` metrics of the calibration."""
        if self.per_token:
            return {}
        t0 = time.monotonic()
        before = self.scales() if self.calibrated else None
        seen = self._observe(policy, samples)
        self.amax = torch.maximum(self.amax * self.decay, seen)
        self.step = next_step
        after = self.scales()
        changed = float((after != before).float().mean()) if before is not None else 1.0
        return {
            "kv/calibration_s": time.monotonic() - t0,
            "kv/amax_mean": float(self.amax.mean()),
            "kv/scales_changed": changed,
            "kv/scale_log2_mean": float(after.log2().mean()),
        }

    def ensure(self, policy: Any, prompts: list[Any], step: int) -> dict[str, float]:
        """Collective: the first calibration, from training prompts alone (data-parallel rank r
        of n reads prompts r, r + n, ...; a replica's tensor-parallel ranks the same ones),
        when the run has no scales yet (not after a resume that restored them)."""
        if self.calibrated:
            return {}
        mine = [
            RolloutSample(
                group=i,
                prompt_ids=p.token_ids,
                completion_ids=[],
                loss_mask=[],
                gen_logprobs=[],
                finish_reason="stop",
                text="",
                row={},
            )
            for i, p in enumerate(prompts[policy.dp_rank :: policy.dp])
        ]
        return self.calibrate(policy, mine, step)

    def rollout_metrics(self, step: int) -> dict[str, float]:
        """``kv/scale_age``: steps since the scales in use were calibrated (0 when they come from
        the weights that generate)."""
        return {} if self.per_token else {"kv/scale_age": float(step - self.step)}

    # ---- checkpoints ------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        return {"amax": self.amax.tolist(), "step": self.step}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """The checkpoint's scales, checked like its weights: CheckpointError (exit 8) unless
        ``amax`` is a ``[L, 2, Hkv]`` list of this model's shape, every value finite, >= 0 and
        at most ``AMAX_LIMIT``, and ``step`` an integer (an edited, re-hashed trainer.json
        with NaN or 1e38 would otherwise quantize every key and value to zero, silently)."""
        why = None
        try:
            amax = torch.tensor(state["amax"], dtype=torch.float32)
            step = state["step"]
        except (KeyError, TypeError, ValueError, RuntimeError) as e:
            amax, step, why = None, None, f"not an amax table ({type(e).__name__})"
        if why is None and amax.shape != self.amax.shape:
            why = f"amax has shape {list(amax.shape)}, this model {list(self.amax.shape)}"
        elif why is None and not bool(((amax >= 0) & (amax <= AMAX_LIMIT)).all()):  # NaN: False
            bad = (~((amax >= 0) & (amax <= AMAX_LIMIT))).nonzero()[0].tolist()
            value = amax[tuple(bad)].item()
            where = ", ".join(map(str, bad))
            why = f"amax[{where}] = {value:.6g} is not a number in [0, {AMAX_LIMIT:g}]"
        elif why is None and (type(step) is not int or step < 0):
            why = f"step is {step!r}, not an integer >= 0"
        if why is not None:
            raise CheckpointError(f"checkpoint trainer.json: kv_scales: {why}; not loaded")
        self.amax, self.step = amax, step
