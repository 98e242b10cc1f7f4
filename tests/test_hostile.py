"""Bad input and misuse, as a hostile new user tries them: one line naming the problem, exit code 2, no traceback,
no hang, and nothing changed on disk (every file of a pre-existing run directory keeps its SHA-256)."""

from __future__ import annotations

import hashlib
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from conftest import assert_user_error, run_job, run_tool

TRAIN = ["--dataset", "synthetic-mnist", "--model", "mlp", "--epochs", "0.02", "--threads", "1"]


def digest(directory: Path) -> dict[str, str]:
    """Return every file under `directory` by relative path, with its SHA-256."""
    return {
        str(path.relative_to(directory)): hashlib.sha256(path.read_bytes()).hexdigest()
        for path in sorted(directory.rglob("*"))
        if path.is_file()
    }


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


CASES = {
    "resume with another model": Case(
        "crossbow_mpi",
        lambda run: ["--run-dir", str(run), *TRAIN[:2], "--model", "lenet", "--resume"],
        "holds a different model",
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
    "report onto the run's config": Case(
        "crossbow_mpi.report", lambda run: [str(run), "--out", str(run / "config.json")], "run's records"
    ),
}


@pytest.mark.parametrize("name", CASES)
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


def test_report_writes_exactly_the_file_it_names(trained, tmp_path):
    out = tmp_path / "report"
    done = run_tool("crossbow_mpi.report", str(trained), "--out", str(out))
    assert done.returncode == 0, done.stderr
    assert out.is_file() and not (tmp_path / "report.png").exists()
    assert done.stdout.splitlines()[-1] == f"wrote {out}"
