"""Flat buffers: a model's parameters and float buffers as views into contiguous tensors, its gradients copied
into one.

A model's *state* vector is its trainable parameters followed by its floating-point buffers (BatchNorm running
statistics); its *gradient* vector covers the trainable parameters only. Binding a module to a row of a state
matrix makes every parameter and buffer a view; after a backward pass `take_gradients` moves the gradients that
autograd wrote into the module's row of a gradient matrix. So a correction, a reduction over learners or an
allreduce is one vector operation and one message.

A parameter or buffer that several modules hold (tied weights) has one slot, under the first name that
`named_parameters()` or `named_buffers()` gives it, and binding gives every module that holds it the same view.
With `channels_last`, each 4-D tensor (a convolution's weight) keeps its elements in channels-last order (N, H, W,
C) in the vector, and binding makes it a channels-last strided view, as `torch.channels_last` lays it out; every
operation on whole vectors is elementwise, so only `flatten`, `load` and the views know. `to_logical` and
`from_logical` convert a vector (or each row of a matrix) between that order and the contiguous (NCHW) one, in
which checkpoints and exports hold every tensor.

The rest of a model's state, its *extra state*, stays outside the vectors and is kept by name: frozen parameters
(`requires_grad=False`) and non-float buffers (BatchNorm's `num_batches_tracked`, counters, index tables).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass

import torch
from torch import nn

from crossbow_mpi.tensor_bytes import from_bytes, to_bytes


@dataclass(frozen=True)
class Slot:
    """One tensor's place in a flat vector."""

    module: str
    name: str
    shape: tuple[int, ...]
    offset: int
    channels_last: bool = False
    """Whether the elements lie in channels-last order (N, H, W, C)."""

    @property
    def numel(self) -> int:
        return int(torch.Size(self.shape).numel())

    def view(self, vector: torch.Tensor) -> torch.Tensor:
        """Return the slot of a vector, shaped (and strided) as the tensor."""
        flat = vector[self.offset : self.offset + self.numel]
        if self.channels_last:
            n, c, h, w = self.shape
            return flat.view(n, h, w, c).permute(0, 3, 1, 2)
        return flat.view(self.shape)


