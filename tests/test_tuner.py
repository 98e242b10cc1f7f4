"""The auto-tuner's policy, as a pure function over measured throughputs and memory readings."""

import math

from crossbow_mpi.control.learner_tuner import Memory, Policy, decide

PLENTY = Memory(used=1e9, cap=1e12, per_learner=1e6)
POLICY = Policy(threshold=0.1, max_learners=8)


def settle(throughput_at, memory_at=lambda k: PLENTY, policy=POLICY):
    """Drive the policy like the tuner does; return the decisions and the final number of learners."""
    learners, baseline, decisions = 1, None, []
    for _ in range(50):
        decision, new = decide(policy, learners, throughput_at(learners), baseline, memory_at(learners))
        decisions.append(decision)
        if decision == "wait":
            return decisions, learners
        if decision == "add":
            baseline = throughput_at(learners)
        learners = new
        if decision in ("remove", "stop"):
            return decisions, learners
    raise AssertionError("the policy never settled")


def test_plateau_at_three_settles_at_three():
    rates = {1: 100.0, 2: 180.0, 3: 250.0, 4: 260.0, 5: 262.0}
    decisions, learners = settle(rates.get)
    assert decisions == ["add", "add", "add", "remove"] and learners == 3


def test_a_gain_of_exactly_the_threshold_is_not_enough():
    decisions, learners = settle({1: 100.0, 2: 110.0}.get)
    assert decisions == ["add", "remove"] and learners == 1


def test_memory_cap_stops_below_it():
    def memory(k):
        return Memory(used=k * 1.0e9, cap=3.5e9, per_learner=1.0e9)

    decisions, learners = settle(lambda k: 100.0 * k, memory)
    assert decisions == ["add", "add", "stop"] and learners == 3
    assert memory(learners).used <= memory(learners).cap


def test_max_learners_is_never_exceeded():
    decisions, learners = settle(lambda k: 100.0 * k, policy=Policy(threshold=0.1, max_learners=4))
    assert decisions[-1] == "stop" and learners == 4


def test_zero_or_missing_samples_never_cause_a_decision():
    for missing in (None, 0.0, -1.0, math.nan, math.inf):
        assert decide(Policy(0.1, 8), 2, missing, 100.0, PLENTY) == ("wait", 2)
        assert decide(Policy(0.1, 8), 1, missing, None, PLENTY) == ("wait", 1)
