"""Tool calling for agentic rollouts, in the Qwen / Hermes convention.

A model calls a tool by emitting, anywhere in its message, one or more blocks::

    <tool_call>
    {"name": "python", "arguments": {"code": "print(1 + 1)"}}
    </tool_call>

:func:`parse_tool_calls` turns the blocks into :class:`ToolCall` values, or
:class:`ToolCallError` values for malformed ones (bad JSON, no name, unknown tool,
an unterminated block); it never raises, because a policy's mistake is an error
*observation* for the policy, not a crash of the trainer. :func:`dispatch` runs one
call and always returns a string. :func:`tool_schemas` gives the OpenAI function
format that chat templates take as ``tools=``.

Tools live in the ``TOOLS`` registry. Two ship here: ``python`` (runs the code in
tandem/rl/sandbox/__init__.py; read its docstring for what that isolation does and does not cover)
and ``calculator`` (arithmetic over an ``ast`` whitelist: number literals,
``+ - * / // % **``, unary ``+``/``-`` and parentheses; no names, calls or
attributes, so there is nothing to escape through; results are capped at
``_CALC_MAX_BITS`` bits so ``9**9**9`` is refused instead of hanging the trainer).

Argument checking is a small subset of JSON Schema (required keys, unknown keys
when ``additionalProperties`` is false, and the primitive ``type``s); it is not a
full validator.
"""

from __future__ import annotations

import ast
import json
import math
import operator
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from tandem.rl.core.registry import Registry
from tandem.rl.sandbox import DEFAULT_LIMITS, SandboxLimits, run_python

__all__ = [
    "TOOLS",
    "Tool",
    "ToolCall",
    "ToolCallError",
    "calculate",
    "dispatch",
    "make_python_tool",
    "parse_tool_calls",
    "register_tool",
    "run_tool_calls",
    "select_tools",
    "tool_schemas",
]

_OPEN, _CLOSE = "<tool_call>", "</tool_call>"
_FENCE_RE = re.compile(r"^```(?:json)?\s*(.*?)\s*```$", re.S)
_JSON_TYPES: dict[str, tuple[type, ...]] = {
    "string": (str,),
    "integer": (int,),
    "number": (int, float),
    "boolean": (bool,),
    "object": (dict,),
    "array": (list,),
    "null": (type(None),),
}
DEFAULT_MAX_CHARS = 8000


@dataclass(frozen=True)
class ToolCall:
    """One well-formed call: a known tool name and its arguments."""

    name: str
    arguments: dict[str, Any]
    raw: str = ""


@dataclass(frozen=True)
class ToolCallError:
    """A call that could not be understood; ``message`` is shown to the model."""

    message: str
    raw: str = ""
    name: str | None = None


@dataclass(frozen=True)
class Tool:
    """A named function with a JSON-schema description of its keyword arguments."""

    name: str
    description: str
    parameters: dict[str, Any]
    fn: Callable[..., str] = field(repr=False)

    def schema(self) -> dict[str, Any]:
        """The OpenAI function-calling entry for chat templates' ``tools=``."""
        return {
            "type": "function",
            "function": {
                "name": self.name,
                "description": self.description,
                "parameters": self.parameters,
            },
        }

    def __call__(self, **arguments: Any) -> str:
        problem = _check_arguments(self.parameters, arguments)
        if problem is not None:
            raise ValueError(problem)
        return self.fn(**arguments)


TOOLS: Registry[Tool] = Registry("tool")


def register_tool(tool: Tool) -> Tool:
    """Add ``tool`` to ``TOOLS`` under its own name."""
    return TOOLS.register(tool.name)(tool)


def select_tools(names: Iterable[str] | None = None) -> dict[str, Tool]:
    """The registered tools with these names (all when None); unknown names raise."""
    return {n: TOOLS.get(n) for n in (TOOLS.names() if names is None else names)}


def tool_schemas(names: Iterable[str] | None = None) -> list[dict[str, Any]]:
    """OpenAI-format schemas of the named registered tools, for ``apply_chat_template``."""
    return [tool.schema() for tool in select_tools(names).values()]


