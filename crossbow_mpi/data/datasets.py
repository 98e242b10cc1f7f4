"""In-memory datasets: MNIST, CIFAR-10, synthetic stand-ins and byte windows of a text corpus, with checksum
verification."""

import functools
import gzip
import hashlib
import math
import re
import struct
import zlib
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Protocol

import numpy as np
import torch
from torch.utils.data import Dataset

SUMS_FILE = "SHA256SUMS"
_SUMS_LINE = re.compile(r"(?P<digest>[0-9a-fA-F]{64}) [ *](?P<name>.+)")

MNIST_MEAN = 0.1307
MNIST_STD = 0.3081
MNIST_IMAGE_SIZE = 28
MNIST_IMAGE_SHAPE = (1, MNIST_IMAGE_SIZE, MNIST_IMAGE_SIZE)
MNIST_NUM_CLASSES = 10

CIFAR10_MEAN = (0.4914, 0.4822, 0.4465)
CIFAR10_STD = (0.2470, 0.2435, 0.2616)
CIFAR10_SUBDIR = "cifar-10-batches-bin"
CIFAR10_TRAIN_FILES = tuple(f"data_batch_{i}.bin" for i in range(1, 6))
CIFAR10_TEST_FILES = ("test_batch.bin",)
CIFAR10_IMAGE_SHAPE = (3, 32, 32)
CIFAR10_RECORD_BYTES = 1 + math.prod(CIFAR10_IMAGE_SHAPE)
CIFAR10_NUM_CLASSES = 10

TEXT_FILE = "corpus.txt"
TEXT_VOCAB = 256
"""Byte-level: every byte value is a token."""
TEXT_TEST_SHARE = 0.1
"""The corpus's last tenth is the test split (contiguous, so no test window overlaps a training one)."""

Stat = float | tuple[float, ...] | None


class DataError(ValueError):
    """A dataset file is missing, corrupt or malformed; the message is one line naming the file."""


