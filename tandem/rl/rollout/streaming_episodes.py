"""Multi-turn episodes in the streaming rollout modes (``env.name`` with ``colocated_async`` or
``split``): the episodes of a prompt group live across generation phases and weight updates.

`StreamingEpisodes` is `StreamingGenerator` with an episode for every sample: a group is
admitted like a single-turn one (its seed keyed by its admission version and stream position,
its deadline ``v + S``), its episodes start with the same seeds and sampling parameters as the
synchronous rollout's (`tandem.rl.rollout.agentic.start_episodes`), and one `EpisodeLoop`, kept
for the whole run, decodes them and steps their environments. A turn may span a weight update:
a sequence paused for its tool call keeps its KV (``rollout.suspended_kv``: kept, offloaded or
recomputed with the new weights, as any suspended sequence), the tool call keeps running in its
pool worker through the update and its result is taken at the next phase. Every completion
token is stamped with the version of the phase that produced it (an environment's tokens, which
never train, with the phase that appended them). A group that misses its deadline is dropped:
its sequences are aborted and its running steps' results are ignored; a step runs in its own
worker process, so nothing of it outlives the step (sandboxes are cleaned as in the synchronous
rollout).

A checkpoint does not hold an episode's environment state (an `Episode` is a Python object;
checkpoints never unpickle): a group in flight at a checkpoint is played afresh after a resume,
its prompt given back to the stream (`ColocatedAsyncRollout.load_state_dict`), so every prompt
still trains once. The episodes share the rollout's environment pool with the evaluations
between two steps; each takes only its own steps' results (`tandem.rl.rollout.agentic.EnvSteps`).
"""

from __future__ import annotations

import time
from typing import Any

from tandem.rl.data.prompts import Prompt
from tandem.rl.envs.base import make_env
from tandem.rl.rollout.agentic import (
    ChatRenderer,
    EnvSteps,
    EpisodeLoop,
    EpisodeState,
    end_of_turn_id,
    episode_metrics,
    episode_sample,
    start_episodes,
)
from tandem.rl.rollout.inflight import Flight
from tandem.rl.rollout.sampling import sampling_params
from tandem.rl.rollout.streaming_groups import StreamingGenerator
from tandem.rl.rollout.types import RolloutSample

_ENV_WAIT_S = 0.02  # with nothing to decode, how long one `step` waits for an environment


class StreamingEpisodes(StreamingGenerator):
    """This rank's episodes across generation phases (``ecfg``: the config's env section)."""

    def __init__(self, tok: Any, rcfg: Any, ecfg: Any, pool: Any, max_seqs: int) -> None:
        # the episode's cap on prompt + completion sizes the generator, as in `sample_episodes`
        super().__init__(tok, rcfg, ecfg.max_total_tokens - rcfg.max_tokens, max_seqs)
        self.ecfg = ecfg
        self.env = make_env(ecfg.name, ecfg.kwargs)
        self.eot = end_of_turn_id(tok, None)
        self.loop: EpisodeLoop | None = None
        self.pool = pool  # the rollout's (evaluations share it: `EnvSteps`)
        self.episodes: dict[int, list[EpisodeState]] = {}  # stream position -> its episodes
        self.done: list[EpisodeState] = []  # taken since the last `phase_metrics`
        self.t0 = time.perf_counter()

    def resume(self, model: Any, kv_scales: Any = None) -> int:
        first = self.gen is None
        requantized = super().resume(model, kv_scales)
        if first:
            assert self.gen is not None
            self.loop = EpisodeLoop(
                self.gen,
                ChatRenderer(self.tok, self.env.tool_schemas(), self.eot),
                EnvSteps(self.pool),
                max_turns=self.ecfg.max_turns,
                token_limit=min(self.ecfg.max_total_tokens, self.gen.scheduler.max_model_len),
                max_turn_tokens=self.ecfg.max_turn_tokens,
            )
        return requantized

    def add(self, flight: Flight, prompt: Prompt, n: int) -> None:
        loop = self.loop
        assert loop is not None
        start = len(loop.eps)
        start_episodes(loop, self.env, [prompt.row], n, sampling_params(self.rcfg), [flight.seed])
        self.episodes[flight.position] = loop.eps[start:]
        del loop.eps[start:]  # kept per group here; the loop keeps none

    def busy(self) -> bool:
        return self.loop is not None and (self.gen.has_work() or bool(self.loop.waiting))

    def step(self) -> None:
        assert self.loop is not None
        self.loop.advance(_ENV_WAIT_S)

    def complete(self) -> set[int]:
        return {p for p, eps in self.episodes.items() if all(ep.finish_reason for ep in eps)}

    def stamp(self, version: int) -> None:
        for eps in self.episodes.values():
            for ep in eps:
                if ep.seq is not None:
                    n = len(ep.seq.completion_token_ids) - len(ep.versions)
                    ep.versions.extend([version] * n)

    def suspend(self, version: int) -> int:
        self.stamp(version)
        n = sum(1 for eps in self.episodes.values() for ep in eps if not ep.finish_reason)
        if self.gen is not None and n:
            self._suspend_kv()
        return n

    def take(self, position: int) -> list[RolloutSample]:
        eps = self.episodes.pop(position)
        self.done += eps
        return [self._episode(ep, position) for ep in eps]

    def peek(self, position: int, version: int) -> list[RolloutSample]:
        self.stamp(version)
        return [self._episode(ep, position) for ep in self.episodes[position]]

    def drop(self, position: int) -> None:
        eps = self.episodes.pop(position, None)
        if eps is not None and self.loop is not None:
            self.loop.forget(eps)

    def _episode(self, ep: EpisodeState, position: int) -> RolloutSample:
        s = episode_sample(ep, self.tok)
        s.group, s.versions = position, list(ep.versions)
        return s

    def phase_metrics(self) -> dict[str, float]:
        """The ``env/*`` metrics of the episodes taken since the last call (this rank's), and
        the loop's counters over that time."""
        loop = self.loop
        if loop is None:
            return {}
        now = time.perf_counter()
        out = episode_metrics(loop, now - self.t0, self.done)
        self.done, self.t0 = [], now
        loop.env_time = loop.device_wait = 0.0
        loop.env_steps = loop.gen_steps = loop.fallbacks = 0
        return out

    def state(self) -> list[dict[str, Any]]:
        """The groups in flight, each marked to be played afresh after a resume."""
        return [{"position": p, "episodes": True} for p in self.episodes]


def streaming_generator(base: Any, max_seqs: int) -> StreamingGenerator:
    """The streaming rollout's generator for ``base`` (a `RolloutPhase`): multi-turn episodes
    when ``env.name`` is set, single-turn groups otherwise."""
    if base.env_cfg.name:
        return StreamingEpisodes(base.tok, base.rcfg, base.env_cfg, base.env_pool, max_seqs)
    return StreamingGenerator(base.tok, base.rcfg, base.max_prompt, max_seqs)


__all__ = ["StreamingEpisodes", "streaming_generator"]
