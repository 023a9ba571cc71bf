"""On-policy distillation on the demo task: the demo's SFT model after GRPO teaches a fresh student.

1. The demo's tiny Llama (built locally), its SFT warm-up (``sft.yaml``) and asynchronous GRPO
   on the held-out problems (``grpo.yaml``): the teacher.
2. ``distill.yaml``: the student, the base model after a short SFT warm-up
   (``--student-sft-steps``, 40: it has seen the answer format and little arithmetic; 0: the
   untrained base model), samples the held-out problems, the ``teacher`` stage adds the
   teacher's log-prob of every sampled token, and the learner minimises the per-token
   reverse KL to the teacher. The reward (is the answer right) is scored for monitoring only;
   it never enters the loss (``reward_weight: 0``).

It reports the teacher's reward, and the student's reward over the first and last 10% of its
steps on the held-out problems (those the SFT warm-up never saw). ``ratio`` is the student's
rise (goal: at least 0.2). Writes ``bench/results/distill.md`` and the student's reward curve.
``--quick`` runs a few steps of each phase (a smoke test of the script, not the figure).
"""

from __future__ import annotations

import json
import shutil
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).parent))
from _common import parser, rlstream_run, table, verdict  # noqa: E402

from examples.arithmetic import task  # noqa: E402
from rlstream.rundir.files import read_jsonl  # noqa: E402

WORK = ROOT / "bench" / ".distill"
RESULTS = ROOT / "bench" / "results"
EXAMPLES = ROOT / "examples" / "arithmetic"


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--sft-steps", type=int, default=80)
    p.add_argument("--grpo-steps", type=int, default=300)
    p.add_argument("--steps", type=int, default=300, help="distillation steps")
    p.add_argument("--lr", type=float, default=None, help="the student's learning rate (default: distill.yaml's)")
    p.add_argument("--student-sft-steps", type=int, default=40,
                   help="warm the student with this many SFT steps first (0: the untrained base model)")
    args = p.parse_args()
    sft_steps, grpo_steps, steps = (10, 4, 6) if args.quick else (args.sft_steps, args.grpo_steps, args.steps)
    if args.quick:
        args.student_sft_steps = min(args.student_sft_steps, 4)
    WORK.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()

    model_dir = WORK / "base_model"
    if not (model_dir / "config.json").exists():
        from rlstream.models.tiny import build_tiny_model

        build_tiny_model(model_dir, corpus=task.corpus(), vocab_size=320, num_layers=2, hidden_size=128, intermediate_size=384)
    data = task.write_datasets(WORK / "data")
    sft_dir, grpo_dir = WORK / f"sft_{sft_steps}", WORK / f"grpo_{sft_steps}_{grpo_steps}"
    if not (sft_dir / "summary.json").exists():
        rlstream_run(EXAMPLES / "sft.yaml", sft_dir, [f"model_checkpoint_path={model_dir}", f"data_source.path={data['sft']}"], sft_steps,
            WORK / "sft.log")
    if not (grpo_dir / "summary.json").exists():
        rlstream_run(EXAMPLES / "grpo.yaml", grpo_dir, [f"model_checkpoint_path={(sft_dir / 'checkpoints' / 'latest').resolve()}",
                                               f"data_source.path={data['rl']}"], grpo_steps, WORK / "grpo.log")
    teacher = json.loads((grpo_dir / "summary.json").read_text())
    teacher_dir = (grpo_dir / "checkpoints" / "latest").resolve()

    student_model = model_dir
    if args.student_sft_steps:
        warm_dir = WORK / f"sft_{args.student_sft_steps}"
        if not (warm_dir / "summary.json").exists():
            rlstream_run(EXAMPLES / "sft.yaml", warm_dir, [f"model_checkpoint_path={model_dir}", f"data_source.path={data['sft']}"],
                args.student_sft_steps, WORK / "sft_student.log")
        student_model = (warm_dir / "checkpoints" / "latest").resolve()
    student_dir = WORK / (f"distill_{steps}" + (f"_lr{args.lr:g}" if args.lr else "") +
                          (f"_warm{args.student_sft_steps}" if args.student_sft_steps else ""))
    shutil.rmtree(student_dir, ignore_errors=True)
    student = rlstream_run(EXAMPLES / "distill.yaml", student_dir, [f"model_checkpoint_path={student_model}", f"data_source.path={data['rl']}",
                                                         f"teacher.model_path={teacher_dir}",
                                                         *([f"learner.lr={args.lr}"] if args.lr else [])], steps, WORK / "distill.log")
    metrics = read_jsonl(student_dir / "metrics.jsonl").rows
    kl = [m["distill/reverse_kl"] for m in metrics if isinstance(m.get("distill/reverse_kl"), (int, float))]
    k = max(1, len(kl) // 10)
    rise = student["reward_last"] - student["reward_first"]
    rows = [("teacher (SFT + GRPO)", teacher["reward_first"], teacher["reward_last"], float("nan"), float("nan"), teacher["steps"]),
            (f"student (SFT {args.student_sft_steps} steps, distilled)" if args.student_sft_steps else "student (base, distilled)", student["reward_first"], student["reward_last"], statistics.fmean(kl[:k]) if kl else float("nan"),
             statistics.fmean(kl[-k:]) if kl else float("nan"), student["steps"])]
    columns = ("model", "reward first", "reward last", "reverse KL first", "reverse KL last", "steps")
    table("on-policy distillation on the demo task (held-out problems)", rows, columns)
    if not args.quick:
        RESULTS.mkdir(parents=True, exist_ok=True)
        curve = student_dir / "reward_curve.png"
        if curve.exists():
            shutil.copy(curve, RESULTS / "distill.png")
        lines = ["| " + " | ".join(columns) + " |", "|" + " --- |" * len(columns)]
        lines += ["| " + " | ".join(f"{v:.4f}" if isinstance(v, float) else str(v) for v in row) + " |" for row in rows]
        cmd = (f"python bench/distill.py --sft-steps {sft_steps} --grpo-steps {grpo_steps} --student-sft-steps {args.student_sft_steps} "
               f"--steps {steps}" + (f" --lr {args.lr:g}" if args.lr else ""))
        (RESULTS / "distill.md").write_text(f"# On-policy distillation\n\n`{cmd}`\n\n" + "\n".join(lines) + "\n\n![student reward](distill.png)\n")
    verdict("distill", teacher_reward=teacher["reward_last"], student_reward_first=student["reward_first"],
            student_reward_last=student["reward_last"], wall_s=time.perf_counter() - t0, ratio=rise, goal=0.2)


if __name__ == "__main__":
    main()
