"""The command line: flags, config files, one-line errors with exit code 2, no hang when a rank dies."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time

import h5py
import pytest

from crossbow_mpi.config import Config, ConfigError
from crossbow_mpi.train import build_parser, parse_config

from helpers import MNIST_DIR, run_job

CONTRACT_FLAGS = [
    "--algorithm",
    "--model",
    "--dataset",
    "--data-dir",
    "--learners",
    "--batch-size",
    "--lr",
    "--momentum",
    "--weight-decay",
    "--alpha",
    "--central-momentum",
    "--lr-steps",
    "--lr-gamma",
    "--warmup-epochs",
    "--epochs",
    "--target-accuracy",
    "--eval-every",
    "--device",
    "--threads",
    "--seed",
    "--run-dir",
    "--checkpoint-every",
    "--resume",
    "--config",
]


def test_help_documents_every_flag():
    text = build_parser().format_help()
    for flag in CONTRACT_FLAGS:
        assert flag in text
    for line in text.splitlines():
        if line.strip().startswith("--") and line.strip().split()[0] in CONTRACT_FLAGS:
            assert len(line.split()) > 2 or "(default" in text


def test_flags_override_toml_which_overrides_defaults(tmp_path):
    toml = tmp_path / "run.toml"
    toml.write_text('algorithm = "ssgd"\nlearners = 3\nlr = 0.5\nlr-steps = [2, 4]\n')
    cfg = parse_config(["--config", str(toml), "--lr", "0.2", "--resume"])
    assert (cfg.algorithm, cfg.learners, cfg.lr, cfg.lr_steps, cfg.resume) == ("ssgd", 3, 0.2, (2.0, 4.0), True)
    assert cfg.momentum == Config().momentum


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--learners", "0"], "--learners must be a positive"),
        (["--learners", "two"], "--learners: invalid value"),
        (["--batch-size", "-4"], "--batch-size must be positive"),
        (["--lr-steps", "5,2"], "--lr-steps must be increasing"),
        (["--alpha", "1.5"], "--alpha must be in"),
        (["--nonsense", "1"], "unrecognized arguments"),
    ],
)
def test_invalid_values_raise_config_error(argv, message):
    with pytest.raises(ConfigError, match=message):
        parse_config(argv).validate(["ssgd", "sma"])


def test_toml_errors_are_config_errors(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("learners = [1\n")
    with pytest.raises(ConfigError, match="invalid TOML"):
        parse_config(["--config", str(bad)])
    bad.write_text("colour = 1\n")
    with pytest.raises(ConfigError, match="unknown config key 'colour'"):
        parse_config(["--config", str(bad)])


MAIN = (
    "import sys; from crossbow_mpi import train; "
    "print(train.main(sys.argv[1:]), 'torch' in sys.modules, 'mpi4py.MPI' in sys.modules)"
)
"""Run main, then print its exit code and whether torch and MPI were loaded."""


@pytest.mark.parametrize(
    "args, launched, loaded, lines",
    [
        (["--learner", "2"], {}, "False False", 1),
        (["--config", "absent.toml"], {}, "False False", 1),
        (["--learner", "2"], {"PMI_SIZE": "2", "PMI_RANK": "1"}, "True True", 1),  # MPI's rank 0, alone
        (["--config", "absent.toml"], {"PMI_SIZE": "2", "PMI_RANK": "1"}, "True True", 1),
    ],
)
def test_a_refused_command_line_of_one_process_loads_neither_torch_nor_mpi(tmp_path, args, launched, loaded, lines):
    """A mistyped flag is one line at once. Several launched processes refuse it once MPI runs: a rank that exits
    before MPI_Init can end the job before rank 0 has said why (a CI run lost the line so), and a --config file may be
    missing on one node only."""
    env = {k: v for k, v in os.environ.items() if k not in ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "SLURM_STEP_NUM_TASKS")}
    job = subprocess.run(
        [sys.executable, "-c", MAIN, *args],
        cwd=tmp_path,
        env={**env, **launched},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert job.stdout.split() == ["2", *loaded.split()], job.stderr
    assert job.stderr.count("crossbow_mpi: error:") == lines


def corrupt_mnist(tmp_path):
    target = tmp_path / "mnist"
    shutil.copytree(MNIST_DIR, target)
    path = target / "t10k-labels-idx1-ubyte.gz"
    path.chmod(0o644)
    data = bytearray(path.read_bytes())
    data[-12] ^= 0xFF
    path.write_bytes(bytes(data))
    return target


BAD_RUNS = {
    "missing data directory": (lambda tmp: ["--data-dir", str(tmp / "nowhere")], "nowhere"),
    "checksum mismatch": (lambda tmp: ["--data-dir", str(corrupt_mnist(tmp))], "t10k-labels-idx1-ubyte"),
    "zero learners": (lambda tmp: ["--learners", "0"], "--learners must be a positive"),
    "negative batch size": (lambda tmp: ["--batch-size", "-3"], "--batch-size must be positive"),
    "unknown algorithm": (lambda tmp: ["--algorithm", "adam"], "--algorithm: unknown value 'adam'"),
    "unknown model": (lambda tmp: ["--model", "vgg"], "--model: unknown value 'vgg'"),
    "unknown flag": (lambda tmp: ["--learner", "2"], "unrecognized arguments"),
    "adamw beta of 1": (lambda tmp: ["--optimizer", "adamw", "--beta2", "1"], "--beta1 and --beta2 must be in [0, 1)"),
    "resume without checkpoint": (lambda tmp: ["--resume"], "no valid checkpoint"),
    "run dir is a file": (lambda tmp: ["--run-dir", str(file_in(tmp))], "--run-dir"),
}


def file_in(tmp):
    path = tmp / "not-a-directory"
    path.write_text("x")
    return path


@pytest.mark.parametrize("ranks", [1, pytest.param(2, marks=pytest.mark.slow)])
@pytest.mark.parametrize("case", sorted(BAD_RUNS))
def test_bad_input_exits_2_with_one_line(tmp_path, ranks, case):
    make_args, expected = BAD_RUNS[case]
    args = ["--run-dir", str(tmp_path / "run"), *make_args(tmp_path)]
    started = time.monotonic()
    job = run_job(ranks, args, timeout=60)
    assert job.returncode == 2, job.stderr
    ours = [line for line in job.stderr.splitlines() if line.startswith("crossbow_mpi:")]
    assert len(ours) == 1 and expected in ours[0], job.stderr
    assert "Traceback" not in job.stderr
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
    assert time.monotonic() - started < 60


@pytest.mark.slow
def test_existing_run_dir_is_not_overwritten(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "checkpoint-000000005.h5").write_bytes(b"precious")
    job = run_job(1, ["--run-dir", str(run_dir), "--dataset", "synthetic-mnist"], timeout=60)
    assert job.returncode == 2 and "pass --resume" in job.stderr
    assert (run_dir / "checkpoint-000000005.h5").read_bytes() == b"precious"


@pytest.mark.slow
def test_default_run_reaches_99_percent_on_two_ranks(tmp_path):
    run_dir = tmp_path / "default"
    job = run_job(2, ["--run-dir", str(run_dir)], timeout=900)
    assert job.returncode == 0, job.stderr[-3000:]
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    summary = records[-1]
    assert summary["event"] == "summary" and summary["reached"] is True
    assert summary["final_test_accuracy"] >= 0.99 and summary["world_size"] == 2
    evaluations = records[:-1]
    for key in (
        "time_s",
        "epoch",
        "iteration",
        "samples",
        "test_accuracy",
        "test_loss",
        "train_loss",
        "samples_per_s",
        "eval_s",
        "learners",
    ):
        assert all(key in r for r in evaluations), key
    assert json.loads((run_dir / "config.json").read_text())["algorithm"] == "sma"
    checkpoints = sorted(run_dir.glob("checkpoint-*.h5"))
    assert checkpoints
    with h5py.File(checkpoints[-1]) as f:
        assert f.attrs["complete"]
