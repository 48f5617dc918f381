"""On-policy distillation in the RL loop: teacher models score the student's own samples.

Each teacher is an HF folder built like the frozen reference (FSDP2 over the
policy's data-parallel mesh, no optimizer); it may be larger than the student
(its own config.json) but must share the student's tokenizer, checked at
start-up. With one teacher every prompt uses it (OPD); with several, each
prompt's ``distill.route_field`` value names its teacher (multi-teacher OPD),
and an unknown value stops the run naming the value and the row.

The update phase asks `Teachers.logprobs` for ``log p_teacher`` of every
completion token; the loop turns ``log p_student - log p_teacher`` (the
sampled per-token reverse KL, rl/algorithms/distill.py) into advantages, and
reports the reverse KL per teacher.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from models.hf import load_args
from models.tokenizer import Tokenizer
from rl.data.loading import DataError
from rl.rollout.types import RolloutSample
from rl.runtime.modeling import BuildSpec, ModelSetupError, build_transformer
from rl.runtime.rl_config import DistillConfig
from rl.update.loss import pack_micro_batches, recompute_logprobs, sync_micro_batch_count


def same_tokenizer(a: Tokenizer, b: Tokenizer) -> bool:
    """Same vocabulary (token -> id, added tokens included) and the same EOS ids."""
    return a.raw.get_vocab(with_added_tokens=True) == b.raw.get_vocab(with_added_tokens=True) \
        and sorted(a.eos_token_ids) == sorted(b.eos_token_ids)


class Teachers:
    def __init__(self, d: DistillConfig, student_tok: Tokenizer, mesh: Any, device: torch.device, spec: BuildSpec,
                 *, seed: int, is_main: bool) -> None:
        self.names = d.teacher_names()
        self.route_field = d.route_field
        self.models = []
        for i, path in enumerate(d.teachers):
            key = f"distill.teachers[{i}] ({path})"
            try:
                tok = Tokenizer.from_dir(path)
                args = load_args(path)
            except (OSError, ValueError, KeyError) as e:
                raise ModelSetupError(f"{key}: {str(e).strip().splitlines()[0]}") from None
            if not same_tokenizer(tok, student_tok):
                raise ModelSetupError(f"{key}: its tokenizer differs from the student's; "
                                      "on-policy distillation scores the student's token ids, so both must share one")
            self.models.append(build_transformer(args, path, seed, mesh, device, spec, is_main=is_main,
                                                 trainable=False))

    def route_rows(self, rows: list[dict[str, Any]]) -> list[int]:
        """Teacher index of every data row (0 for all with one teacher); DataError names a bad row."""
        if len(self.models) == 1:
            return [0] * len(rows)
        index = {n: i for i, n in enumerate(self.names)}
        out = []
        for n, row in enumerate(rows):
            value = row.get(self.route_field)
            if str(value) not in index:
                rid = row.get("id", row.get("problem_id", n))
                raise DataError(f"distill.route_field: row {rid} has {self.route_field}={value!r}, "
                                f"which names no teacher (teachers: {self.names})")
            out.append(index[str(value)])
        return out

    def route(self, samples: list[RolloutSample]) -> list[int]:
        return self.route_rows([s.row for s in samples])

    @torch.no_grad()
    def logprobs(self, samples: list[RolloutSample], route: list[int], width: int, budget: int,
                 device: torch.device) -> torch.Tensor:
        """log p_teacher of every completion token [N, width], each sample under its own teacher.

        Collective: every rank runs every teacher (possibly on padding micro-batches only)."""
        out = torch.zeros(len(samples), width, device=device)
        for k, model in enumerate(self.models):
            rows = [i for i, r in enumerate(route) if r == k]
            mbs = sync_micro_batch_count(pack_micro_batches(samples, rows, budget, device), device)
            out += recompute_logprobs(model, samples, mbs, width, device)  # zero outside ``rows``
        return out

    def metrics(self, rkl: torch.Tensor, mask: torch.Tensor, route: list[int]) -> dict[str, float]:
        """Mean sampled reverse KL over the masked tokens, per teacher (all ranks)."""
        r = torch.tensor(route, device=mask.device)
        sums = torch.zeros(len(self.models), 2, dtype=torch.float64, device=mask.device)
        for k in range(len(self.models)):
            sel = (r == k).float()[:, None] * mask
            sums[k] = torch.stack([(rkl * sel).sum(), sel.sum()]).double()
        dist.all_reduce(sums)
        out = {f"distill/{n}/reverse_kl": (sums[k, 0] / sums[k, 1].clamp(min=1)).item() for k, n in enumerate(self.names)}
        out["distill/reverse_kl"] = (sums[:, 0].sum() / sums[:, 1].sum().clamp(min=1)).item()
        return out
