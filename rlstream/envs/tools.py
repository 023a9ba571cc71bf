"""Tools a model calls: their JSON schemas, the model's calls parsed from its text, dispatch.

**Schemas.** A tool is a plain Python function. Its schema, in the form chat templates take
for ``tools`` (``{"type": "function", "function": {"name", "description", "parameters"}}``),
comes from its type hints and docstring: the docstring's first paragraph is the description;
arguments are described in a Google-style ``Args:`` section or Sphinx ``:param x:`` lines.
Types: ``str``, ``int``, ``float``, ``bool``, ``list[T]``, ``dict[str, T]``, ``Literal[...]``
(an ``enum``), ``T | None`` (``nullable``); an argument without a default is required.

**Calls.** Hermes/Qwen style: each call is ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``
in the model's text; several may follow each other. :func:`parse_tool_calls` returns the calls
it could read and one message per call it could not (bad JSON, no name, arguments that are not
an object, a tag never closed), so a malformed call becomes an observation, not an exception.

**Dispatch.** :meth:`ToolRegistry.call` never raises for anything the model asked: an unknown
tool, bad arguments, a tool that raises, hangs or answers megabytes all come back as text for
the model. Built-in tools: ``calculator`` (arithmetic evaluated in-process on the parsed
expression tree, with bounded exponents and lengths) and ``python`` (code run by
:mod:`rlstream.envs.sandbox`). A user tool given as ``package.module:function`` runs in the
sandbox too (``isolation="process"``, the default: a hang is killed, not abandoned), or in a
thread of this process (``isolation="thread"``: no process start per call, but a call that
hangs past its timeout is abandoned, still running, in its thread, and what it prints goes to
this process's stdout).
"""

from __future__ import annotations

import ast
import asyncio
import contextlib
import inspect
import json
import math
import operator
import re
import threading
import types
import typing
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable, Literal

from rlstream.envs import sandbox
from rlstream.imports import ImportPathError, import_callable

BUILTIN_TOOLS = ("calculator", "python")


class ToolError(ValueError):
    """A tool that cannot be offered as configured (bad import path, unsupported annotation)."""


# ---- schemas -----------------------------------------------------------------------------

_SCALARS = {str: "string", int: "integer", float: "number", bool: "boolean"}


def _type_schema(hint: Any, where: str) -> dict[str, Any]:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint in _SCALARS:
        return {"type": _SCALARS[hint]}
    if hint is Any:
        return {}
    if origin is Literal:
        kinds = {type(a) for a in args}
        out: dict[str, Any] = {"enum": list(args)}
        if len(kinds) == 1 and next(iter(kinds)) in _SCALARS:
            out = {"type": _SCALARS[next(iter(kinds))], **out}
        return out
    if origin in (typing.Union, types.UnionType):
        rest = [a for a in args if a is not type(None)]
        if len(rest) == 1 and len(args) == 2:
            return {**_type_schema(rest[0], where), "nullable": True}
        return {"anyOf": [_type_schema(a, where) for a in args if a is not type(None)]}
    if hint in (list, tuple) or origin in (list, tuple):
        return {"type": "array", **({"items": _type_schema(args[0], where)} if args else {})}
    if hint is dict or origin is dict:
        return {"type": "object", **({"additionalProperties": _type_schema(args[1], where)} if len(args) == 2 else {})}
    raise ToolError(f"{where}: type {hint!r} has no JSON schema here (use str, int, float, bool, list, dict, Literal or X | None)")


_ARGS_HEADER = re.compile(r"^\s*(Args|Arguments|Parameters)\s*:\s*$")
_SECTION = re.compile(r"^\s*(Returns?|Raises|Yields|Examples?|Notes?)\s*:\s*$")
_GOOGLE_ARG = re.compile(r"^\s*(\w+)\s*(?:\([^)]*\))?\s*:\s*(.*)$")
_SPHINX_ARG = re.compile(r"^\s*:param\s+(?:[^:]*\s)?(\w+)\s*:\s*(.*)$")


def parse_docstring(doc: str | None) -> tuple[str, dict[str, str]]:
    """(description, {argument: description}) from a Google- or Sphinx-style docstring."""
    lines = inspect.cleandoc(doc or "").splitlines()
    description: list[str] = []
    params: dict[str, str] = {}
    current: str | None = None
    section = "description"
    for line in lines:
        if _ARGS_HEADER.match(line):
            section, current = "args", None
            continue
        if _SECTION.match(line) or re.match(r"^\s*:(returns?|raises?|rtype)\b", line):
            section, current = "other", None
            continue
        sphinx = _SPHINX_ARG.match(line)
        if sphinx:
            current = sphinx.group(1)
            params[current] = sphinx.group(2).strip()
            section = "args"
            continue
        if section == "description":
            if not line.strip() and description:
                section = "after"
            elif line.strip():
                description.append(line.strip())
        elif section == "args":
            google = _GOOGLE_ARG.match(line)
            if google and (not current or len(line) - len(line.lstrip()) <= _indent_of_args(lines)):
                current = google.group(1)
                params[current] = google.group(2).strip()
            elif current and line.strip():
                params[current] = f"{params[current]} {line.strip()}".strip()
    return " ".join(description), params


