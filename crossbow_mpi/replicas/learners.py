"""Learners: k model replicas on one device, stored as rows of flat matrices, and the central model z."""

from __future__ import annotations

from collections.abc import Callable
from typing import cast

import torch
from torch import nn

from crossbow_mpi.config import ConfigError
from crossbow_mpi.replicas.flat import FlatLayout, take_gradients
from crossbow_mpi.replicas.optimizers import OptimizerFn, RowOptimizers


class CentralModel:
    """The central average model z with its momentum u, and a module bound to z for evaluation."""

    def __init__(self, module: nn.Module, layout: FlatLayout):
        self.layout = layout
        self.z = layout.flatten(module)
        self.u = torch.zeros(layout.num_params, dtype=self.z.dtype, device=self.z.device)
        self.module = module
        layout.bind(module, self.z)
        self.optimizer: RowOptimizers | None = None
        """z's optimizer, where the algorithm steps z with one (`use_optimizer`); None: its momentum u."""

    def use_optimizer(self, optimizer_fn: OptimizerFn) -> None:
        """Step z's parameters with an optimizer from `optimizer_fn` (S-SGD, eager)."""
        self.optimizer = RowOptimizers(optimizer_fn, self.params.unsqueeze(0))

    @property
    def params(self) -> torch.Tensor:
        return self.z[: self.layout.num_params]

    @property
    def buffers(self) -> torch.Tensor:
        return self.z[self.layout.num_params :]

    def state_dict(self, physical: bool = False) -> dict:
        """Return copies of z and u (in contiguous order; `physical`: z and u themselves, for a copy to restore in
        this process), z's extra state (frozen parameters and non-float buffers, as bytes) and its optimizer's
        state where it has one."""
        logical, extra = _copier(self.layout, physical), self.layout.extra_state_bytes(self.module)
        state = {"z": logical(self.z.detach()), "u": logical(self.u), "extra": extra}
        if self.optimizer is None:
            return state
        optimizer = _squeeze(self.optimizer.state_dict(copy=not physical))
        return {**state, "optimizer": _reorder(logical, optimizer, self.layout.num_params)}

    def load_state_dict(self, state: dict, physical: bool = False) -> None:
        """Restore `state_dict(physical)`."""
        convert = _copier(self.layout, physical, restore=True)
        self.z.copy_(convert(state["z"]))
        self.u.copy_(convert(state["u"]))
        self.layout.load_extra_state_bytes(self.module, state["extra"])
        if self.optimizer is not None:
            optimizer = _reorder(convert, state.get("optimizer", {}), self.layout.num_params)
            self.optimizer.load_state_dict({name: t.unsqueeze(0) for name, t in optimizer.items()})

    def broadcast_extra_state(self, comm) -> None:
        """Give z rank 0's frozen parameters and non-float buffers (collective, at start; over the control plane,
        which carries any dtype)."""
        if self.layout.frozen or self.layout.non_float_buffers:
            data = comm.bcast_bytes(self.layout.extra_state_bytes(self.module) if comm.rank == 0 else None)
            self.layout.load_extra_state_bytes(self.module, data)

    def check_extra_state(self, comm) -> None:
        """Raise ConfigError naming z's frozen parameters and non-float buffers that differ between ranks
        (collective; at every evaluation)."""
        digests = self.layout.extra_state_digests(self.module)
        if not digests:
            return
        gathered = comm.allgather_json(digests)
        differing = [name for name in digests if any(d[name] != gathered[0][name] for d in gathered)]
        if differing:
            raise ConfigError(
                f"the model's non-float buffers or frozen parameters {', '.join(differing)} differ "
                "between ranks: its forward pass changes them differently on each rank, which "
                "crossbow_mpi cannot keep consistent (see docs/python-api.md)"
            )


