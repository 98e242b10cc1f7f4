"""The optimizer recipe: AdamW (or any torch.optim optimizer) for what each algorithm steps, its state in checkpoints
and resharded on resume, gradient clipping, learning-rate schedules."""

from __future__ import annotations

import functools
import json
import math

import h5py
import pytest
import torch
from safetensors.torch import load_file
from torch.nn.utils import parameters_to_vector

from crossbow_mpi import Config, Trainer
from crossbow_mpi.algorithms import ALGORITHMS
from crossbow_mpi.config import ConfigError
from crossbow_mpi.control.lr_schedule import learning_rate
from crossbow_mpi.data import dataset_shape, synthetic_dataset
from crossbow_mpi.export import export
from crossbow_mpi.models import build_model
from crossbow_mpi.replicas.optimizers import RowOptimizers, adamw, clip_rows
from crossbow_mpi.training.checkpoint import list_checkpoints

from helpers import (
    BATCH,
    STEPS,
    datasets,
    mlp,
    mlp_bn,
    mlp_bn_float64,
    resume_between_syncs,
    resume_config,
    resume_fit,
    run_config,
    self_comm,
)
from reference import relative_error, sgd_reference, sma_reference

ADAMW = dict(optimizer="adamw", beta1=0.8, beta2=0.99, eps=1e-6, weight_decay=0.1, lr=0.01)


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("learners, clip", [(1, 0.0), (2, 0.3)])
def test_ssgd_with_adamw_equals_single_process_adamw_on_the_union_batch(comm, shared_tmp, learners, clip):
    train, test = datasets(comm.size, learners)
    cfg = run_config(shared_tmp, algorithm="ssgd", learners=learners, clip_grad_norm=clip, **ADAMW)
    result = Trainer(cfg, comm).fit(mlp, train, test)
    assert result.iterations == STEPS

    reference = functools.partial(
        torch.optim.AdamW, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, weight_decay=cfg.weight_decay
    )
    model = sgd_reference(mlp, cfg, train, learners * comm.size * BATCH, STEPS, optimizer_fn=reference)
    expected = parameters_to_vector(model.parameters()).detach()
    assert relative_error(result.central, expected) < 1e-5
    initial = sgd_reference(mlp, cfg, train, 0, 0)
    assert relative_error(result.central, parameters_to_vector(initial.parameters()).detach()) > 1e-3, "it trained"


@pytest.mark.slow
@pytest.mark.mpi(min_size=1)
def test_sma_with_an_optimizer_fn_matches_the_float64_reference_of_local_adamw_and_clipping(comm, shared_tmp):
    train, test = datasets(comm.size, 2)
    cfg = run_config(shared_tmp, algorithm="sma", learners=2, lr=0.01, clip_grad_norm=0.5, lr_steps=(0.5,))
    optimizer_fn = adamw(0.9, 0.99, 1e-8, 0.1)
    result = Trainer(cfg, comm).fit(mlp_bn_float64, train, test, optimizer_fn=optimizer_fn)
    reference = sma_reference(mlp_bn_float64, cfg, train, comm.size, [2] * STEPS, optimizer_fn=optimizer_fn)
    assert relative_error(result.central, reference) < 1e-6
    sgd = sma_reference(mlp_bn_float64, cfg, train, comm.size, [2] * STEPS)
    assert relative_error(result.central, sgd) > 1e-3, "AdamW's local steps are not momentum SGD's"


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("clip", [0.0, 0.3])
def test_omnivore_with_one_group_and_adamw_is_ssgd_with_adamw_bit_for_bit(comm, shared_tmp, clip):
    train, test = datasets(comm.size, 2)
    results = {}
    for algorithm in ("ssgd", "omnivore"):
        batch = BATCH * comm.size if algorithm == "omnivore" else BATCH  # Omnivore's is the group's
        cfg = run_config(
            shared_tmp / algorithm, algorithm=algorithm, batch_size=batch, learners=2, clip_grad_norm=clip, **ADAMW
        )
        results[algorithm] = Trainer(cfg, comm).fit(mlp_bn, train, test)
    assert torch.equal(results["omnivore"].central, results["ssgd"].central)


