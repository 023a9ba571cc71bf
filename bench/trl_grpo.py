"""TRL GRPOTrainer on the arithmetic task: the peer in bench/e2e.py.

Runs inside the benchmark's own environment (TRL is not an rlstream dependency). The reward
function is loaded from its file (``--reward FILE:FUNCTION``), the very code rlstream's scorer
imports through ``function:``. Writes one JSON line per step: seconds since the benchmark
launched this process (``--launch-ts``), mean reward, samples, and TRL's own step time
(``on_step_begin`` to ``on_step_end``: generation, reward and training) with the part spent
generating and scoring, so the training phase shows on its own.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time

T0 = time.time()


def load_reward(spec: str):
    """``path/to/module.py:function``, imported by file path (no package install needed)."""
    import importlib.util

    path, _, name = spec.rpartition(":")
    module_spec = importlib.util.spec_from_file_location("race_reward", path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return getattr(module, name)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--data", required=True, help="jsonl with prompt and answer columns")
    p.add_argument("--out", required=True)
    p.add_argument("--reward", required=True, help="FILE.py:FUNCTION, a TRL reward function")
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--prompts-per-step", type=int, default=8)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--max-new-tokens", type=int, default=6)
    p.add_argument("--min-new-tokens", type=int, default=0)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--micro-batch", type=int, default=None,
                   help="sequences per forward pass (per_device_train_batch_size; the rest by gradient accumulation, "
                        "one generation of the whole step's batch): rlstream's learner.micro_batch_size")
    p.add_argument("--device", default="cpu", help="cpu, or cuda: the trainer's use_cpu is false (bench/gpu.py)")
    p.add_argument("--launch-ts", type=float, default=None, help="time.time() when the benchmark launched this process")
    args = p.parse_args()
    launched = args.launch_ts or T0

    import os

    import torch
    import transformers
    import trl
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    reward = load_reward(args.reward)
    print(f"TRL side: trl {trl.__version__}, transformers {transformers.__version__}, torch {torch.__version__}, "
          f"torch threads {torch.get_num_threads()} (OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')}), "
          f"reward {args.reward}", flush=True)

    rows = [json.loads(line) for line in open(args.data) if line.strip()]
    # repeat the prompts so the trainer never runs out within the steps
    need = args.steps * args.prompts_per_step
    rows = (rows * (need // len(rows) + 1))[:need]
    dataset = Dataset.from_list([{"prompt": r["prompt"], "answer": r["answer"]} for r in rows])

    batch = args.group_size * args.prompts_per_step
    micro = args.micro_batch or batch
    if batch % micro or micro % args.group_size:
        raise SystemExit(f"--micro-batch {micro} must divide the step's {batch} sequences and hold whole groups of {args.group_size}")
    wanted = dict(
        output_dir=args.out + ".trainer", learning_rate=args.lr, lr_scheduler_type="constant", warmup_steps=0,
        per_device_train_batch_size=micro, gradient_accumulation_steps=batch // micro, steps_per_generation=batch // micro,
        num_generations=args.group_size, max_completion_length=args.max_new_tokens, temperature=args.temperature,
        max_steps=args.steps, logging_steps=1, save_strategy="no", report_to="none", use_cpu=args.device == "cpu", beta=0.0,
        seed=args.seed, max_grad_norm=1.0, use_vllm=False, top_k=0, top_p=1.0, adam_beta1=0.9, adam_beta2=0.999,
        weight_decay=0.0, disable_tqdm=True,
        # rlstream's learner trains in float32 without recomputing activations (learner.dtype,
        # learner.gradient_checkpointing); TRL's config turns both on by default, and bf16
        # autocast on this CPU makes its steps ~8x slower: identical work is float32 on both sides
        bf16=False, fp16=False, gradient_checkpointing=False,
        # rlstream's GRPO defaults: token-mean loss over the batch, group std normalisation
        loss_type="dapo", scale_rewards="group",
        generation_kwargs={"min_new_tokens": args.min_new_tokens} if args.min_new_tokens else None,
    )
    names = {f.name for f in dataclasses.fields(GRPOConfig)}
    dropped = sorted(k for k in wanted if k not in names)
    if "generation_kwargs" in dropped and args.min_new_tokens:
        raise SystemExit(f"trl {trl.__version__}: GRPOConfig has no generation_kwargs, so min_new_tokens cannot be set")
    if dropped:
        print(f"TRL side: settings this trl does not have: {dropped}", flush=True)
    config = GRPOConfig(**{k: v for k, v in wanted.items() if k in names})
    tok = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype="float32")
    out = open(args.out, "w")
    timing = {"begin": 0.0, "step_s": 0.0, "gen_s": 0.0, "gen_acc": 0.0}

    class Log(TrainerCallback):
        def on_step_begin(self, _args, state, control, **kw):
            timing["begin"] = time.perf_counter()
            timing["gen_acc"] = 0.0

        def on_step_end(self, _args, state, control, **kw):
            timing["step_s"] = time.perf_counter() - timing["begin"]
            timing["gen_s"] = timing["gen_acc"]

        def on_log(self, _args, state, control, logs=None, **kw):
            logs = logs or {}
            value = logs.get("reward", logs.get(f"rewards/{reward.__name__}/mean"))
            if value is not None:
                out.write(json.dumps({"step": state.global_step, "elapsed_s": time.time() - launched, "reward": float(value),
                                      "samples": state.global_step * args.group_size * args.prompts_per_step,
                                      "step_s": timing["step_s"], "generate_score_s": timing["gen_s"]}) + "\n")
                out.flush()

    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=config, train_dataset=dataset, processing_class=tok, callbacks=[Log()])
    # what the trainer will really do, not what was asked: a library default that turns mixed
    # precision or checkpointing back on changes the work, so the race refuses to run
    mixed = getattr(trainer.accelerator, "mixed_precision", "no")
    dtypes = sorted({str(q.dtype).removeprefix("torch.") for q in trainer.model.parameters()})
    # (the trainer turns checkpointing on when training starts: its config says whether it will)
    checkpointing = bool(config.gradient_checkpointing or getattr(trainer.model, "is_gradient_checkpointing", False))
    print(f"TRL side: parameters {', '.join(dtypes)}, mixed precision {mixed}, gradient checkpointing "
          f"{'on' if checkpointing else 'off'}", flush=True)
    if mixed != "no" or dtypes != ["float32"] or checkpointing:
        raise SystemExit("TRL side: not the work rlstream's learner does (float32, no mixed precision, no gradient "
                         f"checkpointing): parameters {dtypes}, mixed precision {mixed!r}, checkpointing {checkpointing}")
    # generation and scoring happen inside the step; timing them leaves the training phase
    generate = getattr(trainer, "_generate_and_score_completions", None)
    if generate is not None:
        def timed(*a, **kw):
            t = time.perf_counter()
            try:
                return generate(*a, **kw)
            finally:
                timing["gen_acc"] += time.perf_counter() - t

        trainer._generate_and_score_completions = timed
    trainer.train()
    out.close()


if __name__ == "__main__":
    main()
