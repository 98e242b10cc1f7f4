"""The documentation: the README's size and links, the generated configuration page, and the MkDocs site."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import re
import subprocess
import sys

import pytest

from helpers import REPO

README_LIMIT = 16 * 1024


def generator():
    spec = importlib.util.spec_from_file_location("gen_config_reference", REPO / "docs" / "gen_config_reference.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_readme_is_at_most_16_kb():
    size = (REPO / "README.md").stat().st_size
    assert size <= README_LIMIT, f"README.md is {size} bytes; move details to docs/ (limit {README_LIMIT})"


def slug(heading: str) -> str:
    """A heading's anchor as GitHub makes it (and MkDocs, for headings without runs of punctuation)."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_readme_links_point_at_files_and_headings_that_exist():
    text = (REPO / "README.md").read_text(encoding="utf-8")
    targets = [t for t in re.findall(r"\]\(([^)\s]+)\)", text) if not re.match(r"[a-z]+:", t) and t[0] != "#"]
    assert targets
    missing = []
    for target in targets:
        path, _, anchor = target.partition("#")
        if not (REPO / path).exists():
            missing.append(target)
        elif anchor:
            headings = re.findall(r"^#+ (.+)$", (REPO / path).read_text(encoding="utf-8"), re.M)
            if anchor not in {slug(h) for h in headings}:
                missing.append(target)
    assert not missing, f"README.md links to missing files or headings: {missing}"


def test_configuration_page_matches_the_config_docstrings():
    page = REPO / "docs" / "configuration.md"
    assert page.read_text(encoding="utf-8") == generator().render(), (
        "docs/configuration.md is stale: run python docs/gen_config_reference.py"
    )


def test_configuration_page_lists_every_field():
    from crossbow_mpi.config import Config

    text = generator().render()
    for f in dataclasses.fields(Config):
        assert f"`--{f.name.replace('_', '-')} " in text, f.name


def test_the_generator_check_fails_on_a_stale_page(tmp_path, monkeypatch):
    module = generator()
    monkeypatch.setattr(module, "PAGE", tmp_path / "configuration.md")
    module.PAGE.write_text("# stale\n", encoding="utf-8")
    assert module.main(["--check"]) == 1
    assert module.main([]) == 0
    assert module.main(["--check"]) == 0


@pytest.mark.slow
def test_mkdocs_builds_without_warnings(tmp_path):
    pytest.importorskip("mkdocs")
    pytest.importorskip("mkdocstrings_handlers.python")
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-q", "-d", str(tmp_path / "site")],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1", "PYTHONPATH": str(REPO)},
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert (tmp_path / "site" / "configuration" / "index.html").exists()
    assert (tmp_path / "site" / "benchmarks" / "index.html").exists()


@pytest.mark.slow
def test_the_worked_example_of_a_new_algorithm_trains(tmp_path):
    text = (REPO / "docs" / "architecture.md").read_text(encoding="utf-8")
    section = text[text.index("## Adding an algorithm") :]
    example = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    (tmp_path / "averaging.py").write_text(example, encoding="utf-8")
    script = (
        "import sys\n"
        "from crossbow_mpi.algorithms import ALGORITHMS\n"
        "from averaging import ModelAveraging\n"
        "ALGORITHMS[ModelAveraging.name] = ModelAveraging\n"
        "from crossbow_mpi.train import main\n"
        "sys.exit(main(sys.argv[1:]))\n"
    )
    flags = ["--algorithm", "averaging", "--data-dir", str(REPO / "datasets" / "mnist"), "--learners", "2"]
    flags += ["--epochs", "0.05", "--eval-every", "3000", "--target-accuracy", "0.9", "--threads", "1"]
    result = subprocess.run(
        [sys.executable, "-c", script, *flags, "--run-dir", str(tmp_path / "run")],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(tmp_path)])},
    )
    assert result.returncode == 0, result.stdout + result.stderr
    summary = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[-1])
    assert summary["algorithm"] == "averaging"
    assert summary["final_test_accuracy"] > 0.8
