"""On-policy distillation in the RL loop: teacher models score the student's own samples.

Each teacher is an HF folder built like the frozen reference (FSDP2 over the
policy's data-parallel mesh, no optimizer); it may be larger than the student
(its own config.json) and have any tokenizer. With one teacher every prompt
uses it (OPD); with several, each prompt's ``distill.route_field`` value names
its teacher (multi-teacher OPD); a value that names no teacher stops the run
at start (exit 2), naming the value and the row. Under ``parallel.cp`` a teacher scores
the policy's way: each cp rank runs its share of every packed row
(tandem/rl/update/cp_batch.py), so a teacher's activations are split like the student's.

A teacher with the student's tokenizer scores the student's own token ids, and
each token is a chunk of its own. A teacher with another tokenizer sees the
conversation through its own chat template and the completion re-encoded
(tandem/rl/update/xtok_alignment.py); its token log-probs are summed over the chunks both
tokenizations share. `Teachers.score` returns, per completion, the teacher's
log-prob of every chunk and the chunk of every student token; the recipe turns
``log p_student(chunk) - log p_teacher(chunk)`` into advantages
(tandem/rl/algorithms/distill.py) and reports the reverse KL and the aligned share
of tokens per teacher.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from tandem.models.hf import load_args
from tandem.models.tokenizer import Tokenizer
from tandem.parallel.cp import ContextParallel
from tandem.rl.algorithms import chunk_sums
from tandem.rl.config.rl_schema import DistillConfig
from tandem.rl.config.schema import ConfigError
from tandem.rl.core.fields import get_field
from tandem.rl.core.modeling import BuildSpec, ModelSetupError, build_transformer
from tandem.rl.rollout.types import RolloutSample
from tandem.rl.update.loss import recompute_logprobs
from tandem.rl.update.packing import pack_micro_batches, sync_micro_batch_count
from tandem.rl.update.xtok_alignment import CrossTokenizer

Conversation = Callable[[dict[str, Any]], list[dict[str, Any]]]


def same_tokenizer(a: Tokenizer, b: Tokenizer) -> bool:
    """Same vocabulary (token -> id, added tokens included) and the same EOS ids."""
    return a.raw.get_vocab(with_added_tokens=True) == b.raw.get_vocab(
        with_added_tokens=True
    ) and sorted(a.eos_token_ids) == sorted(b.eos_token_ids)


class Teachers:
    """``conversation(row)`` gives the chat turns a data row's prompt was rendered from
    (what a teacher with another tokenizer renders with its own template)."""

    needs_old_logp = True  # the distillation advantage is the reverse KL from the old log-probs

    def __init__(
        self,
        d: DistillConfig,
        student_tok: Tokenizer,
        mesh: Any,
        device: torch.device,
        spec: BuildSpec,
        *,
        seed: int,
        is_main: bool,
        conversation: Conversation,
        group: dist.ProcessGroup | None,
        cp: ContextParallel | None = None,
    ) -> None:
        self.group = group  # the ranks that score together (the policy's)
        self.cp = cp  # the policy's cp split (None: cp = 1)
        self.names = d.teacher_names()
        self.route_field = d.route_field
        self.conversation = conversation
        self.models = []
        self.cross: list[CrossTokenizer | None] = []  # None: the student's tokenizer
        for i, path in enumerate(d.teachers):
            key = f"distill.teachers[{i}] ({path})"
            try:
                tok = Tokenizer.from_dir(path)
                args = load_args(path)
                self.cross.append(
                    None if same_tokenizer(tok, student_tok) else CrossTokenizer(student_tok, tok)
                )
            except (OSError, ValueError, KeyError) as e:
                raise ModelSetupError(f"{key}: {str(e).strip().splitlines()[0]}") from None
            if cp is not None:
                try:
                    cp.check_heads(args.num_heads, args.num_kv_heads)
                except ValueError as e:
                    raise ConfigError(f"{key}: {e}") from None
            self.models.append(
                build_transformer(
                    args, path, seed, mesh, device, spec, is_main=is_main, trainable=False
                )
            )

    @property
    def cross_tokenizer(self) -> bool:
        return any(c is not None for c in self.cross)

    def check_rows(self, rows: list[dict[str, Any]]) -> None:
        """At start: every row routes to a teacher, and every teacher with another tokenizer
        renders each shape of conversation (its roles) with a reply; ConfigError otherwise."""
        route = self.route_rows(rows)
        seen: set[tuple[int, tuple[Any, ...]]] = set()
        for row, k in zip(rows, route):
            if self.cross[k] is None:
                continue
            messages = self.conversation(row)
            shape = (k, tuple(m.get("role") for m in messages))
            if shape in seen:
                continue
            seen.add(shape)
            try:
                self.cross[k].check(messages)
            except ValueError as e:
                raise ConfigError(f"distill.teachers[{k}] ({self.names[k]}): {e}") from None

    def route_rows(self, rows: list[dict[str, Any]]) -> list[int]:
        """Teacher index of every data row (0 for all with one teacher); ConfigError names
        a bad row."""
        if len(self.models) == 1:
            return [0] * len(rows)
        index = {n: i for i, n in enumerate(self.names)}
        out = []
        for n, row in enumerate(rows):
            value = get_field(row, self.route_field)
            if str(value) not in index:
                rid = row.get("id", row.get("problem_id", n))
                raise ConfigError(
                    f"distill.route_field: row {rid} has {self.route_field}"
                    f"={value!r}, which names no teacher (distill.names: "
                    f"{self.names})"
                )
            out.append(index[str(value)])
        return out

    def route(self, samples: list[RolloutSample]) -> list[int]:
        return self.route_rows([s.row for s in samples])

    @torch.no_grad()
    def score(
        self,
        samples: list[RolloutSample],
        route: list[int],
        width: int,
        budget: int,
        device: torch.device,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(teacher log-prob of every chunk [N, width], chunk of every student token [N, width]
        (-1: none)).

        A completion of n tokens has at most n chunks. Collective: every rank runs every
        teacher (possibly on padding micro-batches only)."""
        n = len(samples)
        chunk_logp = torch.zeros(n, width, device=device)
        cols = torch.arange(width)
        lengths = torch.tensor([len(s.completion_ids) for s in samples], dtype=torch.long).reshape(
            n, 1
        )
        chunk_ids = torch.where(cols < lengths, cols, -1)  # [N, width]: one token per chunk
        cp = self.cp
        if cp is not None:  # the policy's packing: each cp rank holds budget tokens of a row
            budget *= cp.size

        def packed(items: list[RolloutSample], rows: list[int]) -> list[Any]:
            mbs = pack_micro_batches(
                items, rows, budget, device, multiple=cp.granularity if cp is not None else 1
            )
            return sync_micro_batch_count(mbs, device, group=self.group)

        for k, model in enumerate(self.models):
            rows = [i for i, r in enumerate(route) if r == k]
            cross = self.cross[k]
            if cross is None:  # the student's ids, as generated
                mbs = packed(samples, rows)
                # zero outside ``rows``
                chunk_logp += recompute_logprobs(model, samples, mbs, width, device, cp=cp)
                continue
            views = {
                i: cross.view(self.conversation(samples[i].row), samples[i].completion_ids)
                for i in rows
            }
            t_samples = [_teacher_sample(samples[i], views.get(i)) for i in range(n)]
            t_width = max([len(s.completion_ids) for s in t_samples] + [1])
            mbs = packed(t_samples, rows)
            t_logp = recompute_logprobs(
                model, t_samples, mbs, t_width, device, cp=cp
            )  # [N, t_width]
            t_chunks = torch.full((n, t_width), -1, dtype=torch.long)
            for i, v in views.items():
                a = v.alignment
                t_chunks[i, : len(a.teacher_chunk)] = torch.tensor(
                    a.teacher_chunk, dtype=torch.long
                )
                chunk_ids[i, : len(a.student_chunk)] = torch.tensor(
                    a.student_chunk, dtype=torch.long
                )
            chunk_logp += chunk_sums(t_logp, t_chunks.to(device), width)
        return chunk_logp, chunk_ids.to(device)

    def metrics(
        self, chunk_rkl: torch.Tensor, chunk_ids: torch.Tensor, mask: torch.Tensor, route: list[int]
    ) -> dict[str, float]:
        """Per teacher (all ranks): the sampled reverse KL summed over chunks per aligned token, and
        the share of sampled tokens that are aligned (1 with the student's tokenizer)."""
        r = torch.tensor(route, device=mask.device)
        aligned = mask * (chunk_ids >= 0).float()  # [N, T]
        # [N, C] chunks with a trained token
        has = chunk_sums(aligned, chunk_ids, chunk_rkl.shape[1]) > 0
        sums = torch.zeros(len(self.models), 3, dtype=torch.float64, device=mask.device)
        for k in range(len(self.models)):
            sel = (r == k)[:, None]
            sums[k] = torch.stack(
                [(chunk_rkl * (has & sel)).sum(), (aligned * sel).sum(), (mask * sel).sum()]
            ).double()
        dist.all_reduce(sums, group=self.group)
        out = {}
        for k, n in enumerate(self.names):
            out[f"distill/{n}/reverse_kl"] = (sums[k, 0] / sums[k, 1].clamp(min=1)).item()
            out[f"distill/{n}/aligned_frac"] = (sums[k, 1] / sums[k, 2].clamp(min=1)).item()
        out["distill/reverse_kl"] = (sums[:, 0].sum() / sums[:, 1].sum().clamp(min=1)).item()
        out["distill/aligned_frac"] = (sums[:, 1].sum() / sums[:, 2].sum().clamp(min=1)).item()
        return out


def _teacher_sample(s: RolloutSample, view: Any) -> RolloutSample:
    """The teacher's token sequence of one completion as a RolloutSample (packing reads
    ids only)."""
    if view is None:  # another teacher's row: never packed here
        return RolloutSample(s.group, [], [], [], [], s.finish_reason, "", s.row)
    n = len(view.completion_ids)
    return RolloutSample(
        s.group,
        view.prompt_ids,
        view.completion_ids,
        [True] * n,
        [0.0] * n,
        s.finish_reason,
        "",
        s.row,
    )
