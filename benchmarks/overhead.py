"""Framework overhead: 1 rank, 1 learner, crossbow_mpi S-SGD (default and `--fused-step`) against a bare PyTorch
loop, LeNet on MNIST.

The three loops run in one MPI process with 1 and then 2 intra-op threads, on the same model, the same batches
(crossbow's sampler order for the same seed) and the same update rule (momentum SGD with weight decay). They take
turns in rounds of a few dozen steps, the order rotating each round, so that the machine's drift (±10 % over
seconds on this VM, for the bare loop alone) hits every loop alike; samples/s is each loop's samples over its
seconds in the training steps (crossbow: `Run.train_step`, what its metrics' samples/s counts). Then one more
round of each with timers around its parts says where a step's time goes (`breakdown`, µs per step): the batch
fetch, forward and backward, the update (crossbow: the learners' local step and the sync), and the rest of the step.
"""

from __future__ import annotations

import contextlib
import json
import statistics
import time
from collections import Counter
from dataclasses import asdict, dataclass

from benchmarks import harness

LR = 0.01
TEST_SAMPLES = 1000


@dataclass
class Budget:
    """How much a mode trains."""

    batch_sizes: tuple[int, ...]
    threads: tuple[int, ...]
    """Intra-op threads of the process (both loops)."""
    samples: int
    """Training samples of each loop, in all rounds (within one epoch)."""
    rounds: int
    """Turns each loop takes, each `samples / rounds` samples."""
    timeout_s: float


FULL = Budget(batch_sizes=(16, 64), threads=(1, 2), samples=32000, rounds=40, timeout_s=900)
QUICK = Budget(batch_sizes=(16,), threads=(1, 2), samples=320, rounds=2, timeout_s=120)

COLUMNS = [
    "threads",
    "b",
    "crossbow_samples_per_s",
    "fused_samples_per_s",
    "pytorch_samples_per_s",
    "crossbow_vs_pytorch",
    "fused_vs_pytorch",
]
SYSTEMS = {"crossbow": False, "fused": True}
"""crossbow_mpi's variants: the default step, and `--fused-step` (the same bits; its kernel is compiled before the
timed runs)."""


class BareLoop:
    """Plain PyTorch training on crossbow's batches for `seed`."""

    def __init__(self, train_set, batch: int, seed: int):
        import torch

        from crossbow_mpi.config import Config
        from crossbow_mpi.data.sampler import GlobalSampler
        from crossbow_mpi.models import build_model

        defaults = Config()
        torch.manual_seed(seed)
        self.model = build_model("lenet", train_set.input_shape, train_set.num_classes)
        self.optimizer = torch.optim.SGD(
            self.model.parameters(), lr=LR, momentum=defaults.momentum, weight_decay=defaults.weight_decay
        )
        self.order = GlobalSampler(len(train_set), seed, rank=0, world_size=1)
        self.train_set, self.batch, self.offset = train_set, batch, 0

    def steps(self, count: int, parts: Counter | None = None) -> float:
        """Take `count` steps; return their seconds; add each part's seconds to `parts` if given."""
        import torch.nn.functional as F

        from crossbow_mpi.data.sampler import fetch_batch

        elapsed, parts = 0.0, Counter() if parts is None else parts
        for _ in range(count):
            started = time.perf_counter()
            inputs, targets = fetch_batch(self.train_set, self.order.indices(0, self.offset, 1, self.batch)[0])
            fetched = time.perf_counter()
            self.optimizer.zero_grad()
            F.cross_entropy(self.model(inputs), targets).backward()
            computed = time.perf_counter()
            self.optimizer.step()
            stepped = time.perf_counter()
            parts.update(
                {"batches": fetched - started, "forward_backward": computed - fetched, "update": stepped - computed}
            )
            elapsed += stepped - started
            self.offset += self.batch
        return elapsed


class CrossbowLoop:
    """crossbow_mpi's S-SGD run (built by `Trainer.start`) on one rank, stepped by `Run.train_step`."""

    def __init__(self, train_set, batch: int, threads: int, seed: int, fused: bool):
        from crossbow_mpi import Config, Trainer
        from crossbow_mpi.comm import MpiCommunicator
        from crossbow_mpi.models import build_model
        from crossbow_mpi.runtime import process

        config = Config(
            algorithm="ssgd",
            learners=1,
            batch_size=batch,
            lr=LR,
            threads=threads,
            seed=seed,
            fused_step=fused,
        )
        comm = MpiCommunicator(process.mpi().COMM_WORLD)
        model_fn = lambda: build_model("lenet", train_set.input_shape, train_set.num_classes)  # noqa: E731
        self.run = Trainer(config, comm).start(model_fn, train_set)

    def steps(self, count: int) -> float:
        """Take `count` steps; return the seconds of their `train_step`s."""
        return sum(self.run.train_step(LR).seconds for _ in range(count))


@contextlib.contextmanager
def timed_methods(methods: dict[str, list[tuple[type, str]]], parts: Counter):
    """Add the seconds spent in each named group of class methods to `parts` while the block runs."""
    originals = []
    for part, targets in methods.items():
        for owner, name in targets:
            original = getattr(owner, name)
            originals.append((owner, name, original))

            def timed(*args, _original=original, _part=part, **kwargs):
                started = time.perf_counter()
                try:
                    return _original(*args, **kwargs)
                finally:
                    parts[_part] += time.perf_counter() - started

            setattr(owner, name, timed)
    try:
        yield parts
    finally:
        for owner, name, original in reversed(originals):
            setattr(owner, name, original)


