"""Multi-turn (agentic) rollouts: the generator decodes while environments step elsewhere.

`run_agentic_rollout` plays ``n_samples`` episodes per dataset row against a registered
environment (tandem/rl/envs/) and returns one `RolloutSample` per episode, the record
single-turn rollouts produce, so rewards, advantages and the update never know the
difference. One sequence per episode holds the conversation; at the end of a turn it is
paused (keeping its KV blocks) while an `EnvPool` worker steps the environment, and the
others keep decoding. Turn boundaries, observation rendering, limits, generation groups
and failures: docs/internals.md.
"""

from __future__ import annotations

import dataclasses
import time
import weakref
from collections.abc import Mapping
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from typing import Any

from tandem.models.tokenizer import Tokenizer
from tandem.parallel.generation_layout import GenerationLayout, from_leader
from tandem.rl.envs.base import Environment, Episode, Message, StepResult, make_env, step_episode
from tandem.rl.generator.engine import Generator
from tandem.rl.generator.sequence import SamplingParams, Sequence
from tandem.rl.rollout.types import RolloutSample
from tandem.rl.workers.env_pool import EnvOutcome, EnvPool

__all__ = [
    "ChatRenderer",
    "EnvSteps",
    "EpisodeLoop",
    "EpisodeState",
    "end_of_turn_id",
    "episode_metrics",
    "episode_sample",
    "run_agentic_rollout",
    "start_episodes",
]

_EOT_CANDIDATES = ("<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>")
_ANCHOR = "\x00anchor\x00"  # placeholder assistant content for anchored suffix rendering
_SUMMED_INFO = ("tool_calls", "tool_errors", "sandbox_limit_hits")


def end_of_turn_id(tokenizer: Tokenizer, token: str | None = None) -> int:
    """The token that ends an assistant turn: ``token``, else the first ChatML-style
    end-of-turn token the vocabulary has, else the first eos id."""
    for name in [token] if token else list(_EOT_CANDIDATES):
        tid = tokenizer.token_to_id(name)
        if tid is not None:
            return tid
    if token:
        raise ValueError(f"end-of-turn token {token!r} is not in the tokenizer's vocabulary")
    if not tokenizer.eos_token_ids:
        raise ValueError(
            "the tokenizer has no end-of-turn token and no eos id; pass end_of_turn_token"
        )
    return tokenizer.eos_token_ids[0]


class ChatRenderer:
    """Chat-template rendering for one environment: prompts and observation deltas."""

    def __init__(
        self, tokenizer: Tokenizer, tools: list[dict[str, Any]] | None, eot_id: int
    ) -> None:
        self.tok, self.tools, self.eot_id = tokenizer, tools, eot_id
        self.eot_text = tokenizer.decode([eot_id])

    def render(self, messages: list[Message], add_generation_prompt: bool) -> str:
        return self.tok.apply_chat_template(
            messages, tools=self.tools, add_generation_prompt=add_generation_prompt
        )

    def prompt(self, messages: list[Message]) -> tuple[str, list[int]]:
        text = self.render(messages, add_generation_prompt=True)
        return text, self.tok.encode(text)

    def delta(
        self,
        history_text: str,
        conversation: list[Message],
        initial: list[Message],
        observations: list[Message],
        ended_with_eot: bool,
    ) -> tuple[str, bool]:
        """Text to append after the last assistant turn, and whether the fallback was used.

        ``history_text`` is the text of the sequence's tokens; ``conversation`` the
        whole conversation with the observations at its end.
        """
        full = self.render(conversation, add_generation_prompt=True)
        if full.startswith(history_text):
            return full[len(history_text) :], False
        anchor = initial + [{"role": "assistant", "content": _ANCHOR}]
        base = self.render(anchor, add_generation_prompt=False)
        after = self.render(anchor + observations, add_generation_prompt=True)
        content_end = base.rfind(_ANCHOR) + len(_ANCHOR)
        eot_at = base.find(self.eot_text, content_end)
        if content_end < len(_ANCHOR) or eot_at < 0 or after[:eot_at] != base[:eot_at]:
            raise RuntimeError(
                "chat template is neither prefix-stable nor renders observations after an "
                "end-of-turn marker; multi-turn rollouts cannot place environment tokens"
            )
        start = eot_at + len(self.eot_text) if ended_with_eot else content_end
        return after[start:], True


