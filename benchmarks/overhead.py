"""Framework overhead: 1 rank, 1 learner, crossbow_mpi S-SGD (default and `--fused-step`) against a bare PyTorch
loop, LeNet on MNIST.

Both run in one MPI process with 1 and then 2 intra-op threads, interleaved run by run, on the same model, the
same batches (crossbow's sampler order for the same seed) and the same update rule (momentum SGD with weight
decay); samples/s counts the training steps only. After the timed runs, one more run of each with timers around
its parts says where a step's time goes (`breakdown`, µs per step): the batch fetch, forward and backward, the
update (crossbow: the learners' local step and the sync), and the rest of the step and loop.
"""

from __future__ import annotations

import contextlib
import functools
import json
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
    """Training samples of one run (within one epoch)."""
    timeout_s: float


FULL = Budget(batch_sizes=(16, 64), threads=(1, 2), samples=16000, timeout_s=900)
QUICK = Budget(batch_sizes=(16,), threads=(1, 2), samples=320, timeout_s=120)

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


def bare_loop(train_set, batch: int, samples: int, seed: int, parts: Counter | None = None) -> float:
    """Train with plain PyTorch on crossbow's batches for `seed`; return samples/s of the steps; add each part's
    seconds to `parts` if given."""
    import torch
    import torch.nn.functional as F

    from crossbow_mpi.config import Config
    from crossbow_mpi.data.sampler import GlobalSampler, fetch_batch
    from crossbow_mpi.models import build_model

    defaults = Config()
    torch.manual_seed(seed)
    model = build_model("lenet", train_set.input_shape, train_set.num_classes)
    optimizer = torch.optim.SGD(
        model.parameters(), lr=LR, momentum=defaults.momentum, weight_decay=defaults.weight_decay
    )
    order = GlobalSampler(len(train_set), seed, rank=0, world_size=1)
    elapsed, parts = 0.0, Counter() if parts is None else parts
    for offset in range(0, samples, batch):
        started = time.perf_counter()
        inputs, targets = fetch_batch(train_set, order.indices(0, offset, 1, batch)[0])
        fetched = time.perf_counter()
        optimizer.zero_grad()
        F.cross_entropy(model(inputs), targets).backward()
        computed = time.perf_counter()
        optimizer.step()
        stepped = time.perf_counter()
        parts.update(
            {"batches": fetched - started, "forward_backward": computed - fetched, "update": stepped - computed}
        )
        elapsed += stepped - started
    return samples / elapsed


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


def breakdown(parts: Counter, steps: int, samples_per_s: float, batch: int) -> dict:
    """Return µs per step of each part, and of the rest of a step at this rate."""
    per_step = {part: seconds / steps * 1e6 for part, seconds in parts.items()}
    return {**per_step, "rest": batch / samples_per_s * 1e6 - sum(per_step.values())}


def profiled(train_set, crossbow, steps: int, batch: int) -> dict[str, dict]:
    """Run each loop once more with timers around its parts; return each one's samples/s and breakdown."""
    from crossbow_mpi.data.prefetch import BatchPrefetcher
    from crossbow_mpi.engines import LearnerEngine

    parts = Counter()
    with timed_methods(
        {
            "batches": [(BatchPrefetcher, "batches"), (BatchPrefetcher, "prefetch")],
            "forward_backward": [(LearnerEngine, "compute_gradients")],
            "update": [(LearnerEngine, "local_step"), (LearnerEngine, "sync")],
        },
        parts,
    ):
        mine = crossbow(0)
    bare_parts = Counter()
    bare = {"samples_per_s": bare_loop(train_set, batch, steps * batch, seed=1, parts=bare_parts)}
    return {
        "crossbow": {**mine, "breakdown": breakdown(parts, steps, mine["samples_per_s"], batch)},
        "pytorch": {**bare, "breakdown": breakdown(bare_parts, steps, bare["samples_per_s"], batch)},
    }


def worker(settings: dict) -> dict:
    """Time both loops for every batch size, interleaved; return every run."""
    import torch

    from crossbow_mpi import Config
    from crossbow_mpi.models import build_model

    train_set, test_set = harness.mnist(TEST_SAMPLES)

    def model_fn():
        return build_model("lenet", train_set.input_shape, train_set.num_classes)

    runs = []
    for threads in settings["threads"]:
        torch.set_num_threads(threads)
        for batch in settings["batch_sizes"]:
            samples = settings["samples"] // batch * batch

            def crossbow(rep: int, batch=batch, samples=samples, threads=threads, fused=False) -> dict:
                config = Config(
                    fused_step=fused,
                    algorithm="ssgd",
                    learners=1,
                    batch_size=batch,
                    lr=LR,
                    epochs=samples / len(train_set),
                    target_accuracy=0,
                    eval_every=harness.NEVER,
                    threads=threads,
                    seed=rep + 1,
                )
                return {"samples_per_s": harness.crossbow_samples_per_s(config, model_fn, train_set, test_set)}

            def pytorch(rep: int, batch=batch, samples=samples) -> dict:
                return {"samples_per_s": bare_loop(train_set, batch, samples, seed=rep + 1)}

            crossbow(0, samples=2 * batch, fused=True)  # compile the fused step (once per process)
            variants = {
                **{system: functools.partial(crossbow, fused=fused) for system, fused in SYSTEMS.items()},
                "pytorch": pytorch,
            }
            runs += [
                {"threads": threads, "b": batch, **run}
                for run in harness.interleave(variants, settings["reps"], quiet=True)
            ]
            runs += [
                {"threads": threads, "b": batch, "variant": system, "rep": "breakdown", **run}
                for system, run in profiled(train_set, crossbow, samples // batch, batch).items()
            ]
    return {"runs": runs}


def measure(options: harness.Options) -> harness.Report:
    budget = QUICK if options.quick else FULL
    runs = harness.run_worker(options.name, 1, {**asdict(budget), "reps": options.reps}, budget.timeout_s)["runs"]
    rows = []
    for threads in budget.threads:
        for batch in budget.batch_sizes:
            mine = [run for run in runs if run["b"] == batch and run["threads"] == threads]
            timed = [run for run in mine if run["rep"] != "breakdown"]
            rates = {
                system: harness.median(harness.column(timed, system, "samples_per_s"))
                for system in (*SYSTEMS, "pytorch")
            }
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
                    "us_per_step": profiles,
                }
            )
    return harness.Report(
        question="Training samples/s on 1 rank × 1 and × 2 threads, 1 learner, LeNet on MNIST: crossbow_mpi S-SGD "
        "(default; fused: --fused-step, the same bits) "
        "against a bare PyTorch loop on the same batches (medians)",
        columns=COLUMNS,
        rows=rows,
        runs=runs,
        settings={"budget": asdict(budget), "lr": LR},
    )


if __name__ == "__main__":
    harness.main(measure, worker)
