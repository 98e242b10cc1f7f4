import gzip
import hashlib
import shutil
import struct
from pathlib import Path

import numpy as np
import pytest
import torch

from crossbow_mpi.data import (
    ArrayDataset,
    DataError,
    build_dataset,
    dataset_names,
    load_cifar10,
    load_mnist,
    sha256_file,
    synthetic_dataset,
    verify_checksums,
)

MNIST_DIR = Path(__file__).parent.parent / "datasets" / "mnist"
MNIST_FILES = [
    "train-images-idx3-ubyte.gz",
    "train-labels-idx1-ubyte.gz",
    "t10k-images-idx3-ubyte.gz",
    "t10k-labels-idx1-ubyte.gz",
]
TEST_IMAGES = "t10k-images-idx3-ubyte"
TEST_LABELS = "t10k-labels-idx1-ubyte"


def assert_data_error(excinfo: pytest.ExceptionInfo, path: Path, problem: str) -> None:
    message = str(excinfo.value)
    assert "\n" not in message
    assert message.startswith(f"{path}: "), message
    assert problem in message, message


def write_sums(directory: Path, contents: dict[str, bytes]) -> None:
    lines = [f"{hashlib.sha256(data).hexdigest()}  {name}\n" for name, data in contents.items()]
    (directory / "SHA256SUMS").write_text("".join(lines))


def idx_bytes(magic: int, dims: tuple[int, ...], payload: bytes) -> bytes:
    return struct.pack(f">{1 + len(dims)}I", magic, *dims) + payload


def write_mnist_test_split(directory: Path, images: bytes, labels: bytes) -> None:
    """Write gzipped t10k IDX files with a SHA256SUMS of their decompressed contents, like the real set."""
    (directory / f"{TEST_IMAGES}.gz").write_bytes(gzip.compress(images))
    (directory / f"{TEST_LABELS}.gz").write_bytes(gzip.compress(labels))
    write_sums(directory, {TEST_IMAGES: images, TEST_LABELS: labels})


def small_mnist(num_images: int = 3, num_labels: int = 3) -> tuple[bytes, bytes]:
    pixels = np.arange(num_images * 28 * 28, dtype=np.uint8).tobytes()
    images = idx_bytes(0x803, (num_images, 28, 28), pixels)
    labels = idx_bytes(0x801, (num_labels,), bytes(i % 10 for i in range(num_labels)))
    return images, labels


@pytest.fixture(scope="module")
def mnist() -> tuple[ArrayDataset, ArrayDataset]:
    return build_dataset("mnist", str(MNIST_DIR), seed=0)


@pytest.fixture(scope="module")
def mnist_train(mnist) -> ArrayDataset:
    return mnist[0]


@pytest.fixture(scope="module")
def mnist_test(mnist) -> ArrayDataset:
    return mnist[1]


@pytest.fixture
def mnist_test_copy(tmp_path: Path) -> Path:
    for name in ["SHA256SUMS", f"{TEST_IMAGES}.gz", f"{TEST_LABELS}.gz"]:
        shutil.copy(MNIST_DIR / name, tmp_path / name)
    return tmp_path


# MNIST


def test_mnist_shapes_and_counts(mnist_train, mnist_test):
    for dataset, size in [(mnist_train, 60000), (mnist_test, 10000)]:
        assert len(dataset) == size
        assert dataset.inputs.dtype == torch.uint8
        assert dataset.inputs.shape == (size, 1, 28, 28)
        assert dataset.targets.dtype == torch.int64
        assert dataset.input_shape == (1, 28, 28)
        assert dataset.num_classes == 10
        assert (dataset.mean, dataset.std) == (0.1307, 0.3081)
        assert set(dataset.targets.tolist()) == set(range(10))
    assert mnist_train.targets[:10].tolist() == [5, 0, 4, 1, 9, 2, 1, 3, 1, 4]
    assert mnist_test.targets[:10].tolist() == [7, 2, 1, 0, 4, 1, 4, 9, 5, 9]


