"""A user's datasets against their model, checked on a few samples before training, so that a wrong sample shape,
a label outside the model's classes, an output that is not class scores or, with the user's own loss, a loss that
is not a finite number is one line naming the sample, the problem and the dataset, not a torch traceback on every
rank."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from crossbow_mpi.data.datasets import DataError
from crossbow_mpi.data.prefetch import to_device
from crossbow_mpi.data.sampler import fetch_batch

SAMPLES_CHECKED = 4


@torch.no_grad()
def check_samples(
    module: nn.Module,
    dtype: torch.dtype,
    dataset,
    role: str,
    output_fn: Callable[[object], torch.Tensor] | None = None,
    loss_fn: Callable[..., torch.Tensor] = F.cross_entropy,
) -> None:
    """Run the first, the last and samples between of `dataset` (called `role` in messages) one at a time through
    the module in evaluation mode; raise DataError at the first that does not fit. With the default loss a sample's
    output must be one row of class scores and its label one class index; with the user's own `loss_fn`, labels
    may have any shape and the loss must only be a finite number."""
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
        if loss_fn is not F.cross_entropy:
            check_loss(where, batch_loss(role, loss_fn, outputs, targets))
            continue
        scores = outputs if output_fn is None else output_fn(outputs)
        if not (isinstance(scores, torch.Tensor) and scores.dim() == 2 and len(scores) == 1):
            got = f"shape {tuple(scores.shape)}" if isinstance(scores, torch.Tensor) else f"a {type(scores).__name__}"
            raise DataError(
                f"the model's output for {where} is {got}, not one row of class scores per sample; "
                "pass fit(..., output_fn=...) to pick the class scores for evaluation"
            )
        if targets[0].numel() != 1:
            raise DataError(
                f"{where} has a label of shape {tuple(targets.shape[1:])}, not one class index; pass "
                "fit(..., loss_fn=...) to train on labels of other shapes"
            )
        label, classes = int(targets[0]), scores.shape[1]
        if not 0 <= label < classes:
            raise DataError(f"{where}: label {label} is outside the model's {classes} classes")
    if loss_fn is F.cross_entropy:
        check_all_labels(dataset, role, classes)


def check_loss(where: str, loss) -> None:
    """DataError unless `loss` is a finite number (a tensor of one element)."""
    if not (isinstance(loss, torch.Tensor) and loss.numel() == 1):
        got = f"shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor) else f"a {type(loss).__name__}"
        raise DataError(f"the loss of {where} is {got}, not one number: loss_fn must reduce to a scalar")
    if not torch.isfinite(loss):
        raise DataError(f"the loss of {where} is {float(loss)}, not a finite number")


def check_all_labels(dataset, role: str, classes: int) -> None:
    """Where the dataset holds its labels as `targets` (torchvision's datasets, ours), check every one at once."""
    targets = getattr(dataset, "targets", None)
    if targets is None:
        return
    labels = torch.as_tensor(targets)
    if labels.dim() != 1 or labels.dtype.is_floating_point:
        return
    outside = ((labels < 0) | (labels >= classes)).nonzero()
    if len(outside):
        index = int(outside[0])
        raise DataError(
            f"sample {index} of the {role}: label {int(labels[index])} is outside the model's {classes} classes"
        )


def batch_loss(role: str, compute: Callable[..., torch.Tensor], *args) -> torch.Tensor:
    """Return compute(*args), a batch's loss; DataError, naming the dataset, when the loss cannot index by a label (one
    outside the model's classes, at a position the start-up check did not sample)."""
    try:
        return compute(*args)
    except IndexError as err:  # cross_entropy's "Target 12 is out of bounds"
        raise DataError(
            f"the loss cannot take a batch of the {role} ({err}): every label must be a class index of the model's "
            "output"
        ) from None
