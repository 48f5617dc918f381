"""Tokenizer and chat template without transformers.

`Tokenizer` wraps a ``tokenizers.Tokenizer`` (tokenizer.json) plus what
``tokenizer_config.json`` / ``generation_config.json`` say about special tokens
and the chat template. Templates are rendered with jinja2 configured as
transformers configures it (sandboxed, trim/lstrip blocks, loop controls, its
``tojson`` and ``raise_exception``), so prompts match ``apply_chat_template``
character for character. `build_char_tokenizer` writes a self-contained
character-level tokenizer folder for runs with no download.
"""

from __future__ import annotations

import functools
import json
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as _RawTokenizer

SPECIAL_TOKEN_KEYS = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")

# Qwen2.5-style ChatML with function calling (tools listed in the system turn,
# calls in <tool_call> blocks, results folded into user turns as <tool_response>).
QWEN_CHAT_TEMPLATE = (
    "{%- if tools %}\n"
    "    {{- '<|im_start|>system\\n' }}\n"
    "    {%- if messages[0]['role'] == 'system' %}\n"
    "        {{- messages[0]['content'] }}\n"
    "    {%- else %}\n"
    "        {{- 'You are a helpful assistant.' }}\n"
    "    {%- endif %}\n"
    '    {{- "\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.'
    "\\n\\nYou are provided with function signatures within <tools></tools> XML "
    'tags:\\n<tools>" }}\n'
    "    {%- for tool in tools %}\n"
    '        {{- "\\n" }}\n'
    "        {{- tool | tojson }}\n"
    "    {%- endfor %}\n"
    '    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and '
    'arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": '
    '<function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}\n'
    "{%- else %}\n"
    "    {%- if messages[0]['role'] == 'system' %}\n"
    "        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}\n"
    "    {%- else %}\n"
    "        {{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}\n"
    "    {%- endif %}\n"
    "{%- endif %}\n"
    "{%- for message in messages %}\n"
    "    {%- if (message.role == 'user') or (message.role == 'system' and not loop.first)"
    " or (message.role == 'assistant' and not message.tool_calls) %}\n"
    "        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' "
    "+ '\\n' }}\n    {%- elif message.role == 'assistant' %}\n"
    "        {{- '<|im_start|>' + message.role }}\n"
    "        {%- if message.content %}\n"
    "            {{- '\\n' + message.content }}\n"
    "        {%- endif %}\n"
    "        {%- for tool_call in message.tool_calls %}\n"
    "            {%- if tool_call.function is defined %}\n"
    "                {%- set tool_call = tool_call.function %}\n"
    "            {%- endif %}\n"
    '            {{- \'\\n<tool_call>\\n{"name": "\' }}\n'
    "            {{- tool_call.name }}\n"
    '            {{- \'", "arguments": \' }}\n'
    "            {%- if tool_call.arguments is string %}\n"
    "                {{- tool_call.arguments }}\n"
    "            {%- else %}\n"
    "                {{- tool_call.arguments | tojson }}\n"
    "            {%- endif %}\n"
    "            {{- '}\\n</tool_call>' }}\n"
    "        {%- endfor %}\n"
    "        {{- '<|im_end|>\\n' }}\n"
    "    {%- elif message.role == 'tool' %}\n"
    "        {%- if loop.first or (messages[loop.index0 - 1].role != 'tool') %}\n"
    "            {{- '<|im_start|>user' }}\n"
    "        {%- endif %}\n"
    "        {{- '\\n<tool_response>\\n' }}\n"
    "        {{- message.content }}\n"
    "        {{- '\\n</tool_response>' }}\n"
    "        {%- if loop.last or (messages[loop.index0 + 1].role != 'tool') %}\n"
    "            {{- '<|im_end|>\\n' }}\n"
    "        {%- endif %}\n"
    "    {%- endif %}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n"
    "    {{- '<|im_start|>assistant\\n' }}\n"
    "{%- endif %}\n"
)

CHAR_SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
CHAR_ADDED_TOKENS = ("<tool_call>", "</tool_call>", "<think>", "</think>")


# ---------------------------------------------------------------------- jinja
class _GenerationTag(jinja2.ext.Extension):
    """Accepts ``{% generation %}...{% endgeneration %}`` (assistant-mask markers) and
    renders the body unchanged, so templates using it still compile."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller: Any) -> str:
        return caller()


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    x: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: Any = None,
    sort_keys: bool = False,
) -> str:
    # Unlike jinja's own filter: no HTML escaping, and indent/separators are exposed.
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@functools.lru_cache(maxsize=32)
def compile_chat_template(source: str) -> jinja2.Template:
    """Compile a chat template in a transformers-compatible jinja environment (cached)."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(source)


