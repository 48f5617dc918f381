"""A streaming rollout's single-turn prompt groups across generation phases (the colocated
asynchronous and split modes: tandem/rl/rollout/streaming.py): `StreamingGenerator` holds this
rank's generator and its groups, suspends them through an update with every token's version,
and saves and restores them for a checkpoint. Multi-turn episodes:
tandem/rl/rollout/streaming_episodes.py.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from tandem.rl.data.prompts import Prompt
from tandem.rl.generator.engine import Generator, stop_strings_check
from tandem.rl.generator.sequence import Sequence, SequenceStatus
from tandem.rl.rollout.inflight import Flight
from tandem.rl.rollout.sampling import generator_settings, group_params, sampling_params
from tandem.rl.rollout.types import RolloutSample


class _Group:
    """One group this rank generates: its sequences and each one's per-token versions."""

    def __init__(
        self, flight: Flight, prompt: Prompt, seqs: list[Sequence], restored: bool = False
    ) -> None:
        self.flight, self.prompt, self.seqs = flight, prompt, seqs
        self.versions: list[list[int]] = [[] for _ in seqs]
        self.restored = restored  # from a checkpoint: the generator saw only part of it

    def stamp(self, version: int) -> None:
        """Give the tokens sampled since the last stamp the version that sampled them."""
        for seq, v in zip(self.seqs, self.versions):
            v.extend([version] * (seq.num_generated - len(v)))

    @property
    def complete(self) -> bool:
        return all(s.is_finished for s in self.seqs)


