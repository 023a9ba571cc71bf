"""Producers: generation backends (hf, vllm, openai-compatible http, fake), the producer
loop that turns prompts into rollout groups, and the feeder that publishes a dataset.

Log-prob convention (every backend): each completion token carries ``log_softmax`` of the
model's **raw** logits at that position, i.e. the log-probability under the policy at
temperature 1 before top-k / top-p / temperature processing, clamped to <= 0. The learner
recomputes the same quantity (a plain forward pass, ``log_softmax`` at temperature 1), so
importance ratios compare like with like. ``RolloutGroup.sampling["logprobs"] == "raw"``
records this; the sampling knobs that shaped the actual draw are in the same dict.
"""

from rlstream.producers.backends.base import Backend, Completion, ProducerError, SamplingSpec, WeightsSource

__all__ = ["Backend", "Completion", "ProducerError", "SamplingSpec", "WeightsSource"]