@dataclass
class EpisodeState:
    """Driver-side state of one episode (one sequence)."""

    index: int
    group: int
    row: Mapping[str, Any]
    episode: Episode
    initial: list[Message]
    messages: list[Message]
    history_text: str
    seq: Sequence | None = None
    prompt_ids: list[int] = field(default_factory=list)  # only for a prompt that did not fit
    turns: int = 0
    turn_gen_start: int = 0  # seq.num_generated when the current turn began
    turn_token_start: int = 0  # index in seq.token_ids where the current turn began
    can_continue: bool = True  # the sequence may take another turn after this env step
    stop_reason: str | None = None  # why the sequence cannot continue ("stop" | "length" | "abort")
    ended_with_eot: bool = True
    reward: float | None = None
    finish_reason: str | None = None
    info: dict[str, float] = field(default_factory=dict)
    versions: list[int] = field(default_factory=list)  # per completion token (streaming modes)

    def add_info(self, key: str, value: float = 1.0) -> None:
        self.info[key] = self.info.get(key, 0.0) + value


class EnvSteps:
    """The environment steps of one rollout, on this rank's pool; outcomes keyed by
    episode index. Several rollouts may share a pool (the streaming modes' episodes and an
    evaluation between two steps): an outcome of another's ticket waits for it in the pool's
    stash (`_unclaimed`)."""

    def __init__(self, pool: EnvPool | None) -> None:
        self.pool = pool
        self.tickets: dict[int, int] = {}  # pool ticket -> episode index
        self.runs_env = True  # this rank resets episodes and steps them

    def shared(self, value: Any) -> Any:
        """What the environment side decided (tp = 1: ``value`` itself)."""
        return value

    def submit(self, index: int, episode: Episode, content: str) -> None:
        assert self.pool is not None
        self.tickets[self.pool.submit(step_episode, episode, content)] = index

    def poll(self, timeout: float | None) -> list[tuple[int, EnvOutcome]]:
        """Finished steps of this rollout, in arrival order (at once when the stash holds one)."""
        assert self.pool is not None
        stash, dropped = _unclaimed(self.pool)
        mine = [(self.tickets.pop(t), stash.pop(t)) for t in list(stash) if t in self.tickets]
        for o in self.pool.poll(0.0 if mine else timeout):
            if o.ticket in self.tickets:
                mine.append((self.tickets.pop(o.ticket), o))
            elif o.ticket in dropped:
                dropped.discard(o.ticket)
            else:
                stash[o.ticket] = o
        return mine

    def drop(self, indices: set[int]) -> None:
        """Forget the steps of episodes ``indices``: their outcomes are thrown away on arrival."""
        assert self.pool is not None
        stash, dropped = _unclaimed(self.pool)
        for t in [t for t, i in self.tickets.items() if i in indices]:
            del self.tickets[t]
            if stash.pop(t, None) is None:
                dropped.add(t)


_STASHES: weakref.WeakKeyDictionary[Any, tuple[dict[int, EnvOutcome], set[int]]] = (
    weakref.WeakKeyDictionary()
)


def _unclaimed(pool: Any) -> tuple[dict[int, EnvOutcome], set[int]]:
    """A pool's outcomes polled by a rollout that did not submit them (ticket -> outcome), and
    the tickets whose outcomes nobody will claim."""
    return _STASHES.setdefault(pool, ({}, set()))


