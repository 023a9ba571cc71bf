"""What rlstream adds to each vLLM worker (``worker_extension_cls``): calls the producer makes
by name through ``collective_rpc``, run where the engine holds the weights.

On CPU, vLLM packs each linear layer's weight for oneDNN after loading and drops the parameter
(``dispatch_cpu_unquantized_gemm(..., remove_weight=True)``): the packed copy cannot be read
back. So, imported in the worker before its model loads, this module has that step record the
fingerprint of each weight just before it is packed, and the fingerprint of the model is its
readable parameters plus those records: the weights as the loader left them.
"""

from __future__ import annotations

from typing import Any

from rlstream.weights.fingerprint import Fingerprint, of_tensors

PACKED = "_rlstream_packed_fingerprint"
"""The attribute a layer whose weight vLLM packed keeps that weight's fingerprint in."""


def _record_before_packing() -> None:
    try:
        from vllm.model_executor.layers import utils
    except ImportError:  # not in a vLLM worker
        return
    pack = getattr(utils, "dispatch_cpu_unquantized_gemm", None)
    if pack is None or getattr(pack, "records_fingerprint", False):
        return

    def recorded(layer: Any, remove_weight: bool) -> None:
        weight = getattr(layer, "weight", None)
        if remove_weight and weight is not None and not weight.is_meta and weight.numel():
            setattr(layer, PACKED, of_tensors([("weight", weight.data)]))
        return pack(layer, remove_weight)

    recorded.records_fingerprint = True
    utils.dispatch_cpu_unquantized_gemm = recorded


_record_before_packing()


def model_fingerprint(model) -> Fingerprint:
    """Every readable parameter of ``model``, plus the recorded fingerprint of each packed one."""
    total_abs, total_sq = of_tensors(model.named_parameters())
    for module in model.modules():
        packed = getattr(module, PACKED, None)
        weight = getattr(module, "weight", None)
        if packed is not None and weight is not None and weight.numel() == 0:
            total_abs, total_sq = total_abs + packed[0], total_sq + packed[1]
    return total_abs, total_sq


class WorkerExtension:
    """Mixed into vLLM's worker class; ``self`` is the worker."""

    def rlstream_fingerprint(self) -> list[float]:
        """The fingerprint of the weights as this worker's model holds them
        (:mod:`rlstream.weights.fingerprint`)."""
        return list(model_fingerprint(self.model_runner.model))
