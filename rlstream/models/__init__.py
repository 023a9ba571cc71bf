"""Models built locally: :mod:`rlstream.models.tiny` builds the tiny Llama and tokenizer that
the demo, the examples, the tests and the benchmarks run on (nothing is downloaded)."""
