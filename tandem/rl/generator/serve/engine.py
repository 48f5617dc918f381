"""`ServingEngine`: the generator loop that serves OpenAI requests, one scheduler tick at a time.

Threads: the HTTP thread only `submit`s messages (a turn, a cancel, a reward, an abort) and
receives events through the ``emit`` callback each message carries; everything else runs in
the engine's thread (the trainer's main thread), which owns the generator and the sessions.

SPMD: every rank of a generation group runs `run`; only the leader (group rank 0) has the
inbox and the sessions. Each tick the leader turns its messages into *commands* (add a
sequence, append tokens and resume, pause, abort), applies them, and broadcasts the tick's
list to the group (`from_leader`); the others apply the same list in the same order, then
every rank takes one generator step (the sampled tokens are the leader's, `leader_tokens`),
so the group's schedulers stay identical. With nothing to compute the leader waits for a
message at most ``heartbeat_s`` and broadcasts an empty tick, so the group's collectives
never wait past their timeout however long a harness takes.

A turn: its sequence samples through end-of-turn tokens (``ignore_eos`` and the other eos
ids as stop ids, as in tandem/rl/rollout/agentic.py); after every step the leader publishes
the new tokens of each turn in flight and ends the turn on a sampled end-of-turn token, a
stop id or string, the turn's ``max_tokens`` or the context limit. A session's sequence is
then paused (it keeps its KV blocks until the next request appends to it); a request
without a session is aborted (blocks freed). A disconnect aborts its session.
"""

from __future__ import annotations

import itertools
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tandem.parallel.generation_layout import GenerationLayout, from_leader
from tandem.rl.core.reward_range import reward_problem
from tandem.rl.generator.engine import Generator
from tandem.rl.generator.sequence import SamplingParams, Sequence
from tandem.rl.generator.serve.protocol import BadRequest, TurnRequest, TurnResult
from tandem.rl.generator.serve.sessions import Session, plan_turn

Emit = Callable[
    [str, Any], None
]  # ("delta" | "done" | "error", payload); called in the engine's thread


@dataclass
class EngineSettings:
    """Defaults for requests that leave a field unset, and the engine's limits."""

    eot_id: int  # the end-of-turn token (tandem.rl.rollout.agentic.end_of_turn_id)
    max_model_len: int  # prompt + completion per sequence
    max_tokens: int = 256  # per turn, when the request sets none (capped by the context)
    # training (rollout.max_tokens): a request's own max_tokens is capped at max_tokens too
    cap_max_tokens: bool = False
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    policy_version: int = 0  # reported per choice: the weights that sampled the tokens
    heartbeat_s: float = 0.5  # longest wait for a message before an empty tick
    open_sessions: bool = True  # an unknown session id starts a session (tandem-serve); False: 404
    episode_timeout_s: float = (
        0.0  # a claimed task's session is dropped this long after the claim; 0 = never
    )
    claim_timeout_s: float = (
        0.0  # an unclaimed task is dropped this long after the engine starts; 0 = never
    )
    # tandem-serve: a session with no turn for this long is closed ("expired", its KV freed),
    # and a closed one forgotten (its id then starts afresh); 0 = never
    session_idle_s: float = 0.0


# ---- the commands the leader applies and broadcasts to its generation group -----------------


@dataclass(frozen=True)
class Add:
    """A new sequence ``key``: prompt ``ids`` sampled with ``params``."""

    key: int
    ids: list[int]
    params: SamplingParams


@dataclass(frozen=True)
class Append:
    """A paused sequence continues: ``ids`` appended (the turn's new tokens), then ``params``."""

    key: int
    ids: list[int]
    params: SamplingParams


@dataclass(frozen=True)
class Pause:
    key: int


@dataclass(frozen=True)
class Abort:
    key: int


Command = Add | Append | Pause | Abort


@dataclass
class _Turn:
    session: Session
    req: TurnRequest
    emit: Emit
    key: int
    seq: Sequence
    prompt_ids: list[int]
    token_start: int
    max_tokens: int
    sent: int = 0  # tokens published
    text_sent: str = ""


