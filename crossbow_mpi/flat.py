"""Flat buffers: a model's parameters, gradients and float buffers as views into contiguous tensors.

A model's *state* vector is its parameters followed by its floating-point buffers (BatchNorm running
statistics); its *gradient* vector covers the parameters only. Binding a module to rows of such tensors
makes every parameter, gradient and buffer a view, so a correction, a reduction over learners or an
allreduce is one vector operation and one message.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class Slot:
    """One tensor's place in a flat vector."""

    module: str
    name: str
    shape: tuple[int, ...]
    offset: int

    @property
    def numel(self) -> int:
        return int(torch.Size(self.shape).numel())


class FlatLayout:
    """Where each parameter and float buffer of a model lives in its flat state vector."""

    def __init__(self, model: nn.Module):
        self.param_slots: list[Slot] = []
        self.buffer_slots: list[Slot] = []
        offset = 0
        dtypes = set()
        for module_name, module in model.named_modules():
            for name, param in module.named_parameters(recurse=False):
                if param.requires_grad:
                    self.param_slots.append(Slot(module_name, name, tuple(param.shape), offset))
                    offset += param.numel()
                    dtypes.add(param.dtype)
        self.num_params = offset
        for module_name, module in model.named_modules():
            for name, buffer in module.named_buffers(recurse=False):
                if buffer is not None and buffer.is_floating_point():
                    self.buffer_slots.append(Slot(module_name, name, tuple(buffer.shape), offset))
                    offset += buffer.numel()
        self.num_state = offset
        if self.num_params == 0:
            raise ValueError("the model has no trainable parameters")
        if len(dtypes) != 1:
            raise ValueError(f"all trainable parameters must share one dtype, found {sorted(map(str, dtypes))}")
        self.dtype = dtypes.pop()

    @property
    def signature(self) -> str:
        """A digest of names and shapes; equal layouts have equal signatures."""
        slots = [(s.module, s.name, s.shape) for s in self.param_slots + self.buffer_slots]
        return hashlib.sha256(json.dumps(slots).encode()).hexdigest()[:16]

    def flatten(self, model: nn.Module) -> torch.Tensor:
        """Return a new state vector holding a copy of the model's parameters and float buffers."""
        tensors = _module_tensors(model)
        return torch.cat([tensors[(s.module, s.name)].detach().reshape(-1) for s in self.param_slots + self.buffer_slots])

    def bind(self, model: nn.Module, state: torch.Tensor, grad: torch.Tensor | None = None) -> None:
        """Make the model's parameters (and gradients) and float buffers views of `state` (and `grad`)."""
        assert state.shape == (self.num_state,) and (grad is None or grad.shape == (self.num_params,))
        modules = dict(model.named_modules())
        for s in self.param_slots:
            param = getattr(modules[s.module], s.name)
            param.data = state[s.offset:s.offset + s.numel].view(s.shape)
            param.grad = None if grad is None else grad[s.offset:s.offset + s.numel].view(s.shape)
        for s in self.buffer_slots:
            modules[s.module]._buffers[s.name] = state[s.offset:s.offset + s.numel].view(s.shape)

    @torch.no_grad()
    def load(self, model: nn.Module, state: torch.Tensor) -> nn.Module:
        """Copy a state vector into the model's parameters and float buffers (the model keeps its own storage);
        return the model."""
        assert state.shape == (self.num_state,)
        tensors = _module_tensors(model)
        for s in self.param_slots + self.buffer_slots:
            tensors[(s.module, s.name)].copy_(state[s.offset:s.offset + s.numel].view(s.shape))
        return model

    def grads_are_bound(self, model: nn.Module, grad: torch.Tensor) -> bool:
        """Tell whether every gradient of the model still lives in `grad` (autograd did not replace it)."""
        modules = dict(model.named_modules())
        for s in self.param_slots:
            g = getattr(modules[s.module], s.name).grad
            if g is None or g.data_ptr() != grad[s.offset:].data_ptr():
                return False
        return True


def _module_tensors(model: nn.Module) -> dict[tuple[str, str], torch.Tensor]:
    tensors = {}
    for module_name, module in model.named_modules():
        for name, t in list(module.named_parameters(recurse=False)) + list(module.named_buffers(recurse=False)):
            if t is not None:
                tensors[(module_name, name)] = t
    return tensors
