"""MkDocs hook: publish the repository's benchmarks/README.md and its plots as the site's `benchmarks/` pages.

The measurements live beside the benchmarks (benchmarks/README.md, benchmarks/results/*.png), where they are read on
their own; the documentation's pages link to them as `benchmarks/README.md`.
"""

from __future__ import annotations

from pathlib import Path

from mkdocs.structure.files import File

ROOT = Path(__file__).resolve().parent.parent


def on_files(files, config):
    for path in [ROOT / "benchmarks" / "README.md", *sorted((ROOT / "benchmarks" / "results").glob("*.png"))]:
        files.append(File.generated(config, path.relative_to(ROOT).as_posix(), abs_src_path=str(path)))
    return files
