"""A rank's memory by part: the bytes each of its tensors holds, and a learner's activations measured once.

The parts are z and u, the learners' weights (their own columns: float buffers alone while they share z),
gradients (with the sync message's room beside them, `Learners.staging`), momenta, the optimizers' state (where
z or the learners step with a torch.optim optimizer), the algorithm's message
buffers beyond those, the activations that autograd saves for the backward pass (the peak: what a forward pass
has saved when its backward pass starts, times the learners whose passes run at once) and the data prefetch.

A learner's activations are counted by saved-tensor hooks (`torch.autograd.graph.saved_tensors_hooks`) around
one forward pass: every distinct storage saved for backward that is neither a parameter nor the batch.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
from torch import nn


class ActivationMeter:
    """The bytes one learner's forward pass saves for its backward pass, measured on the first pass it watches."""

    def __init__(self) -> None:
        self.bytes: int | None = None

    @contextmanager
    def watch(self, module: nn.Module, inputs: torch.Tensor):
        """Count what the forward pass inside saves (once; later passes run without hooks)."""
        if self.bytes is not None:
            yield
            return
        skip = {_storage(t) for t in (*module.parameters(), inputs)}
        saved: dict[int, int] = {}

        def pack(tensor: torch.Tensor) -> torch.Tensor:
            key = _storage(tensor)
            if key not in skip:
                saved[key] = tensor.untyped_storage().nbytes()
            return tensor

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            yield
        self.bytes = sum(saved.values())


def footprint(central, learners, algorithm, activations: int | None, concurrent: int, batch_bytes: int) -> dict:
    """Return a rank's bytes by part (`activations`: one learner's, None where unmeasured; `concurrent`: learners
    whose passes run at once; `batch_bytes`: what the prefetcher holds)."""
    own = {_storage(learners.staging)}
    message = sum(_nbytes(t) for t in _distinct((algorithm.staged, algorithm.message)) if _storage(t) not in own)
    message += sum(_nbytes(t) for t in algorithm.feedback.residuals.values())
    parts = {
        "z": _nbytes(central.z),
        "u": _nbytes(central.u),
        "learner_weights": _nbytes(learners.weights),
        "learner_grads": _nbytes(learners.staging),
        "learner_momenta": _nbytes(learners.momentum),
        "optimizer_state": sum(_nbytes(t) for t in _optimizer_state(central.optimizer, learners.optimizers)),
        "message": message,
        "activations_peak": None if activations is None else activations * concurrent,
        "prefetch": batch_bytes,
    }
    parts["total"] = sum(v for v in parts.values() if v is not None)
    return parts


def bytes_per_learner(learners, activations: int | None) -> int:
    """Return what one more learner costs: its rows of weights, gradients and momenta, and its activations."""
    rows = (learners.weights, learners.staging, learners.momentum, *_optimizer_state(learners.optimizers))
    return sum(t[0].numel() * t.element_size() for t in rows if len(t)) + (activations or 0)


def _optimizer_state(*optimizers) -> list[torch.Tensor]:
    """The state matrices of the optimizers that step z or the learners (where not momentum SGD)."""
    return [t for optimizer in optimizers if optimizer is not None for t in optimizer.state.values()]


def _distinct(tensors) -> list[torch.Tensor]:
    seen: dict[int, torch.Tensor] = {}
    for t in tensors:
        if t.numel():
            seen.setdefault(_storage(t), t)
    return list(seen.values())


def _storage(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage().data_ptr()


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()
