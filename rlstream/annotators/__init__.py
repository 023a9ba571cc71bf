"""Stages that annotate scored groups with per-token log-probs of another model: the frozen
``reference`` (KL term) and the ``teacher`` of on-policy distillation. Both sit between the
scorers and the learner and scale like scorers; see :mod:`rlstream.annotators.loop`."""