def _normalize_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Drop None-valued keys and alias reasoning fields, as transformers does."""
    out = []
    for message in messages:
        m = {k: v for k, v in message.items() if v is not None}
        reasoning = next((m[k] for k in _REASONING_FIELDS if k in m), None)
        if reasoning is not None:
            m = {"thinking": reasoning, **m, "reasoning_content": reasoning}
        out.append(m)
    return out


def _token_content(value: Any) -> str | None:
    """Special tokens in tokenizer_config.json are a string or a serialized AddedToken dict."""
    if isinstance(value, dict):
        return value.get("content")
    return value


# ---------------------------------------------------------------------- tokenizer
class Tokenizer:
    """A loaded tokenizer folder: encoding, decoding, special ids and chat template."""

    def __init__(
        self,
        raw: _RawTokenizer,
        config: dict[str, Any] | None = None,
        chat_template: str | dict[str, str] | None = None,
        eos_token_ids: list[int] | None = None,
    ) -> None:
        self.raw = raw
        self.config = dict(config or {})
        self.chat_template = chat_template
        self.special_tokens = {
            k: _token_content(self.config[k]) for k in SPECIAL_TOKEN_KEYS if self.config.get(k)
        }
        ids = list(eos_token_ids or [])
        eos = self.special_tokens.get("eos_token")
        if (
            eos is not None
            and self.token_to_id(eos) is not None
            and self.token_to_id(eos) not in ids
        ):
            ids.append(self.token_to_id(eos))
        self.eos_token_ids: list[int] = ids

    @classmethod
    def from_dir(cls, path: str | Path) -> Tokenizer:
        """Load tokenizer.json (+ tokenizer_config.json, chat_template.jinja,
        generation_config.json when present)."""
        path = Path(path)
        if not (path / "tokenizer.json").is_file():
            raise FileNotFoundError(f"no tokenizer.json in {path}")
        try:
            raw = _RawTokenizer.from_file(str(path / "tokenizer.json"))
        except Exception as e:  # noqa: BLE001
            # tokenizers raises a bare Exception for a file it cannot parse
            raise ValueError(
                f"{path / 'tokenizer.json'}: not a readable tokenizer.json ("
                f"{str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__}"
                ")"
            ) from None
        config = _read_json(path / "tokenizer_config.json")
        eos: list[int] = []
        gen_eos = _read_json(path / "generation_config.json").get("eos_token_id")
        if gen_eos is not None:
            eos = [gen_eos] if isinstance(gen_eos, int) else list(gen_eos)
        return cls(raw, config, _read_chat_template(path, config), eos)

    # -------------------------------------------------------------- ids
    @property
    def vocab_size(self) -> int:
        """Number of ids including added tokens (the model's vocab may be padded larger)."""
        return self.raw.get_vocab_size(with_added_tokens=True)

    def token_to_id(self, token: str) -> int | None:
        return self.raw.token_to_id(token)

    def id_to_token(self, idx: int) -> str | None:
        return self.raw.id_to_token(idx)

    @property
    def pad_token_id(self) -> int | None:
        """The pad token's id; falls back to the first eos id when no pad token is set."""
        pad = self.special_tokens.get("pad_token")
        if pad is not None and self.token_to_id(pad) is not None:
            return self.token_to_id(pad)
        return self.eos_token_ids[0] if self.eos_token_ids else None

    @property
    def bos_token_id(self) -> int | None:
        bos = self.special_tokens.get("bos_token")
        return None if bos is None else self.token_to_id(bos)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return self.raw.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_batch(self, texts: list[str], add_special_tokens: bool = False) -> list[list[int]]:
        return [e.ids for e in self.raw.encode_batch(texts, add_special_tokens=add_special_tokens)]

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return self.raw.decode(list(ids), skip_special_tokens=skip_special_tokens)

    # -------------------------------------------------------------- chat
    def get_chat_template(self, name: str | None = None, tools: list | None = None) -> str:
        """Select the template: by name, else "tool_use" when tools are given, else "default"."""
        template = self.chat_template
        if template is None:
            raise ValueError("this tokenizer has no chat template")
        if isinstance(template, str):
            return template
        if name is not None:
            if name not in template:
                raise KeyError(f"no chat template named {name!r}; have {sorted(template)}")
            return template[name]
        if tools is not None and "tool_use" in template:
            return template["tool_use"]
        if "default" in template:
            return template["default"]
        raise ValueError(f"several chat templates and none is 'default': {sorted(template)}")

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = False,
        chat_template: str | None = None,
        **extra: Any,
    ) -> str:
        """Render messages to the prompt string (not tokenized), like transformers'
        ``apply_chat_template(..., tokenize=False)``; ``extra`` reaches the template
        (e.g. ``enable_thinking=False``)."""
        source = self.get_chat_template(chat_template, tools)
        variables = {**self.special_tokens, **extra}
        return compile_chat_template(source).render(
            messages=_normalize_messages(messages),
            tools=tools,
            documents=None,
            add_generation_prompt=add_generation_prompt,
            **variables,
        )

    # -------------------------------------------------------------- saving
    def save(self, path: str | Path) -> Path:
        """Write tokenizer.json and tokenizer_config.json (chat template included)."""
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        self.raw.save(str(path / "tokenizer.json"))
        config = dict(self.config)
        config.pop("chat_template", None)
        if isinstance(self.chat_template, str):
            config["chat_template"] = self.chat_template
        elif isinstance(self.chat_template, dict):
            config["chat_template"] = [
                {"name": k, "template": v} for k, v in self.chat_template.items()
            ]
        (path / "tokenizer_config.json").write_text(
            json.dumps(config, indent=2, ensure_ascii=False) + "\n"
        )
        stale = path / "chat_template.jinja"  # would take precedence in transformers 5.x
        if stale.is_file() and isinstance(self.chat_template, str):
            stale.write_text(self.chat_template)
        elif stale.is_file():
            stale.unlink()
        return path


