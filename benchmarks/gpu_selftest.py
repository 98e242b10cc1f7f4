"""GPU self-test on one GPU, in under 8 minutes: tests, the command line, sync cost, throughput, MNIST to 99 %.

    python -m benchmarks.gpu_selftest [--out DIR]        (launch/gpu_selftest.sh runs it)

Needs torch, CuPy, mpi4py with an MPI library and its mpirun, h5py, numpy, pytest and pytest-mpi, and what the
repository carries. Runs tests/gpu under `mpirun -n 1` (all but the shared-GPU test and the NCCL stage link's)
and `mpirun -n 2` with both ranks on the first GPU (the shared-GPU test; with `--device mixed`, one rank on the
GPU and one on the CPU), and where two GPUs are visible the NCCL stage link's test under `mpirun -n 2` with a GPU
per rank (NCCL cannot put two ranks on one GPU, so one GPU leaves it out); then the command-line checks
(CLI_CHECKS, each within its budget); then records CuPy's and torch's NCCL versions and CuPy's NVRTC, and measures
in this process, a singleton MPI rank. Writes gpu_selftest.json, prints its tables, and last one line
`gpu_selftest: PASS: …` or `gpu_selftest: FAIL: …`; exits 0 only on PASS: every part ran, every test ran and passed
(a skip on a GPU is a failure), every command-line check passed, and LeNet/MNIST reached 99 %.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import hashlib
import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import h5py
import torch

from benchmarks import harness, learners
from crossbow_mpi.train import EXIT_PREEMPTED
from tests.helpers import mpirun_command

THROUGHPUT = {
    "model": "resnet32",
    "engine": "streams",
    "device": "cuda",
    "learners": [1, 2, 4, 8],
    "warmup": 5,
    "steps": 20,
}
SHARED_GPU_TEST = "test_two_ranks_on_one_gpu_with_nccl_is_a_clear_error"
MIXED_DEVICES_TESTS = "test_mixed_devices"
NCCL_LINK_TEST = "test_nccl_stage_link"
TEST_RUNS = (
    (1, f"not {SHARED_GPU_TEST} and not {NCCL_LINK_TEST}", True),
    (2, f"{SHARED_GPU_TEST} or {MIXED_DEVICES_TESTS}", True),
)
"""(ranks, pytest -k expression, all ranks on the first GPU): the shared-GPU test needs two ranks on one GPU and
the mixed-devices tests (S-SGD with unequal batches, Hogbatch, Adaptive Hogbatch) a GPU rank and a CPU rank;
every other test but the NCCL stage link's runs on one rank."""
NCCL_LINK_RUN = (2, NCCL_LINK_TEST, False)
"""The NCCL stage link's test: two ranks, a GPU each; run only where two GPUs are visible."""
OUTCOMES = ("passed", "failed", "errors", "skipped", "deselected")
REPEATS = 20
OUTPUT_TAIL = 20000
"""Characters of a failed test run's output kept in the results."""
CLI_DEVICE = "cuda"
CLI_RUN = (
    "--dataset",
    "synthetic-mnist",
    "--model",
    "mlp",
    "--learners",
    "2",
    "--target-accuracy",
    "0",
    "--eval-every",
    str(harness.NEVER),
)
"""Every command-line run's flags beside its own (it evaluates once, at its end)."""
RESUME_RUN = ("--epochs", "0.3", "--checkpoint-every", "10")
"""About 560 steps: the stop signal comes right after the first checkpoint, at step 10, far from the end."""
AUTO_PIPELINE_NOTE = "crossbow_mpi: note: --comm auto: using MPI for the stages' activations, since NCCL cannot"


def pytest_counts(output: str) -> dict[str, int]:
    """Return pytest's final counts (passed, failed, errors, skipped, deselected) from its output."""
    counted = r"(\d+) (passed|failed|errors?|skipped|deselected)"
    summary = [line for line in output.splitlines() if re.search(counted, line)]
    counts = dict.fromkeys(OUTCOMES, 0)
    for number, outcome in re.findall(counted, summary[-1] if summary else ""):
        counts["errors" if outcome.startswith("error") else outcome] = int(number)
    return counts


