"""Cross-tokenizer alignment (tandem/rl/update/xtok_alignment.py, tandem/models/token_bytes.py) on
hand-written cases.

Tokenizers are built here: the student's built-in character tokenizer (byte
fallback for characters outside it), a byte-level BPE trained on a few lines
(GPT-2 / Llama-3 / Qwen style), and a SentencePiece-style BPE with "▁",
``<0xHH>`` byte-fallback pieces and a dummy prefix (Llama-2 style). Each case
asserts the chunks (which student and teacher tokens form each one), that a
chunk's bytes are the same on both sides, and the chunk sums of log-probs.
"""

import json

import pytest
import torch
from tokenizers import AddedToken, decoders, models, normalizers, pre_tokenizers, trainers
from tokenizers import Tokenizer as Raw

from tandem.models.token_bytes import TokenBytes, byte_level_alphabet
from tandem.models.tokenizer import QWEN_CHAT_TEMPLATE, Tokenizer, build_char_tokenizer
from tandem.rl.algorithms import chunk_opd_advantages, chunk_reverse_kl, chunk_sums, opd_advantages
from tandem.rl.update.xtok_alignment import END, CrossTokenizer, align

LLAMA_TEMPLATE = (
    "{{- '<|begin_of_text|>' }}{%- for m in messages %}{%- if m['role'] == 'tool' %}"
    "{{- raise_exception('no tool role') }}{%- endif %}"
    "{{- '<|start_header_id|>' + m['role'] + '<|end_header_id|>\\n\\n' + m['content'] | trim + "
    "'<|eot_id|>' }}{%- endfor %}{%- if add_generation_prompt %}{{- "
    "'<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
)
# Qwen3-style: the last assistant turn opens with an empty think block the student never writes.
THINK_TEMPLATE = QWEN_CHAT_TEMPLATE.replace(
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}",
    "{{- '<|im_start|>' + message.role + '\\n' + ('<think>\\n\\n</think>\\n\\n' if message.role == "
    "'assistant' else '') + message.content + '<|im_end|>' + '\\n' }}",
)


@pytest.fixture(scope="module")
def student(tmp_path_factory):
    return build_char_tokenizer(tmp_path_factory.mktemp("char"))


def _byte_bpe(
    template=LLAMA_TEMPLATE,
    specials=("<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"),
):
    raw = Raw(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    raw.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[AddedToken(t, special=True, normalized=False) for t in specials],
        show_progress=False,
    )
    raw.train_from_iterator(
        ["hello world", "12+7=19", "你好 世界", "🙂 ok", "the answer is 19"] * 20, trainer
    )
    eos = [raw.token_to_id(specials[-1])]
    return Tokenizer(raw, {"eos_token": specials[-1]}, template, eos)


@pytest.fixture(scope="module")
def teacher():
    return _byte_bpe()


def _sentencepiece():
    """Llama-2 style: "▁" for spaces, a dummy prefix, <0xHH> byte fallback, merges for a
    few words."""
    vocab = {"<unk>": 0, "</s>": 1}
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = len(vocab)
    for piece in [
        "▁",
        "h",
        "e",
        "l",
        "o",
        "w",
        "r",
        "d",
        "▁h",
        "▁he",
        "▁hel",
        "▁hell",
        "▁hello",
        "▁w",
        "▁wo",
        "▁wor",
        "▁worl",
        "▁world",
        "1",
        "9",
        "▁1",
        "▁19",
        "a",
        "▁a",
    ]:
        vocab[piece] = len(vocab)
    merges = [
        ("▁", "h"),
        ("▁h", "e"),
        ("▁he", "l"),
        ("▁hel", "l"),
        ("▁hell", "o"),
        ("▁", "w"),
        ("▁w", "o"),
        ("▁wo", "r"),
        ("▁wor", "l"),
        ("▁worl", "d"),
        ("▁", "1"),
        ("▁1", "9"),
        ("▁", "a"),
    ]
    raw = Raw(models.BPE(vocab=vocab, merges=merges, byte_fallback=True, unk_token="<unk>"))
    raw.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    raw.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    raw.add_special_tokens([AddedToken("</s>", special=True)])
    return Tokenizer(
        raw, {"eos_token": "</s>"}, "{% for m in messages %}{{ m['content'] }}{% endfor %}", [1]
    )