class FlatLayout:
    """Where each trainable parameter and float buffer of a model lives in its flat state vector, and which
    tensors are its extra state."""

    def __init__(self, model: nn.Module, channels_last: bool = False):
        self.channels_last = channels_last
        self.param_slots: list[Slot] = []
        self.buffer_slots: list[Slot] = []
        self.frozen: list[str] = []
        """Names of the frozen parameters."""
        self.non_float_buffers: list[str] = []
        """Names of the non-float buffers."""
        offset = 0
        dtypes = set()
        for path, param in model.named_parameters():
            if param.requires_grad:
                self.param_slots.append(_slot(path, param, offset, channels_last))
                offset += param.numel()
                dtypes.add(param.dtype)
            else:
                self.frozen.append(path)
        self.num_params = offset
        for path, buffer in model.named_buffers():
            if buffer.is_floating_point():
                self.buffer_slots.append(_slot(path, buffer, offset, channels_last))
                offset += buffer.numel()
            else:
                self.non_float_buffers.append(path)
        self.num_state = offset
        if self.num_params == 0:
            raise ValueError("the model has no trainable parameters")
        if len(dtypes) != 1:
            raise ValueError(f"all trainable parameters must share one dtype, found {sorted(map(str, dtypes))}")
        self.dtype = dtypes.pop()
        self._logical_index: torch.Tensor | None = None

    @property
    def order(self) -> str:
        """The order of the elements of the 4-D tensors in the vector: "channels_last" or "contiguous"."""
        return "channels_last" if self.channels_last else "contiguous"

    @property
    def signature(self) -> str:
        """A digest of names and shapes; equal layouts have equal signatures."""
        slots = [(s.module, s.name, s.shape) for s in self.param_slots + self.buffer_slots]
        return hashlib.sha256(json.dumps(slots).encode()).hexdigest()[:16]

    def flatten(self, model: nn.Module) -> torch.Tensor:
        """Return a new state vector holding a copy of the model's trainable parameters and float buffers."""
        modules = dict(model.named_modules())
        tensors = []
        for s in self.param_slots + self.buffer_slots:
            tensor = getattr(modules[s.module], s.name).detach()
            tensors.append((tensor.permute(0, 2, 3, 1) if s.channels_last else tensor).reshape(-1))
        return torch.cat(tensors)

    def to_logical(self, vectors: torch.Tensor, fresh: bool = False) -> torch.Tensor:
        """Return a copy of a state, parameter or gradient vector (or of each row of a matrix of them) with every
        tensor's elements in contiguous (NCHW) order; `fresh`: `vectors` is a copy that nothing else holds, which
        needs no second copy in contiguous order."""
        if self.channels_last:
            return vectors.index_select(-1, self._index(vectors)[: vectors.shape[-1]])
        return vectors if fresh else vectors.clone()

    def from_logical(self, vectors: torch.Tensor) -> torch.Tensor:
        """Return a copy of vectors in contiguous order (as `to_logical` gives them) in this layout's order."""
        if not self.channels_last:
            return vectors.clone()
        physical = torch.empty_like(vectors)
        physical.index_copy_(-1, self._index(vectors)[: vectors.shape[-1]], vectors)
        return physical

    def _index(self, like: torch.Tensor) -> torch.Tensor:
        """Position in this layout of each element of the contiguous order."""
        if self._logical_index is None or self._logical_index.device != like.device:
            index = torch.arange(self.num_state, device=like.device)
            for s in self.param_slots + self.buffer_slots:
                if s.channels_last:
                    index[s.offset : s.offset + s.numel] = s.view(index).reshape(-1)
            self._logical_index = index
        return self._logical_index

    def bind(self, model: nn.Module, state: torch.Tensor, params: torch.Tensor | None = None) -> None:
        """Make the model's trainable parameters and float buffers views of `state`, a state vector, or, with
        `params` (a parameter vector, which the parameters then view) given, of its float buffers' part alone;
        drop its gradients."""
        if params is None:
            assert state.shape == (self.num_state,)
            params, state = state[: self.num_params], state[self.num_params :]
        assert state.shape == (self.num_state - self.num_params,)
        for param, view in zip(self.trainable(model), self.param_views(params), strict=True):
            param.data = view  # one Parameter object, however many modules hold it
            param.grad = None
        modules = dict(model.named_modules())
        holders = _buffer_holders(model)
        for s in self.buffer_slots:
            view = dataclasses.replace(s, offset=s.offset - self.num_params).view(state)
            for module, name in holders[id(getattr(modules[s.module], s.name))]:
                module._buffers[name] = view

    @torch.no_grad()
    def load(self, model: nn.Module, state: torch.Tensor, extra: bytes) -> nn.Module:
        """Copy a state vector and extra state (as `extra_state_bytes` gives it) into the model, which keeps its own
        storage; return the model."""
        assert state.shape == (self.num_state,)
        modules = dict(model.named_modules())
        for s in self.param_slots + self.buffer_slots:
            getattr(modules[s.module], s.name).copy_(s.view(state))
        self.load_extra_state_bytes(model, extra)
        return model

    def trainable(self, model: nn.Module) -> list[nn.Parameter]:
        """Return the model's trainable parameters in slot order."""
        modules = dict(model.named_modules())
        return [getattr(modules[s.module], s.name) for s in self.param_slots]

    def param_views(self, vector: torch.Tensor) -> list[torch.Tensor]:
        """Return each trainable parameter's slot of a state or gradient vector, shaped as the parameter."""
        return [s.view(vector) for s in self.param_slots]

    def extra_state(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """Return the model's frozen parameters and non-float buffers by name (the module's own tensors)."""
        tensors = {**dict(model.named_parameters()), **dict(model.named_buffers())}
        return {name: tensors[name].detach() for name in self.frozen + self.non_float_buffers}

    def load_extra_state(self, model: nn.Module, state: dict[str, torch.Tensor]) -> None:
        """Copy the named tensors of `state` into the model's extra state, in place."""
        own = self.extra_state(model)
        with torch.no_grad():
            for name, value in state.items():
                own[name].copy_(value)

    def extra_state_bytes(self, model: nn.Module) -> bytes:
        """Return the model's extra state as raw bytes, tensor after tensor in name order."""
        return b"".join(map(to_bytes, self.extra_state(model).values()))

    def load_extra_state_bytes(self, model: nn.Module, data: bytes) -> None:
        """Load extra state written by `extra_state_bytes` of an equal layout."""
        state, offset = {}, 0
        for name, own in self.extra_state(model).items():
            size = own.numel() * own.element_size()
            state[name] = from_bytes(data[offset : offset + size], own.dtype, own.shape)
            offset += size
        assert offset == len(data), "extra state of another layout"
        self.load_extra_state(model, state)

    def extra_state_digests(self, model: nn.Module) -> dict[str, str]:
        """Return a short digest of each tensor of the model's extra state, by name."""
        return {name: hashlib.sha256(to_bytes(t)).hexdigest()[:16] for name, t in self.extra_state(model).items()}

    def buffer_refs(self, model: nn.Module) -> list[tuple[nn.Module, str]]:
        """Return (owning module, name) of each non-float buffer: how to read the current tensor cheaply at every
        sync, even when a module replaces its buffer by a new tensor."""
        modules = dict(model.named_modules())
        return [(modules[owner], name) for owner, _, name in (path.rpartition(".") for path in self.non_float_buffers)]


def take_gradients(params: list[nn.Parameter], views: list[torch.Tensor]) -> None:
    """Move the parameters' gradients into their views, zeros where a parameter has none, and drop them: one copy
    of gradients that autograd wrote fresh, where zeroing bound views and letting autograd add into them makes
    three passes (measured on LeNet, b = 16: 250 µs of a 7 ms step)."""
    fresh, targets, untouched = [], [], []
    for param, view in zip(params, views, strict=True):
        if param.grad is None:
            untouched.append(view)
        else:
            fresh.append(param.grad)
            targets.append(view)
            param.grad = None
    if targets:
        torch._foreach_copy_(targets, fresh)
    if untouched:
        torch._foreach_zero_(untouched)


def sum_rows(rows: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Write the sum of a matrix's rows into `out`, adding them in order to +0.0: one vectorised pass per row, where
    `torch.sum(rows, 0)` takes several times longer over a few long rows (and gives the same bits up to 4 rows)."""
    first, *others = rows
    torch.add(first, 0.0, out=out)
    for row in others:
        out.add_(row)
    return out


def _slot(path: str, tensor: torch.Tensor, offset: int, channels_last: bool) -> Slot:
    module, _, name = path.rpartition(".")
    return Slot(module, name, tuple(tensor.shape), offset, channels_last and tensor.dim() == 4)


def _buffer_holders(model: nn.Module) -> dict[int, list[tuple[nn.Module, str]]]:
    """Map each buffer tensor's id to every (module, name) that holds it."""
    holders: dict[int, list[tuple[nn.Module, str]]] = {}
    for module in model.modules():
        for name, buffer in module._buffers.items():
            if buffer is not None:
                holders.setdefault(id(buffer), []).append((module, name))
    return holders
