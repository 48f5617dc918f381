"""Print (or refresh in docs/config.md) the config reference, generated from the config dataclasses.

    python scripts/config_reference.py            # print the markdown
    python scripts/config_reference.py --write    # replace the blocks in docs/config.md

The blocks in docs/config.md (the keys, and the table of what composes) are checked against
this output by tests/test_readme.py, so the documented keys, types and defaults always match
the code, and every key must carry a description comment (`undescribed` lists those that do
not; ``--write`` refuses them).
"""

from __future__ import annotations

import dataclasses
import inspect
import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

START, END = "<!-- config-reference:start -->", "<!-- config-reference:end -->"
# the table of what composes (tandem/rl/config/composes.py), rendered between these
COMPOSES_START, COMPOSES_END = "<!-- composes:start -->", "<!-- composes:end -->"


def _comments(cls: type) -> dict[str, str]:
    """Each field's trailing comment, continued by the comment-only lines right below it at its
    indent or deeper (a description longer than one line; a blank line ends it), from the class
    and the dataclasses it extends."""
    out = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass):
            continue
        last, indent = None, 0
        for line in inspect.getsource(klass).splitlines():
            m = re.match(r"(\s+)(\w+):[^#]*?=.*?#\s*(.*)$", line)
            more = re.match(r"(\s+)#\s*(.*)$", line)
            if m:
                last, indent = m.group(2), len(m.group(1))
                out[last] = m.group(3).strip()
            elif more and last is not None and len(more.group(1)) >= indent:
                out[last] += " " + more.group(2).strip()
            else:
                last = None
    return out


def _type(tp: object) -> str:
    s = tp if isinstance(tp, str) else getattr(tp, "__name__", str(tp))
    return s.replace("typing.", "").replace("Literal", "one of ").replace("|", "or")


def undescribed() -> list[str]:
    """``section.key`` of every config key whose dataclass line has no description comment."""
    from tandem.rl.config.schema import Config

    out = []
    for section in dataclasses.fields(Config):
        cls = section.default_factory  # type: ignore[misc]
        notes = _comments(cls)
        out += [
            f"{section.name}.{f.name}" for f in dataclasses.fields(cls) if not notes.get(f.name)
        ]
    return out


def reference() -> str:
    from tandem.rl.config.schema import Config
    from tandem.rl.core.configlib import to_dict

    lines = []
    defaults = to_dict(Config())
    for section in dataclasses.fields(Config):
        cls = section.default_factory  # type: ignore[misc]
        doc = " ".join((inspect.getdoc(cls) or "").split("\n\n")[0].split())  # first paragraph
        lines += [
            f"**[{section.name}]** {doc}",
            "",
            "| key | type | default | meaning |",
            "|---|---|---|---|",
        ]
        notes = _comments(cls)
        for f in dataclasses.fields(cls):
            default = defaults[section.name][f.name]
            shown = (
                "none" if default is None else repr(default).replace("'", '"').replace("|", "\\|")
            )
            tp = str(f.type).replace("|", "or")
            lines.append(
                f"| `{f.name}` | {tp} | `{shown}` | {notes.get(f.name, '').replace('|', '/')} |"
            )
        lines.append("")
    return "\n".join(lines).rstrip() + "\n"


def composes() -> str:
    """The matrix of the headline features and the numbered rows of the table."""
    from tandem.rl.config.composes import FEATURES, matrix, table

    legend = ", ".join(f"**{k}** {f.label}" for k, f in FEATURES.items() if f.short)
    return f"{legend}.\n\n{matrix()}\n{table()}"


def reference_block(text: str, start: str = START, end: str = END) -> str:
    return text.split(start, 1)[1].split(end, 1)[0].strip("\n") + "\n"


def _replace(text: str, start: str, end: str, body: str) -> str:
    head, rest = text.split(start, 1)
    return f"{head}{start}\n{body}{end}{rest.split(end, 1)[1]}"


def main() -> None:
    ref = reference()
    missing = undescribed()
    if missing and "--write" in sys.argv:
        sys.exit(f"error: no description comment for {', '.join(missing)}")
    if "--write" not in sys.argv:
        print(ref, end="")
        return
    path = os.path.join(ROOT, "docs", "config.md")
    text = open(path, encoding="utf-8").read()
    text = _replace(text, START, END, ref)
    text = _replace(text, COMPOSES_START, COMPOSES_END, composes())
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)


if __name__ == "__main__":
    main()
