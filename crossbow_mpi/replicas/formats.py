"""The flat buffers' memory format: `contiguous` (NCHW), `channels_last` (4-D tensors in N, H, W, C order, so that
convolutions read channels-last weights and inputs), or `auto`: channels-last for a model with 4-D weights where
one learner's forward and backward pass measures faster so, timed once at start."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
from torch import nn

from crossbow_mpi.data.prefetch import to_format

TIMED_PASSES = 3


def has_4d_weights(model: nn.Module) -> bool:
    return any(p.dim() == 4 for p in model.parameters() if p.requires_grad)


def choose_channels_last(
    name: str, model_fn: Callable[[], nn.Module], batch: tuple[torch.Tensor, torch.Tensor], loss_fn, device
) -> bool:
    """Resolve `--memory-format` to whether the flat buffers are channels-last (`auto`: time both, best of
    `TIMED_PASSES` passes each after one untimed)."""
    if name != "auto":
        return name == "channels_last"
    model = model_fn().to(device)
    if not has_4d_weights(model):
        return False
    inputs, targets = (t.to(device) for t in batch)
    seconds = {}
    for channels_last in (False, True):
        for param in model.parameters():  # nn.Module.to takes a memory format, which its type hints leave out
            if param.dim() == 4:
                param.data = param.data.contiguous(
                    memory_format=torch.channels_last if channels_last else torch.contiguous_format
                )
        model.zero_grad(set_to_none=True)  # a gradient of the other format would be accumulated into
        x = to_format(inputs, channels_last)
        times = []
        for _ in range(TIMED_PASSES + 1):
            started = time.perf_counter()
            loss_fn(model(x), targets).backward()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            times.append(time.perf_counter() - started)
        seconds[channels_last] = min(times[1:])
    return seconds[True] < seconds[False]
