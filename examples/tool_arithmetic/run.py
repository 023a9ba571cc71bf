"""Tool-use arithmetic, the parts that run today: a tiny model, the SFT warm-up on synthetic
tool traces (`rlstream run sft.yaml`), then episodes of the tool environment driven by the
warmed-up model (plain HF sampling, one turn at a time) to measure how often it calls the
calculator and how often its answer is right.

The GRPO phase (`grpo.yaml.pending`) runs once the producer's multi-turn episode runner is on
main; the environment it will drive is the one evaluated here.

    python -m examples.tool_arithmetic.run [--out runs/tool_arithmetic] [--sft-steps N] [--episodes N]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
from pathlib import Path

import numpy as np

from examples.tool_arithmetic import task
from rlstream.envs.toolenv import ToolEnvironment
from rlstream.schemas import Prompt

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent


async def evaluate(model_dir: Path, rows: list[dict], *, max_turns: int = 3, max_new_tokens: int = 40, seed: int = 0) -> dict:
    """Run one episode per row with the model; success rate, tool-call rate, mean turns."""
    from rlstream.producers.backends.base import SamplingSpec
    from rlstream.producers.backends.hf import HFBackend

    backend = HFBackend(str(model_dir), seed=seed)
    # a model turn ends at the chat template's end-of-turn marker, not only at EOS
    backend.eos_ids.add(backend.tokenizer.convert_tokens_to_ids("<|im_end|>"))
    env = ToolEnvironment(["calculator"], reward="answer", max_tool_rounds=max_turns - 1)
    spec = SamplingSpec(n=1, max_new_tokens=max_new_tokens, temperature=1.0, seed=seed)
    rewards, tool_use, turns = [], [], []
    for i, row in enumerate(rows):
        ep = await env.start(Prompt(id=f"e{i}", text="", messages=row["prompt"], columns={"answer": row["answer"]}))
        conversation, used, reward = list(ep.messages), False, 0.0
        for k in range(max_turns):
            ids = backend.tokenizer.apply_chat_template(conversation, tools=ep.tools, add_generation_prompt=True,
                                                        tokenize=True, return_dict=True)["input_ids"]
            reply = backend.generate_sync([np.asarray(ids, np.int32)], spec)[0][0].text
            turn = await ep.step(reply)
            used = used or bool(turn.info.get("tools"))
            conversation += [{"role": "assistant", "content": reply}, *turn.messages]
            if turn.done:
                reward = turn.reward or 0.0
                break
        await ep.close()
        rewards.append(reward)
        tool_use.append(used)
        turns.append(k + 1)
    return {"success": float(np.mean(rewards)), "tool_use": float(np.mean(tool_use)), "turns": float(np.mean(turns)),
            "episodes": len(rows)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=str(ROOT / "runs" / "tool_arithmetic"))
    p.add_argument("--sft-steps", type=int, default=None)
    p.add_argument("--episodes", type=int, default=64)
    args = p.parse_args()
    out = Path(args.out).resolve()
    model_dir = out / "base_model"
    if not (model_dir / "config.json").exists():
        from rlstream.tiny import build_tiny_model

        build_tiny_model(model_dir, corpus=task.corpus(), vocab_size=400, num_layers=2, hidden_size=128, intermediate_size=384)
    data = task.write_datasets(out / "data")
    sft_dir = out / "sft"
    cmd = [sys.executable, "-m", "rlstream.cli", "run", str(HERE / "sft.yaml"), "--run-dir", str(sft_dir), "--overwrite",
           "--set", f"model_checkpoint_path={model_dir}", "--set", f"data_source.path={data['sft']}"]
    if args.sft_steps:
        cmd += ["--max-steps", str(args.sft_steps)]
    if subprocess.call(cmd, cwd=ROOT) != 0:
        raise SystemExit(f"SFT failed; logs in {sft_dir / 'logs'}")
    rows = [json.loads(line) for line in data["rl"].read_text().splitlines()][:args.episodes]
    before = asyncio.run(evaluate(model_dir, rows))
    after = asyncio.run(evaluate((sft_dir / "checkpoints" / "latest").resolve(), rows))
    result = {"base": before, "sft": after}
    (out / "eval.json").write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
