"""A bounded per-step log of rollout samples: ``<dump_folder>/samples.jsonl``.

Metrics say *that* a run went wrong; the samples say *how* (a reward hacked by
a stray token, completions cut at the length limit, advantages of one sign).
Each logged step keeps at most ``per_step`` records, so the file grows with the
step count, never with the batch size::

    log = SampleLog(cfg.job.dump_folder, cfg.metrics.samples_per_step, enabled=info.is_main,
                    text_sink=logger.text)          # tensorboard text summaries too
    log.truncate(resumed_step)                      # on resume, like metrics.jsonl
    log.log(step, [{"prompt": ..., "completion": ..., "reward": 1.0,
                    "rewards": {"exact_match": 1.0}, "advantage": 0.5,
                    "finish_reason": "stop"}, ...])

One JSON line per step: ``{"step": S, "samples": [record, ...]}``. A record
needs the six keys above; other JSON-serialisable keys (a prompt id, token
counts) are kept as given. The first ``per_step`` records of a step are kept:
callers order them by prompt, so the samples of one group (whose advantages
are relative to each other) sit together. ``tandem-report`` reads the
file with `read_samples`.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from tandem.rl.core.metrics import read_step_log, truncate_jsonl

FILE = "samples.jsonl"
REQUIRED = ("prompt", "completion", "reward", "rewards", "advantage", "finish_reason")


def _number(value: Any) -> float | None:
    """A float for JSON (NaN/Inf become None: JSON has no spelling for them)."""
    if value is None:
        return None
    out = float(value)
    if not math.isfinite(out):
        return None
    return out


def clean_record(record: Mapping[str, Any]) -> dict[str, Any]:
    """The record with its required keys checked and typed; a missing key is a ValueError
    naming it."""
    missing = [k for k in REQUIRED if k not in record]
    if missing:
        raise ValueError(
            f"sample record: missing {', '.join(missing)} (has {', '.join(sorted(record))})"
        )
    rewards = record["rewards"]
    if not isinstance(rewards, Mapping):
        raise ValueError(
            "sample record: 'rewards' must map reward names to floats, got "
            f"{type(rewards).__name__}"
        )
    out = dict(record)
    out.update(
        prompt=str(record["prompt"]),
        completion=str(record["completion"]),
        reward=_number(record["reward"]),
        advantage=_number(record["advantage"]),
        rewards={str(k): _number(v) for k, v in rewards.items()},
        finish_reason=str(record["finish_reason"]),
    )
    return out


def _markdown(records: list[dict[str, Any]]) -> str:
    """Records as tensorboard markdown: a header line each, prompt and completion as code blocks."""
    parts = []
    for i, r in enumerate(records):
        per_fn = ", ".join(
            f"{k} {v:.3g}" if v is not None else f"{k} n/a" for k, v in r["rewards"].items()
        )
        reward = f"{r['reward']:.3g}" if r["reward"] is not None else "n/a"
        adv = f"{r['advantage']:.3g}" if r["advantage"] is not None else "n/a"
        head = (
            f"**{i}** reward {reward}"
            + (f" ({per_fn})" if per_fn else "")
            + f", advantage {adv}, {r['finish_reason']}"
        )
        block = "\n".join(
            "    " + line
            for line in (r["prompt"] + "\n--- completion ---\n" + r["completion"]).splitlines()
        )
        parts.append(head + "\n\n" + block)
    return "\n\n".join(parts)


class SampleLog:
    """Append at most ``per_step`` sample records per step to ``<dump_folder>/samples.jsonl``.

    ``enabled`` is false on every rank but the one that writes (and ``per_step``
    0 turns the log off); then every method does nothing. ``text_sink(tag,
    text, step)``, when given (e.g. `MetricsLogger.text`), also receives each
    step's records as one markdown text summary under the tag ``"samples"``.
    """

    def __init__(
        self,
        dump_folder: str,
        per_step: int,
        enabled: bool,
        text_sink: Callable[[str, str, int], None] | None = None,
    ) -> None:
        if per_step < 0:
            raise ValueError(f"SampleLog: per_step must be >= 0, got {per_step}")
        self.path = os.path.join(dump_folder, FILE)
        self.per_step = per_step
        self.enabled = enabled and per_step > 0
        self.text_sink = text_sink

    def log(self, step: int, records: Sequence[Mapping[str, Any]]) -> int:
        """Write the first ``per_step`` of ``records`` as step ``step``; returns how many
        were written."""
        if not self.enabled or not records:
            return 0
        kept = [clean_record(r) for r in records[: self.per_step]]
        os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps({"step": int(step), "samples": kept}, ensure_ascii=False) + "\n")
        if self.text_sink is not None:
            self.text_sink("samples", _markdown(kept), int(step))
        return len(kept)

    def truncate(self, step: int) -> None:
        """Keep the steps ``<= step`` (a resumed run drops what a crashed one logged past its
        checkpoint)."""
        if self.enabled:
            truncate_jsonl(self.path, step)


def read_samples(dump_folder: str) -> list[dict[str, Any]]:
    """The steps of ``<dump_folder>/samples.jsonl`` in file order ([] when there is none).

    A line cut short by a crash (the last one) is skipped (`read_step_log`).
    """
    return read_step_log(os.path.join(dump_folder, FILE))


def dump_rollouts(dump_folder: str, step: int, rank: int, samples: Sequence[Any]) -> None:
    """``advanced.dump_rollouts`` (a debugging aid, used by the layout tests): every sample of
    this rank as one line of ``rollouts/rank-R.jsonl`` (step, prompt position, tokens, generator
    log-probs, policy versions), so runs on different layouts can be compared sample by sample."""
    os.makedirs(os.path.join(dump_folder, "rollouts"), exist_ok=True)
    with open(os.path.join(dump_folder, "rollouts", f"rank-{rank}.jsonl"), "a") as f:
        for s in samples:
            f.write(
                json.dumps(
                    {
                        "step": step + 1,
                        "prompt": s.group,
                        "completion_ids": s.completion_ids,
                        "gen_logprobs": s.gen_logprobs,
                        "versions": s.versions,
                    }
                )
                + "\n"
            )
