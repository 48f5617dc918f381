"""The generic config mechanism: typed dataclass trees, TOML in, CLI overrides, TOML out.

A config is a tree of plain dataclasses. Each field's type annotation is the
schema: values from a TOML file are checked against it, values from the command
line (``--section.key=value``) are parsed by it, and `format_toml` writes it back
as TOML that reads in to an equal tree. A field whose type is itself a dataclass
is a (sub)section. Nothing here knows Tandem's sections; tandem/rl/config/schema.py defines them.

Supported field types: ``int``, ``float``, ``str``, ``bool``, ``X | None``,
``list[X]``, ``Literal[...]``, ``dict[str, X]`` (TOML only) and dataclasses.
TOML has no null, so ``None`` is written and read as the string ``"none"``.

Every problem is a `ConfigError` whose message is one line naming the key, value
or file, with a hint (nearest key, allowed values, expected type). Float values
must be finite: ``inf`` and ``nan`` parse (TOML has them) but fail validation.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import functools
import json
import math
import os
import re
import sys
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal, ParamSpec, TypeVar, Union

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

__all__ = [
    "EXIT_CONFIG_ERROR",
    "CliArgs",
    "ConfigError",
    "all_keys",
    "apply_override",
    "apply_table",
    "format_toml",
    "main_guard",
    "parse_cli",
    "parse_text",
    "read_toml",
    "require",
    "to_dict",
    "type_name",
    "validate_fields",
]

EXIT_CONFIG_ERROR = 2
"""Process exit status for a bad config (argparse's usage-error status)."""

_NONE_WORDS = ("none", "null")
_TRUE_WORDS = ("true", "1", "yes", "on")
_FALSE_WORDS = ("false", "0", "no", "off")
_INT_RE = re.compile(r"[+-]?\d(_?\d)*")
_BARE_KEY_RE = re.compile(r"[A-Za-z0-9_-]+")

P = ParamSpec("P")
R = TypeVar("R")


class ConfigError(Exception):
    """A bad config value, key or file. ``str()`` is always a single line."""

    def __init__(self, message: str) -> None:
        super().__init__(re.sub(r"\s*\n\s*", " ", str(message)).strip())


def require(ok: bool, message: str) -> None:
    """Raise ConfigError(message) unless ``ok``; for sections' ``validate`` methods."""
    if not ok:
        raise ConfigError(message)


# ---------------------------------------------------------------- types


def is_section(tp: Any) -> bool:
    return isinstance(tp, type) and dataclasses.is_dataclass(tp)


@functools.cache
def field_types(cls: type) -> dict[str, Any]:
    """Resolved type of every dataclass field (annotations may be strings)."""
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def _union(tp: Any) -> tuple[list[Any], bool] | None:
    """(non-None members, whether None is allowed) for a Union, else None."""
    if typing.get_origin(tp) not in (Union, types.UnionType):
        return None
    args = typing.get_args(tp)
    return [a for a in args if a is not type(None)], type(None) in args


def type_name(tp: Any) -> str:
    """How an error message names a type: 'int', 'list of float', 'str or none'."""
    if tp in (int, float, str, bool):
        return tp.__name__
    if tp is Any:
        return "any value"
    if is_section(tp) or typing.get_origin(tp) is dict or tp is dict:
        return "table"
    union = _union(tp)
    if union is not None:
        members, nullable = union
        return " or ".join([type_name(m) for m in members] + (["none"] if nullable else []))
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in args)
    if origin is list or tp is list:
        return f"list of {type_name(args[0])}" if args else "list"
    return str(tp)