def _pieces(tok, ids, eos=()):
    return [END if i in eos else b for i, b in zip(ids, TokenBytes(tok).of(ids))]


def _chunks(chunk_of, pieces):
    """Chunk -> the bytes of its tokens, joined (END as b"<END>")."""
    out = {}
    for c, p in zip(chunk_of, pieces):
        if c >= 0:
            out[c] = out.get(c, b"") + (b"<END>" if p is END else p)
    return out


def _check_same_text(a, s_pieces, t_pieces):
    assert _chunks(a.student_chunk, s_pieces) == _chunks(a.teacher_chunk, t_pieces)
    assert sorted(set(a.student_chunk) - {-1}) == list(range(a.num_chunks))


def test_byte_level_alphabet_is_gpt2s_bijection():
    m = byte_level_alphabet()
    assert sorted(m.values()) == list(range(256)) and len(m) == 256
    assert m["A"] == 65 and m["Ġ"] == 32 and m["Ċ"] == 10 and m["Ā"] == 0  # space, newline, NUL


def test_ascii_chunks_and_sums(student, teacher):
    text = "hello world"
    s_ids = student.encode(text)
    t_ids, t_bytes = TokenBytes(teacher).encode(text)
    assert t_bytes == [b"hello", b" world"]
    a = align(_pieces(student, s_ids), t_bytes)
    assert a.student_chunk == [0] * 5 + [1] * 6 and a.teacher_chunk == [0, 1] and a.num_chunks == 2
    # log p(chunk) = the sum of its tokens' log-probs, on each side
    s_logp = -torch.arange(1.0, 12.0)[None]  # [1, 11]
    t_logp = torch.tensor([[-2.5, -40.0]])
    s_ids_t, t_ids_t = torch.tensor([a.student_chunk]), torch.tensor([a.teacher_chunk])
    t_chunk = chunk_sums(t_logp, t_ids_t, 11)
    assert t_chunk[0, :2].tolist() == [-2.5, -40.0] and t_chunk[0, 2:].abs().sum() == 0
    d = chunk_reverse_kl(s_logp, t_chunk, s_ids_t)
    assert d[0, :2].tolist() == [-15.0 + 2.5, -51.0 + 40.0]
    adv = chunk_opd_advantages(s_logp, t_chunk, s_ids_t, torch.ones(1, 11))
    # every token of a chunk carries the chunk's estimate
    assert adv[0].tolist() == [12.5] * 5 + [11.0] * 6


def test_multibyte_cjk_and_emoji(student, teacher, tmp_path):
    text = "你好🙂"
    # the character student has neither: byte-fallback pieces, one byte each (3 + 3 + 4)
    s_ids = student.encode(text)
    assert len(s_ids) == 10 and TokenBytes(student).of(s_ids)[0] == b"\xe4"
    t_ids, t_bytes = TokenBytes(teacher).encode(text)
    assert b"".join(t_bytes) == text.encode()
    s_pieces = _pieces(student, s_ids)
    a = align(s_pieces, t_bytes)
    _check_same_text(a, s_pieces, t_bytes)
    assert all(c >= 0 for c in a.student_chunk + a.teacher_chunk)
    # chunk edges are where the teacher cuts (byte-level pieces may split the emoji in two)
    assert a.num_chunks == len(t_ids) and a.teacher_chunk == list(range(len(t_ids)))
    # a student that knows the characters: one token per character, the emoji's pieces merge into
    # one chunk
    wide = build_char_tokenizer(tmp_path / "wide", extra_chars="你好🙂")
    w_ids = wide.encode(text)
    assert len(w_ids) == 3
    a = align(_pieces(wide, w_ids), t_bytes)
    _check_same_text(a, _pieces(wide, w_ids), t_bytes)
    emoji_pieces = [
        k for k, b in enumerate(t_bytes) if b and b[0] >= 0xF0 or (b and 0x80 <= b[0] < 0xC0)
    ]
    assert a.student_chunk[2] == a.teacher_chunk[emoji_pieces[-1]]


