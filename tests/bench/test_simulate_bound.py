"""bench/simulate_bound.py: the TTFT bound's later-turn misses on a small run, each looked at on its arrival."""

from __future__ import annotations

from bench.simulate_bound import run_bound
from bench.simulate_pools import Load
from dcpserve.deployments.admission.queue import AdmissionQueue


def test_every_later_turn_miss_is_looked_at_and_the_queue_is_left_as_it_was() -> None:
    acquire_reply = AdmissionQueue.acquire_reply
    # One node at a heavy load, so that some later turns miss a tight target.
    load = Load(1, 60, 10.0, 4.0, 0.5, 0.05)
    result = run_bound(load, 1, 1, 0.5)
    assert AdmissionQueue.acquire_reply is acquire_reply  # the run's wrapper is taken off
    agentic, everyone = result["rows"]["agentic"], result["rows"]["all"]
    assert 0 < agentic["later_turns"] <= everyone["later_turns"]
    for row in (agentic, everyone):
        grants = sum(count for key, count in row.items() if key.startswith("granted_"))
        assert grants == row["missed"]  # each miss was seen arriving, granted (or never), and counted once
        assert row["no_replica_in_time"] <= row["missed"] and row["queue_saw_none"] <= row["missed"]
    assert everyone["missed"] > 0
