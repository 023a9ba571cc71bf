"""No pickle anywhere: the package never imports pickle, never calls torch.save, and only
ever calls torch.load with weights_only=True."""

import re
from pathlib import Path

import rlstream

SRC = Path(rlstream.__file__).parent


def sources():
    return [p for p in SRC.rglob("*.py")]


def test_no_pickle_imports_or_calls():
    offenders = []
    for p in sources():
        text = p.read_text()
        for n, line in enumerate(text.splitlines(), 1):
            code = line.split("#", 1)[0]
            if re.search(r"\bimport (c?pickle|dill|cloudpickle|joblib)\b|\bfrom (c?pickle|dill|cloudpickle) import\b", code):
                offenders.append(f"{p.relative_to(SRC)}:{n}: {line.strip()}")
            if re.search(r"\btorch\.save\(", code) or re.search(r"\bpickle\.loads?\(", code):
                offenders.append(f"{p.relative_to(SRC)}:{n}: {line.strip()}")
    assert not offenders, "pickle on the wire or on disk:\n" + "\n".join(offenders)


def test_torch_load_only_with_weights_only():
    offenders = []
    for p in sources():
        text = p.read_text()
        for m in re.finditer(r"(?<!safetensors\.)\btorch\.load\(([^)]*)\)", text):
            if "weights_only=True" not in m.group(1):
                offenders.append(f"{p.relative_to(SRC)}: torch.load({m.group(1)})")
    assert not offenders, "\n".join(offenders)


def test_numpy_never_allows_pickle():
    for p in sources():
        assert "allow_pickle=True" not in p.read_text(), p
