"""OpenAI request parsing and response shapes, with the vLLM extensions for exact token ids.

Requests are checked field by field: a bad one raises `BadRequest`, which the server turns
into a 4xx JSON error (``{"error": {"message", "type", "param", "code"}}``), never an
exception in the generator loop. Extensions beyond the OpenAI schema are spelled as vLLM
spells them: ``prompt_token_ids`` (token-in, chat and completions), ``return_token_ids``
(``prompt_token_ids`` and ``choices[i].token_ids`` out), ``ignore_eos``, ``top_k``,
``min_p``, ``stop_token_ids``. Tandem adds, with ``return_token_ids``, ``policy_version``
(per choice: the weights that sampled every token; one version per turn in synchronous RL)
and, for MoE models, ``routed_experts`` (per token, per MoE layer, the chosen experts).
Per-token ``logprobs`` are the raw model's (temperature 1, no truncation: vLLM's default
``raw_logprobs``), the numbers the RL update recomputes. Pure Python.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "BadRequest",
    "TurnRequest",
    "TurnResult",
    "parse_chat",
    "parse_completion",
    "response",
    "chunk",
    "error_body",
]

_MAX_STOPS = 16


class BadRequest(Exception):
    """A request the server refuses: ``status`` (4xx) and one line naming the field."""

    def __init__(
        self,
        message: str,
        status: int = 400,
        param: str | None = None,
        kind: str = "invalid_request_error",
    ) -> None:
        super().__init__(message)
        self.status, self.param, self.kind = status, param, kind


def error_body(
    message: str, status: int, param: str | None = None, kind: str = "invalid_request_error"
) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}


@dataclass
class TurnRequest:
    """One chat or completion request, validated; ``None`` sampling fields: server defaults."""

    chat: bool
    messages: list[dict[str, Any]] | None = None  # chat
    prompt_text: str | None = None  # completions
    prompt_ids: list[int] | None = None  # either: token-in, used as given
    tools: list[dict[str, Any]] | None = None
    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    stream: bool = False
    include_usage: bool = False
    logprobs: bool = False
    return_token_ids: bool = False


@dataclass
class TurnResult:
    """What one request sampled (or, streaming, the newest part of it)."""

    token_ids: list[int]
    logprobs: list[float]
    text: str
    finish_reason: str | None
    prompt_token_ids: list[int]
    token_texts: list[str] = field(default_factory=list)  # with logprobs: each token's text
    policy_version: int = 0
    routed_experts: list | None = None  # MoE: [token][layer][k]


def _bad(key: str, what: str, got: Any) -> BadRequest:
    return BadRequest(f"{key}: {what}, got {got!r}"[:300], param=key)


def _number(body: dict, key: str, lo: float, hi: float, integer: bool = False) -> Any:
    v = body.get(key)
    if v is None:
        return None
    kinds = (int,) if integer else (int, float)
    # an int is compared as it is: math.isfinite of a 400-digit one raises OverflowError
    if (
        isinstance(v, bool)
        or not isinstance(v, kinds)
        or (isinstance(v, float) and not math.isfinite(v))
        or not lo <= v <= hi
    ):
        raise _bad(key, f"must be {'an integer' if integer else 'a number'} in [{lo:g}, {hi:g}]", v)
    return v


def _flag(body: dict, key: str) -> bool:
    v = body.get(key, False)
    if v is None:
        return False
    if not isinstance(v, bool):
        raise _bad(key, "must be true or false", v)
    return v


def _ids(value: Any, key: str, vocab: int) -> list[int]:
    if (
        not isinstance(value, list)
        or not value
        or not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab for t in value)
    ):
        raise _bad(
            key,
            f"must be a non-empty list of token ids in [0, {vocab})",
            value if not isinstance(value, list) else f"a list of {len(value)}",
        )
    return list(value)


def _common(body: dict, req: TurnRequest, vocab: int) -> TurnRequest:
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    if body.get("n", 1) != 1:
        raise _bad(
            "n",
            "only 1 is supported (send n requests; in a session each is one turn)",
            body.get("n"),
        )
    if body.get("model") is not None and not isinstance(body.get("model"), str):
        raise _bad("model", "must be a string", body.get("model"))
    req.model = body.get("model")
    limit = body.get("max_completion_tokens", body.get("max_tokens"))
    req.max_tokens = _number({"max_tokens": limit}, "max_tokens", 1, 1 << 30, integer=True)
    req.temperature = _number(body, "temperature", 0, 100)
    req.top_p = _number(body, "top_p", 1e-9, 1)
    req.top_k = _number(body, "top_k", -1, 1 << 30, integer=True)
    if req.top_k == -1:  # vLLM spells "off" as -1
        req.top_k = 0
    req.min_p = _number(body, "min_p", 0, 1)
    req.seed = _number(body, "seed", -(1 << 63), (1 << 63) - 1, integer=True)
    stop = body.get("stop")
    stop = [stop] if isinstance(stop, str) else (stop or [])
    if (
        not isinstance(stop, list)
        or len(stop) > _MAX_STOPS
        or not all(isinstance(s, str) and s for s in stop)
    ):
        raise _bad(
            "stop",
            f"must be a non-empty string or a list of at most {_MAX_STOPS} of them",
            body.get("stop"),
        )
    req.stop = stop
    sti = body.get("stop_token_ids") or []
    req.stop_token_ids = _ids(sti, "stop_token_ids", vocab) if sti else []
    req.ignore_eos = _flag(body, "ignore_eos")
    req.stream = _flag(body, "stream")
    opts = body.get("stream_options") or {}
    if not isinstance(opts, dict):
        raise _bad("stream_options", "must be an object", opts)
    req.include_usage = bool(opts.get("include_usage", False))
    req.return_token_ids = _flag(body, "return_token_ids")
    if body.get("prompt_token_ids") is not None:
        req.prompt_ids = _ids(body["prompt_token_ids"], "prompt_token_ids", vocab)
    return req


def _content(m: dict, i: int) -> str | None:
    c = m.get("content")
    if c is None or isinstance(c, str):
        return c
    if isinstance(c, list) and all(
        isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
        for p in c
    ):
        return "".join(p["text"] for p in c)
    raise _bad(f"messages[{i}].content", "must be a string or a list of text parts", c)


def parse_chat(body: Any, vocab: int) -> TurnRequest:
    """A validated `/v1/chat/completions` request (``vocab``: the tokenizer's size)."""
    req = _common(body, TurnRequest(chat=True), vocab)
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise _bad("messages", "must be a non-empty list of messages", msgs)
    out = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not m["role"]:
            raise _bad(f"messages[{i}]", 'must be an object with a "role" string', m)
        out.append({**m, "content": _content(m, i)})
    req.messages = out
    tools = body.get("tools")
    if tools is not None and (
        not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools)
    ):
        raise _bad("tools", "must be a list of objects", tools)
    req.tools = tools or None
    lp, top = body.get("logprobs"), body.get("top_logprobs")
    if lp is not None and not isinstance(lp, bool):
        raise _bad("logprobs", "must be true or false", lp)
    if top:
        raise _bad("top_logprobs", "only 0 is supported (the sampled token's log-prob)", top)
    req.logprobs = bool(lp)
    return req


