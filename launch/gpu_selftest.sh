#!/usr/bin/env bash
# GPU self-test for one GPU (an H200 in our runs), under 8 minutes, offline: the GPU tests, one-rank NCCL
# allreduce bandwidth against a plain copy, ResNet-32 throughput with 1, 2, 4, 8 and auto learners (SMA) and
# with S-SGD, and LeNet/MNIST with SMA to 99 %. Needs torch, cupy-cuda13x, mpi4py, h5py, numpy, pytest.
# Results: $OUT/gpu_selftest.json (default benchmarks/results); the table is printed last.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
[ "$(id -u)" = 0 ] && export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
nvidia-smi -L || { echo "gpu_selftest: no NVIDIA GPU visible" >&2; exit 1; }
exec timeout --kill-after=10 470 python -m benchmarks.gpu_selftest --out "${OUT:-benchmarks/results}"
