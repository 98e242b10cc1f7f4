"""Learners: k model replicas on one device, stored as rows of flat matrices, and the central model z."""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from crossbow_mpi.flat import FlatLayout


class CentralModel:
    """The central average model z with its momentum u, and a module bound to z for evaluation."""

    def __init__(self, module: nn.Module, layout: FlatLayout):
        self.layout = layout
        self.z = layout.flatten(module)
        self.u = torch.zeros(layout.num_params, dtype=self.z.dtype, device=self.z.device)
        self.module = module
        layout.bind(module, self.z)

    @property
    def params(self) -> torch.Tensor:
        return self.z[:self.layout.num_params]

    @property
    def buffers(self) -> torch.Tensor:
        return self.z[self.layout.num_params:]

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {"z": self.z.detach().clone(), "u": self.u.clone()}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self.z.copy_(state["z"])
        self.u.copy_(state["u"])


class Learners:
    """k replicas; row j of `weights`, `grads` and `momentum` belongs to learner j."""

    def __init__(self, model_fn: Callable[[], nn.Module], layout: FlatLayout, central: CentralModel, k: int):
        self.model_fn = model_fn
        self.layout = layout
        self.modules: list[nn.Module] = []
        self.weights = central.z.new_empty((0, layout.num_state))
        self.grads = central.z.new_empty((0, layout.num_params))
        self.momentum = central.z.new_empty((0, layout.num_params))
        self.resize(k, central.z)

    @property
    def k(self) -> int:
        return len(self.modules)

    @property
    def params(self) -> torch.Tensor:
        return self.weights[:, :self.layout.num_params]

    @property
    def buffers(self) -> torch.Tensor:
        return self.weights[:, self.layout.num_params:]

    def resize(self, k: int, z: torch.Tensor) -> None:
        """Keep the first min(k, self.k) learners; new ones start as copies of z with zero momentum."""
        assert k >= 1
        keep = min(k, self.k)
        weights = z.expand(k, -1).clone()
        weights[:keep] = self.weights[:keep]
        momentum = self.momentum.new_zeros((k, self.layout.num_params))
        momentum[:keep] = self.momentum[:keep]
        self.weights, self.momentum = weights, momentum
        self.grads = self.grads.new_zeros((k, self.layout.num_params))
        while len(self.modules) < k:
            self.modules.append(self.model_fn().to(device=z.device, dtype=z.dtype))
        del self.modules[k:]
        for j, module in enumerate(self.modules):
            self.layout.bind(module, self.weights[j], self.grads[j])
        self.checked: set[int] = set()  # learners whose gradients were seen to land in their rows of `grads`

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {"weights": self.weights.clone(), "momentum": self.momentum.clone()}

    def load_state_dict(self, state: dict[str, torch.Tensor] | None, z: torch.Tensor) -> None:
        """Restore the learners that fit: learner j takes row j of the state where both exist; learners beyond the
        state's (all of them, for None) start from z with zero momentum, and the state's extra rows are dropped."""
        self.reset_to(z)
        self.momentum.zero_()
        if state is None:
            return
        fit = min(self.k, len(state["weights"]))
        self.weights[:fit] = state["weights"][:fit]
        self.momentum[:fit] = state["momentum"][:fit]

    def reset_to(self, z: torch.Tensor) -> None:
        """Set every learner's weights to z."""
        self.weights.copy_(z.expand_as(self.weights))