@pytest.mark.mpi(min_size=1)
def test_hogbatch_with_adamw_checkpoints_the_servers_state_after_every_update(comm, shared_tmp):
    steps = 8
    train, test = datasets(comm.size, 1, steps)
    cfg = run_config(
        shared_tmp, algorithm="hogbatch", learners=1, checkpoint_every=steps, round_samples=comm.size * BATCH, **ADAMW
    )
    result = Trainer(cfg, comm).fit(mlp, train, test)
    assert result.iterations == steps and torch.isfinite(result.central).all()
    if comm.rank == 0:
        with h5py.File(list_checkpoints(cfg.run_dir)[-1]) as f:
            version = json.loads(f["train"].attrs["algorithm"])["version"]
            assert version == f["central/optimizer/step"][()] == steps * comm.size, "one AdamW step per update"
            assert torch.equal(torch.from_numpy(f["central/z"][...]), result.central)


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("algorithm", ["ssgd", "sma", "omnivore", pytest.param("elastic", marks=pytest.mark.slow)])
def test_resume_with_adamw_is_bit_identical_and_stores_the_optimizer_state(comm, shared_tmp, algorithm):
    recipe = dict(algorithm=algorithm, optimizer="adamw", lr=0.005, clip_grad_norm=1.0)
    if algorithm in ("elastic", "omnivore"):  # rounds of one global step, so that every rank takes one step per round
        recipe["round_samples"] = 2 * 4 * comm.size
    if algorithm == "omnivore":  # one group: deterministic; its batch of 4 per rank
        recipe["batch_size"] = 4 * comm.size
    whole, resumed, interrupted = resume_between_syncs(comm, shared_tmp, recipe)
    assert torch.equal(resumed.central, whole.central)
    if comm.rank == 0:
        with h5py.File(list_checkpoints(str(interrupted))[-1]) as f:
            central = algorithm in ("ssgd", "omnivore")
            group = "central/optimizer" if central else "ranks/0/optimizer"
            assert sorted(f[group]) == ["exp_avg", "exp_avg_sq", "step"]
            rows = () if central else (2,)
            assert f[f"{group}/step"].shape == rows and (f[f"{group}/step"][...] == 48).all()
            assert f[f"{group}/exp_avg_sq"].shape == (*rows, f["central/u"].shape[0])


@pytest.mark.mpi(min_size=1)
def test_resume_reshards_the_learners_optimizer_state_to_another_k(comm, shared_tmp):
    recipe = dict(algorithm="sma", optimizer="adamw", lr=0.005)
    resume_fit(comm, resume_config(shared_tmp, epochs=1, **recipe))
    resume_fit(comm, resume_config(shared_tmp, epochs=2, learners=3, resume=True, **recipe))
    if comm.rank == 0:
        with h5py.File(list_checkpoints(str(shared_tmp))[-1]) as f:
            steps = f["ranks/0/optimizer/step"][...].tolist()
    # epoch 1: 16 steps of 2 learners; epoch 2: 10 steps of 3 (128 samples per rank, 12 per step)
    assert comm.rank != 0 or steps == [26, 26, 10], "two learners kept their state, the new one started afresh"


@pytest.mark.slow
@pytest.mark.mpi(min_size=2)
def test_resume_on_more_ranks_keeps_each_held_ranks_optimizer_state_and_starts_a_new_one_afresh(comm, shared_tmp):
    recipe = dict(algorithm="sma", optimizer="adamw", lr=0.005)
    alone = comm.split(comm.rank == 0, comm.rank)
    if comm.rank == 0:
        resume_fit(alone, resume_config(shared_tmp, epochs=1, **recipe))  # 16 steps on one rank
    comm.barrier()
    pair = comm.split(comm.rank < 2, comm.rank)
    if comm.rank < 2:
        resume_fit(pair, resume_config(shared_tmp, epochs=2, resume=True, **recipe))  # then on two ranks
    if comm.rank == 0:
        with h5py.File(list_checkpoints(str(shared_tmp))[-1]) as f:
            held, new = (f[f"ranks/{r}/optimizer/step"][...].tolist() for r in (0, 1))
        assert new[0] > 0 and new == [new[0]] * 2 and held == [16 + new[0]] * 2


def test_row_optimizers_step_each_row_as_torch_adamw_and_keep_their_state_in_matrices():
    torch.manual_seed(0)
    weights, grads = torch.randn(3, 5), torch.randn(4, 3, 5)
    rows = RowOptimizers(adamw(0.9, 0.99, 1e-8, 0.1), weights)
    reference = [torch.nn.Parameter(w.clone()) for w in weights]
    torch_adamw = torch.optim.AdamW(reference, lr=0.1, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1)
    for g in grads:
        rows.step(slice(None), g, 0.1)
        for p, row in zip(reference, g, strict=True):
            p.grad = row.clone()
        torch_adamw.step()
    assert torch.equal(weights, torch.stack([p.detach() for p in reference]))
    assert torch.equal(rows.state["exp_avg"], torch.stack([torch_adamw.state[p]["exp_avg"] for p in reference]))

    saved = rows.state_dict()
    fewer = RowOptimizers(adamw(0.9, 0.99, 1e-8, 0.1), torch.zeros(2, 5))
    fewer.load_state_dict(saved)
    assert torch.equal(fewer.state["exp_avg_sq"], saved["exp_avg_sq"][:2]) and fewer.state["step"].tolist() == [4, 4]


def test_clip_rows_scales_each_row_as_clip_grad_norm_does():
    grads = torch.tensor([[3.0, 4.0], [0.3, 0.4]])
    clip_rows(grads, 1.0)
    assert torch.allclose(grads, torch.tensor([[0.6, 0.8], [0.3, 0.4]]), atol=1e-6)


