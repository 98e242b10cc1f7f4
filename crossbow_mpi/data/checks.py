"""A user's datasets against their model, checked on a few samples before training, so that a wrong sample shape,
a label outside the model's classes or an output that is not class scores is one line naming the sample, the
problem and the dataset, not a torch traceback on every rank."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from crossbow_mpi.data.datasets import DataError
from crossbow_mpi.data.prefetch import to_device
from crossbow_mpi.data.sampler import fetch_batch

SAMPLES_CHECKED = 4


@torch.no_grad()
def check_samples(
    module: nn.Module, dtype: torch.dtype, dataset, role: str, output_fn: Callable[[object], torch.Tensor] | None = None
) -> None:
    """Run the first, the last and samples between of `dataset` (called `role` in messages) one at a time through
    the module in evaluation mode; raise DataError at the first that does not fit."""
    device = next(module.parameters()).device
    module.eval()
    last = len(dataset) - 1
    for index in sorted({last * i // (SAMPLES_CHECKED - 1) for i in range(SAMPLES_CHECKED)}):
        where = f"sample {index} of the {role}"
        try:
            inputs, targets = to_device(fetch_batch(dataset, torch.tensor([index])), device, dtype)
        except DataError as err:
            raise DataError(f"the {role}: {err}") from None
        try:
            outputs = module(inputs)
        except (RuntimeError, ValueError, IndexError) as err:
            reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            raise DataError(
                f"{where}: the model cannot take an input of shape {tuple(inputs.shape[1:])} ({reason})"
            ) from None
        scores = outputs if output_fn is None else output_fn(outputs)
        if not (isinstance(scores, torch.Tensor) and scores.dim() == 2 and len(scores) == 1):
            got = f"shape {tuple(scores.shape)}" if isinstance(scores, torch.Tensor) else f"a {type(scores).__name__}"
            raise DataError(
                f"the model's output for {where} is {got}, not one row of class scores per sample; "
                "pass fit(..., output_fn=...) to pick the class scores for evaluation"
            )
        label, classes = int(targets[0]), scores.shape[1]
        if not 0 <= label < classes:
            raise DataError(f"{where}: label {label} is outside the model's {classes} classes")
