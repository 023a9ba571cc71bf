"""Tool schemas from type hints and docstrings, the parsing of Hermes/Qwen tool calls, and
dispatch: every failure of a tool is text for the model, never an exception."""

from __future__ import annotations

import socket
import time

import pytest
from helpers.sources import interleaved

from rlstream.envs.sandbox import Limits
from rlstream.envs.tools import ToolCall, ToolError, ToolRegistry, calculator, parse_tool_calls, schema_of
from tests.envs import user_tools

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the weather forecast for a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "description": "The city's name, e.g. Paris."},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"], "description": "The temperature unit."},
                "days": {"type": "integer", "nullable": True, "description": "How many days ahead (today when omitted)."},
            },
            "required": ["city"],
        },
    },
}

ADD_ALL = {
    "type": "function",
    "function": {
        "name": "add_all",
        "description": "Sum the values, times a scale.",
        "parameters": {
            "type": "object",
            "properties": {
                "values": {"type": "array", "items": {"type": "number"}, "description": "the numbers to add"},
                "scale": {"type": "number", "description": "multiplies the sum"},
                "labels": {"type": "object", "additionalProperties": {"type": "string"}, "nullable": True, "description": "ignored"},
                "exact": {"type": "boolean", "description": "ignored"},
            },
            "required": ["values"],
        },
    },
}


def test_schema_from_google_docstring_and_hints_is_the_hand_written_one():
    assert schema_of(user_tools.get_weather) == WEATHER


def test_schema_from_sphinx_docstring_list_dict_bool():
    assert schema_of(user_tools.add_all) == ADD_ALL


def test_schema_agrees_with_transformers_for_what_chat_templates_read():
    from transformers.utils import get_json_schema

    theirs = get_json_schema(user_tools.get_weather)
    theirs["function"].pop("return", None)
    assert schema_of(user_tools.get_weather) == theirs


def test_a_hint_without_a_schema_is_a_tool_error():
    def f(x: set) -> str:
        """Nope."""
        return ""

    with pytest.raises(ToolError, match="argument 'x'"):
        schema_of(f)

    def g(x) -> str:
        return ""

    with pytest.raises(ToolError, match="no type hint"):
        schema_of(g)


# ---- parsing --------------------------------------------------------------------------------


def test_one_valid_call():
    calls, errors = parse_tool_calls('Let me add.\n<tool_call>\n{"name": "calculator", "arguments": {"expression": "2+3"}}\n</tool_call>')
    assert [(c.name, c.arguments) for c in calls] == [("calculator", {"expression": "2+3"})] and errors == []


def test_several_calls_in_one_turn_and_string_arguments():
    text = ('<tool_call>{"name": "a", "arguments": {"x": 1}}</tool_call> and '
            '<tool_call>{"name": "b", "arguments": "{\\"y\\": [1, 2]}"}</tool_call>'
            '<tool_call>{"name": "c"}</tool_call>')
    calls, errors = parse_tool_calls(text)
    assert [(c.name, c.arguments) for c in calls] == [("a", {"x": 1}), ("b", {"y": [1, 2]}), ("c", {})] and errors == []
    assert len({c.id for c in calls}) == 3


def test_malformed_calls_are_reported_one_line_each_and_valid_ones_kept():
    text = ("<tool_call>{not json}</tool_call>"
            '<tool_call>{"arguments": {}}</tool_call>'
            '<tool_call>{"name": "x", "arguments": [1]}</tool_call>'
            '<tool_call>{"name": "ok", "arguments": {}}</tool_call>'
            '<tool_call>{"name": "cut", "argum')
    calls, errors = parse_tool_calls(text)
    assert [c.name for c in calls] == ["ok"]
    assert [e.split(":")[0] for e in errors] == ["tool call 1", "tool call 2", "tool call 3 (x)", "tool call 5"]
    assert "not valid JSON" in errors[0] and "never closed" in errors[3]


def test_no_call_is_no_call():
    assert parse_tool_calls("The answer is 5.") == ([], [])


# ---- the calculator ---------------------------------------------------------------------------


@pytest.mark.parametrize("expr, value", [("4837 + 2958", "7795"), ("(12 + 7) * 3", "57"), ("7 / 2", "3.5"),
                                         ("2 ** 10", "1024"), ("sqrt(16)", "4"), ("-3 - -4", "1")])
def test_calculator(expr, value):
    assert calculator(expr) == value