def run_tests(ranks: int, select: str, first_gpu: bool) -> dict:
    """Run tests/gpu on `ranks` MPI ranks, all on the first GPU when `first_gpu`; return pytest's counts and its
    reasons for any test that did not pass."""
    if importlib.util.find_spec("pytest_mpi") is None:
        raise RuntimeError("pytest-mpi is not installed, so the MPI-marked GPU tests would not run")
    command = [
        *mpirun_command(ranks),
        sys.executable,
        "tests/mpi_pytest.py",
        "-q",
        "--color=no",
        "-rfEs",
        "--with-mpi",
        "-k",
        select,
        "tests/gpu",
    ]
    env = {**os.environ, **harness.MPI_ENV}
    if ranks > 1 and first_gpu:
        env["CUDA_VISIBLE_DEVICES"] = env.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0]
    started = time.perf_counter()
    exit_code, output = run_logged(command, env, timeout=300)
    return {
        "ranks": ranks,
        "select": select,
        "exit_code": exit_code,
        **pytest_counts(output),
        "problems": [line for line in output.splitlines() if re.match(r"(FAILED|ERROR|SKIPPED) ", line)],
        "seconds": time.perf_counter() - started,
        "output_tail": output[-OUTPUT_TAIL:] if exit_code != 0 else "",
    }


def run_logged(command: list[str], env: dict[str, str], timeout: float) -> tuple[int | None, str]:
    """Run `command` with its output in a file, so that a run stopped at `timeout` (mpirun passes SIGTERM on to its
    ranks) still leaves what it printed; return its exit code (None when stopped) and its output."""
    with tempfile.TemporaryFile("w+") as log:
        job = subprocess.Popen(command, cwd=harness.REPO, env=env, stdout=log, stderr=subprocess.STDOUT, text=True)
        exit_code, _ = finish(job, time.monotonic() + timeout)
        log.seek(0)
        return exit_code, log.read()


def host_round_trip(tensor: torch.Tensor) -> None:
    tensor.copy_(tensor.to("cpu"))


def sync_cost() -> list[dict]:
    """Microseconds per call on one rank: NCCL's allreduce (one rank moves no data, so this is the call's cost),
    the host staging that `--comm mpi` adds to every allreduce of a GPU buffer (to the host and back), and a
    plain device copy of the same bytes."""
    from crossbow_mpi.comm.nccl import NcclCommunicator
    from crossbow_mpi.runtime import process

    device = torch.device("cuda", 0)
    nccl = NcclCommunicator(process.mpi().COMM_WORLD, device)  # MPI starts here, with the threads the trainer needs
    return [_sync_cost_row(nccl, mib, device) for mib in (1, 16, 256)]


def _sync_cost_row(nccl, mib: int, device: torch.device) -> dict:
    """sync_cost's microseconds per call of each of its calls on `mib` MiB."""
    tensor = torch.ones(mib * 2**18, device=device)
    target = torch.empty_like(tensor)
    calls: dict[str, Callable[[], object]] = {
        "nccl allreduce us": functools.partial(nccl.allreduce_sum_, tensor),
        "mpi host staging us": functools.partial(host_round_trip, tensor),
        "device copy us": functools.partial(target.copy_, tensor),
    }
    return {"MiB": mib, **{name: _ms_per_call(call, warmup=1) * 1e3 for name, call in calls.items()}}


def throughput() -> list[dict]:
    """ResNet-32 samples/s on synthetic CIFAR: SMA with 1, 2, 4, 8 learners and auto; S-SGD with 1 learner."""
    rows = []
    for batch in (16, 64):
        sma = learners.worker({**THROUGHPUT, "batch": batch})
        ssgd = learners.worker({**THROUGHPUT, "batch": batch, "algorithm": "ssgd", "learners": [1]})
        rows.append(
            {
                "b": batch,
                **{f"sma k={k}": v for k, v in sma["throughput"].items()},
                "sma auto k": sma["auto_learners"],
                "ssgd k=1": ssgd["throughput"][1],
            }
        )
    return rows