def _read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.is_file() else {}


def _read_chat_template(path: Path, config: dict[str, Any]) -> str | dict[str, str] | None:
    """chat_template.jinja (transformers 5.x) wins over tokenizer_config.json's entry."""
    template: str | dict[str, str] | None = None
    raw = config.get("chat_template")
    if isinstance(raw, list):
        template = {t["name"]: t["template"] for t in raw}
    elif isinstance(raw, str):
        template = raw
    jinja_file = path / "chat_template.jinja"
    if jinja_file.is_file():
        template = jinja_file.read_text()
    extra_dir = path / "additional_chat_templates"
    if extra_dir.is_dir():
        named = {f.stem: f.read_text() for f in sorted(extra_dir.glob("*.jinja"))}
        if named:
            base = (
                template
                if isinstance(template, dict)
                else ({"default": template} if template else {})
            )
            template = {**base, **named}
    return template


# ---------------------------------------------------------------------- char tokenizer
def char_vocab(extra_chars: str = "") -> list[str]:
    """Printable ASCII, newline and tab, then ``extra_chars`` (deduplicated, in order)."""
    chars = [chr(c) for c in range(32, 127)] + ["\n", "\t"] + list(extra_chars)
    return list(dict.fromkeys(chars))


def build_char_tokenizer(
    path: str | Path,
    extra_chars: str = "",
    special_tokens: tuple[str, ...] = (),
    chat_template: str = QWEN_CHAT_TEMPLATE,
) -> Tokenizer:
    """Write a character-level tokenizer folder and load it.

    One id per character (printable ASCII + newline + tab + ``extra_chars``),
    byte-fallback ids ``<0x00>``..``<0xFF>`` so any other UTF-8 text still
    round-trips, then the ChatML/tool/think special tokens (and ``special_tokens``,
    after them); about 360 ids.
    """
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    vocab = {ch: i for i, ch in enumerate(char_vocab(extra_chars))}
    for b in range(256):
        vocab.setdefault(f"<0x{b:02X}>", len(vocab))
    raw = _RawTokenizer(models.BPE(vocab=vocab, merges=[], byte_fallback=True))
    raw.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    raw.decoder = decoders.Sequence([decoders.ByteFallback(), decoders.Fuse()])
    raw.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t in CHAR_SPECIAL_TOKENS]
    )
    raw.add_tokens([AddedToken(t, special=False, normalized=False) for t in CHAR_ADDED_TOKENS])
    raw.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special_tokens])
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "clean_up_tokenization_spaces": False,
        "model_max_length": 131072,
    }
    eos = [raw.token_to_id("<|im_end|>"), raw.token_to_id("<|endoftext|>")]
    tok = Tokenizer(raw, config, chat_template, eos)
    tok.save(path)
    gen = {"eos_token_id": eos, "pad_token_id": tok.pad_token_id}
    (path / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    return Tokenizer.from_dir(path)