def parse_completion(body: Any, vocab: int) -> TurnRequest:
    """A validated `/v1/completions` request: ``prompt`` text, or token ids (a list of ints, or
    ``prompt_token_ids``)."""
    req = _common(body, TurnRequest(chat=False), vocab)
    prompt = body.get("prompt")
    if req.prompt_ids is None:
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
            req.prompt_ids = _ids(prompt, "prompt", vocab)
        elif isinstance(prompt, str) and prompt:
            req.prompt_text = prompt
        else:
            raise _bad(
                "prompt",
                "must be a non-empty string or a list of token ids (one prompt per request)",
                prompt if not isinstance(prompt, list) else f"a list of {len(prompt)}",
            )
    lp = body.get("logprobs")
    if lp is not None and (isinstance(lp, bool) or not isinstance(lp, int) or lp not in (0, 1)):
        raise _bad("logprobs", "only 0 or 1 is supported (the sampled token's log-prob)", lp)
    req.logprobs = lp == 1
    if body.get("echo"):
        raise _bad("echo", "is not supported", body.get("echo"))
    return req


def _logprobs(req: TurnRequest, part: TurnResult) -> dict | None:
    if not req.logprobs:
        return None
    if req.chat:
        return {
            "content": [
                {"token": t, "logprob": lp, "bytes": list(t.encode()), "top_logprobs": []}
                for t, lp in zip(part.token_texts, part.logprobs)
            ]
        }
    return {
        "tokens": part.token_texts,
        "token_logprobs": part.logprobs,
        "top_logprobs": [{}] * len(part.token_texts),
        "text_offset": [],
    }


def _extras(req: TurnRequest, part: TurnResult) -> dict:
    if not req.return_token_ids:
        return {}
    out: dict[str, Any] = {"token_ids": part.token_ids, "policy_version": part.policy_version}
    if part.routed_experts is not None:
        out["routed_experts"] = part.routed_experts
    return out


def response(req: TurnRequest, rid: str, model: str, result: TurnResult) -> dict:
    """The whole (non-streaming) response body."""
    choice: dict[str, Any] = {
        "index": 0,
        "finish_reason": result.finish_reason,
        "logprobs": _logprobs(req, result),
        **_extras(req, result),
    }
    if req.chat:
        choice["message"] = {"role": "assistant", "content": result.text}
    else:
        choice["text"] = result.text
    body: dict[str, Any] = {
        "id": rid,
        "object": "chat.completion" if req.chat else "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": [choice],
        "usage": {
            "prompt_tokens": len(result.prompt_token_ids),
            "completion_tokens": len(result.token_ids),
            "total_tokens": len(result.prompt_token_ids) + len(result.token_ids),
        },
    }
    if req.return_token_ids:
        body["prompt_token_ids"] = result.prompt_token_ids
    return body


def chunk(
    req: TurnRequest,
    rid: str,
    model: str,
    part: TurnResult | None,
    *,
    first: bool = False,
    usage: tuple[int, int] | None = None,
) -> dict:
    """One streamed chunk: the new part of a choice, or (``usage``) the closing usage chunk."""
    body: dict[str, Any] = {
        "id": rid,
        "object": "chat.completion.chunk" if req.chat else "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": [],
    }
    if usage is not None:
        body["usage"] = {
            "prompt_tokens": usage[0],
            "completion_tokens": usage[1],
            "total_tokens": sum(usage),
        }
        return body
    assert part is not None
    choice: dict[str, Any] = {
        "index": 0,
        "finish_reason": part.finish_reason,
        "logprobs": _logprobs(req, part),
        **_extras(req, part),
    }
    if req.chat:
        choice["delta"] = (
            {"role": "assistant", "content": part.text} if first else {"content": part.text}
        )
    else:
        choice["text"] = part.text
    body["choices"] = [choice]
    if first and req.return_token_ids:
        body["prompt_token_ids"] = part.prompt_token_ids
    return body
