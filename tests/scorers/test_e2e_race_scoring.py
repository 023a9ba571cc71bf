"""How bench/e2e.py turns repeated runs into the race's verdict: the mean curve of a
configuration's repeats, the median repeat's time to the target, a repeat that did not learn
counted as never, and a peer that never got there a lower bound; and the verdict, which reads
the time to target from launch, with the figure from the first step beside it. Worked by hand on step curves of 0s then 1s (a window of 2 first reaches 0.5 at the
first 1), one step a second from 5 s after launch."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("e2e_race", ROOT / "bench" / "e2e.py")
e2e = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = e2e  # its dataclasses look their module up
spec.loader.exec_module(e2e)

WINDOW, TARGET, STEPS = 2, 0.5, 12


def run(reaches_at: int | None, seed: int = 0, label: str = "rlstream async", step_s: float = 1.0) -> e2e.Run:
    """A run whose reward is 0 until step index ``reaches_at``, then 1 (None: 0 throughout)."""
    ones = 0 if reaches_at is None else STEPS - reaches_at
    rewards = [0.0] * (STEPS - ones) + [1.0] * ones
    points = [{"step": i + 1, "elapsed_s": 5.0 + i * step_s, "reward": r, "samples": 64 * (i + 1)} for i, r in enumerate(rewards)]
    return e2e.Run("long", label, "hf", "1", 0.0, points, seed=seed)


def repeats(*at: int | None, label: str = "rlstream async") -> list[e2e.Run]:
    return [run(a, seed, label) for seed, a in enumerate(at)]


def learned(runs: list[e2e.Run]) -> list[e2e.Run]:
    return [r for r in runs if e2e.rise(r.points, WINDOW) >= e2e.RISE_MIN]


def test_the_median_repeat_decides_and_a_repeat_that_never_got_there_counts_as_never():
    ours = repeats(2, 4, None)  # reached 2 s and 4 s after the first step, and never
    assert learned(ours) == ours[:2]
    assert e2e.median_time(ours, TARGET, WINDOW, from_first_step=True, learners=learned(ours)) == 4.0
    assert e2e.median_time(ours, TARGET, WINDOW, from_first_step=False, learners=learned(ours)) == 9.0  # 5 s to the first step


def test_a_repeat_that_did_not_learn_reaches_nothing_even_where_its_curve_touched_the_target():
    ours = repeats(2, 3, 4)
    assert e2e.median_time(ours, TARGET, WINDOW, from_first_step=True, learners=ours) == 3.0
    assert e2e.median_time(ours, TARGET, WINDOW, from_first_step=True, learners=[ours[0], ours[2]]) == 4.0


def test_the_ratio_is_median_against_median():
    ours, theirs = repeats(2, 4, None), repeats(10, 6, 8, label="TRL GRPOTrainer")
    everyone = learned(ours + theirs)
    assert e2e.ratio(theirs, ours, TARGET, WINDOW, from_first_step=True, learners=everyone) == (2.0, False)  # 8 / 4
    # from launch both add the same 5 s: (5 + 8) / (5 + 4)
    assert e2e.ratio(theirs, ours, TARGET, WINDOW, from_first_step=False, learners=everyone) == (pytest.approx(13 / 9), False)


def test_ours_never_there_in_most_repeats_is_a_miss():
    ours, theirs = repeats(2, None, None), repeats(6, 8, 10, label="TRL GRPOTrainer")
    assert e2e.ratio(theirs, ours, TARGET, WINDOW, from_first_step=True, learners=learned(ours + theirs)) == (None, False)


def test_a_peer_never_there_in_most_repeats_gives_a_lower_bound_of_its_whole_run():
    ours, theirs = repeats(2, 4, 6), repeats(3, None, None, label="TRL GRPOTrainer")
    # the median peer ran 11 s after its first step without getting there: at least 11 / 4
    assert e2e.ratio(theirs, ours, TARGET, WINDOW, from_first_step=True, learners=learned(ours + theirs)) == (2.75, True)


def test_against_a_peer_in_two_configurations_the_ratio_is_against_its_better_one():
    ours = repeats(2, 4, 6)
    whole = repeats(10, 8, 12, label="TRL GRPOTrainer")  # median 10: 2.5x
    micro = repeats(5, 6, 7, label="TRL GRPOTrainer (micro 16)")  # median 6: 1.5x
    everyone = learned(ours + whole + micro)
    assert e2e.ratio_vs_best([whole, micro], ours, TARGET, WINDOW, from_first_step=True, learners=everyone) == (1.5, False)
    # a lower bound against one configuration is not the smallest when the other got there
    stuck = repeats(3, None, None, label="TRL GRPOTrainer")  # at least 11 / 4
    assert e2e.ratio_vs_best([stuck, micro], ours, TARGET, WINDOW, from_first_step=True,
                             learners=learned(ours + stuck + micro)) == (1.5, False)
    # ours never there: a miss whatever the peer did
    never = repeats(2, None, None)
    assert e2e.ratio_vs_best([whole, micro], never, TARGET, WINDOW, from_first_step=True,
                             learners=learned(never + whole + micro)) == (None, False)


def test_the_median_of_per_run_figures_skips_runs_without_one():
    rs = repeats(2, 4, 6)
    for r, sps in zip(rs, (100.0, float("nan"), 120.0)):
        r.extra = {"sps": sps}
    assert e2e.medians(rs, "sps") == 110.0 and e2e.medians(rs, "step_s") is None


def test_the_mean_curve_averages_every_repeat_step_by_step():
    # rewards by step index: 1 from index 2, 1 from index 4, never; steps of 1, 2 and 3 s from 5 s
    rs = [run(2, 0, step_s=1.0), run(4, 1, step_s=2.0), run(None, 2, step_s=3.0)]
    mean = e2e.mean_run(rs)
    assert mean.group == rs[0].group and [p["step"] for p in mean.points] == list(range(1, STEPS + 1))
    assert [p["reward"] for p in mean.points[:6]] == pytest.approx([0, 0, 1 / 3, 1 / 3, 2 / 3, 2 / 3])
    assert [p["elapsed_s"] for p in mean.points[:3]] == pytest.approx([5.0, 7.0, 9.0])  # 5 + 2 s a step
    # a window of 2 first reaches 0.5 at index 4, (1/3 + 2/3) / 2: 8 s after the first step, 13 s from launch
    assert e2e.time_to(mean.points, TARGET, WINDOW, from_first_step=True) == pytest.approx(8.0)
    assert e2e.time_to(mean.points, TARGET, WINDOW) == pytest.approx(13.0)
    # a repeat that never got there pulls the mean down: two such of three keep it below 0.5
    assert e2e.time_to(e2e.mean_run([run(2), run(None, 1), run(None, 2)]).points, TARGET, WINDOW) is None


def test_the_mean_curve_keeps_only_the_steps_every_repeat_recorded():
    a, b = run(2, 0), run(2, 1)
    b.points = [p for p in b.points if p["step"] != 3][:-1]  # step 3 and the last step missing
    steps = [p["step"] for p in e2e.mean_run([a, b]).points]
    assert steps == [s for s in range(1, STEPS) if s != 3]


def started(reaches_at: int, first_step_s: float, label: str, seeds: int = 2) -> list[e2e.Run]:
    """Repeats that reach the target at step index ``reaches_at``, their first step ``first_step_s`` after launch."""
    out = []
    for seed in range(seeds):
        r = run(reaches_at, seed, label)
        for p in r.points:
            p["elapsed_s"] += first_step_s - 5.0
        out.append(r)
    return out


def test_async_against_a_peer_counts_from_launch_with_the_first_step_beside_it():
    # async's first step comes late (its producers generate first) and it then gets there in 4 s:
    # 14 s from launch; TRL's first step comes at 5 s and it gets there 8 s later: 13 s from launch
    ours, theirs = started(4, 10.0, "rlstream async"), started(8, 5.0, "TRL GRPOTrainer")
    for r, sps in zip(ours + theirs, (120.0, 120.0, 100.0, 100.0)):
        r.extra = {"sps": sps}
    means = {rs[0].group: e2e.mean_run(rs) for rs in (ours, theirs)}
    out, bounds = e2e.async_ratios("long_hf_async_vs_trl", ours, [theirs], means, TARGET, WINDOW, learned=True,
                                   learners=ours + theirs, mean_learners=list(means.values()))
    assert out["long_hf_async_vs_trl"] == pytest.approx(13 / 14)  # the verdict's figure: from launch
    assert out["long_hf_async_vs_trl_from_first_step"] == pytest.approx(8 / 4)
    assert out["long_hf_async_vs_trl_median_repeat"] == pytest.approx(13 / 14)
    assert out["long_hf_async_vs_trl_from_first_step_median_repeat"] == pytest.approx(2.0)
    assert out["long_hf_async_vs_trl_samples_per_s"] == pytest.approx(1.2) and bounds == []


def fake_verdict(**figures: float) -> dict:
    return {"repeats": 5, **figures}


def test_the_verdict_reads_the_launch_figure_even_where_the_first_step_one_meets_the_goal():
    out = fake_verdict(long_hf_async_vs_trl=1.2, long_hf_async_vs_trl_from_first_step=1.66,
                       long_vllm_async_vs_trl=1.1, long_vllm_async_vs_trl_from_first_step=1.5,
                       long_hf_async_vs_sync=1.7, long_hf_async_vs_sync_from_first_step=1.2,
                       short_hf_async_vs_trl=1.05, short_hf_async_vs_trl_from_first_step=0.9)
    rows = e2e.verdict_rows(out, ["short", "long"], ["hf", "vllm"])
    by = {(r[0], r[1], r[2].split()[0]): r for r in rows}
    assert set(by) == {("long", "hf", "TRL"), ("long", "vllm", "TRL"), ("long", "hf", "rlstream"), ("short", "hf", "TRL")}
    assert by["long", "hf", "TRL"][3:5] == (1.2, 1.66) and by["long", "hf", "TRL"][-2:] == (1.3, "no")
    assert by["long", "hf", "rlstream"][-1] == "yes" and by["short", "hf", "TRL"][-1] == "yes"
    # the headline: long, async vs TRL from launch, its best backend, with the first-step figure beside it
    assert e2e.headline(out, ["short", "long"], ["hf", "vllm"]) == {
        "ratio_of": "long_hf_async_vs_trl", "ratio": 1.2, "goal": 1.3, "ratio_from_first_step": 1.66}


def test_where_no_mean_curve_learned_the_verdict_reads_samples_per_s():
    out = fake_verdict(long_time_to_target_measurable=False, long_hf_async_vs_trl=None,
                       long_hf_async_vs_trl_from_first_step=None, long_hf_async_vs_trl_samples_per_s=1.4)
    assert e2e.verdict_rows(out, ["long"], ["hf"])[0][-1] == "yes"
    assert e2e.headline(out, ["long"], ["hf"]) == {"ratio_of": "long_hf_async_vs_trl_samples_per_s", "ratio": 1.4, "goal": 1.3,
                                                   "ratio_from_first_step": None}
    # short alone: its own goal; nothing raced against TRL: not measured
    assert e2e.headline(fake_verdict(), ["short"], ["hf"])["goal"] == 1.0 and "ratio" not in e2e.headline(fake_verdict(), ["short"], ["hf"])