class StreamingGenerator:
    """This rank's generator across generation phases, and the groups it holds."""

    def __init__(self, tok: Any, rcfg: Any, max_prompt: int, max_seqs: int) -> None:
        self.tok, self.rcfg, self.max_prompt = tok, rcfg, max_prompt
        self.max_seqs = max_seqs
        self.gen: Generator | None = None
        self.groups: dict[int, _Group] = {}
        self.restored: list[_Group] = []  # from a checkpoint: added once the generator exists
        self.check = stop_strings_check(tok.decode, rcfg.stop) if rcfg.stop else None
        self.suspended = False

    def resume(self, model: Any, kv_scales: Any = None) -> int:
        """Start of a phase: the generator (made at the first phase), its KV back, restored
        groups in. ``kv_scales``: an FP8 pool's calibrated scales of this phase's version; the
        entries the pool kept are re-quantised to them (`Generator.set_kv_scales`; a recomputed
        KV is written with them). Returns the KV heads re-quantised."""
        requantized = 0
        if self.gen is None:
            settings = generator_settings(self.rcfg, self.max_prompt, 0)
            settings.max_num_seqs = min(settings.max_num_seqs, max(1, self.max_seqs))
            # captured graphs hold the pool's address, which offload and recompute change
            settings.cuda_graphs = settings.cuda_graphs and self.rcfg.suspended_kv == "keep"
            if getattr(model.args, "num_experts", 0):
                settings.cuda_graphs = False
            self.gen = Generator(
                model, settings, eos_token_ids=self.tok.eos_token_ids, kv_scales=kv_scales
            )
        else:
            if self.suspended and self.rcfg.suspended_kv == "offload":
                self.gen.restore_kv()
            elif self.suspended and self.rcfg.suspended_kv == "recompute":
                self.gen.reacquire_kv()
            requantized = self.gen.set_kv_scales(kv_scales)
        self.suspended = False
        for g in self.restored:
            for seq in g.seqs:
                if seq.is_finished:
                    continue
                self.gen.add_resumed(seq, self.check)
            self.groups[g.flight.position] = g
        self.restored = []
        return requantized

    def add(self, flight: Flight, prompt: Prompt, n: int) -> None:
        params = group_params(sampling_params(self.rcfg), flight.seed)
        seqs = self.gen.add(prompt.token_ids, params, n, stop_check=self.check)
        self.groups[flight.position] = _Group(flight, prompt, seqs)

    def busy(self) -> bool:
        return self.gen is not None and self.gen.has_work()

    def step(self) -> None:
        self.gen.step()

    def complete(self) -> set[int]:
        return {p for p, g in self.groups.items() if g.complete}

    def stamp(self, version: int) -> None:
        """Give every group's tokens sampled since the last stamp the version ``version``."""
        for g in self.groups.values():
            g.stamp(version)

    def suspend(self, version: int) -> int:
        """End of a phase: stamp every partial sequence's new tokens, then suspend the KV as
        configured; returns the sequences suspended."""
        self.stamp(version)
        n = sum(1 for g in self.groups.values() for s in g.seqs if not s.is_finished)
        if self.gen is not None and n:
            self._suspend_kv()
        return n

    def _suspend_kv(self) -> None:
        assert self.gen is not None
        if self.rcfg.suspended_kv == "offload":
            self.gen.offload_kv()
            self.suspended = True
        elif self.rcfg.suspended_kv == "recompute":
            self.gen.release_kv()
            self.suspended = True

    def phase_metrics(self) -> dict[str, float]:
        """This rank's metrics of what the phase's generation played (none for single turns)."""
        return {}

    def close(self) -> None:
        """Nothing to release: the generator goes with the rollout."""

    def take(self, position: int) -> list[RolloutSample]:
        """A complete group's samples (it leaves this generator; `suspend` stamped its versions)."""
        g = self.groups.pop(position)
        return [self._sample(g, j) for j in range(len(g.seqs))]

    def peek(self, position: int, version: int) -> list[RolloutSample]:
        """A complete group's samples, left in this generator (its new tokens stamped with
        ``version``, the one that sampled them)."""
        g = self.groups[position]
        g.stamp(version)
        return [self._sample(g, j) for j in range(len(g.seqs))]

    def drop(self, position: int) -> None:
        """Abandon a group (expired): its sequences are aborted, their blocks freed."""
        g = self.groups.pop(position, None)
        if g is not None and self.gen is not None:
            for seq in g.seqs:
                self.gen.abort(seq)

    def _sample(self, g: _Group, j: int) -> RolloutSample:
        seq, p = g.seqs[j], g.prompt
        comp = seq.completion_token_ids
        mask = seq.completion_sampled_mask
        lp = iter(seq.raw_logprobs)
        gen_lp = [next(lp) if m else 0.0 for m in mask]
        # MoE routing, for the update's parity check: only of samples one version made, whole
        routing = self.gen.routing(seq) if not g.restored and len(set(g.versions[j])) == 1 else None
        return RolloutSample(
            group=g.flight.position,
            prompt_ids=p.token_ids,
            completion_ids=comp,
            loss_mask=mask,
            gen_logprobs=gen_lp,
            finish_reason=seq.finish_reason or "abort",
            text=self.tok.decode(comp, skip_special_tokens=True),
            row=p.row,
            routing=routing,
            versions=list(g.versions[j]),
        )

    # ---- checkpoints -----------------------------------------------------------------

    def state(self) -> list[dict[str, Any]]:
        """Every group this rank holds, as JSON-able records (tokens, log-probs, versions;
        no KV: a restored sequence recomputes it)."""
        out = []
        for g in [*self.groups.values(), *self.restored]:
            out.append(
                {
                    "position": g.flight.position,
                    "samples": [
                        {
                            "tokens": s.completion_token_ids,
                            "sampled": s.completion_sampled_mask,
                            "logprobs": list(s.logprobs),
                            "raw_logprobs": list(s.raw_logprobs),
                            "versions": v,
                            "finish_reason": s.finish_reason,
                        }
                        for s, v in zip(g.seqs, g.versions)
                    ],
                }
            )
        return out

    def restore(
        self, records: list[dict[str, Any]], flights: dict[int, Flight], prompts: list[Prompt]
    ) -> None:
        """Groups from `state` (any rank's), added to the generator at the next `resume`."""
        for rec in records:
            f = flights[rec["position"]]
            prompt = prompts[f.row]
            seqs, versions = [], []
            for j, s in enumerate(rec["samples"]):
                params = group_params(sampling_params(self.rcfg), f.seed)
                params = dataclasses.replace(params, seed=f.seed + j)
                seq = Sequence(-1, prompt.token_ids, params)
                seq.token_ids += s["tokens"]
                seq.sampled += s["sampled"]
                seq.logprobs, seq.raw_logprobs = list(s["logprobs"]), list(s["raw_logprobs"])
                if s["finish_reason"] is not None:
                    seq.status = SequenceStatus.FINISHED
                    seq.finish_reason = s["finish_reason"]
                seqs.append(seq)
                versions.append(list(s["versions"]))
            g = _Group(f, prompt, seqs, restored=True)
            g.versions = versions
            self.restored.append(g)
