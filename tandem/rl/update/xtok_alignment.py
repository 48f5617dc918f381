"""Cross-tokenizer views: a teacher's own tokens for the student's completion, and how they align.

The student samples ids in its vocabulary; a teacher with another tokenizer
scores the same text as it would have seen it: the conversation rendered with
the teacher's own chat template (`CrossTokenizer.view`), the completion text
re-encoded with the teacher's tokenizer and closed with the teacher's own
end-of-turn token where the student ended its turn.

`align` maps both token sequences onto byte spans of the completion text
(tandem/models/token_bytes.py) and cuts it where *both* have a token boundary: the
finest segmentation that is coarser than each tokenization. A chunk's
log-prob under either model is the sum of its tokens' log-probs. The
end-of-turn is one symbol on both sides (the student's EOS id against the
teacher's end-of-turn token, whatever their strings), so stopping is
distilled too.

Where the two texts differ (a template that trims or adds text, a completion
cut inside a UTF-8 character that the teacher sees as U+FFFD), the differing
bytes belong to no chunk: their student tokens get no signal and are counted
as unaligned, never matched to other text. Texts are compared as a common
prefix, a common suffix and, between them, `difflib`'s equal runs; a run
next to a replaced region counts only from ``MIN_RUN`` bytes on (a lone byte
shared by chance, e.g. the 0xBD of a cut "你" and of U+FFFD, is no
alignment), one between insertions or deletions (text a template trimmed or
added) at any length; a common suffix shorter than that counts only when it
ends with the end-of-turn. This follows the text-span idea of TRL's GOLD
trainer and NeMo-RL's cross-tokenizer aligner, with byte rather than
decoded-string spans and masking instead of a forced final group.
"""

from __future__ import annotations

import difflib
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from tandem.models.token_bytes import TokenBytes
from tandem.models.tokenizer import Tokenizer

END = None  # the end-of-turn symbol in a piece list (a token's bytes otherwise)
_END_CHAR = "\u0100"  # END in the latin-1 string form of a byte stream (bytes are U+0000..U+00FF)
MIN_RUN = 4  # shortest equal run accepted next to a replaced region
# |a| * |b| above which a differing middle is masked whole (difflib is quadratic)
MAX_DIFF_CELLS = 1 << 22


@dataclass
class Alignment:
    student_chunk: list[int]  # per student token: its chunk, -1 = unaligned (no signal)
    teacher_chunk: list[int]  # per teacher completion token: its chunk, -1 = in none (context only)
    num_chunks: int


def _stream(pieces: Sequence[bytes | None]) -> tuple[str, list[int]]:
    """The pieces as one latin-1 string (END as U+0100) and each piece's end offset."""
    parts = [_END_CHAR if p is END else p.decode("latin-1") for p in pieces]
    ends, at = [], 0
    for p in parts:
        at += len(p)
        ends.append(at)
    return "".join(parts), ends


def _equal_runs(a: str, b: str) -> list[tuple[int, int, int]]:
    """(i, j, n) with a[i:i+n] == b[j:j+n]: the common prefix, runs in the middle, the
    common suffix."""
    p = len(os.path.commonprefix([a, b]))
    q = len(os.path.commonprefix([a[p:][::-1], b[p:][::-1]]))
    if q and not a.endswith(_END_CHAR) and q < MIN_RUN:
        q = 0
    runs = [(0, 0, p)] if p else []
    mid_a, mid_b = a[p : len(a) - q], b[p : len(b) - q]
    if mid_a and mid_b and len(mid_a) * len(mid_b) <= MAX_DIFF_CELLS:
        ops = difflib.SequenceMatcher(None, mid_a, mid_b, autojunk=False).get_opcodes()
        for k, (tag, i1, i2, j1, _) in enumerate(ops):
            beside_replace = any(
                0 <= m < len(ops) and ops[m][0] == "replace" for m in (k - 1, k + 1)
            )
            if tag == "equal" and (i2 - i1 >= MIN_RUN or not beside_replace):
                runs.append((p + i1, p + j1, i2 - i1))
    if q:
        runs.append((len(a) - q, len(b) - q, q))
    return runs