def _check_arguments(schema: Mapping[str, Any], arguments: Mapping[str, Any]) -> str | None:
    props: Mapping[str, Any] = schema.get("properties", {})
    missing = [k for k in schema.get("required", []) if k not in arguments]
    if missing:
        return f"missing required argument(s): {', '.join(missing)}"
    if schema.get("additionalProperties") is False:
        extra = sorted(k for k in arguments if k not in props)
        if extra:
            return (
                f"unexpected argument(s): {', '.join(extra)} "
                f"(expected: {', '.join(props) or 'none'})"
            )
    for key, value in arguments.items():
        want = props.get(key, {}).get("type")
        if want is None:
            continue
        kinds = want if isinstance(want, list) else [want]
        ok = any(isinstance(value, _JSON_TYPES.get(k, object)) for k in kinds)
        if isinstance(value, bool) and "boolean" not in kinds:
            ok = False  # JSON true is not a number
        if not ok:
            return f"argument {key!r} must be of type {want}, got {type(value).__name__}"
    return None


def _loads(text: str) -> Any:
    """``json.loads`` that raises only ValueError: nesting deeper than the interpreter's
    recursion limit and integers longer than ``sys.get_int_max_str_digits`` are bad JSON
    here, not a RecursionError that escapes the parser."""
    try:
        return json.loads(text)
    except RecursionError:
        raise ValueError("nested too deeply") from None


def _json_problem(exc: ValueError) -> str:
    if isinstance(exc, json.JSONDecodeError):
        return f"{exc.msg} at position {exc.pos}"
    return str(exc)


def _parse_block(body: str, raw: str, known: Callable[[str], bool]) -> ToolCall | ToolCallError:
    text = body.strip()
    fenced = _FENCE_RE.match(text)
    if fenced:
        text = fenced.group(1)
    try:
        obj = _loads(text)
    except ValueError as exc:
        return ToolCallError(f"tool call is not valid JSON: {_json_problem(exc)}", raw)
    if not isinstance(obj, dict):
        return ToolCallError('tool call must be a JSON object with "name" and "arguments"', raw)
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        return ToolCallError('tool call has no "name" string', raw)
    args = obj.get("arguments", {})
    if isinstance(args, str):  # some models emit the arguments as a JSON string
        try:
            args = _loads(args) if args.strip() else {}
        except ValueError as exc:
            return ToolCallError(
                f"arguments of {name!r} are a string that is not valid JSON: {_json_problem(exc)}",
                raw,
                name,
            )
    if not isinstance(args, dict):
        return ToolCallError(
            f"arguments of {name!r} must be a JSON object, got {type(args).__name__}", raw, name
        )
    if not known(name):
        return ToolCallError(f"unknown tool {name!r}", raw, name)
    return ToolCall(name, args, raw)


def parse_tool_calls(
    text: str, tools: Mapping[str, Tool] | None = None
) -> list[ToolCall | ToolCallError]:
    """All ``<tool_call>`` blocks in ``text``, in order; never raises.

    ``tools`` is the set of callable tools (default: everything in ``TOOLS``); a name
    outside it gives a :class:`ToolCallError`. An opening tag without a closing one
    (a truncated generation) is an error too.
    """
    known: Callable[[str], bool] = (
        (lambda n: n in TOOLS) if tools is None else (lambda n: n in tools)
    )
    out: list[ToolCall | ToolCallError] = []
    start = text.find(_OPEN)
    while start != -1:  # str.find, not a lazy regex: linear in len(text) however many tags
        close = text.find(_CLOSE, start + len(_OPEN))
        if close == -1:
            out.append(ToolCallError(f"unterminated {_OPEN} block (no {_CLOSE})", text[start:]))
            break
        end = close + len(_CLOSE)
        out.append(_parse_block(text[start + len(_OPEN) : close], text[start:end], known))
        start = text.find(_OPEN, end)
    return out


