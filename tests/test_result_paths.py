"""Result files name paths relative to the repository, so that they mean the same on any machine."""

from __future__ import annotations

import json

from benchmarks.harness import repo_path

from helpers import REPO


def strings(value):
    """Yield every string inside a JSON value."""
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, list):
        for item in value:
            yield from strings(item)
    elif isinstance(value, str):
        yield value


def test_a_path_inside_the_repository_is_named_relative_to_it(tmp_path):
    assert repo_path(REPO / "benchmarks" / "results" / "tta.json") == "benchmarks/results/tta.json"
    assert repo_path(tmp_path / "x.png") == str(tmp_path / "x.png")


def test_no_committed_result_file_names_an_absolute_path():
    for path in sorted((REPO / "benchmarks" / "results").rglob("*.json")):
        absolute = [text for text in strings(json.loads(path.read_text())) if text.startswith("/")]
        assert not absolute, f"{path.relative_to(REPO)} names absolute paths: {absolute[:3]}"