def test_lr_schedules_warm_up_by_steps_and_decay_by_cosine():
    cosine = Config(lr_schedule="cosine", epochs=4.0, warmup_steps=10)
    assert learning_rate(1.0, cosine, 0.0, 0)[0] == pytest.approx(0.1)
    assert learning_rate(1.0, cosine, 0.0, 10)[0] == 1.0
    assert learning_rate(1.0, cosine, 2.0, 100)[0] == pytest.approx(0.5)
    assert learning_rate(1.0, cosine, 4.0, 100)[0] == pytest.approx(0.0, abs=1e-12)
    assert learning_rate(1.0, Config(lr_schedule="constant"), 3.0, 100) == (1.0, 0)
    assert learning_rate(1.0, Config(lr_steps=(1.0,)), 3.0, 100)[0] == pytest.approx(0.1)
    assert math.isclose(learning_rate(2.0, Config(lr_schedule="cosine", epochs=3.0), 1.0)[0], 1.5)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(optimizer="adamw", beta1=1.0), "--beta1 and --beta2 must be in [0, 1)"),
        (dict(optimizer="adamw", beta2=-0.1), "--beta1 and --beta2 must be in [0, 1)"),
        (dict(eps=0.0), "--eps must be positive"),
        (dict(optimizer="adam"), "--optimizer: unknown value 'adam'"),
        (dict(lr_schedule="cosine", lr_steps=(1.0,)), "--lr-steps applies to --lr-schedule step, not cosine"),
        (dict(warmup_steps=5, warmup_epochs=1.0), "--warmup-steps and --warmup-epochs cannot be combined"),
        (dict(clip_grad_norm=-1.0), "--clip-grad-norm must not be negative"),
        (dict(optimizer="adamw", algorithm="auto"), "--optimizer adamw does not apply to --algorithm auto"),
        (dict(clip_grad_norm=1.0, algorithm="omnivore", groups="auto"), "--clip-grad-norm 1.0 does not apply to"),
        (dict(optimizer="adamw", learners="auto"), "--optimizer adamw needs a fixed number of --learners"),
        (dict(optimizer="adamw", pipeline_stages=2), "--optimizer adamw does not apply to --pipeline-stages"),
    ],
)
def test_recipe_refuses_what_it_does_not_support_in_one_line(overrides, message):
    with pytest.raises(ConfigError, match=None) as raised:
        Config(**overrides).validate(ALGORITHMS)
    assert str(raised.value).startswith(message) and "\n" not in str(raised.value)


@pytest.mark.slow
def test_export_writes_the_optimizer_state_per_parameter_and_refuses_a_run_without_one(tmp_path):
    shape, classes = dataset_shape("synthetic-mnist")
    train = synthetic_dataset(shape, classes, 64, seed=0)
    for optimizer in ("adamw", "sgd"):
        cfg = Config(
            model="mlp",
            dataset="synthetic-mnist",
            algorithm="ssgd",
            optimizer=optimizer,
            learners=1,
            batch_size=8,
            epochs=1,
            eval_every=0,
            target_accuracy=0,
            run_dir=str(tmp_path / optimizer),
        )
        Trainer(cfg, self_comm()).fit(lambda: build_model("mlp", shape, classes), train, train)
    export(str(tmp_path / "adamw"), str(tmp_path / "m.safetensors"), optimizer_out=str(tmp_path / "o.safetensors"))
    state = load_file(tmp_path / "o.safetensors")
    for name, param in build_model("mlp", shape, classes).named_parameters():
        assert state[f"{name}.exp_avg"].shape == state[f"{name}.exp_avg_sq"].shape == param.shape
    assert float(state["step"]) == 8
    with pytest.raises(ConfigError, match="holds no optimizer state"):
        export(str(tmp_path / "sgd"), str(tmp_path / "m2.safetensors"), optimizer_out=str(tmp_path / "o2.safetensors"))
    assert not (tmp_path / "m2.safetensors").exists(), "nothing written"


@pytest.mark.parametrize(
    "optimizer_fn, overrides, message",
    [
        (lambda params: "adamw", {}, "optimizer_fn returned str, not a torch.optim.Optimizer"),
        (lambda params: torch.optim.AdamW(params, betas=(2.0, 0.9)), {}, "optimizer_fn([params]) raised ValueError"),
        (adamw(0.9, 0.999, 1e-8, 0.0), dict(algorithm="auto"), "optimizer_fn does not apply to --algorithm auto"),
    ],
)
def test_a_bad_optimizer_fn_is_refused_in_one_line(tmp_path, optimizer_fn, overrides, message):
    train, _ = datasets(1, 1)
    cfg = run_config(tmp_path, learners=1, **overrides)
    with pytest.raises(ConfigError) as raised:
        Trainer(cfg, self_comm()).start(mlp, train, optimizer_fn=optimizer_fn)
    assert str(raised.value).startswith(message) and "\n" not in str(raised.value)
