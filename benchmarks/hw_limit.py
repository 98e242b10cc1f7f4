"""Hardware limit: achieved training FLOP/s as a fraction of a large float32 matmul's FLOP/s, same cores, same run,
and what moves it: compiled learners, ranks pinned to cores, channels-last (crossbow_mpi's `--memory-format
channels_last` and the bare loop's) and oneDNN.

On 2 ranks × 1 thread, crossbow_mpi trains LeNet on MNIST and ResNet-32 on synthetic CIFAR: S-SGD at batch 64
(as is, with `--compile`, with each rank pinned to its own core, channels-last, and channels-last compiled) and SMA
with 2 learners at batch 16 (as is, channels-last, and channels-last compiled). A bare PyTorch loop (SGD with
momentum, batch 64) on each rank at once runs as is, channels-last, channels-last with its forward pass and loss
compiled (not in --quick), and with oneDNN (mkldnn) switched off to see what it gives, on one batch again and again;
channels-last at batch 16 (SMA's learners' batch); and channels-last as a data-parallel loop, which takes a fresh
batch every step and averages the gradients over the ranks with one Allreduce before its step, so that it waits
for the slower rank every step as synchronous training does. Training FLOPs per sample are
counted with torch.utils.flop_counter.FlopCounterMode over one forward and backward pass and multiplied by the
measured samples/s of all ranks; crossbow_mpi's samples/s are its last evaluation window's, the second half of
the run, so that a compile in the first step is not counted. The peak is every rank multiplying two n×n float32
matrices at once, summed over ranks; every variant alternates with the others run by run.
"""

from __future__ import annotations

import os
import time
from dataclasses import asdict, dataclass

from benchmarks import harness

RANKS = 2
TEST_SAMPLES = 1000
BARE_BATCH = 64
MODELS = {"lenet": "mnist", "resnet32": "synthetic-cifar"}
"""Each model and the dataset it trains on."""
_SSGD = {"algorithm": "ssgd", "learners": 1, "batch_size": 64}
_SMA = {"algorithm": "sma", "learners": 2, "batch_size": 16}
_CHANNELS_LAST = {"memory_format": "channels_last"}
CONFIGS = {
    "ssgd k=1 b=64": _SSGD,
    "ssgd k=1 b=64 compiled": {**_SSGD, "compile": True},
    "ssgd k=1 b=64 pinned": _SSGD,
    "sma k=2 b=16": _SMA,
    "ssgd k=1 b=64 channels-last": {**_SSGD, **_CHANNELS_LAST},
    "sma k=2 b=16 channels-last": {**_SMA, **_CHANNELS_LAST},
    "ssgd k=1 b=64 channels-last compiled": {**_SSGD, **_CHANNELS_LAST, "compile": True},
    "sma k=2 b=16 channels-last compiled": {**_SMA, **_CHANNELS_LAST, "compile": True},
}
"""crossbow_mpi's runs; `pinned` binds each rank to its own core for the run."""
BARE = {
    "bare b=64": {"batch_size": 64},
    "bare b=64 channels-last": {"batch_size": 64, "channels_last": True},
    "bare b=64 no oneDNN": {"batch_size": 64, "onednn": False},
    "bare b=16 channels-last": {"batch_size": 16, "channels_last": True},
    "bare b=64 channels-last data-parallel": {"batch_size": 64, "channels_last": True, "data_parallel": True},
    "bare b=64 channels-last compiled": {"batch_size": 64, "channels_last": True, "compiled": True},
}
"""The bare loops (`bare_samples_per_s`'s options); b = 16 runs 4× the steps, the samples of b = 64."""


@dataclass
class Budget:
    """How much a mode trains and multiplies."""

    samples: dict[str, int]
    """Training samples of one run (all ranks) per model."""
    bare_steps: dict[str, int]
    """Steps of one bare-loop run per model (each rank)."""
    models: tuple[str, ...]
    configs: tuple[str, ...]
    """crossbow_mpi's runs (of `CONFIGS`)."""
    bare: tuple[str, ...]
    """The bare loops (of `BARE`)."""
    matmul_n: int
    matmul_calls: int
    timeout_s: float