class _GroupSteps(EnvSteps):
    """A generation group's steps: only the leader resets episodes, submits steps and polls its
    pool; every rank takes what the leader saw, in its order, so the group's schedulers take
    the same decisions. Each `poll` is a collective (a blocking one blocks the whole group)."""

    def __init__(self, pool: EnvPool | None, layout: GenerationLayout) -> None:
        super().__init__(pool)
        self.layout, self.runs_env = layout, layout.rank == 0
        if self.runs_env and pool is None:
            raise ValueError("the leader of a generation group needs an EnvPool")

    def shared(self, value: Any) -> Any:
        return from_leader(value, self.layout)

    def submit(self, index: int, episode: Episode, content: str) -> None:
        if self.runs_env:
            super().submit(index, episode, content)

    def poll(self, timeout: float | None) -> list[tuple[int, EnvOutcome]]:
        return from_leader(super().poll(timeout) if self.runs_env else None, self.layout)


class EpisodeLoop:
    """The bookkeeping of one `run_agentic_rollout` call."""

    def __init__(
        self,
        generator: Generator,
        renderer: ChatRenderer,
        steps: EnvSteps,
        *,
        max_turns: int,
        token_limit: int,
        max_turn_tokens: int | None,
    ) -> None:
        self.gen, self.renderer, self.steps = generator, renderer, steps
        self.max_turns, self.token_limit, self.max_turn_tokens = (
            max_turns,
            token_limit,
            max_turn_tokens,
        )
        self.eps: list[EpisodeState] = []
        self.generating: dict[int, EpisodeState] = {}  # seq_id -> episode being sampled
        self.waiting: dict[
            int, EpisodeState
        ] = {}  # episode index -> episode whose env step is in flight
        self.unfinished = 0
        self.count = 0  # episodes started (the next one's index)
        self.env_time = self.device_wait = 0.0
        self.env_steps = self.gen_steps = self.fallbacks = 0

    # ---- generator side ---------------------------------------------------------------------
    def after_step(self) -> None:
        """Find the turns that ended in the last generator step and send them to the pool."""
        eot = self.renderer.eot_id
        for ep in list(self.generating.values()):
            seq = ep.seq
            assert seq is not None
            if seq.is_finished:  # a real eos, max_tokens or max_model_len
                ep.stop_reason = seq.finish_reason
                self.end_turn(ep, can_continue=False, eot=seq.token_ids[-1] == eot)
            elif seq.sampled[-1] and seq.token_ids[-1] == eot:
                self.gen.pause(seq)
                self.end_turn(ep, can_continue=True, eot=True)
            elif seq.num_tokens >= self.token_limit:
                self.gen.abort(seq)
                ep.stop_reason = "length"
                ep.add_info("token_limit")
                self.end_turn(ep, can_continue=False, eot=False)
            elif (
                self.max_turn_tokens
                and seq.num_generated - ep.turn_gen_start >= self.max_turn_tokens
            ):
                self.gen.pause(seq)
                self.end_turn(ep, can_continue=True, eot=False)

    def end_turn(self, ep: EpisodeState, *, can_continue: bool, eot: bool) -> None:
        seq = ep.seq
        assert seq is not None
        del self.generating[seq.seq_id]
        turn = seq.token_ids[ep.turn_token_start :]
        content = self.renderer.tok.decode(turn[:-1] if eot else turn)
        ep.history_text += self.renderer.tok.decode(turn)
        ep.messages.append({"role": "assistant", "content": content})
        ep.turns += 1
        ep.can_continue, ep.ended_with_eot = can_continue, eot
        self.steps.submit(ep.index, ep.episode, content)
        self.waiting[ep.index] = ep

    # ---- environment side -------------------------------------------------------------------
    def on_outcome(self, index: int, out: EnvOutcome) -> None:
        ep = self.waiting.pop(index)
        self.env_time += out.seconds
        self.env_steps += 1
        ep.add_info("env_time_s", out.seconds)
        if out.status == "ok":
            ep.episode, result = out.value
            for k, v in result.info.items():
                ep.add_info(k, float(v))
            if result.reward is not None:
                ep.reward = result.reward
        else:
            ep.add_info(
                {"error": "env_errors", "timeout": "env_timeouts", "crash": "env_crashes"}[
                    out.status
                ]
            )
            note = f"[environment error: {out.error}]"
            result = StepResult([{"role": "user", "content": note}], done=False)
        seq = ep.seq
        assert seq is not None
        if result.done or not ep.can_continue:
            reason = ep.stop_reason or "stop"
            self.finish(ep, reason, truncated=not result.done and reason == "length")
        elif ep.turns >= self.max_turns:
            ep.add_info("turn_limit")
            self.finish(ep, "length", truncated=True)
        else:
            self.continue_episode(ep, result.observation_messages)

    def continue_episode(self, ep: EpisodeState, observations: list[Message]) -> None:
        seq = ep.seq
        assert seq is not None
        ep.messages.extend(observations)
        text, fell_back = self.renderer.delta(
            ep.history_text, ep.messages, ep.initial, observations, ep.ended_with_eot
        )
        self.fallbacks += fell_back
        ids = self.renderer.tok.encode(text)
        if not ids:
            ep.add_info("render_errors")
            self.finish(ep, "stop", truncated=True)
            return
        if seq.num_tokens + len(ids) >= self.token_limit:
            ep.add_info("token_limit")
            self.finish(ep, "length", truncated=True)
            return
        try:
            self.gen.append(seq, ids)
        except ValueError:  # would not fit the KV pool / max_model_len
            ep.add_info("token_limit")
            self.finish(ep, "length", truncated=True)
            return
        self.gen.resume(seq)
        ep.history_text += text
        ep.turn_gen_start, ep.turn_token_start = seq.num_generated, seq.num_tokens
        self.generating[seq.seq_id] = ep

    def finish(self, ep: EpisodeState, reason: str | None, truncated: bool = False) -> None:
        if ep.seq is not None and not ep.seq.is_finished:
            self.gen.abort(ep.seq)  # frees its KV blocks
        ep.finish_reason = reason or "stop"
        if truncated:
            ep.add_info("truncated")
        self.unfinished -= 1

    # ---- the loop -----------------------------------------------------------------------------
    def run(self) -> None:
        """Decode while anything is schedulable; block on environments only when nothing is."""
        while self.unfinished > 0:
            if not self.advance(None) and self.unfinished > 0:
                raise RuntimeError(
                    f"agentic rollout stalled: {self.unfinished} episodes neither "
                    "generating nor waiting for an environment"
                )

    def advance(self, wait: float | None) -> bool:
        """One turn of the loop: take the environment steps that finished, then one decode step,
        or (nothing to decode) wait up to ``wait`` seconds (None: until one finishes) for an
        environment. False when there was nothing to do."""
        for index, out in self.steps.poll(0.0):
            self.on_outcome(index, out)
        if self.gen.has_work():
            self.gen.step()
            self.gen_steps += 1
            self.after_step()
        elif self.waiting:
            t0 = time.perf_counter()
            outs = self.steps.poll(wait)
            self.device_wait += time.perf_counter() - t0
            for index, out in outs:
                self.on_outcome(index, out)
        else:
            return False
        return True

    def forget(self, eps: list[EpisodeState]) -> None:
        """Abandon ``eps`` (an expired group): their sequences are aborted, the environment
        steps still running for them are ignored when they finish."""
        self.steps.drop({ep.index for ep in eps})
        for ep in eps:
            self.waiting.pop(ep.index, None)
            if ep.seq is not None:
                self.generating.pop(ep.seq.seq_id, None)
            if ep.finish_reason is None:
                if ep.seq is not None and not ep.seq.is_finished:
                    self.gen.abort(ep.seq)
                ep.finish_reason = "abort"
                self.unfinished -= 1


