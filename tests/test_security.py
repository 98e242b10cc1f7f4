"""No pickle anywhere; archives cannot write outside their target; prepared data is verified."""

from __future__ import annotations

import io
import re
import tarfile
from pathlib import Path

import numpy as np
import pytest

from crossbow_mpi.data import DataError, load_cifar10
from crossbow_mpi.data.prepare import prepare

from helpers import REPO

UNSAFE_CALLS = re.compile(
    r"\bpickle\b|\bcPickle\b|torch\.load\(|allow_pickle\s*=\s*True|\bmarshal\b|\bshelve\b"
    # mpi4py's lower-case methods pickle their Python objects
    r"|(?:mpi_comm|COMM_WORLD|COMM_SELF)\.(?:bcast|allgather|gather|scatter|send|recv|isend|irecv|"
    r"allreduce|reduce|sendrecv|alltoall)\("
)


def test_no_pickle_in_the_library_or_launchers():
    sources = [p for folder in ("crossbow_mpi", "benchmarks", "launch") for p in (REPO / folder).rglob("*.py")]
    assert sources
    offenders = [str(p) for p in sources if UNSAFE_CALLS.search(p.read_text())]
    assert offenders == []


def add(tar: tarfile.TarFile, name: str, data: bytes = b"", kind: bytes = tarfile.REGTYPE, link: str = "") -> None:
    info = tarfile.TarInfo(name)
    info.type, info.size, info.linkname = kind, len(data), link
    tar.addfile(info, io.BytesIO(data))


def cifar_records(count: int, label: int) -> bytes:
    rng = np.random.default_rng(label)
    records = np.concatenate([np.full((count, 1), label, np.uint8), rng.integers(0, 256, (count, 3072), np.uint8)], 1)
    return records.tobytes()


def write_archive(path: Path, members: list[tuple]) -> Path:
    with tarfile.open(path, "w:gz") as tar:
        for member in members:
            add(tar, *member)
    return path


@pytest.mark.parametrize(
    "member, reason",
    [
        (("/etc/evil.bin", b"x"), "path escapes"),
        (("cifar-10-batches-bin/../../evil.bin", b"x"), "path escapes"),
        (("cifar-10-batches-bin/link", b"", tarfile.SYMTYPE, "/etc/passwd"), "not a regular file"),
        (("cifar-10-batches-bin/hard", b"", tarfile.LNKTYPE, "/etc/passwd"), "not a regular file"),
    ],
)
def test_unsafe_archive_members_are_refused_before_anything_is_written(tmp_path, member, reason):
    archive = write_archive(tmp_path / "bad.tar.gz", [("cifar-10-batches-bin/test_batch.bin", b"1"), member])
    target = tmp_path / "out"
    with pytest.raises(DataError, match=reason):
        prepare("cifar10", archive, target)
    assert not target.exists() or not any(target.rglob("*"))
    assert not (tmp_path / "evil.bin").exists()


def test_prepared_cifar_is_verified_before_use(tmp_path):
    files = [(f"cifar-10-batches-bin/data_batch_{i}.bin", cifar_records(3, i)) for i in range(1, 6)]
    files.append(("cifar-10-batches-bin/test_batch.bin", cifar_records(2, 7)))
    directory = prepare("cifar10", write_archive(tmp_path / "cifar.tar.gz", files), tmp_path / "cifar10")
    test = load_cifar10(directory.parent, train=False)
    assert len(test) == 2 and test.targets.tolist() == [7, 7]
    assert len(load_cifar10(directory.parent, train=True)) == 15
    corrupted = directory / "test_batch.bin"
    corrupted.write_bytes(cifar_records(2, 3))
    with pytest.raises(DataError, match=r"test_batch\.bin"):
        load_cifar10(directory.parent, train=False)


def test_an_archive_without_the_dataset_files_is_refused(tmp_path):
    archive = write_archive(tmp_path / "other.tar.gz", [("cifar-10-batches-bin/readme.html", b"hi")])
    with pytest.raises(DataError, match=r"lacks data_batch_1\.bin"):
        prepare("cifar10", archive, tmp_path / "out")
