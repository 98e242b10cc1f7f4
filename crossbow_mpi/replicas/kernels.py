"""Fused kernels: SMA's learner and central steps and S-SGD's central step each in one pass over memory, with the
bits of the in-place sequences they replace; and the C++ compiler that torch.compile needs on a CPU.

A fused step rounds exactly where its in-place sequence does. PyTorch computes `a.add_(b, alpha=s)` as one
multiply-add, fma(b, s, a); every other product, sum and quotient is rounded on its own. So, per element:

SMA, each learner's row (g is read, then holds the correction c: SMA stages c over the gradient)
    g' = fma(w, λ, g);  v ← fma(g', −η, μ v);  c = α (w − z);  w ← (w + v) − c;  g ← c
reading w, v, g (and z once per column) and writing w, v and g: six passes over k·n floats where the in-place
sequence makes eighteen.

SMA, z and its momentum u, with the summed corrections d (d is read, not written back: the next sum replaces it)
    u ← fma(u, μ_z, d);  z ← z + u
reading d, u, z and writing u, z: five passes where the in-place sequence makes eight.

S-SGD, z and its momentum u, with the summed gradient g of n learners' weight
    u ← μ u + fma(z, λ, g / n);  z ← fma(u, −η, z)
reading g, z, u and writing z, u: five passes where the in-place sequence makes twelve.

On a CPU the steps are torch.compile's C++ code (its `fma` is a multiply-add instruction); on CUDA they are CuPy
kernels whose products, sums and quotients are the round-to-nearest intrinsics, so that the compiler cannot
contract them into multiply-adds the in-place kernels do not make. Where neither is available (a CPU without a
C++ compiler, CUDA without CuPy) the algorithms keep their in-place sequences. A CuPy that cannot compile (no
NVRTC) is refused at start-up. fp16 values compute in float inside the CuPy kernels, so the same bits as the
in-place sequences hold for float32 and bfloat16 (as tested), not for float16.
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import tempfile
from collections.abc import Callable

import torch

from crossbow_mpi.config import ConfigError

SmaUpdate = Callable[..., None]
"""update(w, v, g, z, lr, weight_decay, momentum, alpha): one fused SMA learner step, in place (c into g)."""
SmaCentralUpdate = Callable[..., None]
"""update(d, z, u, central_momentum): one fused SMA step of z and u by the summed corrections d, in place."""
SsgdUpdate = Callable[..., None]
"""update(g, carried, z, u, lr, weight_decay, momentum): one fused S-SGD step of z and u, in place."""


def cxx_compiler() -> str | None:
    """Return the path of the C++ compiler that torch.compile's CPU code uses ($CXX, else g++), or None where
    there is none or it cannot compile a program."""
    found = shutil.which(os.environ.get("CXX") or "g++")
    return found if found is not None and _compiles(found) else None


@functools.cache
def _compiles(compiler: str) -> bool:
    with tempfile.TemporaryDirectory() as scratch:
        try:
            done = subprocess.run(
                [compiler, "-x", "c++", "-", "-o", os.path.join(scratch, "a.out")],
                input="int main() { return 0; }\n",
                capture_output=True,
                text=True,
                timeout=60,
            )
        except (OSError, subprocess.TimeoutExpired):
            return False
    return done.returncode == 0


def require_compiler(flag: str) -> None:
    """Raise ConfigError when torch.compile would find no working C++ compiler."""
    if cxx_compiler() is None:
        raise ConfigError(
            f"{flag} needs a C++ compiler for torch.compile: none that works found ($CXX, else g++ on PATH)"
        )


def _sma_update(w, v, g, z, hp) -> None:
    lr, weight_decay, momentum, alpha = hp[0], hp[1], hp[2], hp[3]
    v_new = torch.ops.prims.fma(torch.ops.prims.fma(w, weight_decay, g), -lr, v * momentum)
    c = (w - z) * alpha
    v.copy_(v_new)
    g.copy_(c)
    w.copy_((w + v_new) - c)


def _sma_central_update(d, z, u, hp) -> None:
    u_new = torch.ops.prims.fma(u, hp[0], d)
    u.copy_(u_new)
    z.copy_(z + u_new)


def _ssgd_update(g, carried, z, u, hp) -> None:
    lr, weight_decay, momentum = hp[0], hp[1], hp[2]
    u_new = u * momentum + torch.ops.prims.fma(z, weight_decay, g / carried)
    u.copy_(u_new)
    z.copy_(torch.ops.prims.fma(u_new, -lr, z))


@functools.cache
def _compiled(update: Callable) -> Callable:
    from torch._inductor import inductor_prims  # noqa: F401  (registers prims.fma; 2 s to import, so only here)

    return torch.compile(update, dynamic=True)  # one kernel for every model and k


def _numbers(like: torch.Tensor, *values: float) -> torch.Tensor:
    """The step's numbers as a tensor: as Python numbers, every new learning rate would compile the step again."""
    return torch.tensor(values, dtype=like.dtype, device=like.device)


