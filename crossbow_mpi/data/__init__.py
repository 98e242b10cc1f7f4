"""Datasets, their preparation and checks, and the global sampler."""

from .datasets import (
    DATASETS,
    ArrayDataset,
    DataError,
    build_dataset,
    dataset_names,
    dataset_shape,
    load_cifar10,
    load_mnist,
    sha256_file,
    synthetic_dataset,
    verify_checksums,
)

__all__ = [
    "DATASETS",
    "ArrayDataset",
    "DataError",
    "build_dataset",
    "dataset_names",
    "dataset_shape",
    "load_cifar10",
    "load_mnist",
    "sha256_file",
    "synthetic_dataset",
    "verify_checksums",
]