class ArrayDataset(Dataset):
    """Hold a whole dataset as tensors and normalize samples on access.

    `inputs` is uint8 (scaled to [0, 1] on access) or floating point, shaped [N, C, H, W] or [N, D].
    `mean`/`std` are scalars, per-channel (per-feature for [N, D]) tuples, or both None for no
    normalization.
    """

    def __init__(
        self,
        inputs: torch.Tensor,
        targets: torch.Tensor,
        num_classes: int,
        mean: Stat = None,
        std: Stat = None,
    ):
        if inputs.dim() not in (2, 4):
            raise ValueError(f"inputs must be [N, C, H, W] or [N, D], got shape {tuple(inputs.shape)}")
        if inputs.dtype != torch.uint8 and not inputs.is_floating_point():
            raise ValueError(f"inputs must be uint8 or floating point, got {inputs.dtype}")
        if targets.dtype != torch.int64 or targets.shape != (len(inputs),):
            raise ValueError(
                f"targets must be int64 of shape ({len(inputs)},), got {targets.dtype} of shape {tuple(targets.shape)}"
            )
        if len(targets) and not (int(targets.min()) >= 0 and int(targets.max()) < num_classes):
            raise ValueError(
                f"targets must be class indices in [0, {num_classes}), "
                f"got values from {int(targets.min())} to {int(targets.max())}"
            )
        if (mean is None) != (std is None):
            raise ValueError("mean and std must be given together")
        self.inputs = inputs
        self.targets = targets
        self.num_classes = num_classes
        self.mean = mean
        self.std = std
        self._mean = self._stat_tensor(mean)
        self._std = self._stat_tensor(std)

    def _stat_tensor(self, stat: Stat) -> torch.Tensor | None:
        if stat is None:
            return None
        if isinstance(stat, (int, float)):
            return torch.tensor(float(stat))
        if len(stat) != self.inputs.shape[1]:
            raise ValueError(f"expected {self.inputs.shape[1]} per-channel values, got {len(stat)}")
        return torch.tensor(stat, dtype=torch.float32).reshape(-1, *[1] * (self.inputs.dim() - 2))

    @property
    def input_shape(self) -> tuple[int, ...]:
        return tuple(self.inputs.shape[1:])

    def __len__(self) -> int:
        return len(self.inputs)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        return self._normalize(self.inputs[index]), int(self.targets[index])

    def get_batch(self, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Gather and normalize a whole batch in one indexing operation."""
        return self._normalize(self.inputs[indices]), self.targets[indices]

    def _normalize(self, x: torch.Tensor) -> torch.Tensor:
        x = x.float() / 255 if x.dtype == torch.uint8 else x.float()
        if self._mean is None or self._std is None:
            return x
        return (x - self._mean) / self._std


def sha256_file(path: str | Path) -> str:
    """Return the hex SHA-256 of a file's bytes, read in chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def verify_checksums(directory: str | Path, names: Iterable[str], sums_file: str = SUMS_FILE) -> None:
    """Check each named file in `directory` against `sums_file` (`sha256sum` format).

    A file `X.gz` that is not listed itself is checked against the entry for `X`, by hashing
    its decompressed contents.
    Raise DataError if the sums file is missing, a file is missing or unlisted, or a digest differs.
    """
    directory = Path(directory)
    sums_path = directory / sums_file
    sums = _read_sums(sums_path)
    for name in names:
        _read_verified(directory / name, sums, sums_path)


def _read_sums(sums_path: Path) -> dict[str, str]:
    if not sums_path.is_file():
        raise DataError(f"{sums_path}: missing")
    try:
        text = sums_path.read_text()
    except UnicodeDecodeError:
        raise DataError(f"{sums_path}: not text (lines of '<sha256 hex>  <name>')") from None
    sums = {}
    for line_number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        match = _SUMS_LINE.fullmatch(line)
        if match is None:
            raise DataError(f"{sums_path}: line {line_number} is not '<sha256 hex>  <name>'")
        sums[match["name"]] = match["digest"].lower()
    return sums


def _read_existing(path: Path) -> bytes:
    if not path.is_file():
        raise DataError(f"{path}: missing")
    return path.read_bytes()


def _gunzip(path: Path, raw: bytes) -> bytes:
    try:
        return gzip.decompress(raw)
    except (OSError, EOFError, zlib.error) as exc:
        raise DataError(f"{path}: corrupt gzip data ({exc})") from None


def _check_digest(path: Path, data: bytes, expected: str, hashed: str) -> None:
    actual = hashlib.sha256(data).hexdigest()
    if actual != expected:
        raise DataError(f"{path}: SHA-256 mismatch of {hashed} (expected {expected}, got {actual})")


def _read_verified(path: Path, sums: dict[str, str], sums_path: Path) -> bytes:
    """Return `path`'s contents, gunzipped if it ends in .gz, once they match their listed digest."""
    data = _read_existing(path)
    gzipped = path.suffix == ".gz"
    if path.name in sums:
        _check_digest(path, data, sums[path.name], "file")
        return _gunzip(path, data) if gzipped else data
    if gzipped and path.stem in sums:
        contents = _gunzip(path, data)
        _check_digest(path, contents, sums[path.stem], "decompressed contents")
        return contents
    raise DataError(f"{path}: not listed in {sums_path}")


def _parse_idx(path: Path, data: bytes, ndim: int) -> np.ndarray:
    """Parse an unsigned-byte IDX file with `ndim` dimensions, validating its header and length."""
    header_bytes = 4 + 4 * ndim
    if len(data) < header_bytes:
        raise DataError(f"{path}: truncated IDX file: {len(data)} bytes, less than the {header_bytes}-byte header")
    magic, *dims = struct.unpack(f">{1 + ndim}I", data[:header_bytes])
    expected_magic = 0x800 | ndim
    if magic != expected_magic:
        raise DataError(f"{path}: bad IDX magic 0x{magic:08x} (expected 0x{expected_magic:08x})")
    if 0 in dims:
        raise DataError(f"{path}: IDX header has a zero dimension {tuple(dims)}")
    payload_bytes = len(data) - header_bytes
    if payload_bytes != math.prod(dims):
        problem = "truncated" if payload_bytes < math.prod(dims) else "oversized"
        contents = f"{dims[0]} images of {'x'.join(map(str, dims[1:]))}" if ndim > 1 else f"{dims[0]} labels"
        raise DataError(f"{path}: {problem} IDX file: header says {contents} but {payload_bytes} bytes of data")
    return np.frombuffer(data, dtype=np.uint8, offset=header_bytes).reshape(dims)


def _check_labels(path: Path, labels: np.ndarray, num_classes: int) -> None:
    out_of_range = np.flatnonzero(labels >= num_classes)
    if out_of_range.size:
        index = out_of_range[0]
        raise DataError(f"{path}: label {labels[index]} at index {index} is out of range (expected < {num_classes})")


def _find_mnist_file(directory: Path, name: str) -> Path:
    for candidate in (directory / f"{name}.gz", directory / name):
        if candidate.is_file():
            return candidate
    raise DataError(f"{directory / name}.gz: missing (and no uncompressed {name})")


def load_mnist(data_dir: str | Path, train: bool) -> ArrayDataset:
    """Load the MNIST train or test split from gzip (or uncompressed) IDX files in `data_dir`.

    `data_dir` must hold a SHA256SUMS file; both files are verified before they are parsed.
    """
    directory = Path(data_dir)
    sums_path = directory / SUMS_FILE
    sums = _read_sums(sums_path)
    split = "train" if train else "t10k"
    images_path = _find_mnist_file(directory, f"{split}-images-idx3-ubyte")
    labels_path = _find_mnist_file(directory, f"{split}-labels-idx1-ubyte")
    images_data = _read_verified(images_path, sums, sums_path)
    labels_data = _read_verified(labels_path, sums, sums_path)

    images = _parse_idx(images_path, images_data, ndim=3)
    if images.shape[1:] != (MNIST_IMAGE_SIZE, MNIST_IMAGE_SIZE):
        raise DataError(
            f"{images_path}: expected {MNIST_IMAGE_SIZE}x{MNIST_IMAGE_SIZE} images, "
            f"header says {images.shape[1]}x{images.shape[2]}"
        )
    labels = _parse_idx(labels_path, labels_data, ndim=1)
    _check_labels(labels_path, labels, MNIST_NUM_CLASSES)
    if len(labels) != len(images):
        raise DataError(f"{labels_path}: {len(labels)} labels but {images_path.name} has {len(images)} images")
    return ArrayDataset(
        inputs=torch.from_numpy(images[:, None].copy()),
        targets=torch.from_numpy(labels.astype(np.int64)),
        num_classes=MNIST_NUM_CLASSES,
        mean=MNIST_MEAN,
        std=MNIST_STD,
    )


def load_cifar10(data_dir: str | Path, train: bool) -> ArrayDataset:
    """Load the CIFAR-10 train or test split from the official binary files.

    The `.bin` files may sit in `data_dir` or in `data_dir/cifar-10-batches-bin/`. A SHA256SUMS
    file beside them is verified when present; it is required for trust, since without it the
    files are only checked for well-formedness.
    """
    directory = Path(data_dir)
    if (directory / CIFAR10_SUBDIR).is_dir():
        directory = directory / CIFAR10_SUBDIR
    sums_path = directory / SUMS_FILE
    sums = _read_sums(sums_path) if sums_path.is_file() else None

    records = []
    for name in CIFAR10_TRAIN_FILES if train else CIFAR10_TEST_FILES:
        path = directory / name
        data = _read_existing(path) if sums is None else _read_verified(path, sums, sums_path)
        if not data or len(data) % CIFAR10_RECORD_BYTES:
            raise DataError(
                f"{path}: {len(data)} bytes is not a positive multiple of the "
                f"{CIFAR10_RECORD_BYTES}-byte CIFAR-10 record"
            )
        file_records = np.frombuffer(data, dtype=np.uint8).reshape(-1, CIFAR10_RECORD_BYTES)
        _check_labels(path, file_records[:, 0], CIFAR10_NUM_CLASSES)
        records.append(file_records)

    images = np.concatenate([r[:, 1:] for r in records]).reshape(-1, *CIFAR10_IMAGE_SHAPE)
    labels = np.concatenate([r[:, 0] for r in records]).astype(np.int64)
    return ArrayDataset(
        inputs=torch.from_numpy(images),
        targets=torch.from_numpy(labels),
        num_classes=CIFAR10_NUM_CLASSES,
        mean=CIFAR10_MEAN,
        std=CIFAR10_STD,
    )


def synthetic_dataset(input_shape: Sequence[int], num_classes: int, size: int, seed: int) -> ArrayDataset:
    """Draw N(0, 1) inputs labelled by the argmax of a random linear teacher, all from `seed`.

    The teacher is drawn before the inputs, so it depends only on `seed`, `input_shape` and
    `num_classes`; split one call to get train and test sets that share a teacher.
    """
    generator = torch.Generator().manual_seed(seed)
    teacher = torch.randn(math.prod(input_shape), num_classes, generator=generator)
    inputs = torch.randn(size, *input_shape, generator=generator)
    targets = (inputs.flatten(1) @ teacher).argmax(dim=1)
    return ArrayDataset(inputs, targets, num_classes=num_classes)


class TextDataset(Dataset):
    """Non-overlapping windows of `seq_len` + 1 bytes of a text: sample i's input is bytes [iT, iT + T) and its
    labels, the next byte at each position, bytes [iT + 1, iT + T + 1) (T = `seq_len`)."""

    def __init__(self, data: torch.Tensor, seq_len: int):
        self.data = data
        self.seq_len = seq_len
        self.num_classes = TEXT_VOCAB

    @property
    def input_shape(self) -> tuple[int, ...]:
        return (self.seq_len,)

    def __len__(self) -> int:
        return (len(self.data) - 1) // self.seq_len

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        inputs, targets = self.get_batch(torch.tensor([index]))
        return inputs[0], targets[0]

    def get_batch(self, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        windows = self.data[indices[:, None] * self.seq_len + torch.arange(self.seq_len + 1)].long()
        return windows[:, :-1], windows[:, 1:]


def load_text(data_dir: str | Path, seq_len: int) -> tuple[TextDataset, TextDataset]:
    """Return the (train, test) byte windows of `data_dir`/corpus.txt, verified against its SHA256SUMS."""
    directory = Path(data_dir)
    if not (directory / TEXT_FILE).is_file():
        raise DataError(
            f"{directory / TEXT_FILE}: missing; make it with python -m crossbow_mpi.data.prepare text {directory}"
        )
    sums_path = directory / SUMS_FILE
    text = _read_verified(directory / TEXT_FILE, _read_sums(sums_path), sums_path)
    data = torch.frombuffer(bytearray(text), dtype=torch.uint8)
    split = len(data) - int(len(data) * TEXT_TEST_SHARE)
    train, test = TextDataset(data[:split], seq_len), TextDataset(data[split:], seq_len)
    if not (len(train) and len(test)):
        raise DataError(
            f"{directory / TEXT_FILE}: {len(data)} bytes are too few for --seq-len {seq_len}: each split (the test "
            f"split is the last {TEXT_TEST_SHARE:.0%}) needs at least one window of {seq_len + 1} bytes"
        )
    return train, test


SEQUENCE_LENGTH = 64
"""synthetic-sequences: the longest sequence (and the padded width)."""
SEQUENCE_VOCAB = 32
"""synthetic-sequences: tokens 1..31; 0 pads."""
SEQUENCE_CLASSES = 10
SEQUENCE_SIGNAL = 0.35
"""synthetic-sequences: the chance that a token is one of its class's three (the Bayes accuracy is then about 94 %:
85 % on sequences shorter than 16, 97 % from 16 to 31 tokens, all but certain from 32)."""


class SequenceDataset(ArrayDataset):
    """Token sequences of varying length, padded with 0 to one width. A batch is cut to the length of its first
    sample (its length bucket, as batching by length does), so a step's cost varies from batch to batch without
    any injected delay: the inherent imbalance of eager-SGD's paper (Li et al., PPoPP 2020: video clips of varying
    length)."""

    def __init__(self, inputs: torch.Tensor, targets: torch.Tensor, num_classes: int, lengths: torch.Tensor):
        super().__init__(inputs, targets, num_classes)
        self.lengths = lengths

    def get_batch(self, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        width = int(self.lengths[indices[0]]) if len(indices) else 1
        return self.inputs[indices, :width], self.targets[indices]


def synthetic_sequences(size: int, seed: int) -> SequenceDataset:
    """Draw sequences of log-uniform length in [8, SEQUENCE_LENGTH]: each token is, with probability
    SEQUENCE_SIGNAL, one of its class's three tokens, else uniform over the vocabulary; every prefix carries the
    class."""
    generator = torch.Generator().manual_seed(seed)
    targets = torch.randint(SEQUENCE_CLASSES, (size,), generator=generator)
    lengths = (2 ** (3 + 3 * torch.rand(size, generator=generator))).floor().long()
    noise = torch.randint(1, SEQUENCE_VOCAB, (size, SEQUENCE_LENGTH), generator=generator)
    signal = 1 + 3 * targets[:, None] + torch.randint(3, (size, SEQUENCE_LENGTH), generator=generator)
    tokens = torch.where(torch.rand(size, SEQUENCE_LENGTH, generator=generator) < SEQUENCE_SIGNAL, signal, noise)
    tokens[torch.arange(SEQUENCE_LENGTH) >= lengths[:, None]] = 0
    return SequenceDataset(tokens.float(), targets, SEQUENCE_CLASSES, lengths)


def _build_sequences(
    data_dir: str, seed: int, seq_len: int, train_size: int, test_size: int
) -> tuple[ArrayDataset, ArrayDataset]:
    full = synthetic_sequences(train_size + test_size, seed)
    train, test = (
        SequenceDataset(full.inputs[part], full.targets[part], SEQUENCE_CLASSES, full.lengths[part])
        for part in (slice(None, train_size), slice(train_size, None))
    )
    return train, test


class Loader(Protocol):
    """A real dataset's reader: its training or test split from `data_dir`."""

    def __call__(self, data_dir: str | Path, train: bool) -> ArrayDataset: ...


def _build_real(loader: Loader, data_dir: str, seed: int, seq_len: int) -> tuple[ArrayDataset, ArrayDataset]:
    return loader(data_dir, train=True), loader(data_dir, train=False)


def _build_text(data_dir: str, seed: int, seq_len: int) -> tuple[TextDataset, TextDataset]:
    return load_text(data_dir, seq_len)


def _build_synthetic(
    data_dir: str,
    seed: int,
    seq_len: int,
    *,
    input_shape: tuple[int, ...],
    num_classes: int,
    train_size: int,
    test_size: int,
) -> tuple[ArrayDataset, ArrayDataset]:
    full = synthetic_dataset(input_shape, num_classes, train_size + test_size, seed)
    train = ArrayDataset(full.inputs[:train_size], full.targets[:train_size], num_classes)
    test = ArrayDataset(full.inputs[train_size:], full.targets[train_size:], num_classes)
    return train, test


SHAPES: dict[str, tuple[tuple[int, ...], int]] = {
    "mnist": (MNIST_IMAGE_SHAPE, MNIST_NUM_CLASSES),
    "cifar10": (CIFAR10_IMAGE_SHAPE, CIFAR10_NUM_CLASSES),
    "synthetic-mnist": (MNIST_IMAGE_SHAPE, MNIST_NUM_CLASSES),
    "synthetic-cifar": (CIFAR10_IMAGE_SHAPE, CIFAR10_NUM_CLASSES),
    "synthetic-sequences": ((SEQUENCE_LENGTH,), SEQUENCE_CLASSES),
}
"""Each dataset's input shape (without the batch dimension) and number of classes."""


Builder = Callable[[str, int, int], tuple[Dataset, Dataset]]
"""(data directory, seed, window length) → the (train, test) datasets."""


def _synthetic(name: str, train_size: int, test_size: int) -> Builder:
    input_shape, num_classes = SHAPES[name]
    return functools.partial(
        _build_synthetic, input_shape=input_shape, num_classes=num_classes, train_size=train_size, test_size=test_size
    )


DATASETS: dict[str, Builder] = {
    "mnist": functools.partial(_build_real, load_mnist),
    "cifar10": functools.partial(_build_real, load_cifar10),
    "synthetic-mnist": _synthetic("synthetic-mnist", train_size=60000, test_size=10000),
    "synthetic-cifar": _synthetic("synthetic-cifar", train_size=50000, test_size=10000),
    "text": _build_text,
    "synthetic-sequences": functools.partial(_build_sequences, train_size=20000, test_size=2000),
}


def dataset_names() -> list[str]:
    return sorted(DATASETS)


def build_dataset(name: str, data_dir: str, seed: int, seq_len: int = 64) -> tuple:
    """Return the (train, test) datasets for `name`; `data_dir` holds the files, synthetic sets ignore it; `seq_len`
    is the window length of `text`."""
    _check_known(name)
    return DATASETS[name](data_dir, seed, seq_len)


def dataset_shape(name: str, seq_len: int = 64) -> tuple[tuple[int, ...], int]:
    """Return (input shape, number of classes) of dataset `name` without loading it."""
    _check_known(name)
    return ((seq_len,), TEXT_VOCAB) if name == "text" else SHAPES[name]


def _check_known(name: str) -> None:
    if name not in DATASETS:
        raise ValueError(f"unknown dataset {name!r}; known: {', '.join(dataset_names())}")
