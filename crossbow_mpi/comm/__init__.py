"""Communication backends behind one interface: MPI (flat or by node) and NCCL, and the job's process scopes."""

import sys

import torch

from crossbow_mpi.comm.base import Communicator
from crossbow_mpi.comm.mpi import MpiCommunicator
from crossbow_mpi.config import ConfigError

__all__ = ["Communicator", "MpiCommunicator", "build_communicator", "device_kinds", "start_nccl"]

CPU = torch.device("cpu")


def build_communicator(
    mpi_comm, kind: str = "mpi", device: torch.device = CPU, hierarchy: str = "flat"
) -> Communicator:
    """Return the communicator for this job's ranks (collective): `mpi`, `nccl`, or `auto` (NCCL on GPUs, else
    MPI; when NCCL cannot start, rank 0 says why in one line and MPI is used).

    `hierarchy`: `node` sums over MPI within each node first (see HierarchicalCommunicator; with `auto` it keeps
    MPI on GPUs), `flat` in one collective, `auto` by node when the ranks span several nodes and MPI is the
    transport (NCCL orders its own rings by node). On GPUs rank 0 also says in one line when ranks share a GPU."""
    from crossbow_mpi.comm.gpus import gpu_owners, ranks_per_gpu

    if kind == "nccl" and hierarchy == "node":
        raise ConfigError("--hierarchy node sums over MPI: pass --comm mpi with it (NCCL orders its rings by node)")
    control = _mpi_communicator(mpi_comm, hierarchy)
    kinds = device_kinds(control, device)
    if "cuda" not in kinds:
        if kind == "nccl":
            raise ConfigError("--comm nccl needs CUDA devices (--device cuda)")
        return control
    owners = gpu_owners(control, device)
    most = max(ranks_per_gpu(owners, rank) for rank in range(control.size))
    if most > 1:
        _note(
            control,
            f"up to {most} ranks share a GPU (more ranks than GPUs): they share its compute, and "
            "--learners auto gives each rank its share of the GPU's memory",
        )
    if hierarchy == "node":
        return control
    nccl = start_nccl(mpi_comm, kind, device, control, "the allreduce", kinds)
    return control if nccl is None else nccl


def device_kinds(comm: Communicator, device: torch.device) -> list[str]:
    """Return every rank's device type (`cuda`, `cpu`), in rank order (collective): the ranks decide on NCCL
    together from it, so that a CPU rank beside GPU ranks (`--device mixed`) never leaves them waiting."""
    return comm.allgather_json(device.type)


def start_nccl(mpi_comm, kind: str, device: torch.device, control: Communicator, purpose: str, kinds: list[str]):
    """Return NCCL over `mpi_comm` for `kind` `nccl`, or `auto` when it starts (else rank 0 of `control` says why in
    one line); None where MPI carries `purpose`: `--comm mpi`, or any rank of `kinds` (device_kinds over
    `control`) not on a GPU (collective)."""
    from crossbow_mpi.comm.nccl import NcclCommunicator

    if kind == "mpi":
        return None
    on_cpu = [rank for rank, device_kind in enumerate(kinds) if device_kind != "cuda"]
    if on_cpu and kind == "nccl":
        raise ConfigError(
            f"--comm nccl needs every rank on a GPU, but rank(s) {', '.join(map(str, on_cpu))} are on the CPU: "
            "pass --comm mpi or auto"
        )
    if on_cpu:
        return None
    try:
        return NcclCommunicator(mpi_comm, device)
    except ConfigError as err:
        if kind == "nccl":
            raise ConfigError(f"--comm nccl: {err}") from None
        _note(control, f"--comm auto: using MPI for {purpose}, since NCCL cannot start: {err}")
        return None


def _mpi_communicator(mpi_comm, hierarchy: str) -> MpiCommunicator:
    """Return the MPI backend over `mpi_comm`, summing by node as `hierarchy` asks (collective)."""
    from crossbow_mpi.comm.hierarchical import HierarchicalCommunicator

    if hierarchy == "flat":
        return MpiCommunicator(mpi_comm)
    by_node = HierarchicalCommunicator(mpi_comm)
    return by_node if hierarchy == "node" or by_node.nodes > 1 else MpiCommunicator(mpi_comm)


def _note(comm: Communicator, text: str) -> None:
    if comm.rank == 0:
        print(f"crossbow_mpi: note: {text}", file=sys.stderr, flush=True)
