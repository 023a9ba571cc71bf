"""The arithmetic task: "Q: What is a + b?" with a verifiable answer.

Problems are split by (a, b): 60% for the SFT warm-up, 20% more for GRPO (which trains on
these and the SFT problems), and 20% held out from both for evaluation
(``eval_prompts.jsonl``), so the eval accuracy is on problems the model was never trained on.

GRPO gets the SFT problems too: on its 20 new problems alone, the tiny model memorises their
answers (after 300 steps every greedy answer on the held-out problems was one of those 20
problems' answers) and forgets the rest (greedy accuracy on the SFT problems 1.00 -> 0.40,
held-out 0.65 -> 0.35).
"""

from __future__ import annotations

import json
import random
from pathlib import Path

MAX_OPERAND = 9


def problems(seed: int = 0) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    pairs = [(a, b) for a in range(MAX_OPERAND + 1) for b in range(MAX_OPERAND + 1)]
    random.Random(seed).shuffle(pairs)
    cut = int(len(pairs) * 0.6)
    return pairs[:cut], pairs[cut:]


def prompt(a: int, b: int) -> str:
    return f"Q: What is {a} + {b}?\nA:"


def write_datasets(out_dir: Path, seed: int = 0) -> dict[str, Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    train, held_out = problems(seed)
    sft = out_dir / "sft.jsonl"
    with sft.open("w") as f:
        for a, b in train:
            f.write(json.dumps({"prompt": prompt(a, b), "completion": f" {a + b}", "answer": str(a + b)}) + "\n")
    half = len(held_out) // 2
    rl = out_dir / "rl_prompts.jsonl"
    with rl.open("w") as f:
        for a, b in train + held_out[:half]:
            f.write(json.dumps({"prompt": prompt(a, b), "answer": str(a + b)}) + "\n")
    evaluation = out_dir / "eval_prompts.jsonl"
    with evaluation.open("w") as f:
        for a, b in held_out[half:]:
            f.write(json.dumps({"prompt": prompt(a, b), "answer": str(a + b)}) + "\n")
    # preference pairs for the DPO example: the right sum preferred to an off-by-one
    dpo = out_dir / "dpo.jsonl"
    rng = random.Random(seed + 1)
    with dpo.open("w") as f:
        for a, b in train:
            wrong = a + b + rng.choice([-2, -1, 1, 2])
            f.write(json.dumps({"prompt": prompt(a, b), "chosen": f" {a + b}", "rejected": f" {wrong}"}) + "\n")
    return {"sft": sft, "rl": rl, "eval": evaluation, "dpo": dpo}


def corpus() -> list[str]:
    """Text for the tokenizer: the task's own vocabulary."""
    lines = []
    for a in range(MAX_OPERAND + 1):
        for b in range(MAX_OPERAND + 1):
            lines.append(f"{prompt(a, b)} {a + b}")
    return lines * 4
