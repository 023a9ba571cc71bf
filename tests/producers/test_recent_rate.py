"""The producer's reported rates: over a window of finished batches, not batch to batch."""

from __future__ import annotations

import pytest

from rlstream.producers.loop import RecentRate


def test_two_lanes_finishing_together_report_the_real_rate():
    rate = RecentRate(now=0.0, window_s=10.0)
    assert rate.add(1.0, 100) == pytest.approx((100.0,))  # 100 tokens in the first second
    # the second lane's batch finishes 1 ms later: 200 tokens in 1.001 s, not 100 in 1 ms (100,000/s)
    assert rate.add(1.001, 100) == pytest.approx((200 / 1.001,))


def test_batches_older_than_the_window_leave_it():
    rate = RecentRate(now=0.0, window_s=10.0)
    rate.add(1.0, 100, 2)
    rate.add(1.001, 100, 2)
    # at t=20 the window is (10, 20]: only the new batch, over 10 s
    assert rate.add(20.0, 50, 1) == pytest.approx((5.0, 0.1))


def test_idle_time_is_left_out_after_a_restart():
    rate = RecentRate(now=0.0, window_s=10.0)
    rate.add(1.0, 100)
    rate.restart(30.0)  # nothing fetched: the idle time before 30 s does not count
    assert rate.add(32.0, 40) == pytest.approx((20.0,))
