"""A new user's inputs: config types, datasets that do not fit the model, NaN in the records, resume flags, and an
exception on one rank of an API job."""

from __future__ import annotations

import functools
import itertools
import json
import os
import re
import subprocess
import sys
import textwrap
import time

import pytest
import torch
from torch import nn
from torch.nn.utils import vector_to_parameters
from torch.utils.data import Dataset

from crossbow_mpi import Config, ConfigError, Trainer
from crossbow_mpi.data import DataError, synthetic_dataset
from crossbow_mpi.data.sampler import fetch_batch
from crossbow_mpi.train import parse_config
from crossbow_mpi.training.hooks import DivergenceError

from helpers import REPO, metrics_records, mpirun_command, run_job

ALGORITHMS = ["sma", "ssgd", "eager"]


def small_config(run_dir, **overrides) -> Config:
    values = dict(
        run_dir=str(run_dir), learners=2, batch_size=4, epochs=1, eval_every=0, target_accuracy=0, seed=3, lr=0.05
    )
    values.update(overrides)
    return Config(**values)


def mlp() -> nn.Module:
    return nn.Sequential(nn.Flatten(), nn.Linear(36, 16), nn.Tanh(), nn.Linear(16, 10))


class Items(Dataset):
    """A map-style dataset of (input, label) pairs, without get_batch."""

    def __init__(self, inputs, labels):
        self.inputs, self.labels = inputs, labels

    def __len__(self):
        return len(self.inputs)

    def __getitem__(self, index):
        return self.inputs[index], self.labels[index]


def items(size: int = 64, seed: int = 0, replace: dict | None = None) -> Items:
    """`size` synthetic samples as a plain map-style dataset; `replace` maps an index to a different (x, y)."""
    data = synthetic_dataset((1, 6, 6), 10, size, seed)
    pairs = [data[i] for i in range(size)]
    for index, pair in (replace or {}).items():
        pairs[index] = pair
    return Items([x for x, _ in pairs], [y for _, y in pairs])


@pytest.mark.parametrize(
    "text, message",
    [
        ("lr = true", "--lr: invalid value True"),
        ("resume = 5", "--resume: invalid value 5"),
        ("lr-steps = [1, true]", "--lr-steps: invalid value"),
        ("epochs = inf", "--epochs must be a finite number"),
        ("seed = 9223372036854775808", "--seed must be below 2\\*\\*32"),
    ],
)
def test_toml_values_of_the_wrong_type_are_refused(tmp_path, text, message):
    path = tmp_path / "run.toml"
    path.write_text(text + "\n")
    with pytest.raises(ConfigError, match=message):
        parse_config(["--config", str(path)]).validate(ALGORITHMS)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--epochs", "inf"], "--epochs must be a finite number, got inf"),
        (["--lr", "nan"], "--lr must be a finite number"),
        (["--seed", "9223372036854775808"], "--seed must be below 2\\*\\*32"),
        (["--resume", "5"], "--resume: invalid value '5'"),
        (["--time-limit", "-1"], "--time-limit must be 0 \\(no limit\\) or positive seconds, got -1"),
    ],
)
def test_flags_out_of_range_are_config_errors(argv, message):
    with pytest.raises(ConfigError, match=message):
        parse_config(argv).validate(ALGORITHMS)


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"lr": "0.1"}, "--lr: invalid value '0.1' \\(expected float\\)"),
        ({"batch_size": 16.5}, "--batch-size: invalid value 16.5 \\(expected int"),
        ({"resume": 1}, "--resume: invalid value 1 \\(expected bool\\)"),
        ({"momentum": True}, "--momentum: invalid value True"),
        ({"lr_steps": [1, 2]}, "--lr-steps: invalid value"),
        ({"epochs": float("inf")}, "--epochs must be a finite number"),
    ],
)
def test_api_values_of_the_wrong_type_are_config_errors(overrides, message):
    with pytest.raises(ConfigError, match=message):
        Config(**overrides).validate(ALGORITHMS)


def test_boolean_flags_take_an_optional_value():
    assert parse_config(["--resume"]).resume is True
    assert parse_config(["--resume", "true", "--lr", "0.2"]).resume is True
    assert parse_config(["--resume", "false"]).resume is False
    assert parse_config(["--autotune-on-lr-drop", "--resume", "no"]).autotune_on_lr_drop is True


@pytest.mark.parametrize("case", ["epochs inf", "huge seed"])
def test_bad_numbers_exit_2_with_one_line(tmp_path, case):
    args = {"epochs inf": ["--epochs", "inf"], "huge seed": ["--seed", "9223372036854775808"]}[case]
    job = run_job(1, ["--run-dir", str(tmp_path / "run"), "--dataset", "synthetic-mnist", *args], timeout=60)
    ours = [line for line in job.stderr.splitlines() if line.startswith("crossbow_mpi:")]
    assert job.returncode == 2 and len(ours) == 1 and "Traceback" not in job.stderr, job.stderr


