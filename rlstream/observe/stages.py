"""Where the time goes: the per-stage breakdown and the bottleneck, from the phase figures.

Every component reports the seconds of its last loop pass per phase
(``time/<stage>/<phase>_s``, see :class:`rlstream.broker.telemetry.Phases`). A stage's
**busy** share is its work phases over work plus wait phases (``STAGE_PHASES``): a stage that
never waits for data or room is working flat out. The **bottleneck** is the busiest stage:
the one the others wait for. A stage with several instances (producers, scorers) counts as
the mean of its instances' shares. With no phase figures at all there is no verdict (None).

Pure functions of plain dicts: ``rlstream status``, the live view of ``rlstream run``, the
dashboard (its JavaScript twin) and ``timeline.jsonl`` all use these.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Mapping

from rlstream.broker.telemetry import STAGE_PHASES, phase_key

STAGE_ORDER = ("producer", "scorer", "learner")
"""Pipeline order; also the tie-break (the earlier stage feeds the later ones)."""


@dataclass
class StageTimes:
    """One stage: mean seconds per phase over its reporting instances, and the mean of the
    instances' busy shares (one idle producer beside a flat-out one is half busy)."""

    stage: str
    instances: int
    phases: dict[str, float] = field(default_factory=dict)
    busy: float = 0.0


def stage_times(stage: str, instances: Iterable[Mapping[str, float]]) -> StageTimes | None:
    """The mean phase seconds of ``stage`` over the instances that report any of its phases."""
    spec = STAGE_PHASES[stage]
    names = spec["wait"] + spec["work"]
    rows = [{p: max(0.0, float(v.get(phase_key(stage, p), 0.0))) for p in names}
            for v in instances if any(phase_key(stage, p) in v for p in names)]
    if not rows:
        return None
    mean = {p: sum(r[p] for r in rows) / len(rows) for p in names}
    shares = []
    for r in rows:
        work, wait = sum(r[p] for p in spec["work"]), sum(r[p] for p in spec["wait"])
        shares.append(work / (work + wait) if work + wait > 0 else 0.0)
    return StageTimes(stage, len(rows), mean, sum(shares) / len(shares))


def breakdown(figures: Mapping[str, Iterable[Mapping[str, float]]]) -> dict[str, StageTimes]:
    """``{stage: [values of each instance]}`` -> ``{stage: StageTimes}`` for the stages that report."""
    out = {}
    for stage in STAGE_ORDER:
        st = stage_times(stage, figures.get(stage, ()))
        if st is not None:
            out[stage] = st
    return out


def bottleneck(figures: Mapping[str, Iterable[Mapping[str, float]]]) -> str | None:
    """The busiest stage (highest mean busy share); None when no stage reports phases or
    none did any work. Ties go to the earlier stage in the pipeline."""
    stages = breakdown(figures)
    best, best_share = None, 0.0
    for stage in STAGE_ORDER:
        if stage in stages and stages[stage].busy > best_share:
            best, best_share = stage, stages[stage].busy
    return best


def summary(figures: Mapping[str, Iterable[Mapping[str, float]]]) -> dict:
    """JSON-friendly: ``{"bottleneck": stage|None, "stages": {stage: {instances, busy, phases}}}``."""
    stages = breakdown(figures)
    return {
        "bottleneck": bottleneck(figures),
        "stages": {s: {"instances": st.instances, "busy": round(st.busy, 4),
                       "phases": {p: round(v, 6) for p, v in st.phases.items()}} for s, st in stages.items()},
    }