class ServingEngine:
    """Serves `TurnRequest`s on ``generator``; see the module docstring."""

    def __init__(
        self,
        generator: Generator,
        tokenizer: Any,
        settings: EngineSettings,
        layout: GenerationLayout | None = None,
    ) -> None:
        self.gen, self.tok, self.s = generator, tokenizer, settings
        self.layout = layout or GenerationLayout()
        self.leader = self.layout.rank == 0
        self.inbox: queue.Queue = queue.Queue()
        self.sessions: dict[str, Session] = {}
        self.seqs: dict[int, Sequence] = {}  # command key -> sequence (every rank)
        self.turns: dict[int, _Turn] = {}  # key -> turn in flight (leader)
        self.stats = {
            "requests": 0,
            "bad_requests": 0,
            "disconnects": 0,
            "aborts": 0,
            "timeouts": 0,
            "unclaimed": 0,
            "expired": 0,
            "new_samples": 0,
            "turns": 0,
        }
        self._out: list[Command] = []
        self._keys = itertools.count()
        self._lock = threading.Lock()
        self._closed = False
        self._t0 = time.monotonic()
        stops = set(tokenizer.eos_token_ids) | set(generator.scheduler.eos_token_ids)
        stops.discard(settings.eot_id)
        self._eos_stops = sorted(stops)
        self._special = {settings.eot_id, *stops}

    # ---- the HTTP thread's side ----------------------------------------------------------
    def submit(self, msg: tuple) -> bool:
        """Queue a message for the engine; False once it has stopped (the caller answers 503)."""
        with self._lock:
            if self._closed:
                return False
            self.inbox.put(msg)
            return True

    # ---- the loop (every rank of the group) ---------------------------------------------
    def run(
        self, until: Callable[[], bool] = lambda: False, beat: Callable[[], None] | None = None
    ) -> None:
        """Serve until ``until()`` (asked on the leader every tick) is true; then every live
        sequence is aborted on every rank, so the KV pool is free when this returns."""
        while True:
            stop = False
            if self.leader:
                self._drain(block=not self.gen.has_work())
                self._expire()
                stop = until()
                if stop:
                    self._close_all()
            if self.layout.tp > 1:
                cmds, stop = from_leader((self._out, stop), self.layout)
                if not self.leader:
                    for cmd in cmds:
                        self._apply(cmd)
            self._out = []
            if beat is not None:
                beat()
            if stop:
                return
            if self.gen.has_work():
                self.gen.step()
                if self.leader:
                    self._publish()

    # ---- commands: applied on the leader at once, on the others at the next tick ---------
    def _do(self, cmd: Command) -> None:
        self._apply(
            cmd
        )  # a ValueError here (the pool or context cannot take it) broadcasts nothing
        self._out.append(cmd)

    def _apply(self, cmd: Command) -> None:
        """One command through the generator's public interface, the same on every rank."""
        if isinstance(cmd, Add):
            self.seqs[cmd.key] = self.gen.add(cmd.ids, cmd.params)[0]
        elif isinstance(cmd, Append):
            seq = self.seqs[cmd.key]
            self.gen.append(seq, cmd.ids)
            seq.params = cmd.params
            self.gen.resume(seq)
        elif isinstance(cmd, Pause):
            self.gen.pause(self.seqs[cmd.key])
        elif isinstance(cmd, Abort):
            self.gen.abort(self.seqs.pop(cmd.key))
        else:
            raise TypeError(f"unknown serving command {cmd!r}")

    # ---- messages (leader) ----------------------------------------------------------------
    def _drain(self, block: bool) -> None:
        try:
            msg = self.inbox.get(timeout=self.s.heartbeat_s) if block else self.inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            self._handle(msg)
            try:
                msg = self.inbox.get_nowait()
            except queue.Empty:
                return

    def _handle(self, msg: tuple) -> None:
        kind, emit = msg[0], msg[-1]
        try:
            if kind == "turn":
                self._start_turn(msg[1], msg[2], msg[3], emit)
            elif kind == "cancel":
                s = self.sessions.get(msg[1])
                if s is not None and not s.closed:
                    self.stats["disconnects"] += 1
                    self._close(s, "disconnect")
            elif kind == "reward":
                emit("done", self._reward(msg[1], msg[2], msg[3]))
            elif kind == "abort":
                s = self._session(msg[1])
                self.stats["aborts"] += 1
                self._close(s, "abort")
                emit("done", {"session_id": s.id, "closed": "abort"})
        except BadRequest as e:
            self.stats["bad_requests"] += 1
            emit("error", e)

    def _session(self, sid: str) -> Session:
        s = self.sessions.get(sid)
        if s is None:
            raise BadRequest(f"session {sid!r}: unknown", 404, "session_id")
        if s.closed:
            raise BadRequest(f"session {sid!r}: already closed ({s.closed})", 409, "session_id")
        return s

    def _reward(self, sid: str, value: float, turn: int | None) -> dict:
        s = self._session(sid)
        turns = {**s.turn_rewards, turn: value} if turn is not None else s.turn_rewards
        final = (s.reward or 0.0) if turn is not None else value
        total = final + sum(turns.values())
        why = reward_problem(total)
        if why is not None:  # each reward is in range; their sum must be too (reward_range.py)
            raise BadRequest(
                f"reward: the episode's rewards would sum to {total:.3g}; their sum {why}",
                400,
                "reward",
            )
        if turn is not None:
            s.turn_rewards[turn] = value
            return {"session_id": sid, "closed": None}
        if s.busy:
            raise BadRequest(
                f"session {sid!r}: a turn is in flight; set the reward after it", 409, "session_id"
            )
        s.reward = value
        self._close(s, "reward")
        return {"session_id": sid, "closed": "reward"}

    def _start_turn(self, sid: str, ephemeral: bool, req: TurnRequest, emit: Emit) -> None:
        self.stats["requests"] += 1
        s = self.sessions.get(sid)
        if s is None:
            if not (ephemeral or self.s.open_sessions):
                raise BadRequest(
                    f"session {sid!r}: unknown (sessions come from POST /rl/episodes)", 404
                )
            s = self.sessions[sid] = Session(sid, ephemeral=ephemeral)
        s.touched = time.monotonic()
        if s.closed:
            raise BadRequest(f"session {sid!r}: already closed ({s.closed})", 409)
        if s.busy:
            raise BadRequest(
                f"session {sid!r}: a turn is in flight; send the next one after it", 409
            )
        ids_in = req.prompt_ids
        if ids_in is None and not req.chat:
            ids_in = self.tok.encode(req.prompt_text)
        if ids_in is None and self.tok.chat_template is None:
            raise BadRequest("the model's tokenizer has no chat template: use /v1/completions", 400)
        try:
            action, ids, text = plan_turn(
                s, self.tok, req.messages if ids_in is None else None, ids_in, req.tools
            )
        except ValueError as e:
            raise BadRequest(str(e)) from None
        except Exception as e:  # noqa: BLE001  (a chat template that raises on these messages)
            raise BadRequest(
                f"messages: the chat template failed: {e}"[:300], param="messages"
            ) from None
        context = (s.seq.num_tokens if action == "append" else 0) + len(ids)
        room = self.s.max_model_len - context
        if room < 1:
            raise BadRequest(
                f"the context would hold {context} tokens, leaving no room under the limit of "
                f"{self.s.max_model_len}",
                param="messages",
            )
        if req.max_tokens is not None and req.max_tokens > room:
            raise BadRequest(
                f"max_tokens: {req.max_tokens} + the context's {context} tokens exceed the limit "
                f"of {self.s.max_model_len}",
                param="max_tokens",
            )
        params = self._params(s, req, action)
        try:
            if action == "new":
                if s.segments:
                    s.forks += 1
                    self.stats["new_samples"] += 1
                    self._abort_segments(s)
                key = next(self._keys)
                self._do(Add(key, ids, params))
                s.segments.append((key, self.seqs[key]))
                s.history_text, s.tools = text, req.tools
            else:
                key = s.segments[-1][0]
                self._do(Append(key, ids, params))
                s.history_text += text
        except ValueError as e:  # the KV pool or the context cannot take it
            raise BadRequest(f"cannot schedule the request: {e}"[:300]) from None
        seq = self.seqs[key]
        s.busy = True
        if s.task is not None and s.task.claimed_at is None:
            s.task.claimed_at = time.monotonic()
        self.turns[key] = _Turn(
            s,
            req,
            emit,
            key,
            seq,
            list(seq.token_ids),
            seq.num_tokens,
            min(
                req.max_tokens or self.s.max_tokens,
                room,
                self.s.max_tokens if self.s.cap_max_tokens else room,
            ),
        )

    def _params(self, s: Session, req: TurnRequest, action: str) -> SamplingParams:
        d = self.s

        def pick(value: Any, default: Any) -> Any:
            return default if value is None else value

        greedy = s.task is not None and s.task.greedy
        if req.seed is not None:
            seed = req.seed
        elif action == "append":
            seed = s.seq.params.seed
        elif s.task is not None and s.task.seed is not None:
            seed = s.task.seed + 1_000_003 * len(s.segments)
        else:
            seed = None
        stops = set(req.stop_token_ids) | (set() if req.ignore_eos else set(self._eos_stops))
        return SamplingParams(
            temperature=0.0 if greedy else pick(req.temperature, d.temperature),
            top_p=pick(req.top_p, d.top_p),
            top_k=pick(req.top_k, d.top_k),
            min_p=pick(req.min_p, d.min_p),
            max_tokens=d.max_model_len,
            seed=seed,
            stop_token_ids=sorted(stops),
            ignore_eos=True,
        )

    # ---- publishing and ending turns (leader, after each step) ---------------------------
    def _publish(self) -> None:
        for t in list(self.turns.values()):
            seq = t.seq
            n = seq.num_tokens - t.token_start
            finish = None
            if seq.is_finished:
                finish = "length" if seq.finish_reason == "length" else "stop"
            elif n:
                if not t.req.ignore_eos and seq.token_ids[-1] == self.s.eot_id:
                    finish = "stop"
                elif n >= t.max_tokens:
                    finish = "length"
            text, cut = self._text(t, n, finish)
            if cut:
                finish = "stop"
            if n == t.sent and finish is None:
                continue
            if t.req.stream:
                part = self._result(t, t.sent, n, text[len(t.text_sent) :], finish)
                t.sent, t.text_sent = n, text
                t.emit("delta", part)
            if finish is not None:
                self._end_turn(t, finish, self._result(t, 0, n, text, finish))

    def _text(self, t: _Turn, n: int, finish: str | None) -> tuple[str, bool]:
        """The turn's visible text (its tokens without a closing end-of-turn or stop id; cut
        before a stop string), and whether a stop string cut it. Streaming holds back a
        partial character and what could still become a stop string."""
        ids = t.seq.token_ids[t.token_start : t.token_start + n]
        if ids and finish == "stop" and ids[-1] in self._special | set(t.req.stop_token_ids):
            ids = ids[:-1]
        text = self.tok.decode(ids, skip_special_tokens=True)
        for stop in t.req.stop:
            at = text.find(stop)
            if at >= 0:
                return text[:at], True
        if finish is None:
            text = text.rstrip("\ufffd")
            hold = max((len(s) - 1 for s in t.req.stop), default=0)
            text = text[: len(text) - hold] if hold else text
        return text, False

    def _result(self, t: _Turn, a: int, b: int, text: str, finish: str | None) -> TurnResult:
        seq = t.seq
        ids = seq.token_ids[t.token_start + a : t.token_start + b]
        first = seq.num_generated - (
            seq.num_tokens - t.token_start
        )  # index of the turn's first log-prob
        lps = seq.raw_logprobs[first + a : first + b]
        texts = [self.tok.decode([i]) for i in ids] if t.req.logprobs else []
        routed = None
        if t.req.return_token_ids:  # MoE: the experts of the inputs that made these tokens
            routed = self.gen.routed_positions(seq, t.token_start + a - 1, t.token_start + b - 1)
        return TurnResult(
            ids, lps, text, finish, t.prompt_ids, texts, self.s.policy_version, routed
        )

    def _end_turn(self, t: _Turn, finish: str, result: TurnResult) -> None:
        del self.turns[t.key]
        s = t.session
        s.busy, s.touched = False, time.monotonic()
        s.turns += 1
        self.stats["turns"] += 1
        s.history_text += self.tok.decode(t.seq.token_ids[t.token_start :])
        if s.ephemeral:
            self._close(s, "done")
        elif not t.seq.is_finished:
            self._do(Pause(t.key))
        t.emit("done", result)

    # ---- closing ----------------------------------------------------------------------
    def _abort_segments(self, s: Session) -> None:
        for key, _ in s.segments:
            if key in self.seqs:
                self._do(Abort(key))

    def _close(self, s: Session, reason: str) -> None:
        """End session ``s`` (its turn in flight gets an error; its sequences are freed)."""
        for key, t in list(self.turns.items()):
            if t.session is s:
                del self.turns[key]
                t.emit(
                    "error", BadRequest(f"session {s.id!r} closed ({reason}) during the turn", 409)
                )
        self._abort_segments(s)
        s.busy, s.closed, s.touched = False, reason, time.monotonic()
        if s.ephemeral:
            self.sessions.pop(s.id, None)

    def _expire(self) -> None:
        """Drop the sessions of tasks past their deadline (training), and idle ones
        (``session_idle_s``, tandem-serve)."""
        d = self.s
        if d.session_idle_s:
            self._expire_idle(time.monotonic())
        if not (d.episode_timeout_s or d.claim_timeout_s):
            return
        now = time.monotonic()
        for s in self.sessions.values():
            task = s.task
            if s.closed or task is None:
                continue
            if (
                task.claimed_at is not None
                and d.episode_timeout_s
                and now - task.claimed_at > d.episode_timeout_s
            ):
                self.stats["timeouts"] += 1
                self._close(s, "timeout")
            elif (
                task.claimed_at is None and d.claim_timeout_s and now - self._t0 > d.claim_timeout_s
            ):
                self.stats["unclaimed"] += 1
                self._close(s, "unclaimed")

    def _expire_idle(self, now: float) -> None:
        """Close the sessions without a turn for ``session_idle_s`` (their KV is freed) and
        forget the closed ones as long after (their ids answer 409 until then)."""
        for s in list(self.sessions.values()):
            if s.task is not None or s.busy or now - s.touched <= self.s.session_idle_s:
                continue
            if s.closed:
                del self.sessions[s.id]
            else:
                self.stats["expired"] += 1
                self._close(s, "expired")
                s.touched = now

    def _close_all(self) -> None:
        """Stopping: refuse new messages, answer the queued ones and the turns in flight with
        503, and abort every live sequence."""
        with self._lock:
            self._closed = True
        gone = BadRequest("the server is stopping (the rollout ended); retry later", 503)
        while True:
            try:
                msg = self.inbox.get_nowait()
            except queue.Empty:
                break
            if msg[-1] is not None:
                msg[-1]("error", gone)
        for t in list(self.turns.values()):
            t.emit("error", gone)
        self.turns.clear()
        for key in list(self.seqs):
            self._do(Abort(key))

    def add_tasks(self, sessions: list[Session]) -> None:
        """Training: the step's episodes, as sessions waiting for the harness's first request."""
        for s in sessions:
            self.sessions[s.id] = s
