"""SMA with local steps (`--sync-every`) and an outer optimizer, against an independent float64 reference and S-SGD."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.nn.utils import parameters_to_vector

from crossbow_mpi import Config, Trainer
from crossbow_mpi.config import ConfigError
from crossbow_mpi.data.sampler import GlobalSampler

from helpers import BATCH, STEPS, datasets, mlp, mlp_bn_float64, run_config
from reference import load_state, relative_error, sgd_reference, state_of


def local_sma_reference(model_fn, cfg: Config, train, world_size: int, k: int) -> torch.Tensor:
    """Return z after STEPS steps of SMA syncing every `cfg.sync_every` steps with `cfg.outer_optimizer`: learner by
    learner, momentum SGD between syncs; at a sync SMA's step with α (central), or one torch.optim.SGD step on
    z − mean(w) after which every learner restarts from z (nesterov, sgd)."""
    torch.manual_seed(cfg.seed)
    module = model_fn()
    z = state_of(module).detach()
    n = sum(p.numel() for p in module.parameters())
    u = torch.zeros_like(z[:n])
    keys = [(r, j) for r in range(world_size) for j in range(k)]
    states = {key: z.clone() for key in keys}
    velocity = {key: torch.zeros_like(u) for key in keys}
    order = GlobalSampler(len(train), cfg.seed, rank=0, world_size=1).permutation(0)
    for step in range(STEPS):
        syncs = (step + 1) % cfg.sync_every == 0
        alpha = cfg.alpha if syncs and cfg.outer_optimizer == "central" else 0.0
        corrections = []
        for r, j in keys:
            load_state(module, states[(r, j)], n)
            module.zero_grad()
            first = step * k * world_size * BATCH + (r * k + j) * BATCH
            inputs, targets = train.get_batch(order[first : first + BATCH])
            F.cross_entropy(module(inputs.to(z.dtype)), targets).backward()
            after = state_of(module).detach()
            w = after[:n]
            g = parameters_to_vector([p.grad for p in module.parameters()]) + cfg.weight_decay * w
            velocity[(r, j)] = cfg.momentum * velocity[(r, j)] - cfg.lr * g
            corrections.append(alpha * (w - z[:n]))
            states[(r, j)] = torch.cat([w + velocity[(r, j)] - corrections[-1], after[n:]])
        if not syncs:
            continue
        buffers = torch.stack([s[n:] for s in states.values()]).mean(0)
        if cfg.outer_optimizer == "central":
            u = torch.stack(corrections).sum(0) + cfg.central_momentum * u
            z = torch.cat([z[:n] + u, buffers])
            continue
        delta = z[:n] - torch.stack([s[:n] for s in states.values()]).mean(0)
        u = cfg.outer_momentum * u + delta
        step_dir = delta + cfg.outer_momentum * u if cfg.outer_optimizer == "nesterov" else u
        z = torch.cat([z[:n] - cfg.outer_lr * step_dir, buffers])
        states = {key: z.clone() for key in keys}
    return z


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize(
    "outer, learners, lr, momentum", [("central", 2, 0.7, 0.9), ("nesterov", 2, 0.7, 0.9), ("sgd", 1, 0.5, 0.5)]
)
def test_local_steps_match_float64_reference(comm, shared_tmp, outer, learners, lr, momentum):
    train, test = datasets(comm.size, learners)
    cfg = run_config(
        shared_tmp, learners=learners, sync_every=4, outer_optimizer=outer, outer_lr=lr, outer_momentum=momentum
    )
    result = Trainer(cfg, comm).fit(mlp_bn_float64, train, test)
    reference = local_sma_reference(mlp_bn_float64, cfg, train, comm.size, learners)
    assert relative_error(result.central, reference) < 1e-6
    num_params = sum(p.numel() for p in mlp_bn_float64().parameters())
    assert relative_error(result.central[num_params:], reference[num_params:]) < 1e-6, "BatchNorm statistics"


@pytest.mark.mpi(min_size=1)
def test_nesterov_every_step_with_outer_lr_1_and_no_outer_momentum_is_ssgd(comm, shared_tmp):
    train, test = datasets(comm.size, 3)
    cfg = run_config(shared_tmp, learners=3, outer_optimizer="nesterov", outer_lr=1.0, outer_momentum=0.0)
    result = Trainer(cfg, comm).fit(mlp, train, test)
    model = sgd_reference(mlp, cfg, train, 3 * comm.size * BATCH, STEPS)
    assert relative_error(result.central, parameters_to_vector(model.parameters()).detach()) < 1e-5


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"sync_every": 0}, "--sync-every must be positive"),
        ({"algorithm": "ssgd", "outer_optimizer": "nesterov"}, "use --algorithm sma --outer-optimizer nesterov"),
        ({"algorithm": "eager", "sync_every": 4}, "--sync-every applies to --algorithm sma"),
        ({"outer_optimizer": "adam"}, "--outer-optimizer: unknown value 'adam'"),
        ({"outer_momentum": 1.0}, "--outer-momentum must be below 1"),
        ({"outer_lr": 0.0}, "--outer-lr must be positive"),
        ({"sync_dtype": "int4"}, "--sync-dtype: unknown value 'int4'"),
    ],
)
def test_bad_sync_settings_are_refused_in_one_line(overrides, message):
    from crossbow_mpi.algorithms import ALGORITHMS

    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        Config(**overrides).validate(ALGORITHMS)