def test_fetch_batch_names_the_sample_that_does_not_fit():
    with pytest.raises(DataError, match=r"sample 5 of the dataset Items has shape \(1, 5, 6\), sample 0 has "):
        fetch_batch(items(replace={5: (torch.zeros(1, 5, 6), 1)}), torch.tensor([0, 5]))
    with pytest.raises(DataError, match=r"sample 0 of the dataset Items has label 2\.5 .*integer class indices"):
        fetch_batch(items(replace={0: (torch.zeros(1, 6, 6), 2.5)}), torch.tensor([0, 1]))
    inputs, targets = fetch_batch(items(), torch.tensor([3, 4]))
    assert targets.dtype == torch.int64 and inputs.shape == (2, 1, 6, 6)


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize(
    "case, message",
    [
        ("float labels", "the training set: sample 0 of the dataset Items has label [0-9]+.5 \\(torch.float32\\)"),
        ("label out of range", "sample 63 of the test set: label 12 is outside the model's 10 classes"),
        ("wrong shape", "sample 0 of the training set: the model cannot take an input of shape \\(1, 5, 5\\)"),
        ("tuple output", "the model's output for sample 0 of the training set is a tuple.*output_fn"),
    ],
)
def test_datasets_that_do_not_fit_the_model_stop_with_one_line(comm, shared_tmp, case, message):
    train, test, model_fn = items(seed=0), items(seed=1), mlp
    if case == "float labels":
        train = Items(train.inputs, [y + 0.5 for y in train.labels])
    elif case == "label out of range":
        test = items(seed=1, replace={63: (torch.zeros(1, 6, 6), 12)})
    elif case == "wrong shape":
        train = Items([x[:, :5, :5] for x in train.inputs], train.labels)
    else:
        model_fn = lambda: TupleOutput()  # noqa: E731
    with pytest.raises(ConfigError, match=message) as caught:
        Trainer(small_config(shared_tmp), comm).fit(model_fn, train, test)
    assert "\n" not in str(caught.value)


class TupleOutput(nn.Module):
    """Returns (class scores, an auxiliary output)."""

    def __init__(self):
        super().__init__()
        self.body = mlp()

    def forward(self, x):
        scores = self.body(x)
        return scores, scores.square().mean()


def jumping_loss(after: int):
    """Cross-entropy plus 1e6 from the `after`-th training call on: the gradients, and so the model, stay finite
    and those of cross-entropy, while the loss explodes (as SMA's nesterov over int8 syncs did, at 5e10)."""
    calls = itertools.count()

    def loss_fn(outputs, targets):
        jump = 1e6 if outputs.requires_grad and next(calls) >= after else 0.0
        return nn.functional.cross_entropy(outputs, targets) + jump

    return loss_fn


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("factor", [1000.0, 0.0])
def test_a_finite_loss_past_the_divergence_factor_stops_every_rank_and_keeps_the_last_checkpoint(
    comm, shared_tmp, factor
):
    train = synthetic_dataset((1, 6, 6), 10, 64 * comm.size, seed=0)
    test = synthetic_dataset((1, 6, 6), 10, 60, seed=1)
    config = small_config(shared_tmp, eval_every=32 * comm.size, checkpoint_every=4, divergence_factor=factor)
    fit = functools.partial(Trainer(config, comm).fit, mlp, train, test, loss_fn=jumping_loss(after=2 * 4))
    if not factor:
        assert fit().iterations == 8
        return
    with pytest.raises(DivergenceError) as err:
        fit()
    assert "diverged at iteration 8: the training loss 1e+06 is above --divergence-factor 1000 times" in str(err.value)
    assert "the last checkpoint, checkpoint-000000004.h5, is kept" in str(err.value)
    assert [record["iteration"] for record in metrics_records(comm, shared_tmp)] == [4, 8]


@pytest.mark.mpi(min_size=1)
def test_a_loss_that_explodes_before_the_first_evaluation_stops_the_run_there(comm, shared_tmp):
    """A loss that explodes before the first evaluation inflates that evaluation's training loss, which was the
    check's only reference, so that no later loss exceeded the factor times it; the first step's loss, taken before
    any update, catches it at the first evaluation."""
    train = synthetic_dataset((1, 6, 6), 10, 64 * comm.size, seed=0)
    test = synthetic_dataset((1, 6, 6), 10, 60, seed=1)
    config = small_config(shared_tmp, eval_every=32 * comm.size, checkpoint_every=4)
    with pytest.raises(DivergenceError) as err:
        Trainer(config, comm).fit(mlp, train, test, loss_fn=jumping_loss(after=2))
    assert re.search(
        r"diverged at iteration 4: the training loss 7\.5e\+05 is above --divergence-factor 1000 times "
        r"the first training loss, 2\.\d",
        str(err.value),
    )


@pytest.mark.mpi(min_size=1)
def test_output_fn_picks_the_class_scores_for_evaluation(comm, shared_tmp):
    train = synthetic_dataset((1, 6, 6), 10, 64 * comm.size, seed=0)
    test = synthetic_dataset((1, 6, 6), 10, 60, seed=1)

    def loss_fn(outputs, targets):
        return nn.functional.cross_entropy(outputs[0], targets) + 0.01 * outputs[1]

    result = Trainer(small_config(shared_tmp), comm).fit(
        TupleOutput, train, test, loss_fn=loss_fn, output_fn=lambda outputs: outputs[0]
    )
    model = TupleOutput()
    vector_to_parameters(result.central, model.parameters())
    inputs, targets = test.get_batch(torch.arange(len(test)))
    with torch.no_grad():
        assert result.test_accuracy == pytest.approx(float((model(inputs)[0].argmax(1) == targets).float().mean()))


