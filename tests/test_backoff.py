"""core/backoff.py: the one backoff every retry loop uses."""

from __future__ import annotations

from core.backoff import Backoff, backoff_delay


def test_delays_double_from_the_initial_wait_up_to_the_cap():
    assert [backoff_delay(n, 1.0, 10.0) for n in range(1, 7)] == [1.0, 2.0, 4.0, 8.0, 10.0, 10.0]


def test_a_running_backoff_grows_and_starts_again_after_a_success():
    b = Backoff(0.5, 4.0)
    assert [b.next() for _ in range(5)] == [0.5, 1.0, 2.0, 4.0, 4.0]
    assert b.current == 4.0
    b.reset()
    assert b.current == 0.5 and b.next() == 0.5


def test_jitter_spreads_a_wait_within_its_share_and_never_past_it():
    waits = {backoff_delay(3, 1.0, 60.0, jitter=0.2) for _ in range(200)}
    assert all(3.2 <= w <= 4.8 for w in waits)
    assert len(waits) > 1
