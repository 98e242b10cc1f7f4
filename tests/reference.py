"""An independent single-process implementation of CROSSBOW's SMA equations, learner by learner."""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import parameters_to_vector, vector_to_parameters

from crossbow_mpi import Config
from crossbow_mpi.data.sampler import GlobalSampler


def float_buffers(module: nn.Module) -> list[torch.Tensor]:
    return [b for b in module.buffers() if b.is_floating_point()]


def state_of(module: nn.Module) -> torch.Tensor:
    return torch.cat([parameters_to_vector(module.parameters()), parameters_to_vector(float_buffers(module))])


def load_state(module: nn.Module, state: torch.Tensor, num_params: int) -> None:
    vector_to_parameters(state[:num_params].clone(), module.parameters())
    vector_to_parameters(state[num_params:].clone(), float_buffers(module))


def sma_reference(
    model_fn, cfg: Config, train, world_size: int, learners_per_step: list[int], optimizer_fn=None
) -> torch.Tensor:
    """Return z after len(learners_per_step) iterations of SMA, all in one epoch.

    Learner j of rank r keeps its state while it exists; a learner added later starts as z with zero
    momentum; the data of a step is cut rank-major, then learner by learner, from the epoch's permutation.
    With `optimizer_fn`, each learner's own optimizer over its parameters (one tensor per parameter) replaces its
    momentum step; gradients are clipped to `cfg.clip_grad_norm` where set.
    """
    optimizers: dict[tuple[int, int], torch.optim.Optimizer] = {}
    torch.manual_seed(cfg.seed)
    module = model_fn()
    z = state_of(module).detach()
    n = sum(p.numel() for p in module.parameters())
    u = torch.zeros_like(z[:n])
    states: dict[tuple[int, int], torch.Tensor] = {}
    velocity: dict[tuple[int, int], torch.Tensor] = {}
    order = GlobalSampler(len(train), cfg.seed, rank=0, world_size=1).permutation(0)
    offset, drops = 0, 0
    for k in learners_per_step:
        for key in [key for key in states if key[1] >= k]:
            del states[key], velocity[key]
            optimizers.pop(key, None)
        for r in range(world_size):
            for j in range(k):
                if (r, j) not in states:
                    states[(r, j)], velocity[(r, j)] = z.clone(), torch.zeros_like(u)
        lr_drops = sum(offset / len(train) >= s for s in cfg.lr_steps)
        if lr_drops != drops:
            drops = lr_drops
            states = {key: z.clone() for key in states}
        lr = cfg.lr * cfg.lr_gamma**drops
        corrections = []
        for r, j in sorted(states):
            module.train()
            load_state(module, states[(r, j)], n)
            module.zero_grad()
            first = offset + (r * k + j) * cfg.batch_size
            inputs, targets = train.get_batch(order[first : first + cfg.batch_size])
            F.cross_entropy(module(inputs.to(z.dtype)), targets).backward()
            after_forward = state_of(module).detach()
            w = after_forward[:n]
            if cfg.clip_grad_norm:
                torch.nn.utils.clip_grad_norm_(list(module.parameters()), cfg.clip_grad_norm)
            c = cfg.alpha * (w - z[:n])
            corrections.append(c)
            if optimizer_fn is not None:
                stepped = _optimizer_step(optimizers, (r, j), optimizer_fn, module, lr)
                states[(r, j)] = torch.cat([stepped - c, after_forward[n:]])
                continue
            g = parameters_to_vector([p.grad for p in module.parameters()]) + cfg.weight_decay * w
            velocity[(r, j)] = cfg.momentum * velocity[(r, j)] - lr * g
            states[(r, j)] = torch.cat([w + velocity[(r, j)] - c, after_forward[n:]])
        central_momentum = cfg.central_momentum if cfg.momentum > 0 or cfg.central_momentum_always else 0.0
        dz = torch.stack(corrections).sum(0) + central_momentum * u
        u = dz
        z = torch.cat([z[:n] + dz, torch.stack([s[n:] for s in states.values()]).mean(0)])
        offset += k * world_size * cfg.batch_size
    return z


