"""How close two trainings of the same steps must end, from the arithmetic rather than from one machine.

Two runs that do the same math in another summation order (2 ranks against one process, one
micro-batch against eight, DeepSpeed against torch) end with weights that differ by float
noise. The largest elementwise difference is a poor measure of it: Adam divides each gradient
element by ``sqrt(v) + eps``, so an element whose gradient is near zero turns noise of ~1e-10
in the gradient into an update difference of up to ``lr * 1e-10 / eps``, and which elements
those are depends on the machine's rounding (the same SFT run moved its worst weight by
1.45e-5 on one machine of this kind and by under 1e-5 on another).

The size of the difference against the size of the update does not depend on a few elements:
float-order noise leaves ``||a - b|| / ||a - start||`` near 1e-5 (5e-6 measured on the 2-rank
SFT run), while a run that is one step behind, or weights a micro-batch wrongly, differs by a
sizeable part of its update (0.44 for the SFT run three steps behind). ``rel`` = 1e-3 sits
between the two with two orders of magnitude on each side.
"""

from __future__ import annotations

import torch


def _flat(weights: dict[str, torch.Tensor], keys: list[str]) -> torch.Tensor:
    return torch.cat([weights[k].detach().double().flatten() for k in keys])


def relative_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], start: dict[str, torch.Tensor]) -> float:
    """``||a - b|| / ||a - start||`` over every tensor ``a`` holds."""
    keys = sorted(a)
    assert set(keys) == set(b), sorted(set(keys) ^ set(b))
    moved = float((_flat(a, keys) - _flat(start, keys)).norm())
    assert moved > 0, "the weights did not move from the start: nothing was trained"
    return float((_flat(a, keys) - _flat(b, keys)).norm()) / moved


def assert_same_training(a, b, start, *, behind=None, rel: float = 1e-3) -> float:
    """``a`` and ``b`` are one training up to float summation order (see the module docstring).

    ``behind``: the weights of ``a``'s run some steps earlier. They must fail the same check,
    which shows the bound tells a different training apart from float noise."""
    got = relative_difference(a, b, start)
    assert got <= rel, f"||a - b|| is {got:.3g} of the update (float-order noise is ~1e-5; bound {rel:g})"
    if behind is not None:
        control = relative_difference(a, behind, start)
        assert control > 10 * rel, f"the control (a run some steps behind) is only {control:.3g} of the update"
    return got