def test_byte_fallback_pieces_and_dummy_prefix(student):
    sp = _sentencepiece()
    tb = TokenBytes(sp)
    assert tb.prefix == b" "  # encode("x") gives "▁x": a space the text does not have
    ids, pieces = tb.encode("hello 你 19")
    toks = [sp.id_to_token(i) for i in ids]
    assert toks == ["▁hello", "▁", "<0xE4>", "<0xBD>", "<0xA0>", "▁19"]
    # the dummy prefix left out
    assert pieces == [b"hello", b" ", b"\xe4", b"\xbd", b"\xa0", b" 19"]
    s_ids = student.encode("hello 你 19")
    s_pieces = _pieces(student, s_ids)
    a = align(s_pieces, pieces)
    _check_same_text(a, s_pieces, pieces)
    # hello | " " | 3 bytes one by one on both sides | " 19"
    assert a.teacher_chunk == [0, 1, 2, 3, 4, 5] and a.student_chunk == [0] * 5 + [
        1,
        2,
        3,
        4,
        5,
        5,
        5,
    ]


def test_special_tokens_and_end_of_turn(student, teacher):
    s_ids = student.encode("<think>19") + [student.token_to_id("<|im_end|>")]
    s_pieces = _pieces(student, s_ids, eos=student.eos_token_ids)
    assert s_pieces[0] == b"<think>" and s_pieces[-1] is END
    t_ids, t_bytes = TokenBytes(teacher).encode("<think>19<|eot_id|>")
    t_pieces = [END if i in teacher.eos_token_ids else b for i, b in zip(t_ids, t_bytes)]
    a = align(s_pieces, t_pieces)
    _check_same_text(a, s_pieces, t_pieces)
    # the teacher has no <think> token: the student's one token is one chunk with the teacher's
    # pieces of it
    n_think = sum(1 for c in a.teacher_chunk if c == a.student_chunk[0])
    # END <-> <|eot_id|>
    assert n_think >= 2 and a.student_chunk[-1] == a.teacher_chunk[-1] == a.num_chunks - 1


def test_end_of_turn_strings_differ_but_align(student, teacher):
    x = CrossTokenizer(student, teacher)
    msgs = [{"role": "user", "content": "12+7="}]
    v = x.view(msgs, student.encode("19") + [student.token_to_id("<|im_end|>")])
    assert [teacher.id_to_token(i) for i in v.completion_ids][-1] == "<|eot_id|>"
    assert v.alignment.student_chunk[-1] == v.alignment.teacher_chunk[-1] >= 0
    assert teacher.decode(v.prompt_ids).endswith(
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )
    assert "12+7=" in teacher.decode(v.prompt_ids) and "<|im_start|>" not in teacher.decode(
        v.prompt_ids
    )


def test_completion_cut_mid_character(student, teacher):
    """Truncated after two of the three bytes of 你: the student's text ends in half a character;
    the teacher can only be given U+FFFD there. Those bytes are masked, the rest still aligns."""
    x = CrossTokenizer(student, teacher)
    ids = student.encode("hello 你")[:-1]  # ... <0xE4> <0xBD>, no EOS (finish_reason "length")
    v = x.view([{"role": "user", "content": "hi"}], ids)
    a = v.alignment
    assert a.student_chunk[-2:] == [-1, -1]  # the half character: no signal
    assert all(c >= 0 for c in a.student_chunk[:-2])
    assert "\ufffd" in teacher.decode(v.completion_ids)
    # the other way round: the teacher's pieces cut the emoji mid-character, the student's bytes do
    # not
    t_ids, t_bytes = TokenBytes(teacher).encode("👍")  # not in the BPE's corpus: byte pieces
    # the first piece is half an emoji
    assert t_bytes[0] == b"\xf0\x9f" and b"".join(t_bytes) == "👍".encode()
    s_pieces = _pieces(student, student.encode("👍"))  # four byte-fallback tokens
    a = align(s_pieces, t_bytes)
    _check_same_text(a, s_pieces, t_bytes)
    assert a.student_chunk[:2] == [0, 0] and a.teacher_chunk[0] == 0 and min(a.student_chunk) == 0