def _show(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _type_error(key: str, tp: Any, value: Any, from_text: bool) -> ConfigError:
    got = _show(value) if from_text else f"{type(value).__name__} {_show(value)}"
    if typing.get_origin(tp) is Literal:
        return ConfigError(f"{key}: {_show(value)} is not {type_name(tp)}")
    return ConfigError(f"{key}: expected {type_name(tp)}, got {got}")


# ---------------------------------------------------------------- values


def coerce(value: Any, tp: Any, key: str) -> Any:
    """Check a TOML (or Python) value against ``tp``; returns it normalised (int -> float,
    tuple -> list)."""
    union = _union(tp)
    if union is not None:
        members, nullable = union
        if nullable and (
            value is None or (isinstance(value, str) and value.lower() in _NONE_WORDS)
        ):
            return None
        for member in members:
            try:
                return coerce(value, member, key)
            except ConfigError:
                continue
        raise _type_error(key, tp, value, from_text=False)
    if tp is Any:
        return copy.deepcopy(value)
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is bool:
        ok = isinstance(value, bool)
    elif tp is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            require(math.isfinite(value), f"{key}: must be a finite number, got {value}")
            return float(value)
        ok = False
    elif tp is str:
        ok = isinstance(value, str)
    elif origin is Literal:
        for allowed in args:
            if type(allowed) is type(value) and allowed == value:
                return allowed
        ok = False
    elif origin is list or tp is list:
        if isinstance(value, (list, tuple)):
            elem = args[0] if args else Any
            return [coerce(v, elem, f"{key}[{i}]") for i, v in enumerate(value)]
        ok = False
    elif origin is dict or tp is dict:
        if isinstance(value, Mapping):
            val_t = args[1] if len(args) == 2 else Any
            for k in value:
                require(isinstance(k, str), f"{key}: table keys must be strings, got {_show(k)}")
            return {k: coerce(v, val_t, f"{key}.{k}") for k, v in value.items()}
        ok = False
    else:
        raise ConfigError(f"{key}: unsupported config field type {tp!r}")
    if not ok:
        raise _type_error(key, tp, value, from_text=False)
    return value


def _unquote(text: str) -> str:
    if len(text) >= 2 and text[0] == text[-1] and text[0] in "\"'":
        return text[1:-1]
    return text


def _toml_literal(text: str, key: str) -> Any:
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError as e:  # drop the position: it is in our one-line wrapper
        reason = re.sub(r"\s*\(at line \d+, column \d+\)", "", str(e))
        raise ConfigError(f"{key}: {text!r} is not a valid TOML value ({reason})") from None


def parse_text(text: str, tp: Any, key: str) -> Any:
    """Parse a command-line string by the field type ``tp`` (see the module docstring)."""
    stripped = text.strip()
    union = _union(tp)
    if union is not None:
        members, nullable = union
        if nullable and stripped.lower() in _NONE_WORDS:
            return None
        for member in members:
            try:
                return parse_text(text, member, key)
            except ConfigError:
                continue
        raise _type_error(key, tp, text, from_text=True)
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is bool:
        if stripped.lower() in _TRUE_WORDS:
            return True
        if stripped.lower() in _FALSE_WORDS:
            return False
        raise ConfigError(f"{key}: expected bool (true/false/1/0/yes/no), got {text!r}")
    if tp is int:
        if _INT_RE.fullmatch(stripped):
            return int(stripped)
        raise _type_error(key, tp, text, from_text=True)
    if tp is float:
        try:
            return float(stripped)
        except ValueError:
            raise _type_error(key, tp, text, from_text=True) from None
    if tp is str:
        return _unquote(text)
    if origin is Literal:
        word = _unquote(stripped)
        for allowed in args:
            if str(allowed) == word:
                return allowed
        raise _type_error(key, tp, word, from_text=True)
    if origin is list or tp is list:
        if stripped.startswith("["):
            return coerce(_toml_literal(stripped, key), tp, key)
        if not stripped:
            return []
        elem = args[0] if args else str
        return [parse_text(p, elem, f"{key}[{i}]") for i, p in enumerate(stripped.split(","))]
    if tp is Any:
        try:
            return _toml_literal(stripped, key)
        except ConfigError:
            return text
    if origin is dict or tp is dict:
        raise ConfigError(
            f"{key}: is a table; set it in the TOML config file, not on the command line"
        )
    raise ConfigError(f"{key}: unsupported config field type {tp!r}")


# ---------------------------------------------------------------- tree walking


def all_keys(obj: Any, prefix: str = "") -> list[str]:
    """Every settable dotted key under a config tree: ['job.name', 'job.seed', ...]."""
    keys: list[str] = []
    for name, tp in field_types(type(obj)).items():
        if is_section(tp):
            keys += all_keys(getattr(obj, name), f"{prefix}{name}.")
        else:
            keys.append(prefix + name)
    return keys


def _unknown(root: Any, obj: Any, prefix: str, name: str) -> ConfigError:
    """'unknown key/section' with the nearest valid spelling, tried near then far."""
    key = prefix + name
    moved = getattr(type(root), "MOVED", {})
    if key in moved:
        return ConfigError(f"{key}: {moved[key]}")
    names = list(field_types(type(obj)))
    near = difflib.get_close_matches(name, names, n=1, cutoff=0.6)
    if near:
        hint = f"did you mean '{prefix}{near[0]}'?"
    else:
        keys = all_keys(root)
        elsewhere = [k for k in keys if k.rsplit(".", 1)[-1] == name]
        far = elsewhere or difflib.get_close_matches(key, keys, n=1, cutoff=0.75)
        hint = f"did you mean '{far[0]}'?" if far else f"valid here: {', '.join(names)}"
    kind = "section" if prefix == "" else "key"
    return ConfigError(f"unknown {kind} '{key}'; {hint}")


def apply_table(root: Any, table: Mapping[str, Any], obj: Any = None, prefix: str = "") -> None:
    """Set fields of ``obj`` (default: root) from a parsed TOML table, recursing into sections."""
    obj = root if obj is None else obj
    types_ = field_types(type(obj))
    for name, value in table.items():
        key = prefix + name
        if name not in types_:
            raise _unknown(root, obj, prefix, name)
        tp = types_[name]
        if is_section(tp):
            if not isinstance(value, Mapping):
                raise ConfigError(
                    f"{key}: expected a table [{key}], got {type(value).__name__} {_show(value)}"
                )
            apply_table(root, value, getattr(obj, name), key + ".")
        else:
            setattr(obj, name, coerce(value, tp, key))


def apply_override(root: Any, key: str, text: str | None) -> None:
    """Set one dotted ``key`` from command-line text; ``None`` text is a bare flag
    (bool -> True)."""
    obj, parts = root, key.split(".")
    for i, name in enumerate(parts):
        prefix = ".".join(parts[:i]) + ("." if i else "")
        types_ = field_types(type(obj))
        if name not in types_:
            raise _unknown(root, obj, prefix, name)
        tp, here, last = types_[name], prefix + name, i == len(parts) - 1
        if is_section(tp):
            if last:
                first = next(iter(field_types(tp)), "KEY")
                raise ConfigError(
                    f"--{here} is a section; set one of its keys, e.g. --{here}.{first}=VALUE"
                )
            obj = getattr(obj, name)
            continue
        if not last:
            raise ConfigError(
                f"unknown key '{key}': '{here}' is a key ({type_name(tp)}), not a section"
            )
        if text is None:
            union = _union(tp)
            if tp is bool or (union is not None and union[0] == [bool]):
                setattr(obj, name, True)
                return
            raise ConfigError(f"--{key}: missing value (expected {type_name(tp)})")
        setattr(obj, name, parse_text(text, tp, key))


def validate_fields(obj: Any, prefix: str = "") -> None:
    """Type-check every field below ``obj`` and run each subsection's ``validate()``,
    children first.

    Does not call ``obj.validate()`` itself, so a root ``validate`` can call this
    and then do its cross-section checks.
    """
    for name, tp in field_types(type(obj)).items():
        key, value = prefix + name, getattr(obj, name)
        if is_section(tp):
            require(
                isinstance(value, tp),
                f"{key}: expected a {tp.__name__} section, got {type(value).__name__}",
            )
            validate_fields(value, key + ".")
            check = getattr(value, "validate", None)
            if callable(check):
                check()
        else:
            setattr(obj, name, coerce(value, tp, key))


# Field metadata of a key whose value is a secret (a bearer key): `to_dict(redact=True)` shows
# it as REDACTED and `format_toml` leaves it out, so no config file or logger holds it.
SECRET = {"secret": True}
REDACTED = "<redacted>"


def _secret_set(f: dataclasses.Field, value: Any) -> bool:
    return bool(f.metadata.get("secret")) and value is not None


def to_dict(obj: Any, redact: bool = False) -> dict[str, Any]:
    """A config tree as nested plain dicts (values deep-copied); ``redact``: secret values
    (fields with ``metadata=SECRET``) replaced by REDACTED (what loggers are given)."""
    out: dict[str, Any] = {}
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value):
            out[f.name] = to_dict(value, redact)
        else:
            out[f.name] = REDACTED if redact and _secret_set(f, value) else copy.deepcopy(value)
    return out