FULL = Budget(
    samples={"lenet": 24000, "resnet32": 1600},
    bare_steps={"lenet": 100, "resnet32": 8},
    models=tuple(MODELS),
    configs=tuple(CONFIGS),
    bare=tuple(BARE),
    matmul_n=2048,
    matmul_calls=5,
    timeout_s=3600,
)
QUICK = Budget(
    samples={"lenet": 640},
    bare_steps={"lenet": 4},
    models=("lenet",),
    configs=("ssgd k=1 b=64", "ssgd k=1 b=64 pinned", "sma k=2 b=16", "ssgd k=1 b=64 channels-last"),
    bare=tuple(name for name in BARE if not name.endswith("compiled")),
    matmul_n=256,
    matmul_calls=2,
    timeout_s=140,
)

COLUMNS = ["model", "config", "flops_per_sample", "samples_per_s", "achieved_gflops", "matmul_gflops", "fraction"]


def flops_per_sample(model_fn, train_set, batch: int) -> float:
    """Count the FLOPs of one forward and backward pass over a batch, per sample."""
    import torch
    import torch.nn.functional as F
    from torch.utils.flop_counter import FlopCounterMode

    inputs, targets = train_set.get_batch(torch.arange(batch))
    with FlopCounterMode(display=False) as counter:
        F.cross_entropy(model_fn()(inputs), targets).backward()
    return counter.get_total_flops() / batch


def bare_samples_per_s(
    model_fn,
    train_set,
    steps: int,
    world,
    batch_size: int,
    channels_last: bool = False,
    onednn: bool = True,
    data_parallel: bool = False,
    compiled: bool = False,
) -> float:
    """Train the model with plain PyTorch for `steps` batches (the first one untimed, where `compiled` compiles the
    forward pass and loss as crossbow_mpi's `--compile` does) on one batch again and again, or with `data_parallel`
    on a fresh batch every step, averaging the gradients over the ranks; return samples/s."""
    import torch
    import torch.nn.functional as F

    def model_loss(model, inputs, targets):
        return F.cross_entropy(model(inputs), targets)

    loss_of = torch.compile(model_loss) if compiled else model_loss
    model = model_fn().to(memory_format=torch.channels_last if channels_last else torch.contiguous_format)
    order = torch.randperm(len(train_set), generator=torch.Generator().manual_seed(world.Get_rank()))
    one = None if data_parallel else _in_format(train_set.get_batch(torch.arange(batch_size)), channels_last)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    with torch.backends.mkldnn.flags(enabled=onednn):
        for step in range(steps + 1):
            if step == 1:
                started = time.perf_counter()
            batch = order[step * batch_size : (step + 1) * batch_size]
            inputs, targets = one or _in_format(train_set.get_batch(batch), channels_last)
            optimizer.zero_grad()
            loss_of(model, inputs, targets).backward()
            if data_parallel:
                average_gradients(model, world)
            optimizer.step()
    return steps * batch_size / (time.perf_counter() - started)


def _in_format(batch, channels_last: bool):
    import torch

    inputs, targets = batch
    return (inputs.contiguous(memory_format=torch.channels_last) if channels_last else inputs), targets


def average_gradients(model, world) -> None:
    """Replace every gradient by its mean over the ranks: one Allreduce of them all, as a hand-written loop does."""
    import torch

    from crossbow_mpi.runtime import process

    grads = [p.grad for p in model.parameters()]
    flat = torch.cat([g.reshape(-1) for g in grads])
    world.Allreduce(process.mpi().IN_PLACE, flat.numpy())
    flat /= world.Get_size()
    for g, part in zip(grads, flat.split([g.numel() for g in grads]), strict=True):
        g.copy_(part.view(g.shape))


def worker(settings: dict) -> dict:
    """Alternate matmul rounds with every model's variants; return every run and the FLOPs per sample."""
    import numpy as np
    import torch

    from crossbow_mpi.runtime import process

    MPI = process.mpi()
    world = MPI.COMM_WORLD
    torch.set_num_threads(1)
    n = settings["matmul_n"]
    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b  # warm up

    def all_ranks(rate: float) -> float:
        total = np.array([rate])
        world.Allreduce(MPI.IN_PLACE, total)
        return float(total[0])

    def matmul(rep: int) -> dict:
        world.Barrier()
        started = time.perf_counter()
        for _ in range(settings["matmul_calls"]):
            a @ b
        return {"flops_per_s": all_ranks(2 * n**3 * settings["matmul_calls"] / (time.perf_counter() - started))}

    variants, flops = {"matmul": matmul}, {}
    for model in settings["models"]:
        model_variants, flops[model] = _model_variants(model, settings, world, all_ranks)
        variants |= model_variants
    runs = harness.interleave(variants, settings["reps"], quiet=True)
    return {"runs": runs, "flops_per_sample": flops}