def _turn_params(
    params: SamplingParams, generator: Generator, tokenizer: Tokenizer, eot: int, seed_offset: int
) -> SamplingParams:
    """Sample through end-of-turn tokens (they pause), stop on every other eos id."""
    stops = set(params.stop_token_ids)
    if not params.ignore_eos:
        stops |= set(tokenizer.eos_token_ids) | set(generator.scheduler.eos_token_ids)
    stops.discard(eot)
    seed = None if params.seed is None else params.seed + seed_offset
    return dataclasses.replace(params, ignore_eos=True, stop_token_ids=sorted(stops), seed=seed)


def episode_sample(ep: EpisodeState, tokenizer: Tokenizer) -> RolloutSample:
    seq = ep.seq
    if seq is None:  # the prompt did not fit: an empty completion, counted as prompt_too_long
        seq = Sequence(0, ep.prompt_ids)
    mask = seq.completion_sampled_mask
    raw = iter(seq.raw_logprobs)
    logprobs = [next(raw) if m else 0.0 for m in mask]
    info = {"turns": float(ep.turns), **{k: 0.0 for k in _SUMMED_INFO}, **ep.info}
    return RolloutSample(
        group=ep.group,
        prompt_ids=seq.token_ids[: seq.num_prompt_tokens],
        completion_ids=seq.completion_token_ids,
        loss_mask=mask,
        gen_logprobs=logprobs,
        finish_reason=ep.finish_reason or "stop",
        text=tokenizer.decode(seq.completion_token_ids),
        row=dict(ep.row),
        env_reward=ep.reward,
        info=info,
    )


