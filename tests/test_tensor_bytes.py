"""A tensor's raw bytes and back (crossbow_mpi.tensor_bytes)."""

from __future__ import annotations

import pytest
import torch

from crossbow_mpi.tensor_bytes import dtype_name, from_bytes, named_dtype, nbytes, to_bytes


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.uint8, torch.bool])
@pytest.mark.parametrize("shape", [(), (0,), (3,), (2, 3, 4)])
def test_bytes_round_trip_every_dtype_and_shape(dtype, shape):
    tensor = (torch.arange(max(1, torch.Size(shape).numel())) % 7).to(dtype)[: torch.Size(shape).numel()].reshape(shape)
    data = to_bytes(tensor)
    assert len(data) == nbytes(dtype, shape)
    back = from_bytes(data, named_dtype(dtype_name(dtype)), shape)
    assert back.dtype == dtype and back.shape == tensor.shape and torch.equal(back, tensor)


def test_from_bytes_owns_a_copy_and_to_bytes_reads_views_in_order():
    matrix = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    assert to_bytes(matrix.t()) == to_bytes(matrix.t().contiguous())
    data = bytearray(to_bytes(matrix))
    back = from_bytes(data, torch.float32, (2, 3))
    data[:4] = b"\0\0\0\0"
    assert torch.equal(back, matrix), "the tensor does not share the caller's buffer"


def test_a_name_that_is_no_dtype_is_refused():
    with pytest.raises(ValueError, match="names no torch dtype"):
        named_dtype("Tensor")