def _indent_of_args(lines: list[str]) -> int:
    for i, line in enumerate(lines):
        if _ARGS_HEADER.match(line):
            for nxt in lines[i + 1:]:
                if nxt.strip():
                    return len(nxt) - len(nxt.lstrip())
    return 0


def schema_of(fn: Callable[..., Any], name: str | None = None) -> dict[str, Any]:
    """The chat-template ``tools`` entry of a Python function, from its hints and docstring."""
    where = f"tool {name or fn.__name__}"
    try:
        hints = typing.get_type_hints(fn)
    except Exception as exc:  # an annotation that does not resolve is the tool author's to fix
        raise ToolError(f"{where}: its type hints do not resolve ({exc})") from None
    description, docs = parse_docstring(fn.__doc__)
    properties: dict[str, Any] = {}
    required: list[str] = []
    for pname, param in inspect.signature(fn).parameters.items():
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            continue
        if pname not in hints:
            raise ToolError(f"{where}: argument {pname!r} has no type hint")
        prop = _type_schema(hints[pname], f"{where} argument {pname!r}")
        if pname in docs:
            prop["description"] = docs[pname]
        properties[pname] = prop
        if param.default is inspect.Parameter.empty:
            required.append(pname)
    parameters: dict[str, Any] = {"type": "object", "properties": properties}
    if required:
        parameters["required"] = required
    return {"type": "function", "function": {"name": name or fn.__name__, "description": description, "parameters": parameters}}


# ---- parsing the model's calls -------------------------------------------------------------

_CALL = re.compile(r"<tool_call>(.*?)(</tool_call>|$)", re.DOTALL)


@dataclass(frozen=True, slots=True)
class ToolCall:
    name: str
    arguments: dict[str, Any]
    id: str = field(default_factory=lambda: "call_" + uuid.uuid4().hex[:12])


def parse_tool_calls(text: str) -> tuple[list[ToolCall], list[str]]:
    """The ``<tool_call>`` JSON blocks in ``text``: (calls read, one error line per block that
    could not be read). ``arguments`` may be an object or a JSON string holding one (as
    OpenAI's API writes it)."""
    calls: list[ToolCall] = []
    errors: list[str] = []
    for i, m in enumerate(_CALL.finditer(text)):
        body, closed = m.group(1).strip(), bool(m.group(2))
        if not closed:
            errors.append(f"tool call {i + 1}: <tool_call> is never closed with </tool_call>")
            continue
        try:
            obj = json.loads(body)
        except json.JSONDecodeError as exc:
            errors.append(f"tool call {i + 1}: not valid JSON ({exc.msg} at character {exc.pos})")
            continue
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
            errors.append(f'tool call {i + 1}: expected {{"name": "...", "arguments": {{...}}}}')
            continue
        args = obj.get("arguments", obj.get("parameters", {}))
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except json.JSONDecodeError:
                errors.append(f"tool call {i + 1} ({obj['name']}): arguments is a string that is not JSON")
                continue
        if args is None:
            args = {}
        if not isinstance(args, dict):
            errors.append(f"tool call {i + 1} ({obj['name']}): arguments must be an object, got {type(args).__name__}")
            continue
        calls.append(ToolCall(obj["name"], args))
    return calls, errors


# ---- the calculator ----------------------------------------------------------------------

_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}
_FUNCS = {"sqrt": math.sqrt, "abs": abs, "round": round, "min": min, "max": max, "log": math.log, "exp": math.exp}
_CONSTS = {"pi": math.pi, "e": math.e}
MAX_EXPRESSION = 512
MAX_DIGITS = 1000
# CPython 3.11 counts the AST builder's recursion per interpreter, not per thread: a parse on
# one thread while another's tree is being built fails with SystemError (cpython#106905).
# Tool calls run on threads of their own, so the calculator's parses take turns, and a parse
# that another library's parse on another thread collided with is tried again.
_PARSE = threading.Lock()
_PARSE_ATTEMPTS = 5


def _parse(expression: str) -> ast.Expression:
    with _PARSE:
        for _ in range(_PARSE_ATTEMPTS - 1):
            try:
                return ast.parse(expression, mode="eval")
            except SystemError as exc:
                if "recursion depth mismatch" not in str(exc):
                    raise
        return ast.parse(expression, mode="eval")


