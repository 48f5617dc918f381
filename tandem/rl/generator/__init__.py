"""Tandem's in-house paged-KV generator, split by job like nano-vllm.

- ``sequence.py``: per-request state (`Sequence`, `SamplingParams`).
- ``block_manager.py``: KV blocks, reference counts, fork and copy-on-write.
- ``scheduler.py``: admission, chunked prefill, group prefix sharing, preemption,
  multi-turn pause/resume; emits one explicit `SchedulerOutput` per step.
- ``sampler.py``: batched, per-request-seeded sampling with exact log-probs.
- ``kv_cache.py`` / ``runner.py`` / ``engine.py``: tensors, the model and the loop.

The first three are pure Python (no torch), so this package imports nothing on
purpose: ``import tandem.rl.generator.scheduler`` must not pull in torch.
"""