def _optimizer_step(optimizers: dict, key, optimizer_fn, module: nn.Module, lr: float) -> torch.Tensor:
    """Step learner `key`'s own optimizer (built at its first step) over copies of the module's parameters, with the
    module's weights and gradients; return the stepped weights as a vector."""
    if key not in optimizers:
        optimizers[key] = optimizer_fn([nn.Parameter(p.detach().clone()) for p in module.parameters()])
    optimizer = optimizers[key]
    own = optimizer.param_groups[0]["params"]
    for mine, param in zip(own, module.parameters(), strict=True):
        mine.data.copy_(param.detach())
        mine.grad = param.grad.clone()
    optimizer.param_groups[0]["lr"] = lr
    optimizer.step()
    return parameters_to_vector(own).detach()


def sgd_reference(model_fn, cfg: Config, train, aggregate: int, steps: int, optimizer_fn=None) -> nn.Module:
    """Return model_fn() trained by torch.optim.SGD (or `optimizer_fn(params)`, clipping the gradient's norm to
    `cfg.clip_grad_norm` where set) for `steps` steps of `aggregate` samples, in the harness's data order (the first
    epoch's permutation); frozen parameters stay as model_fn() made them."""
    torch.manual_seed(cfg.seed)
    model = model_fn()
    params = [p for p in model.parameters() if p.requires_grad]
    sgd = functools.partial(torch.optim.SGD, lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay)
    optimizer = (optimizer_fn or sgd)(params)
    order = GlobalSampler(len(train), cfg.seed, rank=0, world_size=1).permutation(0)
    for step in range(steps):
        inputs, targets = train.get_batch(order[step * aggregate : (step + 1) * aggregate])
        optimizer.zero_grad()
        F.cross_entropy(model(inputs), targets).backward()
        if cfg.clip_grad_norm:
            torch.nn.utils.clip_grad_norm_(params, cfg.clip_grad_norm)
        optimizer.step()
    return model


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def elastic_reference(model_fn, cfg: Config, train, world_size: int, learners: int, steps: int) -> torch.Tensor:
    """Return z after `steps` rounds of one global step of adaptive elastic averaging on equal ranks (every p_i
    equal): each learner starts from z, takes one SGD step of size η·b/B on its slice (momentum μ with
    `local_momentum`, else plain), and z moves to the learners' mean by the central momentum step (μ_z:
    `merge_momentum` with `local_momentum`, else μ)."""
    local_mu, merge_mu = (cfg.momentum, cfg.merge_momentum) if cfg.local_momentum else (0.0, cfg.momentum)
    lr = cfg.lr * cfg.batch_size / (cfg.base_batch or cfg.batch_size)  # η·b_i/B
    torch.manual_seed(cfg.seed)
    module = model_fn()
    z = state_of(module).detach()
    n = sum(p.numel() for p in module.parameters())
    u = torch.zeros_like(z[:n])
    velocity = {(r, j): torch.zeros_like(u) for r in range(world_size) for j in range(learners)}
    order = GlobalSampler(len(train), cfg.seed, rank=0, world_size=1).permutation(0)
    for step in range(steps):
        states = []
        for r, j in sorted(velocity):
            module.train()
            load_state(module, z, n)
            module.zero_grad()
            first = (step * world_size * learners + r * learners + j) * cfg.batch_size
            inputs, targets = train.get_batch(order[first : first + cfg.batch_size])
            F.cross_entropy(module(inputs.to(z.dtype)), targets).backward()
            after_forward = state_of(module).detach()
            w = after_forward[:n]
            g = parameters_to_vector([p.grad for p in module.parameters()]) + cfg.weight_decay * w
            velocity[(r, j)] = local_mu * velocity[(r, j)] - lr * g
            states.append(torch.cat([w + velocity[(r, j)], after_forward[n:]]))
        merged = torch.stack(states).mean(0)
        u = merged[:n] - z[:n] + merge_mu * u
        z = torch.cat([z[:n] + u, merged[n:]])
    return z
