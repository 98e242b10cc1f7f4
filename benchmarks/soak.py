"""Soak: 4 ranks train for 20 minutes with periodic checkpoints; resident memory per rank must stay flat.

    python -m benchmarks.soak [--quick] [--out DIR]

Each rank samples its resident set size every few seconds while it trains LeNet on MNIST with SMA and
writes a checkpoint every 200 iterations. The run ends through the preemption path (a stop signal to
itself after the duration), so the last checkpoint is written too. Reported per rank: the least-squares
slope of resident memory after the first minute, in MiB per minute, and the first and last readings.
"""

from __future__ import annotations

import os
import signal
import tempfile
import threading
import time

import numpy as np

from benchmarks import harness

FULL = {"ranks": 4, "duration_s": 1200, "sample_every_s": 5.0, "settle_s": 60, "checkpoint_every": 200}
QUICK = {"ranks": 2, "duration_s": 20, "sample_every_s": 1.0, "settle_s": 5, "checkpoint_every": 50}


def worker(settings: dict) -> dict:
    """On every rank: train until the stop signal, sampling resident memory; rank 0 returns all samples."""
    from mpi4py import MPI

    from crossbow_mpi import Config, Trainer
    from crossbow_mpi.comm import MpiCommunicator
    from crossbow_mpi.control.learner_tuner import resident_bytes
    from crossbow_mpi.data import build_dataset
    from crossbow_mpi.models import build_model
    from crossbow_mpi.runtime import process

    comm = MpiCommunicator(MPI.COMM_WORLD)
    run_dir = comm.bcast_json(tempfile.mkdtemp(prefix="bench-soak-") if comm.rank == 0 else None)
    train, test = build_dataset("mnist", str(harness.REPO / "datasets" / "mnist"), seed=1)
    samples, started, done = [], time.monotonic(), threading.Event()

    def sample() -> None:
        while not done.wait(settings["sample_every_s"]):
            samples.append((time.monotonic() - started, resident_bytes() / 2**20))

    process.install_stop_signals()
    threading.Timer(settings["duration_s"], lambda: os.kill(os.getpid(), signal.SIGUSR1)).start()
    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    cfg = Config(
        run_dir=run_dir,
        epochs=10_000,
        target_accuracy=0,
        eval_every=60_000,
        checkpoint_every=settings["checkpoint_every"],
        seed=1,
    )
    result = Trainer(cfg, comm).fit(lambda: build_model("lenet", train.input_shape, 10), train, test)
    done.set()
    sampler.join()
    every_rank = comm.allgather_json(samples)
    return {"iterations": result.iterations, "preempted": result.preempted, "samples": every_rank}


def slope_mib_per_minute(samples: list[list[float]], settle_s: float) -> float | None:
    points = np.array([s for s in samples if s[0] >= settle_s])
    if len(points) < 2:
        return None
    return float(np.polyfit(points[:, 0] / 60.0, points[:, 1], 1)[0])


def measure(options: harness.Options) -> harness.Report:
    settings = QUICK if options.quick else FULL
    result = harness.run_worker("soak", settings["ranks"], settings, timeout=settings["duration_s"] + 600)
    rows = []
    for rank, samples in enumerate(result["samples"]):
        rows.append(
            {
                "rank": rank,
                "samples": len(samples),
                "first MiB": samples[0][1] if samples else None,
                "last MiB": samples[-1][1] if samples else None,
                "slope MiB/min": slope_mib_per_minute(samples, settings["settle_s"]),
            }
        )
    return harness.Report(
        question=f"resident memory per rank over {settings['duration_s']} s of training "
        f"({result['iterations']} iterations, checkpoint every {settings['checkpoint_every']})",
        columns=["rank", "samples", "first MiB", "last MiB", "slope MiB/min"],
        rows=rows,
        runs=[result],
        settings=settings,
    )


if __name__ == "__main__":
    harness.main(measure, worker)
