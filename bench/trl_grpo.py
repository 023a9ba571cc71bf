"""TRL GRPOTrainer on the arithmetic task: the peer in bench/e2e.py.

Runs inside the benchmark's own environment (TRL is not an rlstream dependency).
Writes one JSON line per step: elapsed seconds since launch, mean reward, samples.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time

T0 = time.monotonic()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--data", required=True, help="jsonl with prompt and answer columns")
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--prompts-per-step", type=int, default=8)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--max-new-tokens", type=int, default=6)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()

    import importlib.util
    import os
    from pathlib import Path

    import torch
    import transformers
    import trl
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    # rlstream's own math rule, loaded from its file (this environment has TRL, not rlstream's
    # dependencies), so both sides of the race score with the same code
    spec = importlib.util.spec_from_file_location("rlstream_rewards", Path(__file__).resolve().parents[1] / "rlstream" / "scorers" / "rewards.py")
    rewards = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(rewards)
    print(f"TRL side: trl {trl.__version__}, transformers {transformers.__version__}, torch {torch.__version__}, "
          f"torch threads {torch.get_num_threads()} (OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')})", flush=True)

    rows = [json.loads(line) for line in open(args.data) if line.strip()]
    # repeat the prompts so the trainer never runs out within the steps
    need = args.steps * args.prompts_per_step
    rows = (rows * (need // len(rows) + 1))[:need]
    dataset = Dataset.from_list([{"prompt": r["prompt"], "answer": r["answer"]} for r in rows])

    def correct(prompts, completions, answer, **kwargs):
        return [rewards.math_reward(c, a) or 0.0 for c, a in zip(completions, answer)]

    wanted = dict(
        output_dir=args.out + ".trainer", learning_rate=args.lr, lr_scheduler_type="constant", warmup_steps=0,
        per_device_train_batch_size=args.group_size * args.prompts_per_step, gradient_accumulation_steps=1,
        num_generations=args.group_size, max_completion_length=args.max_new_tokens, temperature=args.temperature,
        max_steps=args.steps, logging_steps=1, save_strategy="no", report_to="none", use_cpu=True, beta=0.0,
        seed=args.seed, max_grad_norm=1.0, use_vllm=False, top_k=0, top_p=1.0, adam_beta1=0.9, adam_beta2=0.999,
        weight_decay=0.0, disable_tqdm=True,
    )
    names = {f.name for f in dataclasses.fields(GRPOConfig)}
    config = GRPOConfig(**{k: v for k, v in wanted.items() if k in names})
    tok = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype="float32")
    out = open(args.out, "w")

    class Log(TrainerCallback):
        def on_log(self, _args, state, control, logs=None, **kw):
            logs = logs or {}
            reward = logs.get("reward", logs.get("rewards/correct/mean", logs.get("rewards/correct")))
            if reward is not None:
                out.write(json.dumps({"step": state.global_step, "elapsed_s": time.monotonic() - T0, "reward": float(reward),
                                      "samples": state.global_step * args.group_size * args.prompts_per_step}) + "\n")
                out.flush()

    trainer = GRPOTrainer(model=model, reward_funcs=correct, args=config, train_dataset=dataset, processing_class=tok, callbacks=[Log()])
    trainer.train()
    out.close()


if __name__ == "__main__":
    main()