def _eval(node: ast.AST) -> float | int:
    if isinstance(node, ast.Expression):
        return _eval(node.body)
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
        return node.value
    if isinstance(node, ast.Name) and node.id in _CONSTS:
        return _CONSTS[node.id]
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_eval(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _eval(node.left), _eval(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) * math.log10(max(abs(left), 2)) > MAX_DIGITS:
            raise ValueError(f"the result would have more than {MAX_DIGITS} digits")
        if isinstance(node.op, ast.Mult) and isinstance(left, int) and isinstance(right, int) and \
                len(str(abs(left))) + len(str(abs(right))) > MAX_DIGITS:
            raise ValueError(f"the result would have more than {MAX_DIGITS} digits")
        return _BINARY[type(node.op)](left, right)
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in _FUNCS and not node.keywords:
        return _FUNCS[node.func.id](*(_eval(a) for a in node.args))
    raise ValueError(f"unsupported expression element: {ast.dump(node)[:60]}")


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression and return its value.

    Args:
        expression: An arithmetic expression, e.g. "(12 + 7) * 3". Supports + - * / // % **, parentheses, sqrt, abs, round, min, max, log, exp, pi and e.
    """
    if len(expression) > MAX_EXPRESSION:
        raise ValueError(f"the expression is longer than {MAX_EXPRESSION} characters")
    try:
        tree = _parse(expression.strip())
    except SyntaxError as exc:
        raise ValueError(f"not an arithmetic expression ({exc.msg})") from None
    value = _eval(tree)
    if isinstance(value, float) and value.is_integer() and abs(value) < 1e15:
        value = int(value)
    return str(value)


def python(code: str) -> str:
    """Run Python code in a sandbox and return what it printed.

    Args:
        code: A Python program; print() the values you want to see.
    """
    raise RuntimeError("the python tool runs in the sandbox; ToolRegistry dispatches it")  # pragma: no cover


# ---- the registry ------------------------------------------------------------------------


def load_callable(path: str) -> Callable[..., Any]:
    """``package.module:function`` (a dotted attribute allowed) -> the function."""
    try:
        return import_callable(path, "tool")
    except ImportPathError as exc:
        raise ToolError(str(exc)) from None


@dataclass(slots=True)
class Tool:
    name: str
    fn: Callable[..., Any]
    schema: dict[str, Any]
    path: str = ""
    """Import path (user tools): what the sandbox imports."""
    kind: Literal["inline", "sandbox_python", "process", "thread"] = "process"


@dataclass(slots=True)
class ToolResult:
    """What a call gave back: the text for the model, and whether it was an error."""

    name: str
    content: str
    error: bool = False
    reason: str | None = None
    """timeout, cpu, memory, output, killed, exception, unknown_tool, bad_arguments, parse, or None."""


class ToolRegistry:
    """The tools of an environment, by name. ``specs`` are built-in names or import paths."""

    def __init__(self, specs: list[str] | tuple[str, ...] = ("calculator",), *, limits: sandbox.Limits = sandbox.Limits(),  # noqa: B008 (frozen)
                 isolation: Literal["process", "thread"] = "process", max_output_chars: int = 4000):
        self.limits = limits
        self.max_output_chars = max_output_chars
        self.tools: dict[str, Tool] = {}
        for spec in specs:
            if spec == "calculator":
                tool = Tool("calculator", calculator, schema_of(calculator), kind="inline")
            elif spec == "python":
                tool = Tool("python", python, schema_of(python), kind="sandbox_python")
            elif ":" in spec:
                fn = load_callable(spec)
                name = spec.rpartition(":")[2].rpartition(".")[2]
                tool = Tool(name, fn, schema_of(fn, name), path=spec, kind=isolation)
            else:
                raise ToolError(f"tool {spec!r} is neither a built-in ({', '.join(BUILTIN_TOOLS)}) nor 'package.module:function'")
            if tool.name in self.tools:
                raise ToolError(f"two tools are named {tool.name!r}")
            self.tools[tool.name] = tool

    @property
    def schemas(self) -> list[dict[str, Any]]:
        return [t.schema for t in self.tools.values()]

    def _cut(self, text: str) -> str:
        if len(text) <= self.max_output_chars:
            return text
        return text[:self.max_output_chars] + f"\n[... {len(text) - self.max_output_chars} more characters cut]"

    def _check_arguments(self, tool: Tool, args: dict[str, Any]) -> str | None:
        params = tool.schema["function"]["parameters"]
        props, required = params.get("properties", {}), params.get("required", [])
        unknown = sorted(set(args) - set(props))
        if unknown:
            return f"{tool.name} has no argument {', '.join(map(repr, unknown))} (its arguments: {', '.join(props) or 'none'})"
        missing = [r for r in required if r not in args]
        if missing:
            return f"{tool.name} needs argument {', '.join(map(repr, missing))}"
        return None

    async def call(self, call: ToolCall) -> ToolResult:
        """Run one call; every failure comes back as a :class:`ToolResult` with ``error``."""
        tool = self.tools.get(call.name)
        if tool is None:
            return ToolResult(call.name, f"error: there is no tool named {call.name!r} (tools: {', '.join(self.tools)})",
                              True, "unknown_tool")
        bad = self._check_arguments(tool, call.arguments)
        if bad:
            return ToolResult(call.name, f"error: {bad}", True, "bad_arguments")
        if tool.kind == "inline":
            try:
                return ToolResult(call.name, self._cut(str(tool.fn(**call.arguments))))
            except Exception as exc:  # the model's input made the tool fail: that is an observation
                return ToolResult(call.name, f"error: {type(exc).__name__}: {exc}", True, "exception")
        if tool.kind == "sandbox_python":
            return self._from_run(call.name, await sandbox.run_python(str(call.arguments["code"]), self.limits))
        if tool.kind == "process":
            return self._from_function(call.name, await sandbox.run_function(tool.path, call.arguments, self.limits))
        return await self._in_thread(tool, call)

    def _from_run(self, name: str, run: sandbox.Result) -> ToolResult:
        text = (run.stdout + (("\n" if run.stdout else "") + run.stderr if run.stderr else "")).rstrip()
        if run.reason is not None:
            return ToolResult(name, self._cut(f"{text}\nerror: {run.describe(self.limits)}".strip()), True, run.reason)
        if run.returncode != 0:
            return ToolResult(name, self._cut(text or f"error: exited with code {run.returncode}"), True, "exception")
        return ToolResult(name, self._cut(text))

    def _from_function(self, name: str, run: sandbox.Result) -> ToolResult:
        answer = run.extra
        if not answer:
            why = run.describe(self.limits) if run.reason else f"the tool's process ended without an answer ({run.stderr.strip()[-300:]})"
            return ToolResult(name, f"error: {why}", True, run.reason or "exception")
        printed = answer.get("printed", "")
        if answer.get("printed_dropped"):
            printed += f"\n[... {answer['printed_dropped']} more printed characters cut]"
        if not answer.get("ok"):
            return ToolResult(name, self._cut(f"{printed}\nerror: {answer.get('error')}".strip()), True, "exception")
        return ToolResult(name, self._cut(f"{printed}\n{answer['result']}".strip() if printed else answer["result"]))

    async def _in_thread(self, tool: Tool, call: ToolCall) -> ToolResult:
        try:
            if inspect.iscoroutinefunction(tool.fn):
                value = await asyncio.wait_for(tool.fn(**call.arguments), self.limits.timeout_s)
            else:
                value = await asyncio.wait_for(_in_daemon_thread(tool.fn, call.arguments, tool.name), self.limits.timeout_s)
        except TimeoutError:
            return ToolResult(call.name, f"error: stopped: it ran past the {self.limits.timeout_s:g} s time limit", True, "timeout")
        except Exception as exc:  # a failing tool is an observation for the model
            return ToolResult(call.name, f"error: {type(exc).__name__}: {exc}", True, "exception")
        text = value if isinstance(value, str) else _to_text(value)
        return ToolResult(call.name, self._cut(text))


def _in_daemon_thread(fn: Callable[..., Any], arguments: dict[str, Any], name: str) -> asyncio.Future:
    """``fn(**arguments)`` in its own daemon thread. Not the loop's executor: a call that never
    returns would hold up the loop's shutdown and the interpreter's exit, which join those threads."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future = loop.create_future()

    def settle(value: Any, error: BaseException | None) -> None:
        if not future.done():
            future.set_exception(error) if error is not None else future.set_result(value)

    def work() -> None:
        try:
            value, error = fn(**arguments), None
        except BaseException as exc:  # handed to the awaiting coroutine
            value, error = None, exc
        with contextlib.suppress(RuntimeError):  # the loop closed while the call ran
            loop.call_soon_threadsafe(settle, value, error)

    threading.Thread(target=work, name=f"tool-{name}", daemon=True).start()
    return future


def _to_text(value: Any) -> str:
    try:
        return json.dumps(value)
    except (TypeError, ValueError):
        return repr(value)


def format_tool_call(name: str, arguments: dict[str, Any]) -> str:
    """A call as a Hermes/Qwen model writes it (for synthetic traces)."""
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"
