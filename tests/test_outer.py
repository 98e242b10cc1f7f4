"""SMA with local steps (`--sync-every`) and an outer optimizer, against an independent float64 reference and S-SGD."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.nn.utils import parameters_to_vector

from crossbow_mpi import Config, Trainer
from crossbow_mpi.comm.hierarchical import HierarchicalCommunicator
from crossbow_mpi.config import ConfigError
from crossbow_mpi.data.sampler import GlobalSampler

from helpers import (
    BATCH,
    STEPS,
    datasets,
    mlp,
    mlp_bn_float64,
    resume_between_syncs,
    resume_config,
    resume_fit,
    run_config,
)
from reference import load_state, relative_error, sgd_reference, state_of


def local_sma_reference(model_fn, cfg: Config, train, world_size: int, k: int, node_of=None) -> torch.Tensor:
    """Return z after STEPS steps of SMA syncing every `cfg.sync_every` steps with `cfg.outer_optimizer`: learner by
    learner, momentum SGD between syncs; at a sync SMA's step with α (central), or one torch.optim.SGD step on
    z − mean(w) after which every learner restarts from z (nesterov, sgd); with `node_of`, every
    `cfg.sync_every_node`-th step between syncs the learners of a node take their mean parameters."""
    torch.manual_seed(cfg.seed)
    module = model_fn()
    z = state_of(module).detach()
    n = sum(p.numel() for p in module.parameters())
    u = torch.zeros_like(z[:n])
    keys = [(r, j) for r in range(world_size) for j in range(k)]
    states = {key: z.clone() for key in keys}
    velocity = {key: torch.zeros_like(u) for key in keys}
    order = GlobalSampler(len(train), cfg.seed, rank=0, world_size=1).permutation(0)
    runs = tensor_runs([p.numel() for p in module.parameters()], cfg.fragments)
    period = cfg.sync_every // cfg.fragments
    pending: list = []  # delayed syncs: (the step after which it applies, columns, Δ, buffers)
    for step in range(STEPS):
        syncs = (step + 1) % period == 0
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
        if pending and pending[0][0] == step:
            z, u = outer_reference(cfg, z, u, states, n, *pending.pop()[1:])
        if not syncs:
            if node_of and ((step + 1) % cfg.sync_every) % cfg.sync_every_node == 0:
                average_within_nodes(states, n, node_of)
            continue
        buffers = torch.stack([s[n:] for s in states.values()]).mean(0)
        if cfg.outer_optimizer == "central":
            u = torch.stack(corrections).sum(0) + cfg.central_momentum * u
            z = torch.cat([z[:n] + u, buffers])
            continue
        cols = runs[((step + 1) // period - 1) % cfg.fragments]
        delta = z[cols] - torch.stack([s[cols] for s in states.values()]).mean(0)
        pending.append((step + cfg.sync_delay, cols, delta, buffers))
        if not cfg.sync_delay:
            z, u = outer_reference(cfg, z, u, states, n, *pending.pop()[1:])
    for _, cols, delta, buffers in pending:  # the end drains a sync in flight
        z, u = outer_reference(cfg, z, u, states, n, cols, delta, buffers)
    return z


def outer_reference(cfg: Config, z, u, states: dict, n: int, cols: slice, delta, buffers):
    """Apply one outer step of the columns `cols` and restart the learners there from z; return z and u."""
    u, z = u.clone(), torch.cat([z[:n], buffers])
    u[cols] = cfg.outer_momentum * u[cols] + delta
    step_dir = delta + cfg.outer_momentum * u[cols] if cfg.outer_optimizer == "nesterov" else u[cols]
    z[cols] -= cfg.outer_lr * step_dir
    for key, state in states.items():
        states[key] = torch.cat([state[:n], z[n:]])
        states[key][cols] = z[cols]
    return z, u


def tensor_runs(sizes: list[int], fragments: int) -> list[slice]:
    """The columns of `fragments` runs of whole tensors, in order, the first runs one tensor longer if need be."""
    per, extra = divmod(len(sizes), fragments)
    counts = [per + (f < extra) for f in range(fragments)]
    ends = [sum(sizes[: sum(counts[: f + 1])]) for f in range(fragments)]
    return [slice(0 if f == 0 else ends[f - 1], ends[f]) for f in range(fragments)]


def average_within_nodes(states: dict, n: int, node_of) -> None:
    for node in {node_of(r) for r, _ in states}:
        keys = [key for key in states if node_of(key[0]) == node]
        mean = torch.stack([states[key][:n] for key in keys]).mean(0)
        for key in keys:
            states[key] = torch.cat([mean, states[key][n:]])


def pairs(rank: int) -> int:
    return rank // 2


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("outer", ["central", "nesterov"])
def test_nodes_average_every_step_and_sync_across_nodes_every_h(comm, shared_tmp, outer):
    train, test = datasets(comm.size, 2)
    cfg = run_config(shared_tmp, learners=2, sync_every=4, sync_every_node=1, outer_optimizer=outer)
    result = Trainer(cfg, HierarchicalCommunicator(comm.mpi_comm, pairs)).fit(mlp_bn_float64, train, test)
    reference = local_sma_reference(mlp_bn_float64, cfg, train, comm.size, 2, pairs)
    assert relative_error(result.central, reference) < 1e-6


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize(
    "outer, learners, lr, momentum, fragments, delay",
    [
        ("central", 2, 0.7, 0.9, 1, 0),
        ("nesterov", 2, 0.7, 0.9, 1, 0),
        ("sgd", 1, 0.5, 0.5, 1, 0),
        ("nesterov", 2, 0.7, 0.9, 4, 0),
        ("nesterov", 1, 0.7, 0.9, 2, 1),
        ("sgd", 2, 0.7, 0.5, 1, 3),
    ],
)
def test_local_steps_match_float64_reference(comm, shared_tmp, outer, learners, lr, momentum, fragments, delay):
    train, test = datasets(comm.size, learners)
    cfg = run_config(
        shared_tmp,
        learners=learners,
        sync_every=4,
        outer_optimizer=outer,
        outer_lr=lr,
        outer_momentum=momentum,
        fragments=fragments,
        sync_delay=delay,
    )
    result = Trainer(cfg, comm).fit(mlp_bn_float64, train, test)
    reference = local_sma_reference(mlp_bn_float64, cfg, train, comm.size, learners)
    assert relative_error(result.central, reference) < 1e-6
    num_params = sum(p.numel() for p in mlp_bn_float64().parameters())
    assert relative_error(result.central[num_params:], reference[num_params:]) < 1e-6, "BatchNorm statistics"


@pytest.mark.mpi(min_size=2)
def test_delayed_syncs_of_two_ranks_by_their_exchange_give_mpis_bits(comm, shared_tmp):
    if comm.size != 2:
        pytest.skip("a pair's exchange needs exactly 2 ranks")
    from crossbow_mpi.comm import MpiCommunicator

    train, test = datasets(comm.size, 2)
    flags = {"learners": 2, "sync_every": 4, "outer_optimizer": "nesterov", "fragments": 2, "sync_delay": 1}
    centrals = []
    for pair in (True, False):
        cfg = run_config(shared_tmp / f"pair-{pair}", **flags)
        centrals.append(Trainer(cfg, MpiCommunicator(comm.mpi_comm, pair=pair)).fit(mlp, train, test).central)
    assert torch.equal(centrals[0].view(torch.uint8), centrals[1].view(torch.uint8))


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
        ({"algorithm": "elastic", "sync_every": 4}, "elastic syncs every --round-samples samples"),
        ({"outer_optimizer": "adam"}, "--outer-optimizer: unknown value 'adam'"),
        ({"outer_momentum": 1.0}, "--outer-momentum must be below 1"),
        ({"outer_lr": 0.0}, "--outer-lr must be positive"),
        ({"sync_dtype": "int4"}, "--sync-dtype: unknown value 'int4'"),
        ({"algorithm": "elastic", "sync_dtype": "int8"}, "--sync-dtype int8 applies to --algorithm sma without"),
        (
            {"sync_every": 4, "fragments": 2, "outer_optimizer": "sgd", "sync_dtype": "int8"},
            "--sync-dtype int8 applies to --algorithm sma without --fragments",
        ),
        ({"sync_every": 4, "sync_every_node": 4, "hierarchy": "node"}, "--sync-every-node 4 must be below"),
        ({"sync_every": 4, "fragments": 2}, "--fragments needs --outer-optimizer nesterov or sgd"),
        ({"sync_every": 4, "fragments": 3, "outer_optimizer": "sgd"}, "--fragments 3 must divide --sync-every 4"),
        ({"sync_every": 4, "fragments": 2, "outer_optimizer": "sgd", "sync_delay": 2}, "--sync-delay 2 must be below"),
        ({"sync_every": 4, "sync_delay": 1}, "--sync-delay needs --outer-optimizer nesterov or sgd"),
        (
            {"sync_every": 4, "sync_delay": 1, "outer_optimizer": "sgd", "on_rank_loss": "continue"},
            "--sync-delay and --on-rank-loss continue cannot be combined",
        ),
        ({"sync_every": 4, "sync_every_node": 1, "hierarchy": "flat"}, "--sync-every-node needs --hierarchy node"),
    ],
)
def test_bad_sync_settings_are_refused_in_one_line(overrides, message):
    from crossbow_mpi.algorithms import ALGORITHMS

    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        Config(**overrides).validate(ALGORITHMS)


@pytest.mark.slow
@pytest.mark.mpi(min_size=1)
def test_resume_between_syncs_is_bit_identical_and_reshards(comm, shared_tmp):
    local = {"sync_every": 5, "outer_optimizer": "nesterov"}
    whole, resumed, interrupted_dir = resume_between_syncs(comm, shared_tmp, local)
    assert resumed.iterations == whole.iterations and torch.equal(resumed.central, whole.central)
    resharded = resume_fit(comm, resume_config(interrupted_dir, resume=True, learners=3, **local))
    assert resharded.iterations == whole.iterations and torch.isfinite(resharded.central).all()


@pytest.mark.mpi(min_size=1)
def test_more_fragments_than_parameter_tensors_are_refused(comm, shared_tmp):
    train, test = datasets(comm.size, 1)
    cfg = run_config(shared_tmp, learners=1, sync_every=8, fragments=8, outer_optimizer="sgd")
    with pytest.raises(ConfigError, match="--fragments 8 exceeds the model's 4 parameter tensors"):
        Trainer(cfg, comm).fit(mlp, train, test)


@pytest.mark.mpi(min_size=1)
def test_elastic_merge_is_the_outer_sgd_step_with_outer_lr_1(comm, shared_tmp):
    """Rounds of one global step, so that every rank takes exactly one step per round and the bits are fixed."""
    train, test = datasets(comm.size, 2)
    rounds = dict(algorithm="elastic", learners=2, round_samples=2 * BATCH * comm.size)
    merge = dict(local_momentum=True, merge_momentum=0.5)  # μ_z = merge_momentum
    results = {}
    for outer in ("central", "sgd", "nesterov"):
        cfg = run_config(shared_tmp / outer, **rounds, **merge, outer_optimizer=outer, outer_lr=1.0, outer_momentum=0.5)
        results[outer] = Trainer(cfg, comm).fit(mlp, train, test).central
    assert torch.equal(results["sgd"], results["central"])
    assert relative_error(results["nesterov"], results["central"]) > 1e-3


@pytest.mark.mpi(min_size=2)
def test_learners_auto_with_local_steps_and_fragments_keeps_every_rank_on_one_z(comm, shared_tmp):
    train, test = datasets(comm.size, 2, steps=60)
    cfg = run_config(
        shared_tmp,
        learners="auto",
        autotune_interval=5,
        sync_every=4,
        fragments=2,
        sync_delay=1,
        outer_optimizer="nesterov",
    )
    result = Trainer(cfg, comm).fit(mlp, train, test)
    gathered = comm.allgather_bytes(result.central.numpy().tobytes())
    assert result.iterations > 0 and all(g == gathered[0] for g in gathered)
