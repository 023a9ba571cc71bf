"""A verifiers environment trained with rlstream, end to end on a tiny model.

1. Build a tiny Llama and a BPE tokenizer (nothing is downloaded).
2. `rlstream run grpo.yaml`: producers run episodes of the verifiers taskset in `env.py` (its tasks
   are the prompts, its `add` tool answers tool calls), scorers score them with its rubric.
3. Print the rubric's reward components per step, from the run's metrics.

    python -m examples.verifiers_arithmetic.run [--out runs/verifiers_arithmetic] [--steps N]

Needs the verifiers package: `make setup-verifiers` (or `pip install 'rlstream[verifiers]'` and
`pip install --no-deps verifiers==0.4.0`).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=str(ROOT / "runs" / "verifiers_arithmetic"))
    p.add_argument("--steps", type=int, default=None, help="learner steps (grpo.yaml: 20)")
    p.add_argument("--set", action="append", default=[], help="a grpo.yaml override, as for `rlstream run --set`")
    args = p.parse_args()
    out = Path(args.out).resolve()
    model = out / "model"
    if not (model / "config.json").exists():
        from rlstream.models.tiny import build_tiny_model

        build_tiny_model(model)
    cmd = [sys.executable, "-m", "rlstream.cli", "run", str(HERE / "grpo.yaml"), "--run-dir", str(out / "grpo"),
           "--overwrite", "--set", f"model_checkpoint_path={model}"]
    for s in args.set:
        cmd += ["--set", s]
    if args.steps:
        cmd += ["--max-steps", str(args.steps)]
    code = subprocess.call(cmd, cwd=ROOT)  # from the repository root: `examples.verifiers_arithmetic.env` imports
    summary = out / "grpo" / "summary.json"
    if code != 0 or not summary.exists():
        raise SystemExit(f"`rlstream run` failed (exit {code}); logs in {out / 'grpo' / 'logs'}")
    print(json.dumps({k: v for k, v in json.loads(summary.read_text()).items() if not isinstance(v, dict)}))
    for line in (out / "grpo" / "metrics.jsonl").read_text().splitlines():
        m = json.loads(line)
        parts = {k: round(v, 3) for k, v in m.items() if k.startswith("reward/") and k.endswith("/mean")}
        print(m.get("step"), parts)


if __name__ == "__main__":
    main()
