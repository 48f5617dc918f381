"""The planner's prices of the asynchronous rollout modes (docs/async.md).

- ``colocated_async``: a rank's generator holds its share of the ``P (S + 1)`` prompt groups in
  flight (the KV pool is sized for them, by the generator's own rule), and with
  ``rollout.suspended_kv = "keep"`` that pool stays in device memory through the update
  (``suspended KV (keep)`` in the update phase); ``offload`` moves it to host memory and
  ``recompute`` frees it, so neither adds to the update.
- ``split``: two kinds of rank. A trainer's update is the layout's over the trainer ranks alone
  (FSDP2 over ``world - gen_ranks``); during the weight sync it holds its training state and
  at most one bucket of send buffers. A generator holds the whole model in the generation
  dtype, the KV pool of its share of the groups in flight, and at most one bucket of receive
  buffers; it never holds training state.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any


def in_flight_kv(planner: Any, layout: Any, generators: int, cfg_rollout: Any) -> tuple[int, int]:
    """(bytes, full-length sequences) of one generator's KV pool (``rollout.tp = 1``) when
    ``generators`` generators share the ``P (S + 1)`` groups in flight (``planner``, ``layout``:
    tandem/rl/plan/planner.py's `Planner` and `Layout`)."""
    s = planner.s
    sized = copy.copy(planner)
    sized.s = dataclasses.replace(
        s, prompts_per_step=s.prompts_per_step * (cfg_rollout.max_staleness + 1)
    )
    alone = dataclasses.replace(
        layout, pp=1, dp_replicate=1, dp_shard=generators, cp=1, tp=1, ep=1, rollout_tp=1
    )
    return sized.kv_pool(alone)


def async_plans(cfg: Any, planner: Any, layout: Any, plans: list[Any]) -> list[Any]:
    """``plans`` (the layout's ranks) priced for ``rollout.mode``; unchanged for ``sync``. Under
    split, ``layout`` is the trainers' and a generator column comes first."""
    ro = cfg.rollout
    if ro.mode == "colocated_async":
        kv, seqs = in_flight_kv(planner, layout, layout.world, ro)  # rollout.tp = 1 so far
        out = []
        for p in plans:
            update = dict(p.update)
            if ro.suspended_kv == "keep":
                update["suspended KV (keep)"] = kv
            out.append(
                dataclasses.replace(
                    p, update=update, rollout={**p.rollout, "KV pool": kv}, kv_sequences=seqs
                )
            )
        return out
    if ro.mode != "split":
        return plans
    whole = planner.generation_shard(1)
    bucket = min(planner.s.bucket_bytes, whole)
    kv, seqs = in_flight_kv(planner, layout, ro.gen_ranks, ro)
    generator = dataclasses.replace(
        plans[0],
        kind="generator",
        update={},
        kv_sequences=seqs,
        rollout={
            "generation copy (whole)": whole,
            "KV pool": kv,
            "bridge receive buffers (at most)": bucket,
        },
    )
    trainers = [
        dataclasses.replace(
            p,
            kind=f"trainer ({p.kind})" if len(plans) > 1 else "trainer",
            kv_sequences=0,
            rollout={
                "resident training state": p.rollout["resident training state"],
                "bridge send buffers (at most)": bucket,
            },
        )
        for p in plans
    ]
    return [generator, *trainers]