def host_bound() -> list[dict]:
    """Bare ResNet-32, one forward and backward pass per step at b = 16 and 64: milliseconds per step run eagerly
    (each kernel launched from Python) and replayed as one CUDA graph. Where the graph is several times faster, the
    host's launches set the eager pace, and so the pace of every learner the stream engine runs from one thread."""
    import torch.nn.functional as F

    from crossbow_mpi.models import build_model

    rows = []
    for batch in (16, 64):
        torch.manual_seed(0)
        model = build_model("resnet32", (3, 32, 32), 10).cuda()
        x, y = torch.randn(batch, 3, 32, 32, device="cuda"), torch.randint(10, (batch,), device="cuda")

        def step(model=model, x=x, y=y) -> None:
            F.cross_entropy(model(x), y).backward()

        eager = _ms_per_call(step)
        graph = _captured(step, model)
        replayed = _ms_per_call(graph.replay)
        rows.append({"b": batch, "eager ms": eager, "graph ms": replayed, "eager / graph": eager / replayed})
    return rows


def _ms_per_call(call: Callable[[], object], warmup: int = 3) -> float:
    """Wall-clock milliseconds per call of `call` over REPEATS calls after `warmup` calls, the GPU drained."""
    for _ in range(warmup):
        call()
    torch.cuda.synchronize()
    started = time.perf_counter()
    for _ in range(REPEATS):
        call()
    torch.cuda.synchronize()
    return (time.perf_counter() - started) / REPEATS * 1e3


def _captured(step: Callable[[], None], model: torch.nn.Module) -> torch.cuda.CUDAGraph:
    """`step` captured as a CUDA graph, after warm-up calls on a side stream (as torch's docs capture a network)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            step()
    torch.cuda.current_stream().wait_stream(side)
    model.zero_grad(set_to_none=True)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return graph


def start_training(ranks: int, run_dir: Path, *args: str, first_gpu: bool = False) -> subprocess.Popen:
    """Start `python -m crossbow_mpi.train` with CLI_RUN and `args` on `ranks` ranks (all on the first GPU when
    `first_gpu`), with cuBLAS's workspace fixed so that runs on streams repeat their bits, and hwloc's OpenCL plugin
    left out as the launch scripts do."""
    env = {**os.environ, **harness.MPI_ENV, "CUBLAS_WORKSPACE_CONFIG": ":4096:8"}
    env.setdefault("HWLOC_COMPONENTS", "-opencl")  # as launch/common.sh: else LLVM may take mpirun's SIGUSR1
    if first_gpu:
        env["CUDA_VISIBLE_DEVICES"] = env.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0]
    command = [*mpirun_command(ranks), sys.executable, "-m", "crossbow_mpi.train", "--run-dir", str(run_dir)]
    return subprocess.Popen(
        [*command, *CLI_RUN, *args],
        cwd=harness.REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def finish(job: subprocess.Popen, deadline: float) -> tuple[int | None, str]:
    """Wait for `job` until `deadline` (time.monotonic), else stop it (mpirun passes SIGTERM on to its ranks);
    return its exit code (None when it ran past the deadline) and its stderr (empty when not piped)."""
    try:
        _, err = job.communicate(timeout=max(deadline - time.monotonic(), 1))
        return job.returncode, err or ""
    except subprocess.TimeoutExpired:
        job.terminate()
        try:
            _, err = job.communicate(timeout=10)
        except subprocess.TimeoutExpired:
            job.kill()
            _, err = job.communicate()
        return None, err or ""


def last_words(stderr: str) -> str:
    """The last line of a run's stderr that crossbow_mpi wrote, else its last line."""
    ours = [line for line in stderr.splitlines() if line.startswith("crossbow_mpi:")] or stderr.strip().splitlines()
    return (ours or [""])[-1]


def final_z(run_dir: Path) -> tuple[str, int]:
    """Return the sha256 of z in the run's newest checkpoint, and its iteration."""
    with h5py.File(sorted(run_dir.glob("checkpoint-*.h5"))[-1]) as f:
        z, state = f["central/z"][...], json.loads(f["train"].attrs["state"])
    return hashlib.sha256(z.tobytes()).hexdigest(), state["iteration"]