def test_mnist_normalization(mnist_train):
    x, y = mnist_train.get_batch(torch.arange(0, len(mnist_train), 6))
    assert x.dtype == torch.float32 and x.shape == (10000, 1, 28, 28)
    assert y.dtype == torch.int64
    assert abs(x.mean().item()) < 0.05
    assert abs(x.std().item() - 1) < 0.05


def test_get_batch_equals_stacked_getitem(mnist_test):
    indices = torch.tensor([3, 0, 9999, 3, 517])
    x, y = mnist_test.get_batch(indices)
    items = [mnist_test[i] for i in indices.tolist()]
    assert torch.equal(x, torch.stack([item[0] for item in items]))
    assert y.tolist() == [item[1] for item in items]
    assert all(type(item[1]) is int for item in items)


def test_mnist_checksums_pass():
    verify_checksums(MNIST_DIR, MNIST_FILES)


def test_sha256_file_matches_hashlib(tmp_path):
    path = tmp_path / "blob"
    path.write_bytes(b"x" * 3_000_000)
    assert sha256_file(path) == hashlib.sha256(b"x" * 3_000_000).hexdigest()


def test_mnist_accepts_uncompressed_files(mnist_test_copy, mnist_test):
    for name in [TEST_IMAGES, TEST_LABELS]:
        gz_path = mnist_test_copy / f"{name}.gz"
        (mnist_test_copy / name).write_bytes(gzip.decompress(gz_path.read_bytes()))
        gz_path.unlink()
    dataset = load_mnist(mnist_test_copy, train=False)
    assert torch.equal(dataset.inputs, mnist_test.inputs)
    assert torch.equal(dataset.targets, mnist_test.targets)


def test_mnist_corrupted_gzip_byte(mnist_test_copy):
    path = mnist_test_copy / f"{TEST_IMAGES}.gz"
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(DataError) as excinfo:
        load_mnist(mnist_test_copy, train=False)
    assert_data_error(excinfo, path, "corrupt gzip data")


def test_mnist_corrupted_byte_is_checksum_mismatch(mnist_test_copy):
    gz_path = mnist_test_copy / f"{TEST_LABELS}.gz"
    data = bytearray(gzip.decompress(gz_path.read_bytes()))
    data[100] = (data[100] + 1) % 10
    gz_path.write_bytes(gzip.compress(bytes(data)))
    with pytest.raises(DataError) as excinfo:
        load_mnist(mnist_test_copy, train=False)
    assert_data_error(excinfo, gz_path, "SHA-256 mismatch")
    assert "ff7bcfd416de33731a308c3f266cc351222c34898ecbeaf847f06e48f7ec33f2" in str(excinfo.value)
    with pytest.raises(DataError) as excinfo:
        verify_checksums(mnist_test_copy, [f"{TEST_LABELS}.gz"])
    assert_data_error(excinfo, gz_path, "SHA-256 mismatch")


def test_mnist_missing_file(mnist_test_copy):
    path = mnist_test_copy / f"{TEST_LABELS}.gz"
    path.unlink()
    with pytest.raises(DataError) as excinfo:
        load_mnist(mnist_test_copy, train=False)
    assert_data_error(excinfo, path, "missing")
    with pytest.raises(DataError) as excinfo:
        verify_checksums(mnist_test_copy, [path.name])
    assert_data_error(excinfo, path, "missing")


def test_mnist_missing_sums_file(mnist_test_copy):
    (mnist_test_copy / "SHA256SUMS").unlink()
    with pytest.raises(DataError) as excinfo:
        load_mnist(mnist_test_copy, train=False)
    assert_data_error(excinfo, mnist_test_copy / "SHA256SUMS", "missing")


def test_mnist_file_not_listed(mnist_test_copy):
    sums_path = mnist_test_copy / "SHA256SUMS"
    lines = sums_path.read_text().splitlines(keepends=True)
    sums_path.write_text("".join(line for line in lines if TEST_IMAGES not in line))
    with pytest.raises(DataError) as excinfo:
        load_mnist(mnist_test_copy, train=False)
    assert_data_error(excinfo, mnist_test_copy / f"{TEST_IMAGES}.gz", "not listed")


