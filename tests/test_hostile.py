"""Bad input and misuse, as a hostile new user tries them: one line naming the problem, exit code 2, no traceback,
no hang, and nothing changed on disk (every file of a pre-existing run directory keeps its SHA-256)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from helpers import REPO, assert_user_error, digest, mpirun_command, run_job, run_tool

TRAIN = ["--dataset", "synthetic-mnist", "--model", "mlp", "--epochs", "0.02", "--threads", "1"]


def run_command(ranks: int, args: list[str], timeout: float = 120) -> subprocess.CompletedProcess:
    """Run `python ARGS` on `ranks` ranks; fail the test on a hang."""
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", PYTHONUNBUFFERED="1")
    cmd = [*mpirun_command(ranks), sys.executable, *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=REPO, env=env)


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """A finished one-rank run: config.json, metrics.jsonl and a checkpoint."""
    run_dir = tmp_path_factory.mktemp("trained") / "run"
    done = run_job(1, ["--run-dir", str(run_dir), *TRAIN])
    assert done.returncode == 0, done.stderr
    return run_dir


@dataclass
class Case:
    tool: str
    """`crossbow_mpi` (the training command on one rank) or a single-process module."""
    args: Callable[[Path], list[str]]
    """The command's arguments, given the copy of the trained run."""
    message: str
    """What the one line must say."""
    prepare: Callable[[Path], None] = lambda run: None
    """What the user did to the run directory beforehand."""


def write(name: str, text: str) -> Callable[[Path], None]:
    return lambda run: (run / name).write_text(text)


def killed_before_its_first_checkpoint(run: Path) -> None:
    for path in run.glob("checkpoint-*.h5"):
        path.unlink()


GPT = ["--dataset", "text", "--model", "tinygpt"]


