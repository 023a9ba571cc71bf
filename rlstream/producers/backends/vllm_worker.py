"""What rlstream adds to each vLLM worker (``worker_extension_cls``): calls the producer makes
by name through ``collective_rpc``, run where the engine holds the weights."""

from __future__ import annotations


class WorkerExtension:
    """Mixed into vLLM's worker class; ``self`` is the worker."""

    def rlstream_fingerprint(self) -> list[float]:
        """The fingerprint of the weights as this worker's model holds them
        (:mod:`rlstream.weights.fingerprint`)."""
        from rlstream.weights.fingerprint import of_model

        return list(of_model(self.model_runner.model))
