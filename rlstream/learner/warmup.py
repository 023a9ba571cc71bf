"""The learner's warm-up: one forward and backward pass on a dummy micro-batch before the
first batch arrives.

A process's first pass through the model pays once for what later passes reuse: memory
touched for the first time (on a virtual machine, a page fault the host must back too),
allocator growth, kernel set-up. In a streaming run the learner would otherwise wait for
the first rollouts while the producers generate them, then pay those costs on the first
step, on the run's critical path. On this project's 2-core machine, with the race's long
workload, the first step's forward pass took 1.6-2.7 s and 0.16-0.21 s after a warm-up (the
steady state: 0.15-0.5 s).

The pass leaves nothing behind: no gradients (zeroed), no optimizer step, and the random
number generator's state restored (dropout draws do not shift the run's stream), so a run
trains the same weights with and without it.
"""

from __future__ import annotations

import time

import numpy as np
import torch

from rlstream.learner import distributed as dist
from rlstream.learner.batching import Row, collate, forward_logprobs, split_rows

PROMPT_TOKENS = 32
"""The dummy rows' prompt length: the learner has not seen a prompt yet. The completion is
``producer.max_new_tokens`` long; the first step pays only for what its real rows need beyond."""


def warms_up(cfg) -> bool:
    """The learner waits for streamed rollouts (RL, online DPO) and runs eagerly on the torch
    engine: DeepSpeed counts every backward as a micro-step, and a compiled model would
    compile for a shape no batch has."""
    lcfg = cfg.learner
    return lcfg.warmup and cfg.is_online and lcfg.engine == "torch" and not lcfg.compile


def dummy_rows(cfg, pad_id: int) -> list[Row]:
    """One micro-batch of pad tokens: ``micro_batch_size`` rows (at most a step's sequences, and
    at most what ``micro_batch_tokens`` holds) of a :data:`PROMPT_TOKENS` prompt and a
    ``producer.max_new_tokens`` completion, within ``learner.max_seq_len``."""
    lcfg = cfg.learner
    rows = min(lcfg.micro_batch_size, lcfg.batch_groups * cfg.algorithm_params.samples_per_record)
    completion = min(cfg.producer.max_new_tokens, lcfg.max_seq_len - 1)
    prompt = min(PROMPT_TOKENS, lcfg.max_seq_len - completion)
    dummies = [Row(np.full(prompt, pad_id, np.int64), np.full(completion, pad_id, np.int64)) for _ in range(rows)]
    return split_rows(dummies, lcfg)[0]  # as many as a step's first pass of rows this long holds


def warm_up(learner) -> float | None:
    """Run the pass when :func:`warms_up` (and on one rank); its seconds, or None when skipped."""
    if not warms_up(learner.cfg) or dist.is_active(learner.engine):
        return None
    t0 = time.perf_counter()
    lcfg = learner.cfg.learner
    tb = collate(dummy_rows(learner.cfg, learner.pad_id), learner.pad_id, lcfg.max_seq_len, lcfg.pad_to_multiple).to(learner.device)
    on_cpu = learner.device.type == "cpu"
    with torch.random.fork_rng(devices=[] if on_cpu else [learner.device], device_type=None if on_cpu else learner.device.type):
        out = forward_logprobs(learner.engine.module, tb, keep_logits=True)
        out.logprobs.sum().backward()
    learner.model.zero_grad(set_to_none=True)
    return time.perf_counter() - t0
