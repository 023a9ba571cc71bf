"""AdamW's implementation: fused on CUDA where the kernel takes the dtypes, foreach where it
does not, torch's default on CPU (so CPU runs keep their numbers)."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from rlstream.config import LearnerConfig
from rlstream.learner.engines import adamw_kernel, make_optimizer


@dataclass
class Param:
    """What the choice reads of a parameter: where it lives and its dtype."""

    is_cuda: bool
    dtype: torch.dtype


def test_fused_on_cuda_foreach_where_fused_does_not_apply_and_the_default_on_cpu():
    assert adamw_kernel([Param(True, torch.float32), Param(True, torch.bfloat16)]) == {"fused": True}
    assert adamw_kernel([Param(True, torch.float32), Param(True, torch.float64)]) == {"foreach": True}
    assert adamw_kernel([Param(False, torch.float32)]) == {}
    assert adamw_kernel([Param(True, torch.float32), Param(False, torch.float32)]) == {}
    assert adamw_kernel([]) == {}
    opt = make_optimizer([torch.nn.Parameter(torch.zeros(3))], LearnerConfig())
    assert not opt.defaults.get("fused") and opt.defaults.get("foreach") is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: the fused AdamW kernel")
def test_on_cuda_the_fused_kernel_steps_as_the_per_tensor_loop_does():
    torch.manual_seed(0)
    ref = [torch.nn.Parameter(torch.randn(64, 64, device="cuda")) for _ in range(3)]
    fused = [torch.nn.Parameter(p.detach().clone()) for p in ref]
    lcfg = LearnerConfig(lr=1e-2, weight_decay=0.1)
    opt = make_optimizer(fused, lcfg)
    assert opt.defaults["fused"] is True
    loop = torch.optim.AdamW(ref, lr=1e-2, weight_decay=0.1, eps=1e-8, foreach=False)
    for _ in range(3):
        for p, q in zip(ref, fused):
            p.grad = torch.randn_like(p)
            q.grad = p.grad.clone()
        loop.step()
        opt.step()
    for p, q in zip(ref, fused):
        torch.testing.assert_close(q, p, rtol=1e-5, atol=1e-6)
