"""CROSSBOW's learner auto-tuner: add a learner per rank while that raises throughput by more than a threshold.

The policy is a pure function of measured throughputs and memory readings; `AutoTuner` feeds it windows
of measured steps, lets rank 0 decide and broadcasts the decision, so every rank always holds the same k.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch

from crossbow_mpi.comm import Communicator
from crossbow_mpi.comm.gpus import gpu_owners, ranks_per_gpu

RAM_FRACTION = 0.8
WARMUP_STEPS = 2


@dataclass(frozen=True)
class Policy:
    """The tuner's limits."""

    threshold: float
    """Relative throughput gain that justifies one more learner."""
    max_learners: int
    """Most learners per rank."""


@dataclass(frozen=True)
class Memory:
    """One rank's memory reading, in bytes."""

    used: float
    cap: float
    per_learner: float

    @property
    def room_for_one_more(self) -> bool:
        return self.used + self.per_learner <= self.cap


def decide(
    policy: Policy, learners: int, throughput: float | None, baseline: float | None, memory: Memory
) -> tuple[str, int]:
    """Return (decision, learners): `wait` (no usable sample), `add`, `remove` (and stop) or `stop`.

    `baseline` is the throughput measured with one learner fewer (None at the first measurement).
    """
    if throughput is None or not math.isfinite(throughput) or throughput <= 0:
        return "wait", learners
    if baseline is not None and throughput <= baseline * (1 + policy.threshold):
        return "remove", learners - 1
    if learners < policy.max_learners and memory.room_for_one_more:
        return "add", learners + 1
    return "stop", learners


class AutoTuner:
    """Measure throughput over windows of steps and change the number of learners per rank."""

    def __init__(
        self,
        policy: Policy,
        interval: int,
        comm: Communicator,
        device: torch.device,
        max_memory_gib: float,
        local_size: int,
        learner_bytes: Callable[[], float],
        warmup: int = WARMUP_STEPS,
    ):
        self.policy = policy
        self.interval = interval
        self.comm = comm
        self.device = device
        self.max_memory = max_memory_gib * 2**30
        self.local_size = local_size
        self.learner_bytes = learner_bytes
        """What one more learner costs, from the bytes of its tensors and its measured activations."""
        self.warmup = warmup
        self.ranks_per_gpu = ranks_per_gpu(gpu_owners(comm, device), comm.rank)
        self.restart()

    def restart(self) -> None:
        """Start tuning again from one learner per rank."""
        self.active = True
        self.baseline: float | None = None
        self.memory_before_add: float | None = None
        self.observed_bytes = 0.0
        self._new_window()

    def _new_window(self) -> None:
        self.skip = self.warmup
        self.steps = 0
        self.samples = 0
        self.seconds = 0.0

    def observe(self, local_samples: int, seconds: float, learners: int) -> dict | None:
        """Record one step of this rank; at the end of a window return the decision record (collective)."""
        if not self.active:
            return None
        if self.skip:
            self.skip -= 1
            return None
        self.steps += 1
        self.samples += local_samples
        self.seconds += seconds
        if self.steps < self.interval:
            return None
        rate = self.samples / self.seconds if self.seconds > 0 else 0.0
        memory = self.read_memory()
        readings = self.comm.allgather_json([rate, asdict(memory)])
        record = None
        if self.comm.rank == 0:
            rates = [r for r, _ in readings]
            throughput = sum(rates) if all(r > 0 for r in rates) else None
            tightest = min((Memory(**m) for _, m in readings), key=lambda m: m.cap - m.used - m.per_learner)
            decision, new_learners = decide(self.policy, learners, throughput, self.baseline, tightest)
            record = {
                "event": "autotune",
                "learners": new_learners,
                "measured_learners": learners,
                "samples_per_s": throughput,
                "decision": decision,
            }
        record = self.comm.bcast_json(record)
        self._apply(record, memory)
        return record

    def _apply(self, record: dict, memory: Memory) -> None:
        decision = record["decision"]
        if decision == "add":
            self.baseline = record["samples_per_s"]
            self.memory_before_add = memory.used
        elif decision in ("remove", "stop"):
            self.active = False
        self._new_window()

    def read_memory(self) -> Memory:
        """This rank's memory in use, its cap, and the estimated cost of one more learner."""
        if self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            used, cap = (total - free) / self.ranks_per_gpu, total / self.ranks_per_gpu
        else:
            used = resident_bytes()
            cap = (self.max_memory or RAM_FRACTION * _total_ram_bytes()) / self.local_size
        if self.memory_before_add is not None:
            self.observed_bytes = max(self.observed_bytes, used - self.memory_before_add)
        return Memory(used=used, cap=cap, per_learner=max(self.learner_bytes(), self.observed_bytes))

    def state_dict(self) -> dict:
        return {
            "active": self.active,
            "baseline": self.baseline,
            "observed_bytes": self.observed_bytes,
            "memory_before_add": self.memory_before_add,
        }

    def load_state_dict(self, state: dict) -> None:
        self.active, self.baseline = state["active"], state["baseline"]
        self.observed_bytes, self.memory_before_add = state["observed_bytes"], state["memory_before_add"]
        self._new_window()


def resident_bytes() -> float:
    """Return this process's resident set size in bytes."""
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _total_ram_bytes() -> float:
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
