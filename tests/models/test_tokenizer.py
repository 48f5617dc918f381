"""Tokenizer: char tokenizer round trips, special ids, chat templates equal transformers'."""

from __future__ import annotations

import json
import random
import string

import jinja2
import pytest

from tandem.models import Tokenizer, build_char_tokenizer
from tests.fixtures import LLAMA3_STYLE_TEMPLATE, QWEN_CHAT_TEMPLATE

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather for a city — in °C",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                "required": ["city"],
            },
        },
    },
    {
        "type": "function",
        "function": {"name": "noop", "description": "does nothing", "parameters": {}},
    },
]

CONVERSATIONS = {
    "single_user": [{"role": "user", "content": "What is 2+2?"}],
    "system_multi_turn": [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "Count:\n  1, 2, 3"},
    ],
    "tool_calls": [
        {"role": "user", "content": "Weather in Paris and Rome?"},
        {
            "role": "assistant",
            "content": "Let me check.",
            "tool_calls": [
                {
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
                },
                {
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'},
                },
            ],
        },
        {"role": "tool", "content": '{"temp": 21}'},
        {"role": "tool", "content": '{"temp": 25}'},
        {"role": "assistant", "content": "Paris 21, Rome 25.", "tool_calls": None},
    ],
}


@pytest.fixture(scope="module")
def char_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("chartok")
    build_char_tokenizer(path)
    return path


@pytest.fixture(scope="module")
def tok(char_dir):
    return Tokenizer.from_dir(char_dir)


def _hf_fast(char_dir, template):
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast(
        tokenizer_file=str(char_dir / "tokenizer.json"),
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        bos_token="<|endoftext|>",
    )
    hf.chat_template = template
    return hf


def test_char_tokenizer_round_trips_printable_text(tok):
    rng = random.Random(0)
    alphabet = string.printable  # includes space, \t, \n, \r, \x0b, \x0c
    for _ in range(20):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 80)))
        assert tok.decode(tok.encode(text)) == text
    text = "  two  spaces\nand\ttabs \n\n end "
    ids = tok.encode(text)
    assert len(ids) == len(text)  # one id per ASCII character
    assert tok.decode(ids) == text
    assert tok.decode(tok.encode("naïve — 日本")) == "naïve — 日本"  # byte fallback


def test_char_tokenizer_special_tokens(tok):
    assert tok.vocab_size < 512
    ids = {
        t: tok.token_to_id(t)
        for t in (
            "<|endoftext|>",
            "<|im_start|>",
            "<|im_end|>",
            "<tool_call>",
            "</tool_call>",
            "<think>",
            "</think>",
        )
    }
    assert all(i is not None for i in ids.values()) and len(set(ids.values())) == 7
    assert tok.eos_token_ids == [ids["<|im_end|>"], ids["<|endoftext|>"]]
    assert tok.pad_token_id == ids["<|endoftext|>"]
    enc = tok.encode("<|im_start|>a<think>b</think><|im_end|>")
    assert enc == [
        ids["<|im_start|>"],
        tok.token_to_id("a"),
        ids["<think>"],
        tok.token_to_id("b"),
        ids["</think>"],
        ids["<|im_end|>"],
    ]
    assert tok.decode(enc, skip_special_tokens=True) == "a<think>b</think>"
    assert tok.decode(enc) == "<|im_start|>a<think>b</think><|im_end|>"


def test_extra_chars_get_single_ids(tmp_path):
    tok = build_char_tokenizer(tmp_path, extra_chars="é€")
    assert len(tok.encode("é€")) == 2 and tok.decode(tok.encode("aé€b")) == "aé€b"


def test_encoding_matches_transformers(char_dir, tok):
    hf = _hf_fast(char_dir, QWEN_CHAT_TEMPLATE)
    for text in [
        "hello world",
        "<|im_start|>user\nhi <|im_end|>\n",
        " <tool_call>\n{}</tool_call> ",
        "ünï",
    ]:
        assert hf.encode(text, add_special_tokens=False) == tok.encode(text)
        ids = tok.encode(text)
        assert hf.decode(ids, skip_special_tokens=True) == tok.decode(ids, skip_special_tokens=True)


