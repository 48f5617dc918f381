"""The multi-turn rollout driver: masks, log-probs, rendering, limits, failures, overlap.

The model is debug-qwen3 from ``init_weights`` with a test-only output bias
(tests/env_helpers.py) so that its turns end with <|im_end|> after a few tokens.
Torch runs single-threaded here: on a shared 2-core box two threads contend and a
generator step slows down about 20x.
"""

from __future__ import annotations

import os

import pytest
import torch

from tandem.models.tokenizer import Tokenizer
from tandem.rl.generator.engine import GenerationSettings, Generator
from tandem.rl.generator.sequence import SamplingParams
from tandem.rl.rollout.agentic import ChatRenderer, end_of_turn_id, run_agentic_rollout
from tandem.rl.workers.env_pool import EnvPool
from tests.env_helpers import agentic_model, char_tokenizer, tiny_model, train_logprobs
from tests.fixtures import LLAMA3_STYLE_TEMPLATE


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def tok(tmp_path_factory) -> Tokenizer:
    return char_tokenizer(tmp_path_factory.mktemp("agentic"))


@pytest.fixture(scope="module")
def model(tok):
    return agentic_model(tok)


@pytest.fixture(scope="module")
def pool():
    with EnvPool(4) as p:
        p.wait_ready()
        yield p


def make_gen(model, tok) -> Generator:
    return Generator(
        model, GenerationSettings(block_size=8, num_blocks=512), eos_token_ids=tok.eos_token_ids
    )


PARAMS = SamplingParams(temperature=1.0, max_tokens=200, seed=7)
ROWS = [{"id": f"r{i}", "prompt": f"question {i}"} for i in range(3)]


def runs(mask: list[bool]) -> list[tuple[bool, int, int]]:
    """(value, start, end) of each run of equal mask values."""
    out, start = [], 0
    for i in range(1, len(mask) + 1):
        if i == len(mask) or mask[i] != mask[start]:
            out.append((mask[start], start, i))
            start = i
    return out


def test_masks_logprobs_and_rendering(model, tok, pool) -> None:
    gen = make_gen(model, tok)
    samples, metrics = run_agentic_rollout(
        gen,
        tok,
        "sleepy",
        {"sleep_s": 0.0, "turns": 3},
        ROWS,
        2,
        PARAMS,
        max_turns=5,
        max_total_tokens=1000,
        pool=pool,
    )
    assert len(samples) == 6 and [s.group for s in samples] == [0, 0, 1, 1, 2, 2]
    eot = end_of_turn_id(tok)
    for s in samples:
        assert s.finish_reason == "stop" and s.env_reward == 3.0 and s.info["turns"] == 3
        assert len(s.loss_mask) == len(s.completion_ids) == len(s.gen_logprobs)
        # environment tokens: masked out, log-prob 0; sampled tokens: the training forward's
        # log-probs
        mask = torch.tensor(s.loss_mask)
        ref = train_logprobs(model, s.prompt_ids, s.completion_ids)
        got = torch.tensor(s.gen_logprobs)
        assert torch.allclose(got[mask], ref[mask], atol=1e-5, rtol=0)
        assert (got[~mask] == 0).all()
        # three sampled turns, each ending with a sampled <|im_end|>, two observations between
        pieces = runs(s.loss_mask)
        assert [v for v, _, _ in pieces] == [True, False, True, False, True]
        turns = [s.completion_ids[a:b] for v, a, b in pieces if v]
        assert all(t[-1] == eot and eot not in t[:-1] for t in turns)
        # what the environment added is exactly what the chat template renders
        conversation = [{"role": "user", "content": s.row["prompt"]}]
        for k, t in enumerate(turns):
            conversation.append({"role": "assistant", "content": tok.decode(t[:-1])})
            if k < 2:
                conversation.append({"role": "user", "content": f"ok {k + 1}"})
        rendered = tok.apply_chat_template(conversation)
        assert tok.decode(s.prompt_ids + s.completion_ids) + "\n" == rendered
    assert samples[0].prompt_ids == samples[1].prompt_ids and samples[0].text != samples[1].text
    assert metrics["env/turns_mean"] == 3 and metrics["env/render_fallbacks"] == 0
    assert metrics["env/env_steps"] == 18 and metrics["env/truncated"] == 0
    assert gen.pool_is_free()