def episode_metrics(
    r: EpisodeLoop, elapsed: float, eps: list[EpisodeState] | None = None
) -> dict[str, float]:
    """The ``env/*`` metrics of ``eps`` (default: every episode of ``r``), with ``r``'s
    counters."""
    eps = r.eps if eps is None else eps
    n = max(1, len(eps))
    total = {
        k: sum(ep.info.get(k, 0.0) for ep in eps)
        for k in (
            *_SUMMED_INFO,
            "env_errors",
            "env_timeouts",
            "env_crashes",
            "truncated",
            "turn_limit",
            "token_limit",
            "reward_errors",
            "render_errors",
            "prompt_too_long",
        )
    }
    turns = [ep.turns for ep in eps]
    rewards = [ep.reward for ep in eps if ep.reward is not None]
    return {
        "env/episodes": float(len(eps)),
        "env/turns_mean": sum(turns) / n,
        "env/turns_max": float(max(turns, default=0)),
        "env/tool_calls_per_episode": total["tool_calls"] / n,
        "env/tool_errors_per_episode": total["tool_errors"] / n,
        "env/sandbox_limit_hits": total["sandbox_limit_hits"],
        "env/env_errors": total["env_errors"],
        "env/env_timeouts": total["env_timeouts"],
        "env/env_crashes": total["env_crashes"],
        "env/reward_errors": total["reward_errors"],
        "env/truncated": total["truncated"],
        "env/turn_limit_hits": total["turn_limit"],
        "env/token_limit_hits": total["token_limit"],
        "env/prompts_too_long": total["prompt_too_long"],
        "env/render_fallbacks": float(r.fallbacks),
        "env/render_errors": total["render_errors"],
        "env/reward_mean": sum(rewards) / len(rewards) if rewards else 0.0,
        "env/env_steps": float(r.env_steps),
        "env/generator_steps": float(r.gen_steps),
        "env/env_time_s": r.env_time,
        "env/device_wait_s": r.device_wait,
        "env/elapsed_s": elapsed,
        # share of environment time hidden behind decoding (1: the device never waited)
        "env/overlap": 1.0 - r.device_wait / r.env_time if r.env_time > 0 else 1.0,
    }


def _nth(params: SamplingParams, i: int) -> SamplingParams:
    """The params of a group's i-th sample added on its own (``Generator.add`` with n > 1
    does this)."""
    return params if params.seed is None else dataclasses.replace(params, seed=params.seed + i)


