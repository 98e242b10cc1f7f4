"""Prepare a dataset directory from a downloaded archive: safe extraction and a SHA256SUMS file.

    python -m crossbow_mpi.data.prepare cifar10 cifar-10-binary.tar.gz datasets/cifar10

The archive is checked member by member before anything is written: absolute paths, `..` components, links
and device files are refused. The extracted files get a SHA256SUMS, which the loaders verify before use.
"""

from __future__ import annotations

import argparse
import sys
import tarfile
from pathlib import Path, PurePosixPath

from crossbow_mpi.data.datasets import (
    CIFAR10_SUBDIR,
    CIFAR10_TEST_FILES,
    CIFAR10_TRAIN_FILES,
    SUMS_FILE,
    DataError,
    sha256_file,
)

EXPECTED = {"cifar10": (CIFAR10_SUBDIR, CIFAR10_TRAIN_FILES + CIFAR10_TEST_FILES)}


def check_members(archive: Path, members: list[tarfile.TarInfo]) -> None:
    """Refuse an archive with a member that could write outside the target directory."""
    for member in members:
        path = PurePosixPath(member.name)
        if path.is_absolute() or ".." in path.parts:
            raise DataError(f"{archive}: refusing member {member.name!r}: path escapes the target directory")
        if not (member.isfile() or member.isdir()):
            raise DataError(f"{archive}: refusing member {member.name!r}: not a regular file or directory")


def extract(archive: Path, target: Path) -> list[Path]:
    """Extract a tar archive (any compression) into target after checking every member; return the files."""
    try:
        with tarfile.open(archive) as tar:
            members = tar.getmembers()
            check_members(archive, members)
            tar.extractall(target, members=members, filter="data")
    except (tarfile.TarError, EOFError, OSError) as err:
        raise DataError(f"{archive}: cannot extract ({err})") from None
    return [target / m.name for m in members if m.isfile()]


def prepare(name: str, archive: Path, target: Path) -> Path:
    """Extract a dataset archive and write SHA256SUMS beside its files; return the data directory."""
    if name not in EXPECTED:
        raise DataError(f"{name}: no preparation known (choose from {', '.join(EXPECTED)})")
    subdir, names = EXPECTED[name]
    extract(archive, target)
    directory = target / subdir
    missing = [n for n in names if not (directory / n).is_file()]
    if missing:
        raise DataError(f"{archive}: the archive lacks {', '.join(missing)} under {subdir}/")
    lines = [f"{sha256_file(directory / n)}  {n}" for n in names]
    (directory / SUMS_FILE).write_text("\n".join(lines) + "\n")
    return directory


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m crossbow_mpi.data.prepare", description=__doc__.splitlines()[0])
    parser.add_argument("dataset", choices=sorted(EXPECTED))
    parser.add_argument("archive", type=Path)
    parser.add_argument("target", type=Path)
    args = parser.parse_args(argv)
    try:
        directory = prepare(args.dataset, args.archive, args.target)
    except DataError as err:
        print(f"crossbow_mpi: error: {err}", file=sys.stderr)
        return 2
    print(f"prepared {directory}: pass --dataset {args.dataset} --data-dir {directory}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
