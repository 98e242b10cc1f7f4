"""Fused and compiled kernels: SMA's learner step in one pass over memory, and the C++ compiler that torch.compile
needs on a CPU.

The fused SMA step computes, per element of a learner's row (g is read, not written back: the next backward
pass zeroes it),
    v ← μ v − η (g + λ w);  c = α (w − z);  w ← w + v − c
reading w, v, g (and z once per column) and writing w, v and c: six passes over k·n floats where the in-place
sequence makes eighteen. Its roundings differ from the in-place sequence's (which fuses η·g into a
multiply-add), so it is an option, not the default.
"""

from __future__ import annotations

import functools
import os
import shutil
from typing import Callable

import torch

from crossbow_mpi.config import ConfigError

SmaUpdate = Callable[..., None]
"""update(w, v, g, z, corrections, lr, weight_decay, momentum, alpha): one fused SMA learner step, in place."""


def cxx_compiler() -> str | None:
    """Return the path of the C++ compiler that torch.compile's CPU code uses ($CXX, else g++), or None."""
    return shutil.which(os.environ.get("CXX") or "g++")


def require_compiler(flag: str) -> None:
    """Raise ConfigError when torch.compile would find no C++ compiler."""
    if cxx_compiler() is None:
        raise ConfigError(f"{flag} needs a C++ compiler for torch.compile: none found ($CXX, else g++ on PATH)")


def _sma_update(w, v, g, z, corrections, hp) -> None:
    lr, weight_decay, momentum, alpha = hp[0], hp[1], hp[2], hp[3]
    v_new = v * momentum - (g + w * weight_decay) * lr
    c = (w - z) * alpha
    v.copy_(v_new)
    corrections.copy_(c)
    w.copy_(w + v_new - c)


@functools.cache
def _compiled_update():
    return torch.compile(_sma_update, dynamic=True)  # one kernel for every model and k


def compiled_sma_update(w, v, g, z, corrections, lr, weight_decay, momentum, alpha) -> None:
    """Run the fused step as torch.compile's code (C++ on a CPU, Triton on CUDA); compiled at the first call."""
    # the numbers go in a tensor: as Python numbers, every new learning rate would compile the step again
    hp = torch.tensor([lr, weight_decay, momentum, alpha], dtype=w.dtype, device=w.device)
    _compiled_update()(w, v, g, z, corrections, hp)


CUPY_SMA_UPDATE = (
    "T g, T z, T lr, T weight_decay, T momentum, T alpha",
    "T w, T v, T c",
    "v = momentum * v - lr * (g + weight_decay * w); c = alpha * (w - z); w = w + v - c;",
    "crossbow_sma_update",
)
"""The fused step as a CuPy ElementwiseKernel (inputs, outputs, body, name); z broadcasts over the rows."""


@functools.cache
def _cupy_kernel():
    import cupy

    return cupy.ElementwiseKernel(*CUPY_SMA_UPDATE)


def cupy_sma_update(w, v, g, z, corrections, lr, weight_decay, momentum, alpha) -> None:
    """Run the fused step as one CuPy kernel on torch's current stream."""
    import cupy

    kernel = _cupy_kernel()
    with cupy.cuda.Device(w.device.index), cupy.cuda.ExternalStream(torch.cuda.current_stream(w.device).cuda_stream):
        w_, v_, c_ = (cupy.asarray(t) for t in (w, v, corrections))
        scalar = w_.dtype.type
        kernel(cupy.asarray(g), cupy.asarray(z), *map(scalar, (lr, weight_decay, momentum, alpha)), w_, v_, c_)


def build_sma_update(device: torch.device) -> SmaUpdate | None:
    """Return the fused SMA step for the device: a CuPy kernel on CUDA (torch.compile's Triton code without CuPy),
    torch.compile's C++ code on a CPU with a C++ compiler; None on a CPU without one, where eager in-place ops
    cannot do better than the step's own sequence."""
    if device.type == "cuda":
        try:
            import cupy  # noqa: F401
        except ImportError:
            return compiled_sma_update
        return cupy_sma_update
    return compiled_sma_update if cxx_compiler() is not None else None