def start_episodes(
    r: EpisodeLoop,
    env: Environment,
    rows: Seq[Mapping[str, Any]],
    n_samples: int,
    sampling_params: SamplingParams,
    seeds: Seq[int] | None,
) -> None:
    """Reset ``n_samples`` episodes per row (on the group's leader) and add their prompts."""
    gen, renderer, tokenizer = r.gen, r.renderer, r.renderer.tok
    fresh = None
    if r.steps.runs_env:
        fresh = [
            [(ep, ep.reset(row)) for ep in [env.new_episode() for _ in range(n_samples)]]
            for row in rows
        ]
    started = r.steps.shared(fresh)  # [row][sample] -> (episode, initial messages)
    for g, (row, pairs) in enumerate(zip(rows, started)):
        initial = [m for _, m in pairs]
        prompt_text, ids = renderer.prompt(initial[0])
        eps = [
            EpisodeState(r.count + i, g, row, episode, initial[i], list(initial[i]), prompt_text)
            for i, (episode, _) in enumerate(pairs)
        ]
        r.count += len(eps)
        r.eps += eps
        base = (
            sampling_params
            if seeds is None
            else dataclasses.replace(sampling_params, seed=seeds[g])
        )
        params = _turn_params(
            base, gen, tokenizer, renderer.eot_id, 0 if seeds is not None else g * n_samples
        )
        if len(ids) + 1 > r.token_limit:
            for ep in eps:  # a counted skip: no tokens to train on, never silently truncated
                ep.prompt_ids = ids
                ep.finish_reason = "length"
                ep.add_info("prompt_too_long")
                ep.add_info("truncated")
            continue
        same = all(m == initial[0] for m in initial)
        seqs = (
            gen.add(ids, params, n_samples)
            if same
            else [gen.add(renderer.prompt(m)[1], _nth(params, i))[0] for i, m in enumerate(initial)]
        )
        for ep, seq in zip(eps, seqs):
            ep.seq, ep.turn_token_start = seq, seq.num_tokens
            if not same:
                ep.history_text = renderer.prompt(ep.initial)[0]
            r.generating[seq.seq_id] = ep
            r.unfinished += 1


def run_agentic_rollout(
    generator: Generator,
    tokenizer: Tokenizer,
    env_name: str,
    env_kwargs: Mapping[str, Any] | None,
    rows: Seq[Mapping[str, Any]],
    n_samples: int,
    sampling_params: SamplingParams,
    *,
    max_turns: int,
    max_total_tokens: int,
    pool: EnvPool | None,
    max_turn_tokens: int | None = None,
    end_of_turn_token: str | None = None,
    seeds: Seq[int] | None = None,
    layout: GenerationLayout | None = None,
) -> tuple[list[RolloutSample], dict[str, float]]:
    """Play ``n_samples`` episodes of ``env_name`` per row; samples in (row, sample) order.

    ``sampling_params.max_tokens`` caps the tokens the policy samples in a whole
    episode; ``max_total_tokens`` caps prompt + completion; ``max_turns`` caps
    assistant turns. ``env_reward`` is the episode's final reward (None when the
    environment gave none). ``pool`` serves one rollout at a time (outcomes of tickets
    this call did not submit are dropped). ``seeds``: one per row, its episodes sampled with
    seed + episode index (None: ``sampling_params.seed`` + the episode's slot in this call).
    ``layout`` with ``tp > 1``: ``generator`` is the group's (every rank of the group calls,
    with the same ``rows``); only the leader's ``pool`` runs the environment (the others may
    pass None) and the leader's outcomes are broadcast (`_GroupSteps`).
    See the module docstring for the mechanics.
    """
    if n_samples < 1 or max_turns < 1 or max_total_tokens < 2:
        raise ValueError(
            f"need n_samples >= 1, max_turns >= 1, max_total_tokens >= 2; got "
            f"{n_samples}, {max_turns}, {max_total_tokens}"
        )
    if max_turn_tokens is not None and max_turn_tokens < 1:
        raise ValueError(f"max_turn_tokens must be >= 1 or None, got {max_turn_tokens}")
    t0 = time.perf_counter()
    env = make_env(env_name, env_kwargs)
    eot = end_of_turn_id(tokenizer, end_of_turn_token)
    steps = _GroupSteps(pool, layout) if layout is not None and layout.tp > 1 else EnvSteps(pool)
    r = EpisodeLoop(
        generator,
        ChatRenderer(tokenizer, env.tool_schemas(), eot),
        steps,
        max_turns=max_turns,
        token_limit=min(max_total_tokens, generator.scheduler.max_model_len),
        max_turn_tokens=max_turn_tokens,
    )
    start_episodes(r, env, rows, n_samples, sampling_params, seeds)
    r.run()
    samples = [episode_sample(ep, tokenizer) for ep in r.eps]
    return samples, episode_metrics(r, time.perf_counter() - t0)