def test_mnist_malformed_sums_file(mnist_test_copy):
    sums_path = mnist_test_copy / "SHA256SUMS"
    sums_path.write_text(sums_path.read_text() + "not a checksum line\n")
    with pytest.raises(DataError) as excinfo:
        load_mnist(mnist_test_copy, train=False)
    assert_data_error(excinfo, sums_path, "line 5")


def test_mnist_truncated_gzip(mnist_test_copy):
    path = mnist_test_copy / f"{TEST_IMAGES}.gz"
    path.write_bytes(path.read_bytes()[:5000])
    with pytest.raises(DataError) as excinfo:
        load_mnist(mnist_test_copy, train=False)
    assert_data_error(excinfo, path, "corrupt gzip data")


def test_small_mnist_loads(tmp_path):
    images, labels = small_mnist()
    write_mnist_test_split(tmp_path, images, labels)
    dataset = load_mnist(tmp_path, train=False)
    assert dataset.inputs.shape == (3, 1, 28, 28)
    assert dataset.inputs[1, 0, 2, 5].item() == (784 + 2 * 28 + 5) % 256
    assert dataset.targets.tolist() == [0, 1, 2]


def test_mnist_truncated_idx_with_matching_checksum(tmp_path):
    images, labels = small_mnist()
    write_mnist_test_split(tmp_path, images[:-10], labels)
    with pytest.raises(DataError) as excinfo:
        load_mnist(tmp_path, train=False)
    assert_data_error(
        excinfo,
        tmp_path / f"{TEST_IMAGES}.gz",
        f"truncated IDX file: header says 3 images of 28x28 but {3 * 784 - 10} bytes of data",
    )


@pytest.mark.parametrize(
    "make_files, bad_file, problem",
    [
        (lambda: (idx_bytes(0x804, (3, 28, 28), bytes(3 * 784)), small_mnist()[1]), TEST_IMAGES, "bad IDX magic"),
        (lambda: (small_mnist()[0], idx_bytes(0x803, (3,), bytes(3))), TEST_LABELS, "bad IDX magic"),
        (lambda: (small_mnist()[0], small_mnist()[1] + b"\0"), TEST_LABELS, "oversized IDX file"),
        (lambda: (small_mnist()[0], small_mnist()[1][:6]), TEST_LABELS, "truncated IDX file"),
        (lambda: (idx_bytes(0x803, (3, 27, 28), bytes(3 * 27 * 28)), small_mnist()[1]), TEST_IMAGES, "28x28"),
        (lambda: (small_mnist()[0], idx_bytes(0x801, (3,), bytes([1, 10, 2]))), TEST_LABELS, "label 10 at index 1"),
        (lambda: small_mnist(num_images=3, num_labels=4), TEST_LABELS, "4 labels but"),
    ],
    ids=["image-magic", "label-magic", "oversized", "truncated-header", "image-size", "label-range", "count"],
)
def test_mnist_malformed_idx(tmp_path, make_files, bad_file, problem):
    write_mnist_test_split(tmp_path, *make_files())
    with pytest.raises(DataError) as excinfo:
        load_mnist(tmp_path, train=False)
    assert_data_error(excinfo, tmp_path / f"{bad_file}.gz", problem)


# CIFAR-10


def cifar_records(labels: list[int], seed: int) -> bytes:
    rng = np.random.default_rng(seed)
    records = [bytes([label]) + rng.integers(0, 256, 3072, dtype=np.uint8).tobytes() for label in labels]
    return b"".join(records)


CIFAR_TRAIN_LABELS = [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9]]
CIFAR_TEST_LABELS = [9, 0, 3]


def write_cifar(directory: Path, with_sums: bool = True) -> dict[str, bytes]:
    directory.mkdir(parents=True, exist_ok=True)
    files = {f"data_batch_{i + 1}.bin": cifar_records(labels, i) for i, labels in enumerate(CIFAR_TRAIN_LABELS)}
    files["test_batch.bin"] = cifar_records(CIFAR_TEST_LABELS, 99)
    for name, data in files.items():
        (directory / name).write_bytes(data)
    if with_sums:
        write_sums(directory, files)
    return files


