"""The loop redesign changed no bits: a fixed short LeNet/MNIST run at -n 2, k = 2 ends with the same z as
before it.

The reference checksums were recorded at commit b2f8a43 (the last commit before the redesign) with this
same configuration. eager runs with `--eager-sync-every 1`, so that every round is synchronous and its bits do
not depend on timing.

The bits are those of the CPU's float kernels: oneDNN's convolutions, MKL's matrix products and ATen's vector
code choose their instructions, and so their order of additions, by the CPU. A reference is therefore kept per
kernel fingerprint (the bits of one LeNet gradient on fixed inputs); on a CPU without one the test says so and
skips, and `python tests/test_redesign_bits.py` under `mpirun -n 2` prints what to record.
"""

from __future__ import annotations

import hashlib
import shutil
import tempfile
from pathlib import Path

import pytest
import torch

from crossbow_mpi import Config, Trainer
from crossbow_mpi.comm import MpiCommunicator
from crossbow_mpi.data import build_dataset
from crossbow_mpi.models import build_model

from helpers import MNIST_DIR, world

pytestmark = pytest.mark.slow

ALGORITHMS = ("eager", "sma", "ssgd")

REFERENCE_SHA256 = {
    # at b2f8a43, on the machine of 2026-11-30 (its fingerprint was not recorded)
    "unrecorded": {
        "sma": "05e03d9a31ec96c513584cb5843262340cc58593076df109d70d071e1afc5d17",
        "ssgd": "32e1b4e29df753827b18916acd33789361a0022fef8383f113480f43096035f7",
        "eager": "32e1b4e29df753827b18916acd33789361a0022fef8383f113480f43096035f7",
    },
    # at b2f8a43 and again at a229d3c, on an Intel Xeon with AVX-512, torch 2.13.0+cpu
    "908c89f69aff5195": {
        "sma": "261ecf1e5c932f26923137ab2ab976cd4eb394623512d7c190f017273b69cf3c",
        "ssgd": "f22f0696d0c1b78828afc9c761f16fd2d13a3ae94063323fc1f0595f228415be",
        "eager": "f22f0696d0c1b78828afc9c761f16fd2d13a3ae94063323fc1f0595f228415be",
    },
}


def short_run(comm, run_dir, algorithm: str) -> str:
    cfg = Config(
        algorithm=algorithm,
        learners=2,
        batch_size=16,
        epochs=0.05,
        eval_every=0,
        target_accuracy=0,
        seed=5,
        data_dir=str(MNIST_DIR),
        run_dir=str(run_dir),
        eager_sync_every=1,
        threads=1,
        engine="sequential",
    )
    train, test = build_dataset("mnist", cfg.data_dir, cfg.seed)
    result = Trainer(cfg, comm).fit(lambda: build_model("lenet", train.input_shape, train.num_classes), train, test)
    return hashlib.sha256(result.central.numpy().tobytes()).hexdigest()


def kernel_fingerprint() -> str:
    """Return the first 16 hex digits of the SHA-256 of one LeNet gradient on fixed inputs at one thread."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.random.fork_rng():
            torch.manual_seed(0)
            model = build_model("lenet", (1, 28, 28), 10)
            inputs, labels = torch.randn(16, 1, 28, 28), torch.randint(0, 10, (16,))
            torch.nn.functional.cross_entropy(model(inputs), labels).backward()
    finally:
        torch.set_num_threads(threads)
    gradient = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
    return hashlib.sha256(gradient.numpy().tobytes()).hexdigest()[:16]


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_final_central_model_is_bit_identical_to_before_the_redesign(comm, shared_tmp, algorithm):
    if comm.size != 2:
        pytest.skip("the reference was recorded at -n 2")
    digest = short_run(comm, shared_tmp / algorithm, algorithm)
    if digest in {recorded[algorithm] for recorded in REFERENCE_SHA256.values()}:
        return
    fingerprint = comm.bcast_json(kernel_fingerprint())
    if fingerprint not in REFERENCE_SHA256:
        pytest.skip(f"no reference for this CPU's float kernels (fingerprint {fingerprint}); {algorithm} gave {digest}")
    assert digest == REFERENCE_SHA256[fingerprint][algorithm]


def record() -> None:
    """Print this CPU's fingerprint and digests, as a line of REFERENCE_SHA256 (run under `mpirun -n 2`)."""
    comm = MpiCommunicator(world())
    run_dir = Path(comm.bcast_json(tempfile.mkdtemp(prefix="crossbow-bits-") if comm.rank == 0 else None))
    digests = {name: short_run(comm, run_dir / name, name) for name in ALGORITHMS}
    comm.barrier()
    if comm.rank == 0:
        shutil.rmtree(run_dir)
        print(f'"{kernel_fingerprint()}": {digests},')


if __name__ == "__main__":
    record()
