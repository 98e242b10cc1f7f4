"""launch/setup.sh on a fresh machine: the Python version first, the CPU build of torch without a GPU, the CUDA
build and the matching CuPy with one, and a rebuilt mpi4py for a system MPI. The venv's python is faked: it
records each call, and hands pip's torch install to the real pip as a dry run, so nothing is installed."""

from __future__ import annotations

import functools
import http.server
import json
import os
import subprocess
import sys
import threading
import zipfile
from pathlib import Path

import pytest

from helpers import REPO

FAKE_PYTHON = """#!{real}
import json, os, subprocess, sys
args = sys.argv[1:]
with open(os.environ["FAKE_LOG"], "a") as log:
    log.write(json.dumps({{"args": args, "MPICC": os.environ.get("MPICC")}}) + "\\n")
if args[0] == "-c":
    code = args[1]
    if "version_info" in code or "urlopen" in code:
        os.execv("{real}", ["{real}", *args])
    if "torch.version.cuda" in code:
        print(os.environ.get("FAKE_CUDA", ""))
    elif "Get_library_version" in code:
        print("launch/setup.sh: mpi4py uses FAKE MPI 1.0")
    sys.exit(1 if code == "import torch" else 0)
if args[2] == "show":
    sys.exit(0 if os.environ.get("FAKE_OPENMPI") else 1)
if args[2] == "install" and any(a.startswith("torch==") for a in args) and "FAKE_REPORT" in os.environ:
    dry_run = ["--dry-run", "--ignore-installed", "--report", os.environ["FAKE_REPORT"]]
    sys.exit(subprocess.call(["{real}", "-m", "pip", "install", *dry_run, *args[3:]]))
"""


@pytest.fixture
def machine(tmp_path):
    """A fresh venv with the faked python, a bin/ for faked tools; returns (environment, log)."""
    (tmp_path / "venv" / "bin").mkdir(parents=True)
    python = tmp_path / "venv" / "bin" / "python"
    python.write_text(FAKE_PYTHON.format(real=sys.executable))
    python.chmod(0o755)
    (tmp_path / "bin").mkdir()
    log = tmp_path / "calls.jsonl"
    env = dict(
        os.environ,
        CROSSBOW_VENV=str(tmp_path / "venv"),
        FAKE_LOG=str(log),
        PATH=os.pathsep.join([str(tmp_path / "bin"), "/usr/bin", "/bin"]),
    )
    for name in ("CROSSBOW_MPI", "PYTHON", "CROSSBOW_TORCH_CPU_INDEX"):
        env.pop(name, None)
    return env, log


def executable(path: Path, body: str) -> None:
    path.write_text(f"#!/usr/bin/env bash\n{body}\n")
    path.chmod(0o755)


def setup(env: dict, **extra) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", str(REPO / "launch" / "setup.sh")], capture_output=True, text=True, timeout=300, env=dict(env, **extra)
    )


def pip_installs(log: Path) -> list[list[str]]:
    calls = [json.loads(line)["args"] for line in log.read_text().splitlines()]
    return [c[5:] for c in calls if c[:3] == ["-m", "pip", "install"]]


def test_an_old_python_stops_before_anything_is_installed(tmp_path, machine):
    env, _ = machine
    old = tmp_path / "python3.10"
    executable(old, f'echo "$*" >> {tmp_path / "old.log"}; echo 3.10')
    venv = tmp_path / "fresh"
    job = setup(env, PYTHON=str(old), CROSSBOW_VENV=str(venv))
    assert job.returncode == 1
    (line,) = job.stderr.splitlines()
    assert "Python 3.10" in line and "3.11" in line and "PYTHON=" in line
    assert not venv.exists()
    assert len((tmp_path / "old.log").read_text().splitlines()) == 1


def local_cpu_torch_wheel() -> Path | None:
    """A CPU build of torch that pip's configuration here offers from a local directory (find-links), if any."""
    config = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True).stdout
    folders = [
        value.strip("'")
        for key, value in (line.split("=", 1) for line in config.splitlines())
        if key.endswith("find-links")
    ]
    folders += os.environ.get("PIP_FIND_LINKS", "").split()
    return next((w for f in folders if Path(f).is_dir() for w in sorted(Path(f).glob("torch-*+cpu-*.whl"))), None)