@pytest.mark.parametrize("name", sorted(CONVERSATIONS))
@pytest.mark.parametrize("with_tools", [False, True])
@pytest.mark.parametrize("add_generation_prompt", [False, True])
@pytest.mark.parametrize(
    "template", [QWEN_CHAT_TEMPLATE, LLAMA3_STYLE_TEMPLATE], ids=["qwen", "llama3ish"]
)
def test_chat_template_matches_transformers(
    char_dir, tok, template, name, with_tools, add_generation_prompt
):
    hf = _hf_fast(char_dir, template)
    ours = Tokenizer(
        tok.raw, {**tok.config, "bos_token": "<|endoftext|>"}, template, tok.eos_token_ids
    )
    messages = CONVERSATIONS[name]
    tools = TOOLS if with_tools else None
    expected = hf.apply_chat_template(
        messages, tools=tools, add_generation_prompt=add_generation_prompt, tokenize=False
    )
    got = ours.apply_chat_template(
        messages, tools=tools, add_generation_prompt=add_generation_prompt
    )
    assert got == expected
    assert got.endswith("<|im_start|>assistant\n") == add_generation_prompt
    assert got.startswith("<|endoftext|>") == (template is LLAMA3_STYLE_TEMPLATE)


def test_qwen_template_renders_chatml_with_tools(tok):
    text = tok.apply_chat_template(
        CONVERSATIONS["tool_calls"], tools=TOOLS, add_generation_prompt=True
    )
    assert text.startswith("<|im_start|>system\nYou are a helpful assistant.\n\n# Tools\n")
    assert json.dumps(TOOLS[0], ensure_ascii=False) in text  # non-ASCII kept, no HTML escaping
    assert (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in text
    )
    assert '{"name": "get_weather", "arguments": {"city": "Rome"}}' in text
    assert (
        '<|im_start|>user\n<tool_response>\n{"temp": 21}\n</tool_response>\n<tool_response>' in text
    )
    assert text.endswith("Paris 21, Rome 25.<|im_end|>\n<|im_start|>assistant\n")


def test_raise_exception_and_extra_variables(tok):
    bad = Tokenizer(tok.raw, tok.config, LLAMA3_STYLE_TEMPLATE)
    with pytest.raises(jinja2.exceptions.TemplateError, match="unknown role robot"):
        bad.apply_chat_template([{"role": "robot", "content": "x"}])
    flag = Tokenizer(tok.raw, tok.config, "{{ 'T' if enable_thinking else 'F' }}{{ eos_token }}")
    assert flag.apply_chat_template([], enable_thinking=True) == "T<|im_end|>"
    assert flag.apply_chat_template([]) == "F<|im_end|>"


def test_named_templates_select_tool_use(char_dir, tok, tmp_path):
    config = dict(tok.config)
    config["chat_template"] = [
        {"name": "default", "template": "D{{ messages | length }}"},
        {"name": "tool_use", "template": "T{{ tools | length }}"},
    ]
    tok.raw.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    named = Tokenizer.from_dir(tmp_path)
    msgs = [{"role": "user", "content": "x"}]
    assert named.apply_chat_template(msgs) == "D1"
    assert named.apply_chat_template(msgs, tools=TOOLS) == "T2"
    assert named.apply_chat_template(msgs, tools=TOOLS, chat_template="default") == "D1"
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(tmp_path)
    assert hf.apply_chat_template(msgs, tools=TOOLS, tokenize=False) == "T2"
    resaved = Tokenizer.from_dir(named.save(tmp_path / "resaved"))
    assert resaved.chat_template == named.chat_template


def test_save_and_reload(tok, tmp_path):
    again = Tokenizer.from_dir(tok.save(tmp_path / "copy"))
    text = "<|im_start|>x y\n<|im_end|>"
    assert again.encode(text) == tok.encode(text)
    assert again.chat_template == tok.chat_template
    assert again.pad_token_id == tok.pad_token_id
    # generation_config.json is not part of a tokenizer save: only the eos token remains.
    assert again.eos_token_ids == [tok.token_to_id("<|im_end|>")]
    msgs = CONVERSATIONS["system_multi_turn"]
    assert again.apply_chat_template(msgs) == tok.apply_chat_template(msgs)