def preempt_and_resume(root: Path, deadline: float) -> tuple[bool, str]:
    """SIGUSR1 after the first checkpoint: exit 75 with a checkpoint; `--resume` then ends with the bits of z of an
    uninterrupted run (one rank on the GPU, NCCL and streams as `auto` picks them)."""
    whole, stopped = root / "whole", root / "stopped"
    code, err = finish(start_training(1, whole, "--device", CLI_DEVICE, *RESUME_RUN), deadline)
    if code != 0:
        return False, f"the uninterrupted run exited {code}: {last_words(err)}"
    job = start_training(1, stopped, "--device", CLI_DEVICE, *RESUME_RUN)
    while not (stopped / "checkpoint-000000010.h5").exists() and job.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    job.send_signal(signal.SIGUSR1)
    code, err = finish(job, deadline)
    if code != EXIT_PREEMPTED or not list(stopped.glob("checkpoint-*.h5")):
        return (
            False,
            f"SIGUSR1 after the first checkpoint: exit {code}, not {EXIT_PREEMPTED} and a checkpoint: "
            + last_words(err),
        )
    stopped_at = final_z(stopped)[1]
    code, err = finish(start_training(1, stopped, "--device", CLI_DEVICE, "--resume", *RESUME_RUN), deadline)
    if code != 0:
        return False, f"the --resume exited {code}: {last_words(err)}"
    (z, iterations), (z_whole, whole_iterations) = final_z(stopped), final_z(whole)
    same = (z, iterations) == (z_whole, whole_iterations)
    return same, (
        f"stopped at iteration {stopped_at}; resumed to {iterations} with z sha256 {z[:16]}, "
        f"{'equal to' if same else 'not'} the uninterrupted run's {whole_iterations} with {z_whole[:16]}"
    )


def mixed_devices(root: Path, deadline: float) -> tuple[bool, str]:
    """`--device mixed` on 2 ranks and one GPU: rank 0 on the GPU, rank 1 on the CPU, to the end of the run."""
    code, err = finish(start_training(2, root, "--device", "mixed", "--epochs", "0.05", first_gpu=True), deadline)
    device = json.loads((root / "metrics.jsonl").read_text().splitlines()[-1])["device"] if code == 0 else None
    passed = code == 0 and str(device).startswith("cuda")
    return passed, f"exit {code}, rank 0 on {device}" + ("" if passed else f": {last_words(err)}")


def pipeline_shares_the_gpu(root: Path, deadline: float) -> tuple[bool, str]:
    """2 ranks on one GPU with `--pipeline-stages 2 --comm auto`: NCCL cannot link them, so MPI does, with a note."""
    job = start_training(
        2, root, "--device", CLI_DEVICE, "--pipeline-stages", "2", "--comm", "auto", "--epochs", "0.05", first_gpu=True
    )
    code, err = finish(job, deadline)
    noted = any(line.startswith(AUTO_PIPELINE_NOTE) for line in err.splitlines())
    return code == 0 and noted, f"exit {code}, {'with' if noted else 'without'} the note: {last_words(err)}"


CLI_CHECKS = {
    "preempt_and_resume": (preempt_and_resume, 90),
    "mixed_devices": (mixed_devices, 60),
    "pipeline_shares_the_gpu": (pipeline_shares_the_gpu, 60),
}
"""Each command-line check, and its budget in seconds: its runs are stopped when it is spent."""


def command_line() -> list[dict]:
    """Run each of CLI_CHECKS: the command line as a user runs it, on this GPU."""
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, (check, seconds) in CLI_CHECKS.items():
            started = time.monotonic()
            (Path(tmp) / name).mkdir()
            passed, detail = check(Path(tmp) / name, started + seconds)
            rows.append({"check": name, "passed": passed, "seconds": time.monotonic() - started, "detail": detail})
    return rows


def versions() -> dict:
    """CuPy's and torch's NCCL versions, and the NVRTC CuPy compiles with: its version and the files loaded (their
    names: a results file names no absolute path)."""
    import cupy
    from cupy.cuda import nccl, nvrtc

    nvrtc_version = nvrtc.getVersion()
    maps = Path("/proc/self/maps").read_text().splitlines()
    return {
        "cupy": cupy.__version__,
        "cupy_nccl": nccl.get_version(),
        "torch_nccl": torch.cuda.nccl.version(),
        "nvrtc": nvrtc_version,
        "nvrtc_library": sorted({Path(line.split()[-1]).name for line in maps if "nvrtc" in line}),
    }


