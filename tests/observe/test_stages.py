"""The per-stage breakdown and the bottleneck verdict, from phase figures worked out by hand."""

import time

from rlstream.broker.telemetry import Phases, phase_key, prometheus_name
from rlstream.observe.stages import bottleneck, breakdown, summary


def L(**phases):
    return {phase_key("learner", p): v for p, v in phases.items()}


def P(**phases):
    return {phase_key("producer", p): v for p, v in phases.items()}


def S(**phases):
    return {phase_key("scorer", p): v for p, v in phases.items()}


def test_learner_never_waits_is_the_bottleneck():
    # learner: work 0.02+0.05+0.08+0.01 = 0.16, wait 0.0 -> busy 1.0
    # producer: work 0.10 (generate) + 0.01 (publish) = 0.11, wait 0.30 pacing + 0.01 fetch = 0.31 -> 0.11/0.42 = 0.2619
    # scorer: work 0.001, wait 0.2 -> 0.001/0.201 = 0.004975
    figures = {"learner": [L(wait=0.0, collate=0.02, forward=0.05, backward=0.08, optimizer=0.01)],
               "producer": [P(pacing=0.30, fetch=0.01, generate=0.10, publish=0.01)],
               "scorer": [S(fetch=0.2, score=0.001)]}
    assert bottleneck(figures) == "learner"
    st = breakdown(figures)
    assert st["learner"].busy == 1.0
    assert abs(st["producer"].busy - 0.11 / 0.42) < 1e-12
    assert abs(st["scorer"].busy - 0.001 / 0.201) < 1e-12
    assert st["learner"].phases["publish"] == 0.0  # a phase not reported counts 0


def test_learner_waiting_on_generation_blames_the_producers():
    # learner: work 0.1, wait 0.9 -> 0.1
    # producers: one flat out (generate 0.5, no wait -> 1.0), one half idle (generate 0.5, fetch 0.5 -> 0.5);
    # the stage is their mean share 0.75, and its mean generate is 0.5 s
    figures = {"learner": [L(wait=0.9, forward=0.05, backward=0.05)],
               "producer": [P(generate=0.5), P(generate=0.5, fetch=0.5)],
               "scorer": [S(fetch=1.0, score=0.01)]}
    st = breakdown(figures)
    assert st["producer"].instances == 2 and st["producer"].busy == 0.75
    assert st["producer"].phases["generate"] == 0.5 and st["producer"].phases["fetch"] == 0.25
    assert bottleneck(figures) == "producer"


def test_a_slow_reward_blames_the_scorers():
    # scorer: score 2.0, fetch 0.0 -> 1.0; producer: generate 0.2, pacing 1.8 -> 0.1; learner: forward 0.1, wait 1.9 -> 0.05
    figures = {"learner": [L(wait=1.9, forward=0.1)], "producer": [P(generate=0.2, pacing=1.8)], "scorer": [S(score=2.0, fetch=0.0)]}
    assert bottleneck(figures) == "scorer"
    assert summary(figures)["bottleneck"] == "scorer"


def test_no_figures_no_verdict_and_ties_go_upstream():
    assert bottleneck({}) is None
    assert bottleneck({"learner": [{"loss/total": 1.0}]}) is None  # no phase keys: not reporting phases
    assert bottleneck({"learner": [L(wait=0.0)]}) is None  # reports, but did no work: busy 0
    # producer and learner both 1.0 busy: the earlier stage (producer) is named
    assert bottleneck({"learner": [L(forward=1.0)], "producer": [P(generate=1.0)]}) == "producer"
    # negative figures (a clock step) count as 0
    assert bottleneck({"learner": [L(forward=-1.0, wait=1.0)], "scorer": [S(score=0.5, fetch=0.5)]}) == "scorer"


def test_phases_record_every_phase_within_the_pass():
    ph = Phases("producer")
    ph.start()
    with ph.time("generate"):
        time.sleep(0.01)
    ph.add("publish", 0.0)
    ph.add("fetch", -1.0)  # clamped to 0
    out = ph.finish()
    assert set(out) == {f"time/producer/{p}_s" for p in ("pacing", "fetch", "weight_wait", "weight_reload", "generate", "publish", "loop")}
    assert all(v >= 0 for v in out.values())
    assert out["time/producer/generate_s"] >= 0.01
    assert sum(v for k, v in out.items() if not k.endswith("loop_s")) <= out["time/producer/loop_s"]
    ph.start()
    assert ph.finish()["time/producer/generate_s"] == 0.0  # a new pass starts from zero
    assert prometheus_name("time/learner/forward_s") == "rlstream_time_learner_forward_s"
