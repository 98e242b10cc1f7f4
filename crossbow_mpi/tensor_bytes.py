"""A tensor's raw bytes and back: what the communicators' broadcasts, the pipeline's messages, the flat layout's
extra state and the survivors' digests carry."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch


def to_bytes(tensor: torch.Tensor) -> bytes:
    """Return a tensor's elements as raw bytes in contiguous order, copied to the host."""
    return tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def from_bytes(data: bytes | bytearray, dtype: torch.dtype, shape: Sequence[int]) -> torch.Tensor:
    """Return a new host tensor of `dtype` and `shape` holding a copy of `data` (as `to_bytes` gave it)."""
    if not data:
        return torch.empty(tuple(shape), dtype=dtype)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).view(dtype).reshape(tuple(shape))


def nbytes(dtype: torch.dtype, shape: Sequence[int]) -> int:
    """Return the bytes of a tensor of `dtype` and `shape`."""
    return math.prod(shape) * dtype.itemsize


def dtype_name(dtype: torch.dtype) -> str:
    """Return a dtype's name without the `torch.` prefix (`named_dtype` reads it back)."""
    return str(dtype).removeprefix("torch.")


def named_dtype(name: str) -> torch.dtype:
    """Return the dtype that `dtype_name` named."""
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"{name!r} names no torch dtype")
    return dtype