def test_templates_that_trim_and_add_text(student, teacher):
    msgs = [{"role": "user", "content": "12+7="}]
    eos = [student.token_to_id("<|im_end|>")]
    # the Llama-style template trims the reply: the spaces the student wrote are masked, "19" and
    # the end align
    a = CrossTokenizer(student, teacher).view(msgs, student.encode(" 19 ") + eos).alignment
    assert (
        a.student_chunk[0] == a.student_chunk[3] == -1
        and min(a.student_chunk[1:3] + a.student_chunk[4:]) >= 0
    )
    # a Qwen3-style template puts an empty think block before the reply: teacher-only text is
    # context
    think = _byte_bpe(THINK_TEMPLATE, specials=("<|im_start|>", "<|im_end|>"))
    v = CrossTokenizer(student, think).view(msgs, student.encode("19") + eos)
    text = think.decode(v.completion_ids)
    assert text.startswith("<think>\n\n</think>\n\n19") and text.endswith("<|im_end|>")
    assert min(v.alignment.student_chunk) >= 0  # every student token aligned
    pieces = TokenBytes(think).of(v.completion_ids)
    n_lead = next(
        k for k in range(len(pieces)) if b"".join(pieces[:k]) == b"<think>\n\n</think>\n\n"
    )
    # scored, never compared
    assert n_lead > 0 and v.alignment.teacher_chunk[:n_lead] == [-1] * n_lead
    assert min(v.alignment.teacher_chunk[n_lead:]) >= 0


def test_template_that_cannot_render_the_roles(student, teacher):
    x = CrossTokenizer(student, teacher)
    with pytest.raises(ValueError, match=r"cannot render roles \['user', 'tool'\]"):
        x.check([{"role": "user", "content": "a"}, {"role": "tool", "content": "b"}])
    x.check([{"role": "system", "content": "s"}, {"role": "user", "content": "a"}])
    plain = Tokenizer(teacher.raw, {"eos_token": "<|eot_id|>"}, None, teacher.eos_token_ids)
    with pytest.raises(ValueError, match="no chat template"):
        CrossTokenizer(student, plain).check([{"role": "user", "content": "a"}])


def test_same_tokenizer_is_token_by_token_and_bitwise_today(student, tmp_path):
    x = CrossTokenizer(student, build_char_tokenizer(tmp_path / "same"))
    msgs = [{"role": "user", "content": "3+5="}]
    ids = student.encode("8 apples") + [student.token_to_id("<|im_end|>")]
    v = x.view(msgs, ids)
    assert v.completion_ids == ids  # re-encoding a canonical completion gives the sampled ids
    assert v.prompt_ids == student.encode(
        student.apply_chat_template(msgs, add_generation_prompt=True)
    )
    assert v.alignment.student_chunk == v.alignment.teacher_chunk == list(range(len(ids)))
    # chunks of one token: the chunk advantages are today's per-token OPD advantages, bit for bit
    g = torch.Generator().manual_seed(0)
    s, t = -torch.rand(6, 9, generator=g) * 5, -torch.rand(6, 9, generator=g) * 5
    t[0, 0] = s[0, 0] = -0.0
    mask = (torch.rand(6, 9, generator=g) > 0.2).float()
    ids_t = torch.where(
        torch.arange(9) < torch.tensor([9, 9, 5, 7, 1, 9])[:, None], torch.arange(9), -1
    )
    mask = mask * (ids_t >= 0)
    want = opd_advantages(s, t, mask)
    got = chunk_opd_advantages(s, chunk_sums(t, ids_t, 9), ids_t, mask)
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))


def test_tokenizers_that_rewrite_text_are_refused(teacher):
    raw = Raw.from_str(teacher.raw.to_str())
    raw.normalizer = normalizers.NFKC()
    with pytest.raises(ValueError, match="rewrites text"):
        TokenBytes(Tokenizer(raw, {}, None, [])).check()
    spec = json.loads(teacher.raw.to_str())
    spec["decoder"] = {"type": "WordPiece", "prefix": "##", "cleanup": True}
    with pytest.raises(ValueError, match="WordPiece"):
        TokenBytes(Tokenizer(Raw.from_str(json.dumps(spec)), {}, None, []))
