"""The learners benchmark runs in quick mode and writes well-formed results (never checks speeds)."""

import json
import subprocess
import sys

import pytest

from helpers import REPO

pytestmark = pytest.mark.slow


def test_learners_benchmark_quick_mode_writes_results(tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.learners", "--quick", "--out", str(tmp_path)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads((tmp_path / "learners.json").read_text())
    assert result["quick"] is True and result["rows"]
    for row in result["rows"]:
        assert {"model", "b", "ranks", "engine", "k=1", "k=2", "auto k", "best k"} <= row.keys()
        assert row["k=1"] > 0 and row["auto k"] in (1, 2)
    assert (tmp_path / "learners.png").stat().st_size > 0
    assert done.stdout.rstrip().splitlines()[-1].startswith("lenet")
