"""The bytes each token id stands for in decoded text.

Comparing two tokenizations of one text (cross-tokenizer distillation) needs
each token's span in bytes. ``decode`` cannot give it: it returns ``str``, so
a token holding part of a multi-byte character (a byte-level BPE piece of an
emoji, a SentencePiece ``<0xE4>`` byte-fallback piece) decodes to U+FFFD.
`TokenBytes` reads tokenizer.json's model and decoder instead and builds one
``bytes`` value per id:

- byte-level decoders (GPT-2 / Llama-3 / Qwen): each character of the token
  string stands for one byte (GPT-2's printable-character map);
- ``<0xHH>`` pieces of a byte-fallback model: the byte HH;
- otherwise the token string with the decoder's ``Replace`` / ``Metaspace``
  substitutions (SentencePiece's "▁" -> " "), as UTF-8;
- added and special tokens: their content, as UTF-8.

Decoders whose output depends on the neighbouring tokens beyond a leading
space (WordPiece's "##", CTC) are refused. A space that encoding puts in front
of every text (SentencePiece's dummy prefix) is measured once (`prefix`) and
left out of the first token of an encoded text (`encode`). `check` encodes
probe texts (ASCII, CJK, emoji, newlines) and fails when the bytes do not
come back, so a normaliser that rewrites text is caught at start.
"""

from __future__ import annotations

import json
import re
from functools import lru_cache
from typing import Any

from tandem.models.tokenizer import Tokenizer

PROBES = (
    "The answer is 42.\n\tx = y + 1;",
    "数学 答案：十二",
    "emoji 🙂👍🏽 ok",
    "  two  spaces\n\n",
)
_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


@lru_cache(maxsize=1)
def byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level map, character -> byte: printable Latin-1 bytes stand for
    themselves, the other 68 bytes for the characters from U+0100 on, in byte order."""
    keep = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    out = {chr(b): b for b in keep}
    n = 0
    for b in range(256):
        if b not in out.values():
            out[chr(256 + n)] = b
            n += 1
    return out


def _decoder_steps(spec: dict[str, Any] | None) -> list[dict[str, Any]]:
    if spec is None:
        return []
    if spec.get("type") == "Sequence":
        return [s for d in spec.get("decoders", []) for s in _decoder_steps(d)]
    return [spec]


class TokenBytes:
    """Per-id bytes of one tokenizer; ``table[i]`` is what id ``i`` adds to the text."""

    def __init__(self, tok: Tokenizer) -> None:
        self.tok = tok
        spec = json.loads(tok.raw.to_str())
        steps = _decoder_steps(spec.get("decoder"))
        kinds = {s.get("type") for s in steps}
        unsupported = kinds - {"ByteLevel", "ByteFallback", "Fuse", "Replace", "Strip", "Metaspace"}
        if unsupported:
            raise ValueError(
                f"tokenizer decoder {sorted(unsupported)} is not supported for byte alignment"
            )
        replace: list[tuple[str, str]] = []
        for s in steps:
            if s.get("type") == "Replace" and "String" in s.get("pattern", {}):
                replace.append((s["pattern"]["String"], s["content"]))
            elif s.get("type") == "Metaspace":
                replace.append((s.get("replacement", "\u2581"), " "))
        byte_level = "ByteLevel" in kinds
        byte_fallback = "ByteFallback" in kinds or bool(spec.get("model", {}).get("byte_fallback"))
        added = {t["id"]: t["content"] for t in spec.get("added_tokens", [])}
        alphabet = byte_level_alphabet()
        self.table: list[bytes] = []
        for i in range(tok.vocab_size):
            piece = tok.id_to_token(i)
            if i in added or piece is None:
                self.table.append((added.get(i) or "").encode())
            elif byte_level:
                self.table.append(
                    bytes(alphabet[c] for c in piece)
                    if all(c in alphabet for c in piece)
                    else piece.encode()
                )
            elif byte_fallback and _BYTE_PIECE.fullmatch(piece):
                self.table.append(bytes([int(piece[3:5], 16)]))
            else:
                for old, new in replace:
                    piece = piece.replace(old, new)
                self.table.append(piece.encode())
        self.prefix = self._measure_prefix()

    def _measure_prefix(self) -> bytes:
        got = b"".join(self.of(self.tok.encode("x")))
        return got[:-1] if got.endswith(b"x") else b""

    def of(self, ids: list[int]) -> list[bytes]:
        return [self.table[i] if 0 <= i < len(self.table) else b"" for i in ids]

    def encode(self, text: str) -> tuple[list[int], list[bytes]]:
        """Ids of ``text`` and each one's bytes, the encoder's prefix (if any) dropped from
        the first."""
        ids = self.tok.encode(text)
        pieces = self.of(ids)
        if self.prefix and pieces and pieces[0].startswith(self.prefix):
            want, got = text.encode(), b"".join(pieces)
            if got == self.prefix + want or not want.startswith(self.prefix):
                pieces[0] = pieces[0][len(self.prefix) :]
        return ids, pieces

    def check(self) -> None:
        """ValueError naming the first probe text whose bytes do not survive encode -> bytes."""
        for text in PROBES:
            got = b"".join(self.encode(text)[1])
            if got != text.encode():
                raise ValueError(
                    f"encoding {text!r} gives back {got.decode(errors='replace')!r}: "
                    "its tokenizer rewrites text, so byte spans cannot be aligned"
                )
