"""The suite's own parse survives another thread's parse in the middle of it."""

from __future__ import annotations

import ast

import pytest
from helpers.sources import interleaved, parse

SOURCE = "def f(a, b):\n    return [x * (a + b) for x in range(a) if x % 2]\n" * 40


def test_a_parse_interrupted_by_another_threads_parse_is_retried():
    tree, other = interleaved(lambda: parse(SOURCE), lambda: ast.parse("1 + 2"))
    assert ast.dump(tree) == ast.dump(ast.parse(SOURCE)) and isinstance(other, ast.Module)


def test_the_collision_the_retry_is_for_is_real_on_this_python():
    """Without the retry the same interleaving fails (on CPython 3.11; later ones fixed it)."""
    try:
        interleaved(lambda: ast.parse(SOURCE), lambda: ast.parse("1 + 2"))
    except SystemError as exc:
        assert "recursion depth mismatch" in str(exc)
    else:
        pytest.skip("this Python builds ASTs with a per-call recursion count")