class Learners:
    """k replicas; row j of `weights`, `grads`, `momentum` and `staging` belongs to learner j.

    A learner's parameters are views of its row of `weights`, or of z itself while `shares_z` (for algorithms
    after whose every sync each learner equals z: a copy of z would be written every step and read by the next
    forward pass, twice z's bytes through the caches for nothing). Its float buffers are always its own row's.
    While `shares_z` the learners hold no parameter columns and no momentum (no algorithm that shares z reads a
    learner's momentum): `weights` holds the float buffers alone and `momentum` has no columns. Nor has it while
    each learner steps with an optimizer (`use_optimizer`), whose state replaces the momentum.
    Its gradients are not bound: autograd writes them fresh and `take_gradients` moves them into its row of
    `grads` after its backward passes. Learners stay in training mode (evaluation runs the central model)."""

    def __init__(self, model_fn: Callable[[], nn.Module], layout: FlatLayout, central: CentralModel, k: int):
        self.model_fn = model_fn
        self.layout = layout
        self.central = central
        self.modules: list[nn.Module] = []
        self.weights = central.z.new_empty((0, layout.num_state))
        """Row j: learner j's own columns of the state vector (`own_columns`)."""
        self.staging = central.z.new_empty((0, layout.num_state + 1))
        """Row j: [learner j's gradient | room for its float buffers and its weight], the layout of a sync message
        row, so that an algorithm whose message is the learners' gradients stages them without a copy."""
        self.grads = self.staging[:, : layout.num_params]
        """The first part of `staging`: row j is learner j's gradient."""
        self.momentum = central.z.new_empty((0, layout.num_params))
        self.shares_z = False
        """Whether every learner's parameters are z's."""
        self.optimizer_fn: OptimizerFn | None = None
        self.optimizers: RowOptimizers | None = None
        """Each learner's optimizer, where the algorithm steps the learners with one (`use_optimizer`)."""
        self.resize(k, central.z)

    @property
    def k(self) -> int:
        return len(self.modules)

    @property
    def params(self) -> torch.Tensor:
        """Row j: learner j's parameters (a view of z for every row while `shares_z`)."""
        if self.shares_z:
            return self.central.params.expand(self.k, -1)
        return self.weights[:, : self.layout.num_params]

    @property
    def buffers(self) -> torch.Tensor:
        return self.weights[:, self.layout.num_params - self.own_columns.start :]

    @property
    def own_columns(self) -> slice:
        """The columns of the state vector that the learners hold: all, or the float buffers' while `shares_z`."""
        return slice(self.layout.num_params if self.shares_z else 0, self.layout.num_state)

    def resize(self, k: int, z: torch.Tensor) -> None:
        """Keep the first min(k, self.k) learners; new ones start as copies of z with zero momentum."""
        assert k >= 1
        keep = min(k, self.k)
        weights = z[self.own_columns].expand(k, -1).clone()
        weights[:keep] = self.weights[:keep]
        momentum = self.momentum.new_zeros((k, self.momentum.shape[1]))
        momentum[:keep] = self.momentum[:keep]
        self.weights, self.momentum = weights, momentum
        self.staging = self.staging.new_zeros((k, self.layout.num_state + 1))
        self.grads = self.staging[:, : self.layout.num_params]
        while len(self.modules) < k:
            module = self.model_fn().to(device=z.device, dtype=z.dtype).train()
            self.layout.load_extra_state(module, self.layout.extra_state(self.central.module))
            self.modules.append(module)
        del self.modules[k:]
        self._bind()
        self.grad_views = [self.layout.param_views(row) for row in self.grads]
        self.buffer_refs = [self.layout.buffer_refs(m) for m in (*self.modules, self.central.module)]
        if self.optimizer_fn is not None:
            state = self.optimizers.state_dict() if self.optimizers is not None else None
            self.use_optimizer(self.optimizer_fn)
            self.optimizers.load_state_dict(state)  # type: ignore[union-attr]

    def use_optimizer(self, optimizer_fn: OptimizerFn) -> None:
        """Step each learner's parameters with its own optimizer from `optimizer_fn` (SMA, elastic)."""
        assert not self.shares_z, "a learner's optimizer steps its own row"
        self.optimizer_fn = optimizer_fn
        self.optimizers = RowOptimizers(optimizer_fn, self.params)
        self.momentum = self.momentum.new_zeros((self.k, 0))

    def share_z(self, shares: bool) -> None:
        """Bind every learner's parameters to z (True: their columns and momenta are freed) or to its own row,
        which starts as z with zero momentum (False)."""
        if shares != self.shares_z:
            buffers = self.buffers
            self.shares_z = shares
            columns = 0 if shares else self.layout.num_params
            self.weights = torch.cat([self.central.params[:columns].expand(self.k, -1), buffers], dim=1)
            self.momentum = self.momentum.new_zeros((self.k, columns))
            self._bind()

    def _bind(self) -> None:
        z = self.central.params if self.shares_z else None
        for j, module in enumerate(self.modules):
            self.layout.bind(module, self.weights[j], params=z)
        self.trainable = [self.layout.trainable(m) for m in self.modules]

    def take_gradients(self, j: int) -> None:
        """Move the gradients that learner j's backward passes left on its parameters into row j of `grads`."""
        take_gradients(self.trainable[j], self.grad_views[j])

    def state_dict(self, physical: bool = False) -> dict:
        """Return every learner's full state vector and momentum (zero where the learners hold none), in contiguous
        order, and its optimizer's state where it has one. `physical`: the learners' own columns (`weights`),
        momenta and optimizer state themselves, no more, for a copy to restore in this process."""
        if physical:
            state = {"weights": self.weights, "momentum": self.momentum}
        else:
            weights = torch.cat([self.params, self.buffers], dim=1)
            momentum = (
                self.momentum if self.momentum.shape[1] else self.momentum.new_zeros((self.k, self.layout.num_params))
            )
            logical = self.layout.to_logical
            state = {"weights": logical(weights, fresh=True), "momentum": logical(momentum)}
        if self.optimizers is None:
            return state
        optimizer = self.optimizers.state_dict(copy=not physical)
        return {**state, "optimizer": _reorder(_copier(self.layout, physical), optimizer, self.layout.num_params)}

    def load_state_dict(self, state: dict | None, z: torch.Tensor, physical: bool = False) -> None:
        """Restore the learners that fit: learner j takes row j of the state where both exist; learners beyond the
        state's (all of them, for None) start from z with zero momentum and fresh optimizer state, and the state's
        extra rows are dropped.
        Every learner takes z's extra state. `physical`: the state is `state_dict(physical=True)` of learners
        that share z as these do."""
        self.take_extra_state()
        self.reset_to(z)
        self.momentum.zero_()
        convert = _copier(self.layout, physical, restore=True)
        if self.optimizers is not None:
            optimizer = None if state is None else state.get("optimizer")
            num_params = self.layout.num_params
            self.optimizers.load_state_dict(optimizer and _reorder(convert, optimizer, num_params))
        if state is None:
            return
        fit = min(self.k, len(state["weights"]))
        own = slice(None) if physical else self.own_columns
        self.weights[:fit] = convert(state["weights"][:fit])[:, own]
        if self.momentum.shape[1]:
            self.momentum[:fit] = convert(state["momentum"][:fit])

    def take_extra_state(self) -> None:
        """Give every learner z's frozen parameters and non-float buffers."""
        extra = self.layout.extra_state(self.central.module)
        for module in self.modules:
            self.layout.load_extra_state(module, extra)

    def reset_to(self, z: torch.Tensor) -> None:
        """Set every learner's weights to z (its float buffers alone while `shares_z`: its parameters are z's)."""
        self.weights.copy_(z[self.own_columns].expand_as(self.weights))

    def share_extra_state(self) -> None:
        """Give every learner and z learner 0's non-float buffers (at every sync; local, no communication)."""
        first, *others = self.buffer_refs
        targets = _buffers([ref for refs in others for ref in refs])
        if targets:  # one multi-tensor copy: BatchNorm gives every model such buffers, so keep it cheap
            torch._foreach_copy_(targets, _buffers(first) * len(others))


def _reorder(convert: Callable, state: dict[str, torch.Tensor], num_params: int) -> dict[str, torch.Tensor]:
    """Convert each parameter-shaped tensor of an optimizer's state between the layout's and contiguous order."""
    return {name: convert(t) if t.shape[-1:] == (num_params,) else t for name, t in state.items()}


def _copier(layout: FlatLayout, physical: bool, restore: bool = False) -> Callable[[torch.Tensor], torch.Tensor]:
    """Copy a vector (or each row of a matrix) to or from (`restore`) contiguous order; `physical`: give it as
    it is (its copy to restore is made from it)."""
    if physical:
        return lambda vectors: vectors
    return layout.from_logical if restore else layout.to_logical


def _squeeze(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """One row's optimizer state: each matrix's only row."""
    return {name: matrix[0] for name, matrix in state.items()}


def _buffers(refs: list[tuple[nn.Module, str]]) -> list[torch.Tensor]:
    """The buffers that `(owner, name)` references name (registered tensors, never None)."""
    return cast(list[torch.Tensor], [owner._buffers[name] for owner, name in refs])