def align(student: Sequence[bytes | None], teacher: Sequence[bytes | None]) -> Alignment:
    """Chunks of two tokenizations of (nearly) one text; ``END`` marks the end-of-turn token.

    A chunk is a span inside one equal run whose two ends are token boundaries on both
    sides; a token of zero bytes belongs to no chunk."""
    a, a_ends = _stream(student)
    b, b_ends = _stream(teacher)
    a_cut, b_cut = {0, *a_ends}, {0, *b_ends}
    a_first = _first_token_at(a_ends)
    b_first = _first_token_at(b_ends)
    s_chunk, t_chunk = [-1] * len(student), [-1] * len(teacher)
    c = 0
    for i, j, n in _equal_runs(a, b):
        cuts = [x for x in range(i, i + n + 1) if x in a_cut and x - i + j in b_cut]
        for x, y in zip(cuts, cuts[1:]):
            _label(s_chunk, a_first[x], a_ends, y, c)
            _label(t_chunk, b_first[x - i + j], b_ends, y - i + j, c)
            c += 1
    return Alignment(s_chunk, t_chunk, c)


def _first_token_at(ends: list[int]) -> dict[int, int]:
    """Start offset -> index of the first token of non-zero width starting there."""
    out: dict[int, int] = {}
    start = 0
    for k, end in enumerate(ends):
        if end > start:
            out.setdefault(start, k)
        start = end
    return out


def _label(chunk: list[int], k: int, ends: list[int], stop: int, c: int) -> None:
    """Tokens from index k up to the one ending at ``stop`` join chunk c (zero-width ones
    stay out)."""
    start = ends[k - 1] if k else 0
    while k < len(ends) and ends[k] <= stop:
        if ends[k] > start:
            chunk[k] = c
        start = ends[k]
        k += 1


@dataclass
class TeacherView:
    """One completion as a teacher sees it."""

    prompt_ids: list[int]
    completion_ids: list[int]
    alignment: Alignment


class CrossTokenizer:
    """The student's and one teacher's tokenizers: renders, re-encodes and aligns completions."""

    def __init__(self, student: Tokenizer, teacher: Tokenizer) -> None:
        self.teacher = TokenBytes(teacher)
        self.teacher.check()
        try:
            self.student = TokenBytes(student)
            self.student.check()
        except ValueError as e:
            raise ValueError(f"the student's tokenizer: {e}") from None
        self.s_eos, self.t_eos = set(student.eos_token_ids), set(teacher.eos_token_ids)
        self.t_tok = teacher
        self.t_eos_text = sorted({teacher.id_to_token(i) for i in self.t_eos} - {None})

    def student_pieces(self, ids: Sequence[int]) -> list[bytes | None]:
        return [END if i in self.s_eos else b for i, b in zip(ids, self.student.of(list(ids)))]

    def _render(self, messages: list[dict[str, Any]], reply: str) -> tuple[str, str]:
        """The teacher's generation prompt, and the text its template puts after it for ``reply``
        (cut after the first end-of-turn token)."""
        gen = self.t_tok.apply_chat_template(messages, add_generation_prompt=True)
        full = self.t_tok.apply_chat_template([*messages, {"role": "assistant", "content": reply}])
        tail = full[len(os.path.commonprefix([gen, full])) :]
        cut = [tail.find(e) + len(e) for e in self.t_eos_text if e in tail]
        return gen, tail[: min(cut)] if cut else tail

    def check(self, messages: list[dict[str, Any]]) -> None:
        """ValueError (one line) when the template cannot render this conversation and a reply."""
        if self.t_tok.chat_template is None:
            raise ValueError(
                "it has no chat template, so it cannot render the student's conversations"
            )
        probe = "Tandem probe 12345"
        roles = [m.get("role") for m in messages]
        try:
            _, tail = self._render(messages, probe)
        except Exception as e:  # jinja's raise_exception, a missing key, a role it refuses
            raise ValueError(
                f"its chat template cannot render roles {roles} + assistant: "
                f"{str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__}"
            ) from None
        if probe not in tail:
            raise ValueError(f"its chat template drops the assistant reply after roles {roles}")
        if not any(e in tail[tail.index(probe) :] for e in self.t_eos_text):
            raise ValueError(
                "its chat template ends an assistant turn with none of its EOS "
                f"tokens {self.t_eos_text}"
            )

    def view(self, messages: list[dict[str, Any]], completion_ids: Sequence[int]) -> TeacherView:
        s_pieces = self.student_pieces(completion_ids)
        body = b"".join(p for p in s_pieces if p is not END).decode("utf-8", errors="replace")
        gen, tail = self._render(messages, body)
        ids, pieces = self.teacher.encode(tail)
        t_pieces = [END if i in self.t_eos else p for i, p in zip(ids, pieces)]
        return TeacherView(self.t_tok.encode(gen), ids, align(s_pieces, t_pieces))