def _truncate(text: str, max_chars: int) -> str:
    """Keep the head and the tail (tracebacks end with the useful line)."""
    if len(text) <= max_chars:
        return text
    keep = max(max_chars - 60, 2) // 2
    return f"{text[:keep]}\n... [{len(text) - 2 * keep} characters omitted] ...\n{text[-keep:]}"


def dispatch(
    call: ToolCall | ToolCallError,
    tools: Mapping[str, Tool] | None = None,
    *,
    max_chars: int = DEFAULT_MAX_CHARS,
) -> str:
    """Run one parsed call; the tool's output, or an ``Error: ...`` line. Never raises
    for anything the call or the tool does (the trainer's own bugs aside)."""
    if isinstance(call, ToolCallError):
        return f"Error: {call.message}"
    if tools is None:
        tool = TOOLS.get(call.name) if call.name in TOOLS else None
    else:
        tool = tools.get(call.name)
    if tool is None:
        return f"Error: unknown tool {call.name!r}"
    problem = _check_arguments(tool.parameters, call.arguments)
    if problem is not None:
        return f"Error: {call.name}: {problem}"
    try:
        result = tool.fn(**call.arguments)
    except Exception as exc:  # a tool failing is an observation, not a trainer crash
        return f"Error: {call.name} failed: {type(exc).__name__}: {exc}"
    return _truncate(str(result), max_chars)


def run_tool_calls(text: str, tools: Mapping[str, Tool] | None = None) -> list[str]:
    """Parse every call in a message and dispatch each; one observation per block."""
    return [dispatch(c, tools) for c in parse_tool_calls(text, tools)]


# ---- python --------------------------------------------------------------------------

_LIMIT_NOTES = {
    "cpu": "CPU time limit reached",
    "wall": "wall-clock time limit reached",
    "memory": "memory limit reached",
    "nproc": "process limit reached",
    "fsize": "file size limit reached",
    "output": "output limit reached, output cut",
}


def make_python_tool(
    limits: SandboxLimits = DEFAULT_LIMITS, max_chars: int = 4000, name: str = "python"
) -> Tool:
    """A tool that runs a Python program in the sandbox and reports what it printed."""

    def run(code: str) -> str:
        res = run_python(code, limits=limits)
        parts = []
        if res.stdout:
            parts.append(_truncate(res.stdout, max_chars))
        if res.stderr:
            parts.append("[stderr]\n" + _truncate(res.stderr, max_chars))
        if res.limit_hit is not None:
            parts.append(f"[stopped: {_LIMIT_NOTES[res.limit_hit]}]")
        if res.exit_code != 0:
            parts.append(f"[exit code {res.exit_code}]")
        return "\n".join(parts) if parts else "[no output]"

    return Tool(
        name=name,
        description=(
            "Run a Python 3 program in a fresh sandbox (no network, no state "
            "kept between calls) and return its stdout and stderr. Print what "
            "you want to see."
        ),
        parameters={
            "type": "object",
            "properties": {
                "code": {"type": "string", "description": "The complete Python program to run."}
            },
            "required": ["code"],
            "additionalProperties": False,
        },
        fn=run,
    )


# ---- calculator ----------------------------------------------------------------------