# ---------------------------------------------------------------- TOML in / out


def read_toml(path: str) -> dict[str, Any]:
    """Parse a TOML file; a missing file or bad syntax is a one-line ConfigError naming the path."""
    if not os.path.exists(path):
        raise ConfigError(f"config file not found: {path}")
    if os.path.isdir(path):
        raise ConfigError(f"config path is a folder, not a TOML file: {path}")
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except tomllib.TOMLDecodeError as e:  # message ends "(at line L, column C)"
        raise ConfigError(f"invalid TOML in {path}: {e}") from None
    except UnicodeDecodeError as e:
        raise ConfigError(
            f"invalid TOML in {path}: not UTF-8 ({e.reason} at byte {e.start})"
        ) from None
    except OSError as e:
        raise ConfigError(f"cannot read config file {path}: {e.strerror}") from None


def _toml_key(key: str) -> str:
    return key if _BARE_KEY_RE.fullmatch(key) else json.dumps(key, ensure_ascii=False)


def _toml_value(value: Any, key: str, top: bool = True) -> str:
    if value is None:
        if top:
            return '"none"'
        raise ConfigError(f"{key}: None inside a list or table cannot be written as TOML")
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        return repr(value)
    if isinstance(value, str):  # JSON string escapes are TOML's, bar DEL
        return json.dumps(value, ensure_ascii=False).replace("\x7f", "\\u007f")
    if isinstance(value, (list, tuple)):
        return (
            "[" + ", ".join(_toml_value(v, f"{key}[{i}]", False) for i, v in enumerate(value)) + "]"
        )
    if isinstance(value, Mapping):
        items = [
            f"{_toml_key(k)} = {_toml_value(v, f'{key}.{k}', False)}" for k, v in value.items()
        ]
        return "{ " + ", ".join(items) + " }" if items else "{}"
    raise ConfigError(f"{key}: cannot write {type(value).__name__} {_show(value)} as TOML")


