"""Datasets and the prompt format, shared by the feeder, the learner's offline modes, the
environments, evaluation and preflight:

- :mod:`rlstream.data.rows`: rows from jsonl, json, parquet, a ``datasets`` directory or a Hub id;
- :mod:`rlstream.data.shards`: WebDataset shards as a data source, read in a resumable order;
- :mod:`rlstream.data.chat`: TRL's conversational format, rendered with the chat template.
"""