def test_turn_and_token_limits(model, tok, pool) -> None:
    gen = make_gen(model, tok)
    samples, m = run_agentic_rollout(
        gen,
        tok,
        "sleepy",
        {"sleep_s": 0.0, "turns": 50},
        ROWS,
        2,
        PARAMS,
        max_turns=2,
        max_total_tokens=1000,
        pool=pool,
    )
    assert len(samples) == 6 and all(
        s.info["turns"] == 2
        and s.finish_reason == "length"
        and s.info["truncated"] == 1
        and s.info["turn_limit"] == 1
        and s.env_reward is None
        for s in samples
    )
    assert m["env/turn_limit_hits"] == 6
    limit = len(samples[0].prompt_ids) + 40
    samples, m = run_agentic_rollout(
        gen,
        tok,
        "sleepy",
        {"sleep_s": 0.0, "turns": 50},
        ROWS,
        2,
        PARAMS,
        max_turns=50,
        max_total_tokens=limit,
        pool=pool,
    )
    assert len(samples) == 6
    for s in samples:
        assert len(s.prompt_ids) + len(s.completion_ids) <= limit
        assert s.finish_reason == "length" and s.info["token_limit"] == 1 and s.info["turns"] > 1
    assert m["env/token_limit_hits"] == 6
    samples, m = run_agentic_rollout(
        gen, tok, "sleepy", {}, ROWS[:1], 1, PARAMS, max_turns=3, max_total_tokens=10, pool=pool
    )  # the prompt alone is too long
    assert samples[0].completion_ids == [] and samples[0].finish_reason == "length"
    assert m["env/prompts_too_long"] == 1
    assert gen.pool_is_free()


def test_max_turn_tokens_end_turns_without_eot(tok, pool) -> None:
    model = tiny_model(
        0, {tok.token_to_id("<|im_end|>"): -30.0, tok.token_to_id("<|endoftext|>"): -30.0}
    )
    gen = make_gen(model, tok)
    samples, _ = run_agentic_rollout(
        gen,
        tok,
        "sleepy",
        {"sleep_s": 0.0, "turns": 2},
        ROWS[:2],
        1,
        PARAMS,
        max_turns=4,
        max_total_tokens=1000,
        pool=pool,
        max_turn_tokens=5,
    )
    assert len(samples) == 2
    for s in samples:
        assert [(v, b - a) for v, a, b in runs(s.loss_mask)][::2] == [(True, 5), (True, 5)]
        env_part = tok.decode([t for t, m in zip(s.completion_ids, s.loss_mask) if not m])
        assert env_part == "<|im_end|>\n<|im_start|>user\nok 1<|im_end|>\n<|im_start|>assistant\n"
        ref = train_logprobs(model, s.prompt_ids, s.completion_ids)
        mask = torch.tensor(s.loss_mask)
        assert torch.allclose(torch.tensor(s.gen_logprobs)[mask], ref[mask], atol=1e-5, rtol=0)


def test_malformed_tool_calls_in_a_rollout(tok, pool) -> None:
    """A policy that opens <tool_call> and never closes it gets error observations, no crash."""
    bias = {
        tok.token_to_id("<tool_call>"): 8.0,
        tok.token_to_id("<|im_end|>"): 7.0,
        tok.token_to_id("<|endoftext|>"): -30.0,
    }
    model = tiny_model(1, bias)
    gen = make_gen(model, tok)
    rows = [{"prompt": "What is 2+2?", "answer": "4"}]
    samples, m = run_agentic_rollout(
        gen,
        tok,
        "tool",
        {"tools": ["calculator"]},
        rows,
        3,
        PARAMS,
        max_turns=3,
        max_total_tokens=2000,
        pool=pool,
    )
    assert m["env/tool_errors_per_episode"] >= 1 and len(samples) == 3
    for s in samples:
        assert s.info["turns"] <= 3
        if s.info["tool_errors"]:
            assert "<tool_response>\nError: unterminated <tool_call> block" in s.text
            assert "# Tools" in tok.decode(s.prompt_ids)  # tool schemas rendered in the prompt
        if s.info["turns"] == 3 and s.env_reward is None:
            assert s.finish_reason == "length" and s.info["turn_limit"] == 1
    assert gen.pool_is_free()