def _model_variants(model: str, settings: dict, world, all_ranks) -> tuple[dict, dict]:
    """Return the model's variants, crossbow_mpi's configurations and the bare loops, and its FLOPs per sample at
    their batch sizes."""
    from crossbow_mpi import Config
    from crossbow_mpi.data import ArrayDataset, build_dataset
    from crossbow_mpi.models import build_model

    train_set, test = build_dataset(MODELS[model], str(harness.REPO / "datasets" / "mnist"), seed=1)
    test_set = ArrayDataset(
        test.inputs[:TEST_SAMPLES], test.targets[:TEST_SAMPLES], test.num_classes, test.mean, test.std
    )

    def model_fn():
        return build_model(model, train_set.input_shape, train_set.num_classes)

    def training(config: dict, pinned: bool):
        samples = settings["samples"][model]

        def run(rep: int) -> dict:
            cpus = os.sched_getaffinity(0)
            if pinned:
                os.sched_setaffinity(0, {sorted(cpus)[world.Get_rank() % len(cpus)]})
            cfg = Config(
                **config,
                lr=0.01,
                epochs=samples / len(train_set),
                target_accuracy=0,
                eval_every=samples // 2,
                threads=1,
                seed=rep + 1,
            )
            try:
                return {"samples_per_s": harness.crossbow_samples_per_s(cfg, model_fn, train_set, test_set)}
            finally:
                os.sched_setaffinity(0, cpus)

        return run

    def bare(options: dict):
        def run(rep: int) -> dict:
            world.Barrier()
            steps = settings["bare_steps"][model] * BARE_BATCH // options["batch_size"]
            return {"samples_per_s": all_ranks(bare_samples_per_s(model_fn, train_set, steps, world, **options))}

        return run

    variants = {
        f"{model} {name}": training(CONFIGS[name], pinned=name.endswith("pinned")) for name in settings["configs"]
    }
    variants |= {f"{model} {name}": bare(BARE[name]) for name in settings["bare"]}
    batches = {BARE_BATCH, CONFIGS["sma k=2 b=16"]["batch_size"]}
    return variants, {batch: flops_per_sample(model_fn, train_set, batch) for batch in batches}


def batch_size(config: str) -> int:
    return (CONFIGS[config] if config in CONFIGS else BARE[config])["batch_size"]


def measure(options: harness.Options) -> harness.Report:
    budget = QUICK if options.quick else FULL
    measured = harness.run_worker(options.name, RANKS, {**asdict(budget), "reps": options.reps}, budget.timeout_s)
    runs = measured["runs"]
    peak = harness.median(harness.column(runs, "matmul", "flops_per_s"))
    rows = []
    for model in budget.models:
        for config in (*budget.configs, *budget.bare):
            flops = measured["flops_per_sample"][model][str(batch_size(config))]
            rate = harness.median(harness.column(runs, f"{model} {config}", "samples_per_s"))
            rows.append(
                {
                    "model": model,
                    "config": config,
                    "flops_per_sample": flops,
                    "samples_per_s": rate,
                    "achieved_gflops": flops * rate / 1e9,
                    "matmul_gflops": peak / 1e9,
                    "fraction": harness.ratio(flops * rate, peak),
                }
            )
    return harness.Report(
        question=f"Training FLOP/s (FlopCounterMode forward+backward × samples/s) over a {budget.matmul_n}² float32 "
        f"matmul's FLOP/s, {RANKS} ranks × 1 thread (medians): crossbow_mpi as is, compiled, pinned, "
        "channels-last and both, and a bare loop with channels-last, compiled, without oneDNN, at SMA's batch and "
        "data-parallel",
        columns=COLUMNS,
        rows=rows,
        runs=runs,
        settings={
            "ranks": RANKS,
            "budget": asdict(budget),
            "configs": CONFIGS,
            "flops_per_sample": measured["flops_per_sample"],
        },
    )


if __name__ == "__main__":
    harness.main(measure, worker)
