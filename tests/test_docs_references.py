"""The documents name the tests that prove their claims: every named test must exist.

RELIABILITY.md, BENCHMARKS.md, README.md and docs/*.md cite tests as ``tests/x.py`` or
``tests/x.py::test_name`` (and ``::other`` / ``...::other`` for another test of the same
file). A renamed or deleted test would leave a claim without its proof.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
from helpers.sources import parse

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "RELIABILITY.md", ROOT / "BENCHMARKS.md", ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
CITATION = re.compile(r"`(tests/[\w/]+\.py)((?:::\w+)?)`|`(?:\.\.\.)?(::\w+)`")


def citations(text: str) -> list[tuple[str, str]]:
    """(file, test) pairs in reading order; a bare ``::name`` belongs to the last file named."""
    out, last = [], None
    for m in CITATION.finditer(text):
        path, test, bare = m.group(1), m.group(2), m.group(3)
        if path:
            last = path
            out.append((path, test.lstrip(":")))
        elif bare and last:
            out.append((last, bare.lstrip(":")))
    return out


def test_citations_are_read_as_file_and_test():
    text = ("see `tests/a.py::test_one`, `::test_two` and `...::test_three`; "
            "then `tests/b/c.py` and `::test_four`")
    assert citations(text) == [("tests/a.py", "test_one"), ("tests/a.py", "test_two"),
                               ("tests/a.py", "test_three"), ("tests/b/c.py", ""), ("tests/b/c.py", "test_four")]


def defined_tests(path: Path) -> set[str]:
    tree = parse(path.read_text())
    return {n.name for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_cited_test_exists(doc):
    missing = []
    for path, test in citations(doc.read_text()):
        file = ROOT / path
        if not file.is_file():
            missing.append(path)
        elif test and test not in defined_tests(file):
            missing.append(f"{path}::{test}")
    assert not missing, f"{doc.name} cites tests that do not exist: {missing}"
