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


MODEL_LOADS = ("learner/steps.py", "learner/lora.py", "producers/backends/hf.py", "annotators/logprobs.py", "scorers/reward_server.py")


def test_every_model_load_takes_safetensors_only():
    """A `.bin` in a restored or shared model folder goes through torch.load, which unpickles;
    every from_pretrained of weights asks for safetensors, so such a folder is refused."""
    offenders = []
    for rel in MODEL_LOADS:
        text = (SRC / rel).read_text()
        for m in re.finditer(r"AutoModelFor\w+\.from_pretrained\(", text):
            depth, end = 1, m.end()
            while depth:  # to the call's closing parenthesis
                depth += {"(": 1, ")": -1}.get(text[end], 0)
                end += 1
            call = text[m.start():end]
            if "use_safetensors=True" not in call:
                offenders.append(f"{rel}: {call}")
    assert not offenders, "\n".join(offenders)


def test_a_model_folder_holding_only_a_pickled_checkpoint_is_refused(tiny_model_dir, tmp_path):
    import shutil

    import pytest
    import torch
    from safetensors.torch import load_file

    from rlstream.producers.backends.hf import HFBackend

    folder = tmp_path / "model"
    shutil.copytree(tiny_model_dir, folder)
    weights = load_file(str(folder / "model.safetensors"))
    (folder / "model.safetensors").unlink()
    torch.save(weights, folder / "pytorch_model.bin")  # what an attacker leaves in a shared folder
    with pytest.raises(OSError, match="safetensors"):
        HFBackend(str(folder))