def compiled_sma_update(w, v, g, z, lr, weight_decay, momentum, alpha) -> None:
    """Run the fused SMA step as torch.compile's code; compiled at the first call."""
    _compiled(_sma_update)(w, v, g, z, _numbers(w, lr, weight_decay, momentum, alpha))


def compiled_sma_central_update(d, z, u, central_momentum) -> None:
    """Run the fused SMA central step as torch.compile's code; compiled at the first call."""
    _compiled(_sma_central_update)(d, z, u, _numbers(z, central_momentum))


def compiled_ssgd_update(g, carried, z, u, lr, weight_decay, momentum) -> None:
    """Run the fused S-SGD step as torch.compile's code; compiled at the first call."""
    _compiled(_ssgd_update)(g, carried, z, u, _numbers(z, lr, weight_decay, momentum))


CUPY_ROUNDED = r"""
__device__ float mul_rn(float a, float b) { return __fmul_rn(a, b); }
__device__ double mul_rn(double a, double b) { return __dmul_rn(a, b); }
__device__ float add_rn(float a, float b) { return __fadd_rn(a, b); }
__device__ double add_rn(double a, double b) { return __dadd_rn(a, b); }
__device__ float sub_rn(float a, float b) { return __fsub_rn(a, b); }
__device__ double sub_rn(double a, double b) { return __dsub_rn(a, b); }
__device__ float div_rn(float a, float b) { return __fdiv_rn(a, b); }
__device__ double div_rn(double a, double b) { return __ddiv_rn(a, b); }
"""
"""Round-to-nearest arithmetic that nvcc does not contract into multiply-adds (the kernels' preamble)."""

CUPY_SMA_UPDATE = (
    "T z, T lr, T weight_decay, T momentum, T alpha",
    "T w, T v, T g",
    "T v_new = fma(fma(w, weight_decay, g), -lr, mul_rn(v, momentum));"
    " T c = mul_rn(sub_rn(w, z), alpha);"
    " w = sub_rn(add_rn(w, v_new), c); v = v_new; g = c;",
    "crossbow_sma_update",
)
"""The fused SMA step as a CuPy ElementwiseKernel (inputs, outputs, body, name); z broadcasts over the rows; g is
an output, read before it takes c (as an input beside it, CuPy would copy it first)."""

CUPY_SMA_CENTRAL_UPDATE = (
    "T d, T central_momentum",
    "T z, T u",
    "T u_new = fma(u, central_momentum, d); u = u_new; z = add_rn(z, u_new);",
    "crossbow_sma_central_update",
)
"""The fused SMA central step as a CuPy ElementwiseKernel."""

CUPY_SSGD_UPDATE = (
    "T g, raw T carried, T lr, T weight_decay, T momentum",
    "T z, T u",
    "T u_new = add_rn(mul_rn(u, momentum), fma(z, weight_decay, div_rn(g, carried[0])));"
    " u = u_new; z = fma(u_new, -lr, z);",
    "crossbow_ssgd_update",
)
"""The fused S-SGD step as a CuPy ElementwiseKernel; `carried` is the one-element summed weight."""


@functools.cache
def _cupy_kernel(spec: tuple[str, str, str, str]):
    import cupy

    return cupy.ElementwiseKernel(*spec, preamble=CUPY_ROUNDED)