def _emit(obj: Any, path: list[str], lines: list[str]) -> None:
    scalars, sections = [], []
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value):
            sections.append((f.name, value))
        elif _secret_set(f, value):  # read back, the key is unset: its environment variable
            scalars.append(f"# {f.name}: a secret, not written (give it again to reuse this file)")
        else:
            scalars.append(f"{f.name} = {_toml_value(value, '.'.join([*path, f.name]))}")
    if path and (scalars or not sections):
        lines += ["", f"[{'.'.join(path)}]"]
    lines += scalars
    for name, value in sections:
        _emit(value, [*path, name], lines)


def format_toml(obj: Any, header: str = "") -> str:
    """The config tree as TOML text that `apply_table` reads back to an equal tree, except
    for secrets (``metadata=SECRET``), which are left out (a comment says so)."""
    lines = [f"# {line}".rstrip() for line in header.splitlines()]
    _emit(obj, [], lines)
    return "\n".join(lines).lstrip("\n") + "\n"


# ---------------------------------------------------------------- command line


@dataclasses.dataclass
class CliArgs:
    """What `parse_cli` found: ``--config FILE``, ``--print-config``, ``--plan``, ``--help`` and
    overrides.

    Each override is ``"section.key=value"``, or ``"section.key"`` for a bare flag.
    """

    config: str | None = None
    print_config: bool = False
    plan: bool = False
    help: bool = False
    overrides: list[str] = dataclasses.field(default_factory=list)


