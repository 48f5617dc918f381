"""Tests for tandem/rl/envs/tools.py: Hermes-style tool-call parsing, dispatch, and the
shipped tools."""

from __future__ import annotations

import json
import time

import pytest

from tandem.rl.envs.tools import (
    TOOLS,
    Tool,
    ToolCall,
    ToolCallError,
    calculate,
    dispatch,
    parse_tool_calls,
    run_tool_calls,
    select_tools,
    tool_schemas,
)


def block(obj: object) -> str:
    body = obj if isinstance(obj, str) else json.dumps(obj)
    return f"<tool_call>\n{body}\n</tool_call>"


def test_parse_several_calls_in_order() -> None:
    text = (
        "Let me compute.\n"
        + block({"name": "calculator", "arguments": {"expression": "1+2"}})
        + "\nand run\n"
        + block({"name": "python", "arguments": {"code": "print(3)"}})
    )
    calls = parse_tool_calls(text)
    assert calls == [
        ToolCall("calculator", {"expression": "1+2"}, calls[0].raw),
        ToolCall("python", {"code": "print(3)"}, calls[1].raw),
    ]
    assert calls[0].raw.startswith("<tool_call>") and calls[0].raw.endswith("</tool_call>")


def test_no_calls() -> None:
    assert parse_tool_calls("The answer is 4.") == []


def test_arguments_as_json_string() -> None:
    text = block({"name": "calculator", "arguments": json.dumps({"expression": "2*3"})})
    (call,) = parse_tool_calls(text)
    assert isinstance(call, ToolCall) and call.arguments == {"expression": "2*3"}


def test_missing_arguments_means_empty() -> None:
    (call,) = parse_tool_calls(block({"name": "calculator"}))
    assert isinstance(call, ToolCall) and call.arguments == {}
    assert "missing required argument(s): expression" in dispatch(call)


@pytest.mark.parametrize(
    "body, message",
    [
        ('{"name": "calculator", "arguments": {', "not valid JSON"),
        ("[1, 2]", "must be a JSON object"),
        ('{"arguments": {}}', 'no "name"'),
        ('{"name": "", "arguments": {}}', 'no "name"'),
        ('{"name": "calculator", "arguments": "{oops"}', "string that is not valid JSON"),
        ('{"name": "calculator", "arguments": [1]}', "must be a JSON object, got list"),
        ('{"name": "rm_rf", "arguments": {}}', "unknown tool 'rm_rf'"),
    ],
)
def test_malformed_calls_become_errors(body: str, message: str) -> None:
    (err,) = parse_tool_calls(block(body))
    assert isinstance(err, ToolCallError)
    assert message in err.message
    assert dispatch(err).startswith("Error: ") and message in dispatch(err)


def test_error_does_not_hide_the_next_call() -> None:
    text = block("{bad") + block({"name": "calculator", "arguments": {"expression": "7"}})
    err, ok = parse_tool_calls(text)
    assert isinstance(err, ToolCallError) and isinstance(ok, ToolCall)
    assert run_tool_calls(text)[1] == "7"


def test_unterminated_block_is_an_error() -> None:
    text = (
        block({"name": "calculator", "arguments": {"expression": "1"}})
        + '<tool_call>\n{"name": "calcul'
    )
    ok, err = parse_tool_calls(text)
    assert isinstance(ok, ToolCall)
    assert isinstance(err, ToolCallError) and "unterminated" in err.message


def test_fenced_json_inside_block() -> None:
    text = block('```json\n{"name": "calculator", "arguments": {"expression": "5"}}\n```')
    (call,) = parse_tool_calls(text)
    assert isinstance(call, ToolCall)


@pytest.mark.parametrize(
    "body, message",
    [
        ("[" * 100_000, "nested too deeply"),
        ('{"name": "calculator", "arguments": ' + "[" * 100_000 + "}", "nested too deeply"),
        ('{"name": "calculator", "arguments": "' + "[" * 100_000 + '"}', "nested too deeply"),
        ('{"name": "calculator", "arguments": {"n": ' + "7" * 5000 + "}}", "integer string"),
    ],
    ids=["array", "arguments", "arguments-string", "huge-int"],
)
def test_hostile_json_is_an_error_not_an_exception(body: str, message: str) -> None:
    (err,) = parse_tool_calls(block(body))
    assert isinstance(err, ToolCallError) and message in err.message, err.message[:200]


def test_many_unclosed_tags_parse_in_linear_time() -> None:
    start = time.monotonic()
    calls = parse_tool_calls("<tool_call>" * 20_000)  # 220k characters, no closing tag
    assert time.monotonic() - start < 0.5
    assert len(calls) == 1 and isinstance(calls[0], ToolCallError)
    assert "unterminated" in calls[0].message and len(calls[0].raw) == 220_000


def test_restricted_tool_set() -> None:
    allowed = select_tools(["calculator"])
    (err,) = parse_tool_calls(block({"name": "python", "arguments": {"code": ""}}), allowed)
    assert isinstance(err, ToolCallError) and "unknown tool 'python'" in err.message
    assert (
        dispatch(ToolCall("python", {"code": "print(1)"}), allowed)
        == "Error: unknown tool 'python'"
    )