@pytest.mark.parametrize("subdir", ["", "cifar-10-batches-bin"])
def test_cifar10_layout_and_labels(tmp_path, subdir):
    files = write_cifar(tmp_path / subdir)
    train = load_cifar10(tmp_path, train=True)
    test = load_cifar10(tmp_path, train=False)
    assert train.inputs.dtype == torch.uint8 and train.inputs.shape == (10, 3, 32, 32)
    assert train.targets.tolist() == list(range(10))
    assert test.targets.tolist() == CIFAR_TEST_LABELS
    assert train.input_shape == (3, 32, 32) and train.num_classes == 10
    record = files["data_batch_3.bin"][3073:]  # second record of the third file: train index 5
    for channel, row, col in [(0, 0, 0), (1, 5, 7), (2, 31, 30), (0, 7, 5)]:
        assert train.inputs[5, channel, row, col].item() == record[1 + channel * 1024 + row * 32 + col]
    assert test.inputs[2, 2, 31, 31].item() == files["test_batch.bin"][2 * 3073 + 3072]


def test_cifar10_per_channel_normalization(tmp_path):
    write_cifar(tmp_path)
    train = load_cifar10(tmp_path, train=True)
    x, y = train.get_batch(torch.tensor([4, 1]))
    mean, std = (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)
    for channel in range(3):
        expected = (train.inputs[[4, 1], channel].float() / 255 - mean[channel]) / std[channel]
        assert torch.allclose(x[:, channel], expected)
    assert y.tolist() == [4, 1]
    assert torch.equal(x[0], train[4][0])


def test_cifar10_loads_without_sums(tmp_path):
    write_cifar(tmp_path, with_sums=False)
    assert len(load_cifar10(tmp_path, train=True)) == 10


def test_cifar10_checksum_mismatch(tmp_path):
    write_cifar(tmp_path)
    path = tmp_path / "test_batch.bin"
    data = bytearray(path.read_bytes())
    data[10] ^= 1
    path.write_bytes(bytes(data))
    with pytest.raises(DataError) as excinfo:
        load_cifar10(tmp_path, train=False)
    assert_data_error(excinfo, path, "SHA-256 mismatch")


def test_cifar10_missing_file(tmp_path):
    write_cifar(tmp_path)
    path = tmp_path / "data_batch_4.bin"
    path.unlink()
    with pytest.raises(DataError) as excinfo:
        load_cifar10(tmp_path, train=True)
    assert_data_error(excinfo, path, "missing")


@pytest.mark.parametrize(
    "data, problem",
    [
        (cifar_records([1, 2], 0) + b"\0" * 5, "not a positive multiple of the 3073-byte"),
        (b"", "not a positive multiple of the 3073-byte"),
        (cifar_records([1, 10, 2], 0), "label 10 at index 1"),
    ],
    ids=["length", "empty", "label"],
)
@pytest.mark.parametrize("with_sums", [False, True])
def test_cifar10_malformed(tmp_path, data, problem, with_sums):
    files = write_cifar(tmp_path, with_sums=False)
    path = tmp_path / "test_batch.bin"
    path.write_bytes(data)
    if with_sums:
        write_sums(tmp_path, {**files, "test_batch.bin": data})
    with pytest.raises(DataError) as excinfo:
        load_cifar10(tmp_path, train=False)
    assert_data_error(excinfo, path, problem)


# Synthetic and registry


def test_synthetic_dataset_is_deterministic():
    a = synthetic_dataset((1, 8, 8), 5, 200, seed=3)
    b = synthetic_dataset((1, 8, 8), 5, 200, seed=3)
    c = synthetic_dataset((1, 8, 8), 5, 200, seed=4)
    assert torch.equal(a.inputs, b.inputs) and torch.equal(a.targets, b.targets)
    assert not torch.equal(a.inputs, c.inputs)
    assert a.inputs.dtype == torch.float32 and a.inputs.shape == (200, 1, 8, 8)
    assert a.targets.dtype == torch.int64 and a.targets.min() >= 0 and a.targets.max() < 5
    assert a.num_classes == 5 and a.mean is None