def text_corpus(data: Path, size: int) -> None:
    """Write a corpus of about `size` bytes into `data`, as `prepare text --source` does."""
    from crossbow_mpi.data.prepare import prepare_text

    (data.parent / "mine.txt").write_bytes(b"a hostile user's text. " * (size // 23))
    prepare_text(data, data.parent / "mine.txt", max_bytes=0)


def garbage_sums(data: Path) -> None:
    data.mkdir()
    for path in (REPO / "datasets" / "mnist").glob("*.gz"):
        (data / path.name).symlink_to(path)
    (data / "SHA256SUMS").write_bytes(bytes(range(256)))


CASES = {
    "resume with another model": Case(
        "crossbow_mpi",
        lambda run: ["--run-dir", str(run), *TRAIN[:2], "--model", "lenet", "--resume"],
        "holds a different model",
    ),
    "resume with another --lr": Case(
        "crossbow_mpi",
        lambda run: ["--run-dir", str(run), *TRAIN, "--resume", "--lr", "0.1"],
        "was trained with --lr 0.01 (this command: 0.1); a resume continues with the run's hyper-parameters",
    ),
    "resume with another --sync-dtype": Case(
        "crossbow_mpi",
        lambda run: ["--run-dir", str(run), *TRAIN, "--resume", "--sync-dtype", "fp16"],
        "was trained with --sync-dtype fp32 (this command: fp16)",
    ),
    "rerun of a run killed before its first checkpoint": Case(
        "crossbow_mpi",
        lambda run: ["--run-dir", str(run), *TRAIN],
        "holds the records of an earlier run that wrote no checkpoint",
        killed_before_its_first_checkpoint,
    ),
    "export onto the newest checkpoint": Case(
        "crossbow_mpi.export",
        lambda run: [str(run), "--out", str(next(run.glob("checkpoint-*.h5")))],
        "would overwrite a checkpoint or a run's records",
    ),
    "export onto a renamed checkpoint": Case(
        "crossbow_mpi.export",
        lambda run: [str(run), "--out", str(run / "model.bin")],
        "would overwrite a checkpoint",
        lambda run: shutil.copy(next(run.glob("checkpoint-*.h5")), run / "model.bin"),
    ),
    "export onto the run's records": Case(
        "crossbow_mpi.export", lambda run: [str(run), "--out", str(run / "metrics.jsonl")], "run's records"
    ),
    "export with a config.json that is a JSON array": Case(
        "crossbow_mpi.export",
        lambda run: [str(run), "--out", str(run.parent / "model.safetensors")],
        "config.json: not a crossbow_mpi configuration (not a JSON object)",
        write("config.json", "[1, 2]\n"),
    ),
    "export with a config.json of wrong types": Case(
        "crossbow_mpi.export",
        lambda run: [str(run), "--out", str(run.parent / "model.safetensors")],
        "config.json: --learners: invalid value {}",
        write("config.json", '{"learners": {}}\n'),
    ),
    "a SHA256SUMS that is not text": Case(
        "crossbow_mpi",
        lambda run: ["--run-dir", str(run.parent / "new"), "--data-dir", str(run.parent / "data"), *TRAIN[2:]],
        "SHA256SUMS: not text",
        lambda run: garbage_sums(run.parent / "data"),
    ),
    **{
        f"{flag} {value}": Case(
            "crossbow_mpi",
            lambda run, flag=flag, value=value: ["--run-dir", str(run.parent / "new"), *TRAIN, flag, *value.split()],
            message,
        )
        for flag, value, message in (
            ("--lr", "1e308", "--lr must be at most 3.403e+38 (float32's largest), got 1e+308"),
            ("--weight-decay", "1e308", "--weight-decay must be at most 3.403e+38"),
            ("--lr-gamma", "1e308", "--lr-gamma must be at most 3.403e+38"),
            ("--target-accuracy", "1.5", "--target-accuracy must be a fraction in [0, 1] (0.99 for 99 %), got 1.5"),
            ("--sync-every", "0", "--sync-every must be positive, got 0"),
            ("--algorithm", "ssgd --outer-optimizer nesterov", "use --algorithm sma --outer-optimizer nesterov"),
            ("--fragments", "5 --sync-every 5 --outer-optimizer sgd", "--fragments 5 exceeds the model's 4 parameter"),
            ("--sync-delay", "2 --sync-every 4 --fragments 2 --outer-optimizer sgd", "--sync-delay 2 must be below"),
            *(
                (
                    "--algorithm",
                    f"{name} --pipeline-stages 2",
                    f"--pipeline-stages applies to --algorithm sma, ssgd and eager, not {name}",
                )
                for name in ("hogbatch", "omnivore", "elastic")
            ),
        )
    },
    **{
        name: Case(
            "crossbow_mpi",
            lambda run, flags=flags: [
                *("--run-dir", str(run.parent / "new"), "--data-dir", str(run.parent / "text")),
                *TRAIN[4:],
                *GPT,
                *flags,
            ],
            message,
            lambda run, size=size: text_corpus(run.parent / "text", size),
        )
        for name, flags, size, message in (
            ("a text corpus smaller than one window", ["--seq-len", "64"], 300, "bytes are too few for --seq-len 64"),
            (
                "tinygpt with a width its heads do not divide",
                ["--model-args", "width=30,heads=4"],
                4000,
                "the embedding width 30 is not divisible by the 4 heads",
            ),
            ("--target-loss 0", ["--target-loss", "0"], 4000, "--target-loss must be positive, got 0.0"),
        )
    },
    "text without its corpus": Case(
        "crossbow_mpi",
        lambda run: ["--run-dir", str(run.parent / "new"), *GPT, "--data-dir", str(run.parent / "none")],
        "corpus.txt: missing; make it with python -m crossbow_mpi.data.prepare text",
    ),
    "plan with a negative bandwidth": Case(
        "crossbow_mpi.plan",
        lambda run: ["--quick", "--bandwidth", "-1", "--latency", "2", "--out", str(run.parent / "plan")],
        "--bandwidth must be a positive number of Gb/s, got -1.0",
    ),
    "plan with a latency that is not a number": Case(
        "crossbow_mpi.plan",
        lambda run: ["--quick", "--bandwidth", "10", "--latency", "nan", "--out", str(run.parent / "plan")],
        "--latency must be a non-negative number of µs, got nan",
    ),
    "plan into a directory holding an earlier plan": Case(
        "crossbow_mpi.plan",
        lambda run: ["--quick", "--out", str(run)],
        "holds an earlier plan (plan.json): choose another directory",
        write("plan.json", "{}\n"),
    ),
    "plan into a file": Case(
        "crossbow_mpi.plan", lambda run: ["--quick", "--out", str(run / "config.json")], "not a directory"
    ),
    "plan without MNIST": Case(
        "crossbow_mpi.plan",
        lambda run: ["--quick", "--data-dir", str(run / "nowhere"), "--out", str(run.parent / "plan")],
        "no MNIST there (run from the repository root, or pass it)",
    ),
    "report onto the run's config": Case(
        "crossbow_mpi.report", lambda run: [str(run), "--out", str(run / "config.json")], "run's records"
    ),
}


FAST = ("resume with another model", "export onto the newest checkpoint", "--lr 1e308")
"""The cases `tests/run.sh --fast` keeps (with the planner's, which refuse in a tenth of a second)."""


@pytest.mark.parametrize(
    "name",
    [pytest.param(name, marks=[] if name in FAST or name.startswith("plan") else [pytest.mark.slow]) for name in CASES],
)
def test_a_refused_command_says_one_line_and_changes_nothing(trained, tmp_path, name):
    case = CASES[name]
    run = tmp_path / "run"
    shutil.copytree(trained, run)
    case.prepare(run)
    before = digest(tmp_path)
    if case.tool == "crossbow_mpi":
        done = run_job(1, case.args(run), timeout=120)
    else:
        done = run_tool(case.tool, *case.args(run), timeout=120)
    assert "Traceback" not in done.stderr, done.stderr
    assert_user_error(done, case.tool, case.message)
    assert digest(tmp_path) == before


@pytest.mark.slow
def test_a_resume_with_the_runs_flags_and_more_epochs_goes_on(trained, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(trained, run)
    longer = [*TRAIN[:5], "0.04", *TRAIN[6:]]
    done = run_job(1, ["--run-dir", str(run), *longer, "--resume", "--lr", "0.01", "--sync-dtype", "fp32"])
    assert done.returncode == 0 and "resumed from checkpoint-" in done.stderr + done.stdout, done.stderr
    assert len(list(run.glob("checkpoint-*.h5"))) == 2


@pytest.mark.slow
def test_report_writes_exactly_the_file_it_names(trained, tmp_path):
    out = tmp_path / "report"
    done = run_tool("crossbow_mpi.report", str(trained), "--out", str(out))
    assert done.returncode == 0, done.stderr
    assert out.is_file() and not (tmp_path / "report.png").exists()
    assert done.stdout.splitlines()[-1] == f"wrote {out}"


API_SCRIPT = """
import sys
from mpi4py import MPI
from torch import nn
from crossbow_mpi import Config, ConfigError, Trainer
from crossbow_mpi.data import synthetic_dataset

rank, case, run_dir = MPI.COMM_WORLD.Get_rank(), sys.argv[1], sys.argv[2]
data = synthetic_dataset((16,), 2, 64 + (rank if case == "datasets of different lengths" else 0), seed=0)
model_fn = {
    "architectures of equal size": lambda: nn.Linear(16, 8, bias=False) if rank else nn.Linear(8, 16, bias=False),
    "architectures of different sizes": lambda: nn.Linear(16, 2 + rank),
    "a model_fn that returns None": lambda: None,
    "a model without parameters": lambda: nn.Flatten(),
}.get(case, lambda: nn.Linear(16, 2))
config = Config(run_dir=run_dir, epochs=0.1, threads=1, batch_size=4, learners=1, collective_timeout=5)
try:
    Trainer(config).fit(model_fn, data, None if case == "no test set" else data)
except ConfigError as err:
    print(f"ConfigError: {err}", flush=True)
"""
API_CASES = {
    "architectures of equal size": "rank 1 of the data scope built another model than rank 0",
    "architectures of different sizes": "rank 1 of the data scope built another model than rank 0",
    "a model_fn that returns None": "rank 0: model_fn returned NoneType, not a torch.nn.Module",
    "a model without parameters": "rank 0: the model has no trainable parameters",
    "no test set": "fit needs a test set to evaluate on (test_set is None)",
    "datasets of different lengths": "rank 1's training set has 65 samples and rank 0's 64",
}


@pytest.mark.slow
@pytest.mark.parametrize("case", API_CASES)
def test_api_misuse_is_one_config_error_on_every_rank(tmp_path, case):
    script = tmp_path / "misuse.py"
    script.write_text(API_SCRIPT)
    done = run_command(2, [str(script), case, str(tmp_path / "run")])
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr
    errors = [line for line in done.stdout.splitlines() if line.startswith("ConfigError: ")]
    assert len(errors) == 2 and all(API_CASES[case] in line for line in errors), done.stdout


@pytest.mark.slow
def test_a_trainer_made_on_one_rank_only_stops_within_the_collective_timeout(tmp_path):
    script = tmp_path / "alone.py"
    script.write_text(
        "from mpi4py import MPI\nfrom torch import nn\nfrom crossbow_mpi import Config, Trainer\n"
        "from crossbow_mpi.data import synthetic_dataset\n"
        "if MPI.COMM_WORLD.Get_rank() == 0:\n"
        "    data = synthetic_dataset((1, 4, 4), 2, 64, seed=0)\n"
        f"    config = Config(run_dir={str(tmp_path / 'run')!r}, threads=1, collective_timeout=2)\n"
        "    Trainer(config).fit(lambda: nn.Sequential(nn.Flatten(), nn.Linear(16, 2)), data, data)\n"
    )
    done = run_command(2, [str(script)], timeout=60)
    assert done.returncode == 2, done.stderr
    assert "crossbow_mpi: error: rank 0 waited 2 s (--collective-timeout) in Trainer(config)" in done.stderr
    assert "Traceback" not in done.stderr


@pytest.mark.slow
@pytest.mark.parametrize("algorithm", ["sma", "hogbatch"])
def test_a_divergence_names_the_cause_the_fix_and_what_was_kept(tmp_path, algorithm):
    run = tmp_path / "run"
    done = run_job(2, ["--run-dir", str(run), *TRAIN, "--algorithm", algorithm, "--lr", "1e6"], timeout=120)
    lines = [line for line in done.stderr.splitlines() if line.startswith("crossbow_mpi")]
    assert done.returncode == 3 and len(lines) == 1, done.stderr
    assert "diverged at iteration" in lines[0] and "lower --lr (or --momentum)" in lines[0]
    assert "no checkpoint was written" in lines[0] and "Traceback" not in done.stderr
    assert ("adds momentum of its own" in lines[0]) == ("--explicit-momentum" in lines[0]) == (algorithm == "hogbatch")


@pytest.mark.slow
def test_resuming_with_other_pipeline_stages_says_so_and_changes_nothing(tmp_path):
    run = tmp_path / "run"
    trained = run_job(2, ["--run-dir", str(run), *TRAIN, "--pipeline-stages", "2"])
    assert trained.returncode == 0, trained.stderr
    before = digest(run)
    done = run_job(2, ["--run-dir", str(run), *TRAIN, "--resume"])
    ours = [line for line in done.stderr.splitlines() if line.startswith("crossbow_mpi")]  # mpirun adds its banner
    assert done.returncode == 2 and len(ours) == 1, done.stderr
    assert "was written with --pipeline-stages 2: resume with it" in ours[0]
    assert digest(run) == before


@pytest.mark.slow
def test_fp16_beyond_its_range_at_the_first_sync_is_one_line_and_leaves_no_run_directory(tmp_path):
    run = tmp_path / "new" / "run"
    fp16 = ["--sync-dtype", "fp16", "--sync-every", "2", "--outer-optimizer", "nesterov", "--checkpoint-every", "1"]
    done = run_job(2, ["--run-dir", str(run), *TRAIN, "--algorithm", "sma", *fp16, "--lr", "1e5"])
    ours = [line for line in done.stderr.splitlines() if line.startswith("crossbow_mpi")]  # mpirun adds its banner
    assert done.returncode == 2 and len(ours) == 1 and "Traceback" not in done.stderr, done.stderr
    assert "--sync-dtype fp16: layers.1.weight holds values beyond float16's range (65504) at the first sync" in ours[0]
    assert digest(tmp_path) == {} and not (tmp_path / "new").exists()  # a checkpoint was written before the sync


@pytest.mark.slow
def test_int8_syncs_over_a_node_hierarchy_are_refused_at_start_up_and_write_nothing(tmp_path):
    run = tmp_path / "run"
    done = run_job(2, ["--run-dir", str(run), *TRAIN, "--sync-dtype", "int8", "--hierarchy", "node"])
    ours = [line for line in done.stderr.splitlines() if line.startswith("crossbow_mpi")]  # mpirun adds its banner
    assert done.returncode == 2 and len(ours) == 1 and "Traceback" not in done.stderr, done.stderr
    assert "--sync-dtype int8 needs a flat MPI transport (--comm mpi --hierarchy flat)" in ours[0]
    assert not run.exists()


@pytest.mark.slow
def test_a_round_larger_than_the_run_stops_at_its_epochs(tmp_path):
    run = tmp_path / "run"
    args = ["--run-dir", str(run), *TRAIN, "--algorithm", "hogbatch", "--round-samples", "1000000000000"]
    done = run_job(2, args, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "after 0.02 epochs" in done.stdout, done.stdout


@pytest.mark.slow
@pytest.mark.parametrize("flag", ["--fused-step", "--compile"])
def test_a_compiler_that_cannot_compile_is_no_compiler(tmp_path, monkeypatch, flag):
    monkeypatch.setenv("CXX", "/bin/false")
    run = tmp_path / "run"
    done = run_job(1, ["--run-dir", str(run), *TRAIN, flag], timeout=120)
    assert "Traceback" not in done.stderr and "InductorError" not in done.stderr, done.stderr
    if flag == "--fused-step":  # falls back to the in-place steps
        assert done.returncode == 0, done.stderr
    else:
        assert_user_error(done, "crossbow_mpi", "--compile needs a C++ compiler for torch.compile: none that works")


BAD_LABEL_SCRIPT = """
import sys
import torch
from torch import nn
from torch.utils.data import Dataset
from crossbow_mpi import Config, Trainer


class OneBadLabel(Dataset):
    def __init__(self, where):
        self.where = where

    def __len__(self):
        return 64

    def __getitem__(self, i):
        return torch.full((16,), float(i)), 12 if i == self.where else i % 2


train, test = (OneBadLabel(33), OneBadLabel(-1)) if sys.argv[1] == "training" else (OneBadLabel(-1), OneBadLabel(5))
config = Config(run_dir=sys.argv[2], threads=1, batch_size=4, learners=1, epochs=1)
Trainer(config).fit(lambda: nn.Linear(16, 2), train, test)
"""


@pytest.mark.slow
@pytest.mark.parametrize("role", ["training", "test"])
def test_a_label_outside_the_classes_found_mid_run_is_one_line(tmp_path, role):
    script = tmp_path / "bad_label.py"
    script.write_text(BAD_LABEL_SCRIPT)
    done = run_command(2, [str(script), role, str(tmp_path / "run")])
    ours = [line for line in done.stderr.splitlines() if "crossbow_mpi: error:" in line]
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert len(ours) == 1 and f"the loss cannot take a batch of the {role} set (Target 12 is out of bounds" in ours[0]


def test_labels_held_as_targets_are_all_checked_at_start():
    from torch import nn

    from crossbow_mpi.data import synthetic_dataset
    from crossbow_mpi.data.checks import check_samples
    from crossbow_mpi.data.datasets import DataError

    data = synthetic_dataset((16,), 2, 64, seed=0)
    data.targets = data.targets.clone()
    data.targets[33] = 12  # a position the sampled check does not read
    with pytest.raises(DataError, match=r"^sample 33 of the training set: label 12 is outside the model's 2 classes$"):
        check_samples(nn.Linear(16, 2), torch.float32, data, "training set")


@pytest.mark.slow
def test_a_checkpoint_that_does_not_fit_on_disk_is_one_line_and_leaves_no_temporary_file(tmp_path):
    run = tmp_path / "run"
    command = [*mpirun_command(1), sys.executable, "-m", "crossbow_mpi.train", "--run-dir", str(run), *TRAIN]
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    # a 256 KiB limit on any file's size stands in for a full disk: the write fails with EFBIG
    done = subprocess.run(
        ["bash", "-c", 'ulimit -f 256 && exec "$@"', "bash", *command],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
        env=env,
    )
    ours = [line for line in done.stderr.splitlines() if line.startswith("crossbow_mpi")]  # beside the progress
    assert done.returncode == 2 and len(ours) == 1 and "Traceback" not in done.stderr, done.stderr
    assert ours[0].startswith("crossbow_mpi: error: cannot write checkpoint") and ours[0].endswith(": File too large")
    assert not list(run.glob("*.tmp"))


def test_toml_arrays_give_per_rank_values_like_comma_lists(tmp_path):
    from crossbow_mpi.train import parse_config

    toml = tmp_path / "run.toml"
    toml.write_text('batch_size = [16, 8]\ndevice = ["cpu", "cpu"]\n')
    config = parse_config(["--config", str(toml)])
    assert (config.batch_size, config.device) == ((16, 8), "cpu,cpu")
    assert parse_config(["--batch-size", "16,8", "--device", "cpu,cpu"]) == config
