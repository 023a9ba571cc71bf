"""Held-out evaluation, in one place:

- :mod:`rlstream.evaluation.rounds`: pass@k, a round's prompts and its figures (no broker);
- :mod:`rlstream.evaluation.training`: the learner's rounds during training, over the broker
  (``Evaluator``, ``NoEvaluation``);
- :mod:`rlstream.evaluation.checkpoint`: ``rlstream eval CHECKPOINT``, one round in one process
  with the producers' HF backend and the scorers' reward terms. It sits on the entry points'
  floor (docs/architecture.md); nothing below it imports it.

Nothing is imported here, so importing ``rounds`` or ``training`` pulls in no stage.
"""