def _check_cupy_compiles(device: torch.device) -> None:
    """Compile and run one fused kernel on 1-element arrays, so that a CuPy that cannot compile (no NVRTC) is a
    one-line ConfigError at start-up instead of an abort at the first step."""
    import cupy

    try:
        with cupy.cuda.Device(device.index or 0) as gpu:
            d, z, u = (cupy.zeros(1, dtype=cupy.float32) for _ in range(3))
            _cupy_kernel(CUPY_SMA_CENTRAL_UPDATE)(d, cupy.float32(0), z, u)
            gpu.synchronize()
    except Exception as err:  # CuPy's CompileException, or NVRTC's library missing at load
        reason = (str(err).strip().splitlines() or [""])[0]
        raise ConfigError(
            f"--fused-step: CuPy cannot compile its kernels ({type(err).__name__}: {reason}); install NVRTC for "
            f"CUDA {torch.version.cuda} (the nvidia-cuda-nvrtc wheel, or the CUDA toolkit) or leave --fused-step off"
        ) from None


def _run_cupy(spec, like: torch.Tensor, inputs: tuple, numbers: tuple[float, ...], outputs: tuple) -> None:
    """Run a CuPy kernel on torch's current stream: tensors in, the numbers as scalars of `like`'s dtype, outputs
    written in place."""
    import cupy

    device, stream = like.device, torch.cuda.current_stream(like.device).cuda_stream
    with cupy.cuda.Device(device.index), _cupy_stream(cupy, stream):
        scalar = cupy.asarray(like).dtype.type
        _cupy_kernel(spec)(*map(cupy.asarray, inputs), *map(scalar, numbers), *map(cupy.asarray, outputs))


class _StreamAddress:
    """A CUDA stream by its address, in the CUDA stream protocol that CuPy 14's `Stream.from_external` reads."""

    def __init__(self, address: int):
        self.address = address

    def __cuda_stream__(self) -> tuple[int, int]:
        return 0, self.address


def _cupy_stream(cupy, address: int):
    """CuPy's handle of the stream at `address`: `Stream.from_external` (CuPy 14, which deprecates
    `ExternalStream`), else `ExternalStream` (CuPy 13)."""
    from_external = getattr(cupy.cuda.Stream, "from_external", None)
    return from_external(_StreamAddress(address)) if from_external else cupy.cuda.ExternalStream(address)


def cupy_sma_update(w, v, g, z, lr, weight_decay, momentum, alpha) -> None:
    """Run the fused SMA step as one CuPy kernel on torch's current stream."""
    _run_cupy(CUPY_SMA_UPDATE, w, (z,), (lr, weight_decay, momentum, alpha), (w, v, g))


def cupy_sma_central_update(d, z, u, central_momentum) -> None:
    """Run the fused SMA central step as one CuPy kernel on torch's current stream."""
    _run_cupy(CUPY_SMA_CENTRAL_UPDATE, z, (d,), (central_momentum,), (z, u))


def cupy_ssgd_update(g, carried, z, u, lr, weight_decay, momentum) -> None:
    """Run the fused S-SGD step as one CuPy kernel on torch's current stream."""
    _run_cupy(CUPY_SSGD_UPDATE, z, (g, carried), (lr, weight_decay, momentum), (z, u))


FUSED: dict[str, dict[str, tuple[Callable[..., None], Callable[..., None]]]] = {
    "sma": {
        "fused_update": (compiled_sma_update, cupy_sma_update),
        "fused_central": (compiled_sma_central_update, cupy_sma_central_update),
    },
    "ssgd": {"fused_update": (compiled_ssgd_update, cupy_ssgd_update)},
}
"""Each algorithm's fused steps, by the algorithm's attribute that holds one: (torch.compile's, CuPy's)."""


def build_fused_steps(algorithm: str, device: torch.device) -> dict[str, Callable[..., None]]:
    """Return the algorithm's fused steps for the device by attribute: torch.compile's C++ code on a CPU with a C++
    compiler, CuPy kernels on CUDA; none for an algorithm without any, or where neither is available, so that the
    in-place sequences run."""
    if device.type == "cuda":
        try:
            import cupy  # noqa: F401
        except ImportError:
            return {}
        if algorithm in FUSED:
            _check_cupy_compiles(device)
        return {attribute: cupy_update for attribute, (_, cupy_update) in FUSED.get(algorithm, {}).items()}
    if cxx_compiler() is None:
        return {}
    return {attribute: compiled for attribute, (compiled, _) in FUSED.get(algorithm, {}).items()}


def fuse(algorithm, device: torch.device) -> None:
    """Give an Algorithm its fused steps for the device, where it has any and they are available."""
    for attribute, step in build_fused_steps(algorithm.name, device).items():
        setattr(algorithm, attribute, step)