@pytest.mark.mpi(min_size=1)
def test_a_time_limit_ends_the_run_at_the_first_evaluation_past_it_with_a_checkpoint(comm, shared_tmp):
    train = synthetic_dataset((1, 6, 6), 10, 64 * comm.size, seed=0)
    test = synthetic_dataset((1, 6, 6), 10, 60, seed=1)
    config = small_config(shared_tmp, epochs=4, eval_every=32 * comm.size, time_limit=1e-9)
    result = Trainer(config, comm).fit(mlp, train, test)
    records = metrics_records(comm, shared_tmp)
    evaluations = [record for record in records if "test_accuracy" in record]
    summary = records[-1]
    assert len(evaluations) == 1 and summary["time_limited"] and not summary["reached"]
    assert summary["iterations"] == evaluations[0]["iteration"] == result.iterations == 4  # 32 samples a rank
    assert (shared_tmp / "checkpoint-000000004.h5").exists()


@pytest.mark.mpi(min_size=1)
def test_nan_in_the_test_inputs_gives_strict_json_with_a_flag(comm, shared_tmp):
    train = synthetic_dataset((1, 6, 6), 10, 64 * comm.size, seed=0)
    test = synthetic_dataset((1, 6, 6), 10, 60, seed=1)
    test.inputs[7, 0, 0, 0] = float("nan")
    Trainer(small_config(shared_tmp), comm).fit(mlp, train, test)
    if comm.rank == 0:

        def refuse(constant):
            raise AssertionError(f"{constant} is not JSON")

        lines = (shared_tmp / "metrics.jsonl").read_text().splitlines()
        records = [json.loads(line, parse_constant=refuse) for line in lines]
        assert records[0]["test_loss"] is None and records[0]["non_finite"] == ["test_loss"]


@pytest.mark.mpi(min_size=1)
def test_resumed_runs_config_replays_from_the_start_and_a_failed_resume_leaves_no_trace(comm, shared_tmp):
    train = synthetic_dataset((1, 6, 6), 10, 64 * comm.size, seed=0)
    test = synthetic_dataset((1, 6, 6), 10, 60, seed=1)
    missing = shared_tmp / "never-written"
    with pytest.raises(ConfigError, match="no valid checkpoint"):
        Trainer(small_config(missing, resume=True), comm).fit(mlp, train, test)
    assert not missing.exists()
    Trainer(small_config(shared_tmp), comm).fit(mlp, train, test)
    Trainer(small_config(shared_tmp, epochs=2, resume=True), comm).fit(mlp, train, test)
    if comm.rank == 0:
        replay = Config.from_dict(json.loads((shared_tmp / "config.json").read_text()))
        assert replay == small_config(shared_tmp, epochs=2)


FAILING_RANK_SCRIPT = """
    import torch
    from torch import nn
    from crossbow_mpi import Config, Trainer
    from crossbow_mpi.data import synthetic_dataset
    from crossbow_mpi.runtime.process import mpi

    class FailsOnRank1(torch.utils.data.Dataset):
        def __init__(self, data):
            self.data, self.calls = data, 0
        def __len__(self):
            return len(self.data)
        def __getitem__(self, index):
            self.calls += 1
            if mpi().COMM_WORLD.Get_rank() == 1 and self.calls > 100:
                raise RuntimeError("a bad sample on rank 1")
            return self.data[index]

    train = FailsOnRank1(synthetic_dataset((1, 6, 6), 10, 4096, seed=0))
    test = synthetic_dataset((1, 6, 6), 10, 60, seed=1)
    config = Config(run_dir={run_dir!r}, learners=2, batch_size=4, epochs=1, target_accuracy=0)
    Trainer(config).fit(lambda: nn.Sequential(nn.Flatten(), nn.Linear(36, 10)), train, test)
"""


@pytest.mark.slow
def test_an_exception_on_one_rank_ends_an_api_job_with_its_traceback(tmp_path):
    script = tmp_path / "user.py"
    script.write_text(textwrap.dedent(FAILING_RANK_SCRIPT.format(run_dir=str(tmp_path / "run"))))
    env = dict(
        os.environ,
        OMPI_ALLOW_RUN_AS_ROOT="1",
        OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
        PYTHONUNBUFFERED="1",
        PYTHONPATH=str(REPO),
    )
    started = time.monotonic()
    job = subprocess.run(
        [*mpirun_command(2), sys.executable, str(script)], capture_output=True, text=True, timeout=90, env=env
    )
    assert job.returncode != 0
    assert "[rank 1] Traceback" in job.stderr and "RuntimeError: a bad sample on rank 1" in job.stderr, job.stderr
    assert time.monotonic() - started < 60
