"""Optimizers: a torch.optim optimizer per row of a flat parameter matrix, its state kept in matrices of those rows.

What an algorithm's optimizer steps (`--optimizer`, or `optimizer_fn` in the Python API):
    S-SGD, eager-SGD   z, with the averaged gradient (one optimizer: the central model's)
    Omnivore, hogbatch the server's z, with each group's averaged gradient as the server applies it (the server's
                       optimizer; every rank's z's optimizer takes its state where the world meets)
    SMA, elastic       each learner's weights, with its own gradient (the local step); the correction c_j = α (w_j − z)
                       is taken from the weights before the step, and z's central step is unchanged
With `sgd` the algorithms keep their own momentum equations; any other optimizer replaces the momentum step
(d = g + λ w; v ← μ v + d) by the optimizer's step, with the schedule's learning rate written into its parameter
groups before every step.

Row j's optimizer holds one parameter, row j itself. Its state tensors move, after its first step or on a load,
into rows of per-name matrices (`state`): a tensor of the row's size into an [rows, n] matrix, a one-element tensor
(AdamW's step count) into an [rows] vector. So a checkpoint writes them as matrices beside the momenta and a resume
to another number of learners keeps the rows that fit, as it does for the momenta; a row without state (a new
learner) starts as the optimizer starts.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

OptimizerFn = Callable[[list[torch.Tensor]], torch.optim.Optimizer]
"""optimizer_fn(params): a torch.optim optimizer over the given parameters."""


def adamw(beta1: float, beta2: float, eps: float, weight_decay: float) -> OptimizerFn:
    """Return an optimizer_fn for torch.optim.AdamW with these hyper-parameters (decoupled weight decay; the
    learning rate is the schedule's, set before every step)."""
    return lambda params: torch.optim.AdamW(
        params, lr=1.0, betas=(beta1, beta2), eps=eps, weight_decay=weight_decay, foreach=False
    )


def config_optimizer_fn(config) -> OptimizerFn | None:
    """Return the configured optimizer's optimizer_fn; None for `sgd` (the algorithms' own momentum steps)."""
    if config.optimizer == "adamw":
        return adamw(config.beta1, config.beta2, config.eps, config.weight_decay)
    return None


def check_optimizer_fn(optimizer_fn: OptimizerFn) -> None:
    """Raise ValueError unless `optimizer_fn` gives a torch.optim optimizer (tried on a scratch parameter)."""
    try:
        optimizer = optimizer_fn([torch.zeros(2)])
    except Exception as err:
        raise ValueError(f"optimizer_fn([params]) raised {type(err).__name__}: {err}") from None
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise ValueError(f"optimizer_fn returned {type(optimizer).__name__}, not a torch.optim.Optimizer")


class RowOptimizers:
    """One optimizer per row of `params` (an [rows, n] matrix), state in per-name matrices of those rows."""

    def __init__(self, optimizer_fn: OptimizerFn, params: torch.Tensor):
        self.optimizer_fn = optimizer_fn
        self.params = params
        self.rows = list(params)  # fixed tensor objects: an optimizer keys its state by them
        self.optimizers = [optimizer_fn([row]) for row in self.rows]
        self.state: dict[str, torch.Tensor] = {}
        """Per state name: an [rows, n] matrix (or an [rows] vector for one-element state), row j learner j's."""
        self.held = [False] * len(self.rows)
        """Whether row j's optimizer state lives in `state` (it does from its first step or a load on)."""

    def step(self, rows: slice, grads: torch.Tensor, lr: float) -> None:
        """Step the optimizers of `rows` with the gradient rows `grads` and learning rate `lr`."""
        for j, grad in zip(range(*rows.indices(len(self.rows))), grads, strict=True):
            row, optimizer = self.rows[j], self.optimizers[j]
            for group in optimizer.param_groups:
                group["lr"] = lr
            row.grad = grad
            optimizer.step()
            row.grad = None
            if not self.held[j]:
                self._hold(j)

    def _hold(self, j: int) -> None:
        """Move row j's optimizer state into row j of the state matrices (allocated at the first row's)."""
        state = self.optimizers[j].state[self.rows[j]]
        for name, value in state.items():
            if not isinstance(value, torch.Tensor):
                continue
            if name not in self.state:
                shape = (len(self.rows), *((value.numel(),) if value.dim() > 0 else ()))
                self.state[name] = value.new_zeros(shape)
            self.state[name][j] = value.reshape(self.state[name][j].shape)
            state[name] = self.state[name][j].view(value.shape)
        self.held[j] = True

    def state_dict(self, copy: bool = True) -> dict[str, torch.Tensor]:
        """Return the state matrices (rows without state are zeros), by name: copies, or (not `copy`) themselves."""
        return {name: matrix.clone() if copy else matrix for name, matrix in self.state.items()}

    def load_state_dict(self, state: dict[str, torch.Tensor] | None) -> None:
        """Restore the rows that fit: row j takes row j of each matrix where both exist; the other rows (all, for
        None or an empty state) start as the optimizer starts."""
        for optimizer, row in zip(self.optimizers, self.rows, strict=True):
            optimizer.state.pop(row, None)
        self.state, self.held = {}, [False] * len(self.rows)
        if not state:
            return
        fit = min(len(self.rows), *(len(matrix) for matrix in state.values()))
        for name, matrix in state.items():
            shape = (len(self.rows), *matrix.shape[1:])
            device = self.params.device if matrix.dim() > 1 else matrix.device  # AdamW's step count stays on the CPU
            self.state[name] = matrix.new_zeros(shape, device=device)
            self.state[name][:fit] = matrix[:fit]
        scalar = {name for name, matrix in state.items() if matrix.dim() == 1}
        for j in range(fit):
            self.optimizers[j].state[self.rows[j]] = {
                name: self.state[name][j] if name in scalar else self.state[name][j].view_as(self.rows[j])
                for name in state
            }
            self.held[j] = True


def clip_rows(grads: torch.Tensor, max_norm: float) -> None:
    """Scale each row of `grads` whose L2 norm exceeds `max_norm` down to it (torch.nn.utils.clip_grad_norm_'s rule,
    coefficient max_norm / (norm + 1e-6), one norm per row)."""
    norms = torch.linalg.vector_norm(grads, dim=1, keepdim=True)
    grads.mul_((max_norm / (norms + 1e-6)).clamp_(max=1.0))