_OPTIONS = ("--config", "--print-config", "--plan", "--help")


def parse_cli(argv: Sequence[str]) -> CliArgs:
    """Split argv into options and ``--section.key=value`` / ``--section.key value`` overrides."""
    out, i = CliArgs(), 0
    while i < len(argv):
        tok = argv[i]
        name, eq, value = tok.partition("=")
        nxt = argv[i + 1] if i + 1 < len(argv) else None
        takes_next = not eq and nxt is not None and not nxt.startswith("--")
        if tok in ("-h", "--help"):
            out.help = True
        elif name == "--print-config":
            require(not eq, "--print-config takes no value")
            out.print_config = True
        elif name == "--plan":
            require(
                not eq,
                "--plan takes no value; the target is --plan.nodes=N "
                "--plan.devices_per_node=G --plan.device_memory_gb=M",
            )
            out.plan = True
        elif name == "--config":
            require(out.config is None, "--config given twice; pass one config file")
            require(bool(eq) or takes_next, "--config needs a file path: --config FILE.toml")
            out.config = value if eq else nxt
            i += 0 if eq else 1
        elif tok.startswith("--") and "." in name:
            out.overrides.append(
                f"{name[2:]}={value}" if eq else f"{name[2:]}={nxt}" if takes_next else name[2:]
            )
            i += 1 if takes_next else 0
        elif tok.startswith("-"):
            near = difflib.get_close_matches(name, _OPTIONS, n=1)
            hint = (
                f"did you mean '{near[0]}'?" if near else "overrides look like --section.key=value"
            )
            raise ConfigError(f"unknown option '{name}'; {hint}")
        else:
            raise ConfigError(
                f"unexpected argument {tok!r}; overrides look like --section.key=value"
            )
        i += 1
    return out


def split_override(item: str) -> tuple[str, str | None]:
    """``"--a.b=v"`` or ``"a.b=v"`` -> ("a.b", "v"); ``"a.b"`` -> ("a.b", None)."""
    key, eq, value = item.removeprefix("--").partition("=")
    return key.strip(), (value if eq else None)


# ---------------------------------------------------------------- entry points


def report_config_error(err: ConfigError) -> None:
    """Print ``error: <line>`` to stderr (rank-prefixed under a multi-rank launcher)."""
    sys.stdout.flush()
    rank_prefix = ""
    if os.environ.get("WORLD_SIZE", "1") not in ("", "0", "1"):
        rank_prefix = f"[rank {os.environ.get('RANK', '?')}] "
    print(f"{rank_prefix}error: {err}", file=sys.stderr, flush=True)


def main_guard(fn: Callable[P, R]) -> Callable[P, R]:
    """Wrap an entry point: a ConfigError prints one line and exits with EXIT_CONFIG_ERROR, no
    traceback."""

    @functools.wraps(fn)
    def guarded(*args: P.args, **kwargs: P.kwargs) -> R:
        try:
            return fn(*args, **kwargs)
        except ConfigError as err:
            report_config_error(err)
            raise SystemExit(EXIT_CONFIG_ERROR) from None

    return guarded


def is_loopback(host: str) -> bool:
    """Whether ``host`` (a name or an IP address) is this machine's loopback: a server bound
    there is reachable from this machine only."""
    import ipaddress

    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
