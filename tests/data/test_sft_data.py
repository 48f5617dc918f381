"""SFT data: assistant-only loss masks, packing, bad rows, and the step sampler."""

import json

import pytest

from tandem.models.tokenizer import build_char_tokenizer
from tandem.rl.data.loading import DataError, load_rows
from tandem.rl.data.sft import (
    IGNORE,
    StepSampler,
    build_sft_data,
    collate,
    example_to_row,
    tokenize_chat,
)


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return build_char_tokenizer(tmp_path_factory.mktemp("tok"))


def test_chat_mask_covers_exactly_the_assistant_replies(tok):
    msgs = [
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "3+3?"},
        {"role": "assistant", "content": "6"},
    ]
    ex = tokenize_chat(msgs, tok)
    assert tok.decode(ex.input_ids) == tok.apply_chat_template(msgs)
    trained = tok.decode([t for t, m in zip(ex.input_ids, ex.loss_mask) if m])
    # Each reply and its end-of-turn marker are trained; nothing of the user turns.
    assert trained == "4<|im_end|>\n6<|im_end|>\n"


def test_packing_targets_and_doc_boundaries(tok):
    rows = [{"prompt": "ab", "completion": "cd"}, {"prompt": "x", "completion": "yz"}]
    data = build_sft_data(rows, tok, source="mem", max_length=64)
    assert len(data.rows) == 1
    r = data.rows[0]
    eos = tok.eos_token_ids[0]
    a, b, c, d = tok.encode("abcd")
    x, y, z = tok.encode("xyz")
    assert r.tokens == [a, b, c, d, x, y, z]
    # token t predicts t+1 only where t+1 is a completion token (incl. eos)
    assert r.targets == [IGNORE, c, d, eos, y, z, eos]
    assert r.positions == [0, 1, 2, 3, 0, 1, 2]
    assert r.doc_ids == [0, 0, 0, 0, 1, 1, 1]
    batch = collate([r, data.rows[0]])
    assert batch["tokens"].shape == (2, 7)


def test_bad_rows_are_counted_or_rejected(tok):
    rows = [
        {"messages": []},
        {"other": 1},
        {"prompt": "a" * 100, "completion": "b"},
        {"prompt": "q", "completion": "ok"},
    ]
    data = build_sft_data(rows, tok, source="f.jsonl", max_length=32)
    assert data.num_examples == 1
    assert sum(data.skipped.values()) == 3
    assert data.skipped["empty conversation"] == 1
    with pytest.raises(DataError, match=r"f.jsonl: row 0: empty conversation"):
        build_sft_data(rows, tok, source="f.jsonl", max_length=32, on_bad_row="error")


def test_load_rows_names_the_bad_line(tmp_path):
    p = tmp_path / "d.jsonl"
    p.write_text(json.dumps({"prompt": "a"}) + "\n{oops\n")
    with pytest.raises(DataError, match=r"d.jsonl:2: invalid JSON"):
        load_rows(str(p))
    with pytest.raises(DataError, match="file not found"):
        load_rows(str(tmp_path / "missing.jsonl"))
    p.write_text(json.dumps({"prompt": "a", "completion": "b"}) + "\n")
    assert load_rows(str(p)) == [{"prompt": "a", "completion": "b"}]


def test_step_sampler_epochs_and_ranks():
    s = StepSampler(num_rows=5, batch_size=4, seed=3)
    chain = s.global_batch(0) + s.global_batch(1) + s.global_batch(2)
    # every epoch is a permutation of all rows
    assert sorted(chain[:5]) == list(range(5)) and sorted(chain[5:10]) == list(range(5))
    assert s.epoch_of(1) == 0 and s.epoch_of(2) == 1
    g = s.global_batch(1)
    assert s.local_batch(1, 0, 2) + s.local_batch(1, 1, 2) == g[0::2] + g[1::2]
    assert StepSampler(5, 4, 3).global_batch(2) == s.global_batch(2)  # stateless: resume exact


def test_tool_calling_transcript_renders_its_tools_and_trains_only_the_assistant(tok):
    from tandem.rl.envs.tools import TOOLS

    tools = [TOOLS.get("calculator").schema()]
    call = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "12*34"}}\n</tool_call>'
    msgs = [
        {"role": "user", "content": "What is 12*34?"},
        {"role": "assistant", "content": call},
        {"role": "tool", "content": "408"},
        {"role": "assistant", "content": "\\boxed{408}"},
    ]
    ex = tokenize_chat(msgs, tok, tools)
    text = tok.decode(ex.input_ids)
    assert (
        text == tok.apply_chat_template(msgs, tools=tools)
        and '"name": "calculator"' in text.split(call)[0]
    )
    trained = tok.decode([t for t, m in zip(ex.input_ids, ex.loss_mask) if m])
    # the tool's result is context only
    assert trained == call + "<|im_end|>\n" + "\\boxed{408}<|im_end|>\n"
    rows = [{"messages": msgs, "tools": tools}, {"messages": msgs, "tools": "calculator"}]
    data = build_sft_data(rows, tok, source="t.jsonl", max_length=4096, pack=False)
    assert data.num_examples == 1 and data.skipped["tools must be a list of JSON objects"] == 1
    assert data.rows[0] == example_to_row(ex)


def test_trl_conversational_prompt_completion_trains_as_one_conversation(tok):
    """TRL's conversational prompt-completion rows (both sides lists of messages) give the
    example the same conversation under messages_field gives; a nested messages path too."""
    prompt = [{"role": "user", "content": "2+2?"}]
    completion = [{"role": "assistant", "content": "4"}]
    rows = [{"prompt": prompt, "completion": completion}, {"conv": {"turns": prompt + completion}}]
    data = build_sft_data(rows[:1], tok, source="mem", max_length=64, pack=False)
    nested = build_sft_data(
        rows[1:], tok, source="mem", max_length=64, pack=False, messages_field="conv.turns"
    )
    ref = build_sft_data(
        [{"messages": prompt + completion}], tok, source="mem", max_length=64, pack=False
    )
    assert data.rows[0] == ref.rows[0] == nested.rows[0] and not data.skipped