_CALC_MAX_CHARS = 1000
_CALC_MAX_NODES = 400
_CALC_MAX_BITS = 4096
_BINOPS: dict[type[ast.operator], Callable[[Any, Any], Any]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY: dict[type[ast.unaryop], Callable[[Any], Any]] = {
    ast.USub: operator.neg,
    ast.UAdd: operator.pos,
}
_OP_NAMES: dict[type[ast.AST], str] = {
    ast.BitXor: "^ (use ** for powers)",
    ast.BitAnd: "&",
    ast.BitOr: "|",
    ast.LShift: "<<",
    ast.RShift: ">>",
    ast.MatMult: "@",
    ast.Invert: "~",
    ast.Not: "not",
}


class CalculatorError(ValueError):
    """The expression is not plain arithmetic or its value is out of range."""


def _bits(x: int | float) -> float:
    if isinstance(x, int):
        return float(abs(x).bit_length())
    return math.log2(abs(x)) if x not in (0.0,) and math.isfinite(x) else 0.0


def _guard_size(op: type[ast.operator], a: int | float, b: int | float) -> None:
    if not (isinstance(a, int) and isinstance(b, int)):
        return  # float overflow raises OverflowError by itself
    if op is ast.Pow and b > 0 and abs(a) > 1 and b * _bits(a) > _CALC_MAX_BITS:
        raise CalculatorError(f"result of {a} ** {b} would exceed {_CALC_MAX_BITS} bits")
    if op is ast.Pow and b < 0 and abs(b) > _CALC_MAX_BITS:
        raise CalculatorError(f"exponent {b} is too large")
    if op is ast.Mult and _bits(a) + _bits(b) > _CALC_MAX_BITS:
        raise CalculatorError(f"product would exceed {_CALC_MAX_BITS} bits")


def _eval(node: ast.AST) -> int | float:
    if isinstance(node, ast.Expression):
        return _eval(node.body)
    if isinstance(node, ast.Constant):
        if isinstance(node.value, bool) or not isinstance(node.value, (int, float)):
            raise CalculatorError(f"only numbers are allowed, not {node.value!r}")
        return node.value
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_eval(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
        a, b = _eval(node.left), _eval(node.right)
        _guard_size(type(node.op), a, b)
        result = _BINOPS[type(node.op)](a, b)
        if isinstance(result, complex):
            raise CalculatorError("result is not a real number")
        return result
    op = getattr(node, "op", None)
    if op is not None and type(op) in _OP_NAMES:
        raise CalculatorError(f"operator {_OP_NAMES[type(op)]} is not supported")
    if isinstance(node, ast.Name):
        raise CalculatorError(f"names are not allowed ({node.id!r}); use numbers only")
    if isinstance(node, ast.Call):
        raise CalculatorError("function calls are not allowed")
    raise CalculatorError(f"unsupported syntax: {type(node).__name__}")


def calculate(expression: str) -> str:
    """Evaluate plain arithmetic; the value as a string, or raise CalculatorError."""
    expr = expression.strip()
    if not expr:
        raise CalculatorError("empty expression")
    if len(expr) > _CALC_MAX_CHARS:
        raise CalculatorError(f"expression longer than {_CALC_MAX_CHARS} characters")
    try:
        tree = ast.parse(expr, mode="eval")
    except SyntaxError as exc:
        raise CalculatorError(f"syntax error: {exc.msg}") from None
    except (RecursionError, MemoryError):
        raise CalculatorError("expression is nested too deeply") from None
    if sum(1 for _ in ast.walk(tree)) > _CALC_MAX_NODES:
        raise CalculatorError(f"expression has more than {_CALC_MAX_NODES} parts")
    try:
        value = _eval(tree)
    except ZeroDivisionError:
        raise CalculatorError("division by zero") from None
    except OverflowError:
        raise CalculatorError("result is too large for a float") from None
    except RecursionError:
        raise CalculatorError("expression is nested too deeply") from None
    if isinstance(value, float) and not math.isfinite(value):
        raise CalculatorError("result is not finite")
    return repr(value) if isinstance(value, float) else str(value)


def _calculator(expression: str) -> str:
    try:
        return calculate(expression)
    except CalculatorError as exc:
        return f"Error: {exc}"


register_tool(make_python_tool())
register_tool(
    Tool(
        name="calculator",
        description=(
            "Evaluate an arithmetic expression exactly (integers) or in floating "
            "point: numbers, + - * / // % **, unary minus and parentheses."
        ),
        parameters={
            "type": "object",
            "properties": {
                "expression": {
                    "type": "string",
                    "description": "For example: (3 + 4) * 2 ** 10 / 7",
                }
            },
            "required": ["expression"],
            "additionalProperties": False,
        },
        fn=_calculator,
    )
)
