"""Loading transformers' model code leaves out the packages it would import only for
features rlstream never uses (they cost seconds of CPU in every model-loading process)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_model_code_loads_without_sklearn_and_sklearn_still_imports(tiny_model_dir):
    code = (
        "import sys\n"
        "from rlstream.imports import import_transformers_models\n"
        "import_transformers_models()\n"
        "from transformers import AutoModelForCausalLM\n"
        f"AutoModelForCausalLM.from_pretrained({str(tiny_model_dir)!r})\n"
        "print(sorted(m for m in ('sklearn', 'scipy', 'pandas', 'boto3') if m in sys.modules))\n"
        "import importlib.util\n"
        "print(all(importlib.util.find_spec(m) is not None for m in ('sklearn', 'scipy', 'boto3')))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == ["[]", "True"]