def test_argument_validation() -> None:
    assert "unexpected argument(s): extra" in dispatch(
        ToolCall("calculator", {"expression": "1", "extra": 2})
    )
    assert "must be of type string" in dispatch(ToolCall("calculator", {"expression": 5}))


def test_failing_tool_is_an_observation() -> None:
    def broken(x: int) -> str:
        raise RuntimeError("kaput")

    tool = Tool(
        "broken",
        "fails",
        {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]},
        broken,
    )
    out = dispatch(ToolCall("broken", {"x": 1}), {"broken": tool})
    assert out == "Error: broken failed: RuntimeError: kaput"
    assert "must be of type integer" in dispatch(ToolCall("broken", {"x": True}), {"broken": tool})
    with pytest.raises(ValueError, match="missing required"):
        tool()


def test_long_output_is_truncated() -> None:
    tool = Tool("long", "", {"type": "object", "properties": {}}, lambda: "a" * 5000 + "END")
    out = dispatch(ToolCall("long", {}), {"long": tool}, max_chars=200)
    assert len(out) < 260 and "characters omitted" in out and out.endswith("END")


def test_schemas_openai_format() -> None:
    schemas = tool_schemas(["calculator", "python"])
    assert [s["function"]["name"] for s in schemas] == ["calculator", "python"]
    for s in schemas:
        assert s["type"] == "function"
        assert set(s["function"]) == {"name", "description", "parameters"}
        assert s["function"]["parameters"]["type"] == "object"
    assert {"calculator", "python"} <= set(TOOLS.names())
    json.dumps(tool_schemas())  # serialisable for the chat template


@pytest.mark.parametrize(
    "expr, want",
    [
        ("1 + 2 * 3", "7"),
        ("(1 + 2) * 3", "9"),
        ("-2 ** 2", "-4"),
        ("(-2) ** 3", "-8"),
        ("7 // 2", "3"),
        ("-7 % 3", "2"),
        ("1 / 4", "0.25"),
        ("2 ** -1", "0.5"),
        ("0.1 + 0.2", "0.30000000000000004"),
        ("2 ** 100", str(2**100)),
        ("+5", "5"),
        ("1e3 * 2", "2000.0"),
        ("10 ** 1000 // 10 ** 999", "10"),
    ],
)
def test_calculator_values(expr: str, want: str) -> None:
    assert calculate(expr) == want
    assert dispatch(ToolCall("calculator", {"expression": expr})) == want


@pytest.mark.parametrize(
    "expr, message",
    [
        ("1 / 0", "division by zero"),
        ("5 % 0", "division by zero"),
        ("x + 1", "names are not allowed"),
        ("__import__('os').system('id')", "calls are not"),
        ("(1).__class__", "unsupported syntax: Attribute"),
        ("'a' * 3", "only numbers"),
        ("True + 1", "only numbers"),
        ("2 ^ 3", "use ** for powers"),
        ("1 +", "syntax error"),
        ("9 ** 9 ** 9", "would exceed"),
        ("10 ** 5000", "would exceed"),
        ("2.0 ** 10000", "too large for a float"),
        ("(-8) ** 0.5", "not a real number"),
        ("[1, 2]", "unsupported syntax: List"),
        ("", "empty expression"),
        ("1+" * 600 + "1", "longer than"),
        ("(" * 300 + "1" + ")" * 300, "nested"),
        ("lambda: 1", "unsupported syntax: Lambda"),
    ],
    ids=lambda v: v[:24] if isinstance(v, str) else None,
)
def test_calculator_errors(expr: str, message: str) -> None:
    out = dispatch(ToolCall("calculator", {"expression": expr}))
    assert out.startswith("Error: ") and message in out, out


def test_calculator_huge_exponent_is_fast() -> None:
    start = time.monotonic()
    for expr in ("9 ** 9 ** 9 ** 9", "(10 ** 400) * (10 ** 400) * (10 ** 400) * (10 ** 400)"):
        assert dispatch(ToolCall("calculator", {"expression": expr})).startswith("Error:")
    assert time.monotonic() - start < 1.0


def test_python_tool_runs_code() -> None:
    out = run_tool_calls(block({"name": "python", "arguments": {"code": "print(sum(range(10)))"}}))
    assert out == ["45\n"]


def test_python_tool_reports_errors_and_limits() -> None:
    out = dispatch(ToolCall("python", {"code": "print('before')\nraise KeyError('k')"}))
    assert out.startswith("before\n") and "[stderr]" in out and "KeyError: 'k'" in out
    assert out.endswith("[exit code 1]")
    assert dispatch(ToolCall("python", {"code": "pass"})) == "[no output]"
    flood = dispatch(ToolCall("python", {"code": "while True: print('z' * 99)"}))
    assert "[stopped: output limit reached, output cut]" in flood
    assert len(flood) < 4200
