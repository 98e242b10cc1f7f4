"""Prepare a dataset directory: from a downloaded archive, or a text corpus; each with a SHA256SUMS file.

    python -m crossbow_mpi.data.prepare cifar10 cifar-10-binary.tar.gz datasets/cifar10
    python -m crossbow_mpi.data.prepare text datasets/text [--source FILE]

The archive is checked member by member before anything is written: absolute paths, `..` components, links
and device files are refused. The extracted files get a SHA256SUMS, which the loaders verify before use.

`text` writes corpus.txt: the `--source` file's bytes, or (needing no download) the running Python's standard-
library sources, its `.py` files in sorted order up to `--max-bytes`; MANIFEST.json says which text it is (the
source, the Python version, each file and its SHA-256).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import platform
import sys
import sysconfig
import tarfile
from pathlib import Path, PurePosixPath

from crossbow_mpi.data.datasets import (
    CIFAR10_SUBDIR,
    CIFAR10_TEST_FILES,
    CIFAR10_TRAIN_FILES,
    SUMS_FILE,
    TEXT_FILE,
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


TEXT_MAX_BYTES = 4 << 20
MANIFEST_FILE = "MANIFEST.json"


def stdlib_sources(max_bytes: int) -> tuple[bytes, list[dict]]:
    """Return the standard library's `.py` files (not site-packages), in sorted order, joined up to `max_bytes`, and
    each one's path and SHA-256."""
    root = Path(sysconfig.get_paths()["stdlib"])
    text, files = bytearray(), []
    for path in sorted(p for p in root.rglob("*.py") if "site-packages" not in p.parts):
        data = path.read_bytes()[: max_bytes - len(text)]
        text += data
        digest = hashlib.sha256(data).hexdigest()
        files.append({"path": str(path.relative_to(root)), "bytes": len(data), "sha256": digest})
        if len(text) >= max_bytes:
            break
    return bytes(text), files


def prepare_text(target: Path, source: Path | None, max_bytes: int) -> Path:
    """Write target/corpus.txt (the source file, or the standard library's sources), MANIFEST.json and SHA256SUMS."""
    try:
        if source is None:
            text, files = stdlib_sources(max_bytes)
            origin = {"source": "python standard library", "python": platform.python_version(), "files": files}
        else:
            text = source.read_bytes()
            origin = {"source": str(source.resolve())}
        target.mkdir(parents=True, exist_ok=True)
        (target / TEXT_FILE).write_bytes(text)
        digest = hashlib.sha256(text).hexdigest()
        manifest = {**origin, "file": TEXT_FILE, "bytes": len(text), "sha256": digest}
        (target / MANIFEST_FILE).write_text(json.dumps(manifest, indent=1) + "\n")
        (target / SUMS_FILE).write_text(f"{digest}  {TEXT_FILE}\n")
    except OSError as err:
        raise DataError(f"{err.filename or target}: {err.strerror or err}") from None
    return target


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m crossbow_mpi.data.prepare", description=__doc__.splitlines()[0])
    kinds = parser.add_subparsers(dest="dataset", required=True)
    for name in sorted(EXPECTED):
        archive = kinds.add_parser(name, help=f"extract {name} from its archive")
        archive.add_argument("archive", type=Path)
        archive.add_argument("target", type=Path)
    text = kinds.add_parser("text", help="a byte-level text corpus (default: the Python standard library's sources)")
    text.add_argument("target", type=Path)
    text.add_argument("--source", type=Path, help="a text file of your own")
    text.add_argument("--max-bytes", type=int, default=TEXT_MAX_BYTES, help="standard-library bytes to take")
    args = parser.parse_args(argv)
    try:
        if args.dataset == "text":
            directory = prepare_text(args.target, args.source, args.max_bytes)
        else:
            directory = prepare(args.dataset, args.archive, args.target)
    except DataError as err:
        print(f"crossbow_mpi: error: {err}", file=sys.stderr)
        return 2
    print(f"prepared {directory}: pass --dataset {args.dataset} --data-dir {directory}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
