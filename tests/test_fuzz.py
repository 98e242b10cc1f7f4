"""Random bytes as data files or config files give a one-line user error, never a traceback or a hang."""

from __future__ import annotations

import gzip
import hashlib

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from crossbow_mpi.config import Config, ConfigError
from crossbow_mpi.data import DataError, load_cifar10, load_mnist
from crossbow_mpi.train import parse_config

FUZZ = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


def write_with_sums(directory, files: dict[str, bytes], gzipped: bool) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    lines = []
    for name, data in files.items():
        (directory / (name + ".gz" if gzipped else name)).write_bytes(gzip.compress(data) if gzipped else data)
        lines.append(f"{hashlib.sha256(data).hexdigest()}  {name}")
    (directory / "SHA256SUMS").write_text("\n".join(lines) + "\n")


def one_line_or_success(load, *args) -> None:
    try:
        load(*args)
    except (DataError, ConfigError) as err:
        assert "\n" not in str(err) and str(err)


@FUZZ
@given(images=st.binary(max_size=300), labels=st.binary(max_size=40), gzipped=st.booleans())
def test_random_idx_files(tmp_path_factory, images, labels, gzipped):
    directory = tmp_path_factory.mktemp("idx")
    write_with_sums(directory, {"t10k-images-idx3-ubyte": images, "t10k-labels-idx1-ubyte": labels}, gzipped)
    one_line_or_success(load_mnist, directory, False)


@FUZZ
@given(header=st.binary(min_size=8, max_size=8), body=st.binary(max_size=64))
def test_idx_headers_with_plausible_magic(tmp_path_factory, header, body):
    directory = tmp_path_factory.mktemp("idx")
    images = b"\x00\x00\x08\x03" + header + body
    labels = b"\x00\x00\x08\x01" + header[:4] + body[:8]
    write_with_sums(directory, {"t10k-images-idx3-ubyte": images, "t10k-labels-idx1-ubyte": labels}, False)
    one_line_or_success(load_mnist, directory, False)


@FUZZ
@given(data=st.binary(max_size=7000))
def test_random_cifar_files(tmp_path_factory, data):
    directory = tmp_path_factory.mktemp("cifar")
    write_with_sums(directory, {"test_batch.bin": data}, False)
    one_line_or_success(load_cifar10, directory, False)


@pytest.mark.slow
@FUZZ
@given(
    text=st.one_of(
        st.binary(max_size=200),
        st.dictionaries(
            st.sampled_from([f.replace("_", "-") for f in Config.__dataclass_fields__]),
            st.one_of(st.integers(), st.floats(), st.text(max_size=5), st.booleans()),
            max_size=4,
        ).map(lambda d: "\n".join(f"{k} = {v!r}".lower() for k, v in d.items()).encode()),
    )
)
def test_random_config_files(tmp_path_factory, text):
    path = tmp_path_factory.mktemp("toml") / "run.toml"
    path.write_bytes(text)
    try:
        parse_config(["--config", str(path)]).validate(["ssgd", "sma"])
    except ConfigError as err:
        assert "\n" not in str(err)