def breakdown(parts: Counter, steps: int, seconds: float) -> dict:
    """Return µs per step of each part, and of the rest of the step."""
    per_step = {part: total / steps * 1e6 for part, total in parts.items()}
    return {**per_step, "rest": seconds / steps * 1e6 - sum(per_step.values())}


def profiled(loops: dict, steps: int) -> dict[str, dict]:
    """Run the default crossbow loop and the bare loop once more with timers around their parts; return each one's
    µs per step by part."""
    from crossbow_mpi.data.prefetch import BatchPrefetcher
    from crossbow_mpi.replicas.engines import LearnerEngine

    parts = Counter()
    with timed_methods(
        {
            "batches": [(BatchPrefetcher, "batches"), (BatchPrefetcher, "prefetch")],
            "forward_backward": [(LearnerEngine, "compute_gradients")],
            "update": [(LearnerEngine, "local_step"), (LearnerEngine, "sync")],
        },
        parts,
    ):
        mine = loops["crossbow"].steps(steps)
    bare_parts = Counter()
    bare = loops["pytorch"].steps(steps, bare_parts)
    return {"crossbow": breakdown(parts, steps, mine), "pytorch": breakdown(bare_parts, steps, bare)}


def worker(settings: dict) -> dict:
    """Time the loops for every thread count and batch size in rotating rounds; return every round."""
    import torch

    train_set, _ = harness.mnist(TEST_SAMPLES)
    rounds, runs = settings["rounds"], []
    for threads in settings["threads"]:
        torch.set_num_threads(threads)
        for batch in settings["batch_sizes"]:
            loops = {
                **{system: CrossbowLoop(train_set, batch, threads, 1, fused) for system, fused in SYSTEMS.items()},
                "pytorch": BareLoop(train_set, batch, 1),
            }
            steps = max(settings["samples"] // (batch * rounds), 1)
            for loop in loops.values():
                loop.steps(2)  # warm up (and compile the fused step)
            names = list(loops)
            for r in range(rounds):
                for name in names[r % len(names) :] + names[: r % len(names)]:
                    seconds, samples = loops[name].steps(steps), steps * batch
                    run = {"threads": threads, "b": batch, "variant": name, "rep": r, "samples": samples}
                    runs.append({**run, "seconds": seconds, "samples_per_s": samples / seconds})
            profile = profiled(loops, steps * max(rounds // 4, 1))  # a quarter of the timed steps: less noise
            runs += [
                {"threads": threads, "b": batch, "variant": system, "rep": "breakdown", "breakdown": parts}
                for system, parts in profile.items()
            ]
    return {"runs": runs}


def samples_per_s(runs: list[dict], system: str) -> float:
    """A loop's samples over its seconds in all its rounds."""
    mine = [run for run in runs if run["variant"] == system]
    return sum(run["samples"] for run in mine) / sum(run["seconds"] for run in mine)


def round_ratios(runs: list[dict], system: str) -> dict:
    """The spread of a crossbow loop's samples/s over the bare loop's in the same round: median, min, max."""
    by_round = {(run["rep"], run["variant"]): run["samples_per_s"] for run in runs}
    ratios = [by_round[rep, system] / by_round[rep, "pytorch"] for rep, variant in by_round if variant == system]
    return {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios)}


def measure(options: harness.Options) -> harness.Report:
    budget = QUICK if options.quick else FULL
    runs = harness.run_worker(options.name, 1, asdict(budget), budget.timeout_s)["runs"]
    rows = []
    for threads in budget.threads:
        for batch in budget.batch_sizes:
            mine = [run for run in runs if run["b"] == batch and run["threads"] == threads]
            timed = [run for run in mine if run["rep"] != "breakdown"]
            rates = {system: samples_per_s(timed, system) for system in (*SYSTEMS, "pytorch")}
            profiles = {run["variant"]: run["breakdown"] for run in mine if run["rep"] == "breakdown"}
            harness.log(f"overhead: {threads} thread(s), b = {batch}: µs per step {json.dumps(profiles)}")
            rows.append(
                {
                    "threads": threads,
                    "b": batch,
                    "crossbow_samples_per_s": rates["crossbow"],
                    "pytorch_samples_per_s": rates["pytorch"],
                    "fused_samples_per_s": rates["fused"],
                    "crossbow_vs_pytorch": harness.ratio(rates["crossbow"], rates["pytorch"]),
                    "fused_vs_pytorch": harness.ratio(rates["fused"], rates["pytorch"]),
                    "round_ratios": {system: round_ratios(timed, system) for system in SYSTEMS},
                    "us_per_step": profiles,
                }
            )
    return harness.Report(
        question="Training samples/s on 1 rank × 1 and × 2 threads, 1 learner, LeNet on MNIST: crossbow_mpi S-SGD "
        "(default; fused: --fused-step, the same bits) "
        "against a bare PyTorch loop on the same batches, in rotating rounds (samples over seconds of all rounds)",
        columns=COLUMNS,
        rows=rows,
        runs=runs,
        settings={"budget": asdict(budget), "lr": LR},
    )


if __name__ == "__main__":
    harness.main(measure, worker)