@pytest.fixture
def cpu_index(tmp_path):
    """A PyTorch-style CPU wheel index on localhost, holding this machine's local CPU torch wheel; its metadata
    is served beside it (PEP 658), so that a dry run never downloads the wheel."""
    wheel = local_cpu_torch_wheel()
    if wheel is None:
        pytest.skip("no local CPU build of torch to serve")
    folder = tmp_path / "index" / "torch"
    folder.mkdir(parents=True)
    (folder / wheel.name).symlink_to(wheel)
    with zipfile.ZipFile(wheel) as zf:
        metadata = next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))
        (folder / f"{wheel.name}.metadata").write_bytes(zf.read(metadata))
    (folder / "index.html").write_text(
        f'<a href="{wheel.name}" data-dist-info-metadata="true" data-core-metadata="true">{wheel.name}</a>\n'
    )
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(tmp_path / "index"))
    handler.log_message = lambda *args: None
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def resolved(report: Path) -> dict[str, str]:
    return {i["metadata"]["name"].lower(): i["metadata"]["version"] for i in json.loads(report.read_text())["install"]}


@pytest.mark.slow
def test_without_a_gpu_torch_comes_from_the_cpu_index_and_pulls_no_cuda(tmp_path, machine, cpu_index):
    env, log = machine
    job = setup(env, CROSSBOW_TORCH_CPU_INDEX=cpu_index, FAKE_REPORT=str(tmp_path / "report.json"))
    assert job.returncode == 0, job.stderr
    installs = pip_installs(log)
    assert installs[0] == ["--index-url", cpu_index, "torch==2.13.0"]
    packages = resolved(tmp_path / "report.json")
    assert packages["torch"].endswith("+cpu")
    assert not [name for name in packages if name.startswith("nvidia-") or name == "triton"]
    assert installs[1] == ["-e", f"{REPO}[test,mpi]"]


@pytest.mark.slow
def test_without_a_gpu_or_the_cpu_index_torch_comes_as_pip_is_configured(tmp_path, machine):
    env, log = machine
    job = setup(env, CROSSBOW_TORCH_CPU_INDEX="http://127.0.0.1:9/whl/cpu", FAKE_REPORT=str(tmp_path / "r.json"))
    assert job.returncode == 0, job.stderr
    (note,) = [line for line in job.stderr.splitlines() if line.startswith("launch/setup.sh:")]
    assert "cannot reach http://127.0.0.1:9/whl/cpu" in note
    assert pip_installs(log)[0] == ["torch==2.13.0"]
    if local_cpu_torch_wheel() is not None:  # this machine: pip is configured with a local CPU wheel
        assert resolved(tmp_path / "r.json")["torch"].endswith("+cpu")


@pytest.mark.parametrize("cuda", ["12", "13"])
def test_with_a_gpu_torch_is_the_cuda_build_and_cupy_matches_its_cuda(tmp_path, machine, cuda):
    env, log = machine
    executable(tmp_path / "bin" / "nvidia-smi", 'echo "GPU 0: NVIDIA H200"')
    job = setup(env, FAKE_CUDA=cuda)
    assert job.returncode == 0, job.stderr
    assert pip_installs(log) == [["torch==2.13.0"], ["-e", f"{REPO}[test,mpi,cuda{cuda}]"]]


def test_system_mpi_removes_the_wheel_and_rebuilds_mpi4py_against_the_mpicc_on_path(tmp_path, machine):
    env, log = machine
    executable(tmp_path / "bin" / "mpicc", "exit 0")
    job = setup(env, CROSSBOW_MPI="system", FAKE_OPENMPI="1", CROSSBOW_TORCH_CPU_INDEX="http://127.0.0.1:9")
    assert job.returncode == 0, job.stderr
    calls = [json.loads(line) for line in log.read_text().splitlines()]
    uninstall = next(i for i, c in enumerate(calls) if c["args"][:3] == ["-m", "pip", "uninstall"])
    assert calls[uninstall]["args"][3:] == ["--quiet", "--yes", "openmpi"]
    rebuild = next(i for i, c in enumerate(calls) if "--no-binary" in c["args"])
    assert uninstall < rebuild
    assert calls[rebuild]["args"][5:] == ["--no-binary", "mpi4py", "--no-cache-dir", "--force-reinstall", "mpi4py"]
    assert calls[rebuild]["MPICC"] == str(tmp_path / "bin" / "mpicc")
    assert pip_installs(log)[-1] == ["-e", f"{REPO}[test]"]
    assert "mpi4py uses FAKE MPI" in job.stdout


def test_system_mpi_without_mpicc_stops_with_one_line(machine):
    env, _ = machine
    job = setup(env, CROSSBOW_MPI="system", CROSSBOW_TORCH_CPU_INDEX="http://127.0.0.1:9")
    assert job.returncode == 1
    assert job.stderr.splitlines()[-1] == (
        "launch/setup.sh: CROSSBOW_MPI=system: no mpicc on PATH; load your MPI first (module load ...)"
    )