@pytest.mark.parametrize("expr, message", [("__import__('os')", "unsupported"), ("9 ** 9 ** 9", "digits"),
                                           ("1 +", "not an arithmetic"), ("1" * 600, "longer than")])
def test_calculator_refuses_what_is_not_small_arithmetic(expr, message):
    with pytest.raises(ValueError, match=message):
        calculator(expr)


def test_calculators_on_two_threads_at_once_both_answer():
    """Tool calls run on threads of their own, so two episodes can call the calculator at once.
    CPython 3.11 counts the AST builder's recursion per interpreter (cpython#106905): a parse
    on another thread while the first's tree was being built made the first raise SystemError."""
    assert interleaved(lambda: calculator("((1 + 2) * (3 + 4) - 5) // 2 + max(1, 2) * sqrt(16)"),
                       lambda: calculator("(2 + 3) * (4 + 5)")) == ("16", "45")


# ---- dispatch -----------------------------------------------------------------------------------

LIMITS = Limits(timeout_s=2.0, cpu_s=2, memory_mb=256, max_output_bytes=64 << 10)


async def test_unknown_tools_bad_arguments_and_calculator_errors_are_observations():
    reg = ToolRegistry(["calculator"], limits=LIMITS)
    r = await reg.call(ToolCall("nope", {}))
    assert r.error and r.reason == "unknown_tool" and "calculator" in r.content
    r = await reg.call(ToolCall("calculator", {"expr": "1"}))
    assert r.error and r.reason == "bad_arguments" and "no argument 'expr'" in r.content
    r = await reg.call(ToolCall("calculator", {}))
    assert r.error and "needs argument 'expression'" in r.content
    r = await reg.call(ToolCall("calculator", {"expression": "1/0"}))
    assert r.error and r.reason == "exception" and "ZeroDivisionError" in r.content
    assert (await reg.call(ToolCall("calculator", {"expression": "19 * 21"}))).content == "399"


@pytest.mark.parametrize("isolation", ["process", "thread"])
async def test_a_user_tool_that_hangs_raises_or_answers_10_mb_gives_an_observation(isolation):
    reg = ToolRegistry([f"tests.envs.user_tools:{n}" for n in ("hangs", "fails", "huge", "loud", "get_weather")],
                       limits=LIMITS, isolation=isolation, max_output_chars=1000)
    start = time.monotonic()
    r = await reg.call(ToolCall("hangs", {}))
    assert r.error and r.reason == "timeout" and "time limit" in r.content and time.monotonic() - start < 12  # 2 s bound + slack
    r = await reg.call(ToolCall("fails", {"why": "no such city"}))
    assert r.error and r.content == "error: LookupError: no such city"
    r = await reg.call(ToolCall("huge", {}))
    assert len(r.content) < 1100  # cut to max_output_chars (+ the note); in a process, stopped at the byte cap
    assert (r.error and r.reason == "output") if isolation == "process" else (not r.error and r.content.endswith("characters cut]"))
    if isolation == "process":  # in a thread, print() writes to this process's own stdout
        r = await reg.call(ToolCall("loud", {"n": 10_000_000}))
        assert not r.error and len(r.content) < 1100 and r.content.startswith("yyy")
    r = await reg.call(ToolCall("get_weather", {"city": "Oslo"}))
    assert r.content == "Oslo: 21 degrees celsius"


async def test_the_python_tool_runs_in_the_sandbox(listener):
    reg = ToolRegistry(["python"], limits=LIMITS)
    r = await reg.call(ToolCall("python", {"code": "print(sum(range(10)))"}))
    assert r.content == "45" and not r.error
    r = await reg.call(ToolCall("python", {"code": "while True: pass"}))
    assert r.error and r.reason in ("cpu", "timeout")
    # a server this process reaches (the control) is out of the tool's reach
    socket.create_connection(("127.0.0.1", listener), timeout=5).close()
    r = await reg.call(ToolCall("python", {"code": f"import socket; socket.create_connection(('127.0.0.1', {listener}), timeout=2)"}))
    assert r.error and r.reason == "exception" and "Error" in r.content


def test_a_bad_tool_spec_fails_at_start():
    with pytest.raises(ToolError, match="neither a built-in"):
        ToolRegistry(["web_search"])
    with pytest.raises(ToolError, match="cannot import"):
        ToolRegistry(["no.such.module:f"])
