"""rlstream: asynchronous, streaming post-training for language models over NATS JetStream."""

__version__ = "0.1.0"
