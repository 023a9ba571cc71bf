"""The run directory and what the learner reports into it:

- :mod:`rlstream.rundir.files`: every file name in a run directory, and the torn-line-safe
  jsonl reader and writers;
- :mod:`rlstream.rundir.report`: the ``report_to`` sinks (tensorboard, wandb, trackio, mlflow)
  and the sample-completion rows beside ``metrics.jsonl``.
"""