def test_synthetic_get_batch_equals_stacked_getitem():
    dataset = synthetic_dataset((12,), 3, 50, seed=0)
    x, y = dataset.get_batch(torch.tensor([7, 2, 49]))
    assert torch.equal(x, torch.stack([dataset[i][0] for i in [7, 2, 49]]))
    assert y.tolist() == [dataset[i][1] for i in [7, 2, 49]]


def least_squares_accuracy(train: ArrayDataset, test: ArrayDataset) -> float:
    """Fit a linear map to one-hot labels on `train`; return its argmax accuracy on `test`."""
    x_train, y_train = train.get_batch(torch.arange(len(train)))
    x_test, y_test = test.get_batch(torch.arange(len(test)))
    one_hot = torch.nn.functional.one_hot(y_train, train.num_classes).float()
    weights = torch.linalg.lstsq(x_train.flatten(1), one_hot).solution
    return ((x_test.flatten(1) @ weights).argmax(1) == y_test).float().mean().item()


def test_synthetic_labels_are_linearly_learnable():
    dataset = synthetic_dataset((2, 4, 4), 4, 3000, seed=0)
    train = ArrayDataset(dataset.inputs[:2000], dataset.targets[:2000], 4)
    test = ArrayDataset(dataset.inputs[2000:], dataset.targets[2000:], 4)
    assert least_squares_accuracy(train, test) > 0.8


@pytest.mark.parametrize(
    "name, input_shape, sizes",
    [("synthetic-mnist", (1, 28, 28), (60000, 10000)), ("synthetic-cifar", (3, 32, 32), (50000, 10000))],
)
def test_build_synthetic(name, input_shape, sizes):
    train, test = build_dataset(name, "/nonexistent", seed=0)
    assert (len(train), len(test)) == sizes
    assert train.input_shape == test.input_shape == input_shape
    assert train.num_classes == test.num_classes == 10
    assert torch.bincount(train.targets, minlength=10).min() > sizes[0] // 20
    if name == "synthetic-mnist":  # train and test share the teacher
        small_train = ArrayDataset(train.inputs[:2000], train.targets[:2000], 10)
        assert least_squares_accuracy(small_train, test) > 0.25


def test_build_dataset_cifar10(tmp_path):
    write_cifar(tmp_path / "cifar-10-batches-bin")
    train, test = build_dataset("cifar10", str(tmp_path), seed=0)
    assert (len(train), len(test)) == (10, 3)


def test_unknown_dataset():
    assert dataset_names() == ["cifar10", "mnist", "synthetic-cifar", "synthetic-mnist", "synthetic-sequences", "text"]
    with pytest.raises(ValueError) as excinfo:
        build_dataset("imagenet", "", seed=0)
    message = str(excinfo.value)
    assert "\n" not in message and "'imagenet'" in message
    assert all(name in message for name in dataset_names())


def test_synthetic_sequences_batches_take_their_first_samples_length():
    train, test = build_dataset("synthetic-sequences", "", seed=3)
    assert train.input_shape == (64,) and (len(train), len(test)) == (20000, 2000)
    assert int(train.lengths.min()) >= 8 and int(train.lengths.max()) <= 64
    assert bool((train.inputs[0, int(train.lengths[0]) :] == 0).all()) and bool((train.inputs[0, :8] > 0).all())
    widths = set()
    for first in range(0, 320, 32):
        inputs, targets = train.get_batch(torch.arange(first, first + 32))
        assert inputs.shape == (32, int(train.lengths[first])) and targets.shape == (32,)
        widths.add(inputs.shape[1])
    assert len(widths) > 3, f"the batches' lengths hardly vary: {widths}"
    again, _ = build_dataset("synthetic-sequences", "", seed=3)
    assert torch.equal(again.inputs, train.inputs) and torch.equal(again.lengths, train.lengths)


def test_array_dataset_rejects_bad_targets():
    with pytest.raises(ValueError):
        ArrayDataset(torch.zeros(4, 3), torch.zeros(4, dtype=torch.int32), 2)
    with pytest.raises(ValueError):
        ArrayDataset(torch.zeros(4, 3, 2, 2), torch.zeros(4, dtype=torch.int64), 2, mean=(0.5, 0.5), std=(1, 1))