def mnist_to_99() -> dict:
    """Train LeNet on MNIST with the default SMA settings on this GPU until 99 % test accuracy."""
    from crossbow_mpi import Config, Trainer
    from crossbow_mpi.data import build_dataset
    from crossbow_mpi.models import build_model

    train, test = build_dataset("mnist", str(harness.REPO / "datasets" / "mnist"), seed=1)
    with tempfile.TemporaryDirectory() as run_dir:
        cfg = Config(device="cuda", run_dir=run_dir, epochs=10)
        result = Trainer(cfg).fit(lambda: build_model("lenet", train.input_shape, 10), train, test)
    return {
        "reached": result.reached,
        "time_to_accuracy_s": result.time_to_accuracy_s,
        "epochs": result.epochs,
        "test_accuracy": result.test_accuracy,
    }


PARTS = {
    "tests": lambda: [
        run_tests(*run) for run in TEST_RUNS + ((NCCL_LINK_RUN,) if torch.cuda.device_count() >= 2 else ())
    ],
    "command_line": command_line,
    "versions": versions,
    "sync_cost": sync_cost,
    "throughput": throughput,
    "host_bound": host_bound,
    "mnist_to_99": mnist_to_99,
}


def verdict(results: dict) -> tuple[bool, str]:
    """Return whether the self-test passed on a GPU, and why in a few words."""
    errors = [
        f"{name}: {results[name]['error']}"
        for name in PARTS
        if isinstance(results.get(name), dict) and "error" in results[name]
    ]
    if errors:
        return False, f"{len(errors)} part(s) raised an error; first {errors[0]}"
    for run in results["tests"]:
        where = f"tests/gpu on {run['ranks']} rank(s) (-k '{run['select']}')"
        bad = {outcome: run[outcome] for outcome in ("failed", "errors", "skipped") if run[outcome]}
        if bad:
            counts = ", ".join(f"{number} {outcome}" for outcome, number in bad.items())
            first = "".join(f"; {problem}" for problem in run["problems"][:1])
            return False, f"{where}: {counts} (a skip on a GPU is a failure){first}"
        if run["exit_code"] != 0 or run["passed"] == 0:
            return False, f"{where}: exit code {run['exit_code']} with {run['passed']} passed"
    failed = [check for check in results["command_line"] if not check["passed"]]
    if failed:
        return False, f"command line: {failed[0]['check']}: {failed[0]['detail']}"
    mnist = results["mnist_to_99"]
    if not mnist["reached"]:
        return False, (
            f"LeNet/MNIST did not reach 99 % in {mnist['epochs']:g} epochs (best {mnist['test_accuracy']:.4f})"
        )
    passed = " and ".join(f"{run['passed']} on {run['ranks']} rank(s)" for run in results["tests"])
    checks, seconds = len(results["command_line"]), mnist["time_to_accuracy_s"]
    return (
        True,
        f"tests passed ({passed}); {checks} command-line checks passed; LeNet/MNIST reached 99 % in {seconds:.1f} s",
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=harness.RESULTS_DIR)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("gpu_selftest: FAIL: torch sees no CUDA device")
        return 1
    args.out.mkdir(parents=True, exist_ok=True)
    results: dict = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
    }
    for name, part in PARTS.items():
        harness.log(f"== {name}")
        started = time.perf_counter()
        try:
            results[name] = part()
        except Exception as err:  # a failed part is reported, and the others still run
            results[name] = {"error": f"{type(err).__name__}: {(str(err).strip().splitlines() or [''])[0]}"}
        results[f"{name}_seconds"] = time.perf_counter() - started
        (args.out / "gpu_selftest.json").write_text(json.dumps(results, indent=1) + "\n")
    passed, reason = verdict(results)
    results["verdict"] = {"passed": passed, "reason": reason}
    (args.out / "gpu_selftest.json").write_text(json.dumps(results, indent=1) + "\n")
    print(f"\nGPU self-test on {results['device']}, {results['date']}; wrote {args.out / 'gpu_selftest.json'}")
    for name in ("tests", "command_line", "sync_cost", "throughput", "host_bound"):
        rows = [
            {k: v for k, v in row.items() if k not in ("problems", "output_tail")}
            for row in (results[name] if isinstance(results[name], list) else [results[name]])
        ]
        columns = list(dict.fromkeys(key for row in rows for key in row))
        print(f"\n{name}\n" + harness.Report(name, columns, rows, [], {}).table())
    for name in ("versions", "mnist_to_99"):
        print(f"\n{name}: {json.dumps(results[name])}")
    print(f"gpu_selftest: {'PASS' if passed else 'FAIL'}: {reason}")
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
