"""GPU self-test on one GPU, in under 8 minutes: tests, NCCL bandwidth, learner throughput, MNIST to 99 %.

    python -m benchmarks.gpu_selftest [--out DIR]        (launch/gpu_selftest.sh runs it)

Needs only torch, CuPy, mpi4py, h5py, numpy and pytest, and what the repository carries. Runs as a single
MPI process (a singleton), plus `mpirun -n 2` for the two-ranks-on-one-GPU check when mpirun exists.
Writes gpu_selftest.json and prints a short table last.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from benchmarks import harness, learners

THROUGHPUT = {"model": "resnet32", "engine": "streams", "device": "cuda", "learners": [1, 2, 4, 8],
              "warmup": 5, "steps": 20}


def run_tests(ranks: int, select: str = "") -> dict:
    """Run tests/gpu (on `ranks` MPI ranks when more than one); return pytest's summary."""
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/gpu"]
    if select:
        command += ["-k", select]
    if ranks > 1:
        command = [shutil.which("mpirun"), "-n", str(ranks), "--oversubscribe"] + command
    started = time.perf_counter()
    env = {**os.environ, **harness.MPI_ENV}
    done = subprocess.run(command, cwd=harness.REPO, capture_output=True, text=True, timeout=300, env=env)
    summary = [line for line in done.stdout.splitlines() if re.search(r"\d+ (passed|failed|skipped)", line)]
    return {"ranks": ranks, "exit_code": done.returncode, "summary": summary[-1] if summary else done.stdout[-500:],
            "seconds": time.perf_counter() - started}


def nccl_bandwidth() -> list[dict]:
    """One-rank NCCL allreduce against a plain device copy of the same bytes, GB/s."""
    from mpi4py import MPI

    from crossbow_mpi.comm.nccl import NcclCommunicator

    device = torch.device("cuda", 0)
    nccl = NcclCommunicator(MPI.COMM_WORLD, device)
    rows = []
    for mib in (1, 16, 256):
        tensor = torch.ones(mib * 2**18, device=device)
        target = torch.empty_like(tensor)
        timings = {}
        for name, op in (("nccl allreduce", lambda: nccl.allreduce_sum_(tensor)), ("torch copy", lambda: target.copy_(tensor))):
            op()
            torch.cuda.synchronize()
            started = time.perf_counter()
            for _ in range(20):
                op()
            torch.cuda.synchronize()
            timings[name] = 20 * mib * 2**20 / (time.perf_counter() - started) / 1e9
        rows.append({"MiB": mib, "nccl GB/s": timings["nccl allreduce"], "copy GB/s": timings["torch copy"]})
    return rows


def throughput() -> list[dict]:
    """ResNet-32 samples/s on synthetic CIFAR: SMA with 1, 2, 4, 8 learners and auto; S-SGD with 1 learner."""
    rows = []
    for batch in (16, 64):
        sma = learners.worker({**THROUGHPUT, "batch": batch})
        ssgd = learners.worker({**THROUGHPUT, "batch": batch, "algorithm": "ssgd", "learners": [1]})
        rows.append({"b": batch, **{f"sma k={k}": v for k, v in sma["throughput"].items()},
                     "sma auto k": sma["auto_learners"], "ssgd k=1": ssgd["throughput"][1]})
    return rows


def mnist_to_99() -> dict:
    """Train LeNet on MNIST with the default SMA settings on this GPU until 99 % test accuracy."""
    from crossbow_mpi import Config, Trainer
    from crossbow_mpi.data import build_dataset
    from crossbow_mpi.models import build_model

    train, test = build_dataset("mnist", str(harness.REPO / "datasets" / "mnist"), seed=1)
    with tempfile.TemporaryDirectory() as run_dir:
        cfg = Config(device="cuda", run_dir=run_dir, epochs=10)
        result = Trainer(cfg).fit(lambda: build_model("lenet", train.input_shape, 10), train, test)
    return {"reached": result.reached, "time_to_accuracy_s": result.time_to_accuracy_s,
            "epochs": result.epochs, "test_accuracy": result.test_accuracy}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=harness.RESULTS_DIR)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    results = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
               "device": torch.cuda.get_device_name(0), "torch": torch.__version__}
    steps = [("tests", lambda: [run_tests(1)] + ([run_tests(2, "share")] if shutil.which("mpirun") else [])),
             ("nccl_bandwidth", nccl_bandwidth), ("throughput", throughput), ("mnist_to_99", mnist_to_99)]
    for name, step in steps:
        harness.log(f"== {name}")
        started = time.perf_counter()
        try:
            results[name] = step()
        except Exception as err:  # a failed part is reported, and the others still run
            results[name] = {"error": f"{type(err).__name__}: {err}"}
        results[f"{name}_seconds"] = time.perf_counter() - started
        (args.out / "gpu_selftest.json").write_text(json.dumps(results, indent=1) + "\n")
    print(f"\nGPU self-test on {results['device']}, {results['date']}; wrote {args.out / 'gpu_selftest.json'}")
    for name in ("tests", "nccl_bandwidth", "throughput"):
        rows = results[name] if isinstance(results[name], list) else [results[name]]
        columns = list(dict.fromkeys(key for row in rows for key in row))
        print(f"\n{name}\n" + harness.Report(name, columns, rows, [], {}).table())
    print(f"\nmnist_to_99: {json.dumps(results['mnist_to_99'])}")


if __name__ == "__main__":
    main()