def test_env_that_raises_becomes_error_observation(model, tok, pool) -> None:
    rows = [{"prompt": "a", "faulty": True}, {"prompt": "b"}]
    gen = make_gen(model, tok)
    kwargs = {"sleep_s": 0.0, "turns": 3, "raise_on_turn": 2, "only_faulty_rows": True}
    samples, m = run_agentic_rollout(
        gen, tok, "sleepy", kwargs, rows, 1, PARAMS, max_turns=4, max_total_tokens=2000, pool=pool
    )
    bad, good = samples
    assert "[environment error: RuntimeError: sleepy env broke on turn 2]" in bad.text
    assert bad.info["env_errors"] == 3 and bad.finish_reason == "length"  # retried until max_turns
    assert good.env_reward == 3.0 and good.info.get("env_errors", 0) == 0
    assert m["env/env_errors"] == 3
    samples, _ = run_agentic_rollout(
        gen,
        tok,
        "sleepy",
        {"sleep_s": 0.0},
        rows,
        1,
        PARAMS,
        max_turns=4,
        max_total_tokens=2000,
        pool=pool,
    )  # the pool still works
    assert [s.env_reward for s in samples] == [3.0, 3.0]


def test_env_steps_overlap_with_decoding(model, tok, pool) -> None:
    """16 episodes x 3 turns of a 100 ms environment on 4 workers: 4.8 s of env time."""
    rows = [{"prompt": f"p{i}"} for i in range(16)]
    gen = make_gen(model, tok)
    samples, m = run_agentic_rollout(
        gen,
        tok,
        "sleepy",
        {"sleep_s": 0.1, "turns": 3},
        rows,
        1,
        PARAMS,
        max_turns=3,
        max_total_tokens=1000,
        pool=pool,
    )
    total_sleep = 16 * 3 * 0.1
    assert len(samples) == 16 and all(s.info["turns"] == 3 and s.env_reward == 3.0 for s in samples)
    assert m["env/env_time_s"] >= total_sleep
    assert m["env/elapsed_s"] < 0.5 * total_sleep, m
    assert m["env/device_wait_s"] < m["env/env_time_s"]
    print(
        f"\noverlap: elapsed {m['env/elapsed_s']:.2f} s for {m['env/env_time_s']:.2f} s "
        f"of env time; device waited {m['env/device_wait_s']:.2f} s; overlap {m['env/overlap']:.2f}"
        f"; pid {os.getpid()}"
    )


def test_renderer_falls_back_when_history_is_not_prefix_stable(tok) -> None:
    """A template that trims assistant content re-renders history differently."""
    trimming = Tokenizer(tok.raw, tok.config, LLAMA3_STYLE_TEMPLATE, tok.eos_token_ids)
    r = ChatRenderer(trimming, None, end_of_turn_id(trimming))
    initial = [{"role": "user", "content": "hi"}]
    prompt, _ = r.prompt(initial)
    history = prompt + "  spaced answer <|im_end|>"
    obs = [{"role": "user", "content": "ok"}]
    conv = initial + [{"role": "assistant", "content": "  spaced answer "}] + obs
    text, fell_back = r.delta(history, conv, initial, obs, ended_with_eot=True)
    assert fell_back and text == "\n<|im_start|>user\nok<|im_end|>\n<|im_start|>assistant\n"
    stable = initial + [{"role": "assistant", "content": "answer"}] + obs
    text2, fell_back2 = r.delta(
        prompt + "answer<|im_end|>", stable, initial, obs, ended_with_eot=True
    )
    assert not fell_back2 and text2 == text


def test_env_that_kills_its_worker_is_counted(model, tok, pool) -> None:
    rows = [{"prompt": "a", "faulty": True, "parent_pid": os.getpid()}, {"prompt": "b"}]
    gen = make_gen(model, tok)
    kwargs = {"sleep_s": 0.0, "turns": 1, "crash_on_turn": 1, "only_faulty_rows": True}
    samples, m = run_agentic_rollout(
        gen, tok, "sleepy", kwargs, rows, 1, PARAMS, max_turns=2, max_total_tokens=2000, pool=pool
    )
    bad, good = samples
    assert (
        "[environment error: worker died (exit code 3)" in bad.text
    )  # retried once, then given up
    assert bad.info["env_crashes"] == 2 and bad.finish_reason == "length" and bad.env_reward is None
    assert good.env_reward == 1.0 and m["env/env_crashes"] == 2 and pool.counts["crashes"] >= 4
    assert gen.pool_is_free()
