"""The GPU start-up on a CPU machine, with a fake CuPy/NCCL and fake CUDA device properties: the NCCL unique id
in CuPy 13's and 14's types, NCCL failing to start on one rank, ranks sharing a GPU, the tuner's GPU memory cap;
the pipeline's NCCL link on a fake NCCL whose send/recv groups are synchronous MPI messages."""

from __future__ import annotations

import ctypes
import faulthandler
import sys
import types

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from crossbow_mpi import ConfigError
from crossbow_mpi.comm import MpiCommunicator, build_communicator
from crossbow_mpi.comm.base import wait_sleeping
from crossbow_mpi.comm.nccl import NcclCommunicator, unique_id_bytes, unique_id_for_cupy
from crossbow_mpi.control.learner_tuner import AutoTuner, Policy
from crossbow_mpi.parallel.partition import param_cut, split_model
from crossbow_mpi.parallel.pipeline import NcclLink, PipelineEngine, PipelineStage, StageLink, build_link

from helpers import deep_mlp, needs_stages

GPU = torch.device("cuda", 0)
CUPY_13, CUPY_14 = "13.6.0", "14.2.0"
RAW_ID = bytes((7 * i + 200) % 256 for i in range(128))


def fake_cupy(version: str, failing_ranks: tuple[int, ...] = (), p2p=None) -> types.ModuleType:
    """A CuPy whose NCCL takes and returns the unique id in `version`'s type and fails to start on `failing_ranks`;
    its send/recv (in host memory, over the mpi4py communicator `p2p`) post a group's messages at `groupEnd` as
    synchronous sends (Issend) and receives, and wait for all of them: NCCL's rendezvous, on the host."""
    bytes_id = int(version.split(".")[0]) >= 14
    nccl = types.ModuleType("cupy.cuda.nccl")
    nccl.available = True
    nccl.NCCL_SUM, nccl.NCCL_UINT8, nccl.NCCL_FLOAT16, nccl.NCCL_FLOAT32, nccl.NCCL_FLOAT64 = 0, 1, 6, 7, 8
    nccl.NCCL_BFLOAT16 = 9
    nccl.NcclError = type("NcclError", (RuntimeError,), {})
    nccl.started, nccl.destroyed, group = [], [], []

    def memory(pointer: int, count: int) -> np.ndarray:
        return np.ctypeslib.as_array((ctypes.c_uint8 * count).from_address(pointer))

    def group_end():
        requests = [post() for post in group]
        group.clear()
        wait_sleeping(requests)

    def get_unique_id():
        return RAW_ID if bytes_id else tuple(np.frombuffer(RAW_ID, dtype=np.int8).tolist())

    class Communicator:
        def __init__(self, ndev: int, comm_id, rank: int):
            expected = bytes if bytes_id else tuple
            if not isinstance(comm_id, expected):
                raise TypeError(
                    f"Argument 'commId' has incorrect type (expected {expected.__name__}, got {type(comm_id).__name__})"
                )
            if not bytes_id and not all(-128 <= value < 128 for value in comm_id):
                raise OverflowError("value too large to convert to char")
            if rank in failing_ranks:
                raise nccl.NcclError("NCCL_ERROR_SYSTEM_ERROR: unhandled system error\n(see NCCL_DEBUG=INFO)")
            self.args, self.aborted = (ndev, comm_id, rank), False
            nccl.started.append(self)

        def abort(self):
            self.aborted = True

        def destroy(self):
            nccl.destroyed.append(self)

        def send(self, pointer: int, count: int, datatype: int, peer: int, stream: int):
            group.append(lambda: p2p.Issend(memory(pointer, count), dest=peer))

        def recv(self, pointer: int, count: int, datatype: int, peer: int, stream: int):
            group.append(lambda: p2p.Irecv(memory(pointer, count), source=peer))

        def check_async_error(self):
            pass

    nccl.get_unique_id, nccl.NcclCommunicator = get_unique_id, Communicator
    nccl.groupStart, nccl.groupEnd = group.clear, group_end
    cuda = types.ModuleType("cupy.cuda")
    cuda.nccl = nccl
    cuda.Device = lambda index: types.SimpleNamespace(use=lambda: None)
    cupy = types.ModuleType("cupy")
    cupy.__version__, cupy.cuda = version, cuda
    return cupy


@pytest.fixture
def gpus(monkeypatch, comm):
    """Install a CuPy and give every rank its own fake GPU; return a function that changes both."""

    def install(version: str = CUPY_14, failing_ranks: tuple[int, ...] = (), shared: bool = False, p2p=None):
        cupy = fake_cupy(version, failing_ranks, p2p)
        for name, module in (("cupy", cupy), ("cupy.cuda", cupy.cuda), ("cupy.cuda.nccl", cupy.cuda.nccl)):
            monkeypatch.setitem(sys.modules, name, module)
        uuid = "GPU-shared" if shared else f"GPU-{comm.rank}"
        monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: types.SimpleNamespace(uuid=uuid))
        return cupy.cuda.nccl

    return install


def test_the_unique_id_round_trips_between_bytes_and_each_cupys_type():
    signed = tuple(np.frombuffer(RAW_ID, dtype=np.int8).tolist())
    assert unique_id_bytes(signed) == unique_id_bytes(RAW_ID) == RAW_ID
    assert unique_id_for_cupy(RAW_ID, CUPY_13) == signed and min(signed) < 0
    assert unique_id_for_cupy(RAW_ID, CUPY_14) is RAW_ID


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("version", [CUPY_13, CUPY_14])
def test_every_rank_starts_nccl_with_rank_0s_unique_id_in_its_cupys_type(comm, gpus, version):
    nccl = gpus(version)
    communicator = build_communicator(comm.mpi_comm, "nccl", GPU)
    assert isinstance(communicator, NcclCommunicator) and nccl.started == [communicator.comm]
    ndev, comm_id, rank = communicator.comm.args
    assert (ndev, rank) == (comm.size, comm.rank) and comm_id == nccl.get_unique_id()
    assert communicator.dtypes[torch.bfloat16] == nccl.NCCL_BFLOAT16


@pytest.mark.mpi(min_size=1)
def test_nccl_failing_to_start_on_one_rank_stops_nccl_in_one_line_and_auto_falls_back(comm, gpus, capsys):
    last = comm.size - 1
    nccl = gpus(failing_ranks=(last,))
    with pytest.raises(ConfigError) as raised:
        build_communicator(comm.mpi_comm, "nccl", GPU)
    assert str(raised.value) == (
        f"--comm nccl: starting NCCL failed on rank {last}: NcclError: NCCL_ERROR_SYSTEM_ERROR: unhandled system error"
    )
    assert [started.aborted for started in nccl.started] == ([] if comm.rank == last else [True])
    capsys.readouterr()
    assert type(build_communicator(comm.mpi_comm, "auto", GPU)) is MpiCommunicator
    notes = capsys.readouterr().err.splitlines()
    assert notes == (
        [
            f"crossbow_mpi: note: --comm auto: using MPI for the allreduce, since NCCL cannot start: "
            f"starting NCCL failed on rank {last}: NcclError: NCCL_ERROR_SYSTEM_ERROR: unhandled system "
            "error"
        ]
        if comm.rank == 0
        else []
    )


@pytest.mark.mpi(min_size=1)
def test_cupy_13_given_a_bytes_id_is_a_failure_like_any_other(comm, gpus, monkeypatch, capsys):
    gpus(CUPY_13)
    monkeypatch.setattr("crossbow_mpi.comm.nccl.unique_id_for_cupy", lambda unique_id, version: unique_id)
    assert type(build_communicator(comm.mpi_comm, "auto", GPU)) is MpiCommunicator
    if comm.rank == 0:
        assert "starting NCCL failed on rank 0: TypeError: Argument 'commId'" in capsys.readouterr().err


@pytest.mark.mpi(min_size=1)
def test_without_cupy_auto_says_so_and_uses_mpi(comm, gpus, monkeypatch, capsys):
    gpus()
    monkeypatch.setitem(sys.modules, "cupy", None)
    monkeypatch.setitem(sys.modules, "cupy.cuda", None)
    with pytest.raises(ConfigError, match=r"^--comm nccl: CuPy with NCCL is not installed"):
        build_communicator(comm.mpi_comm, "nccl", GPU)
    assert type(build_communicator(comm.mpi_comm, "auto", GPU)) is MpiCommunicator
    assert ("CuPy with NCCL is not installed" in capsys.readouterr().err) == (comm.rank == 0)


@pytest.mark.mpi(min_size=2)
def test_ranks_sharing_a_gpu_are_told_so_and_nccl_refuses_them(comm, gpus, capsys):
    gpus(shared=True)
    with pytest.raises(ConfigError, match=f"^--comm nccl: ranks {', '.join(map(str, range(comm.size)))} share GPUs"):
        build_communicator(comm.mpi_comm, "nccl", GPU)
    for kind in ("mpi", "auto"):
        capsys.readouterr()
        assert type(build_communicator(comm.mpi_comm, kind, GPU)) is MpiCommunicator
        notes = capsys.readouterr().err.splitlines()
        if comm.rank == 0:
            assert notes[0].startswith(f"crossbow_mpi: note: up to {comm.size} ranks share a GPU")
            assert len(notes) == (1 if kind == "mpi" else 2)


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("shared", [False, True])
def test_the_tuners_gpu_memory_cap_is_the_gpus_memory_divided_among_its_ranks(comm, gpus, monkeypatch, shared):
    gpus(shared=shared)
    free, total = 6 * 2**30, 16 * 2**30
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (free, total))
    tuner = AutoTuner(Policy(0.1, 8), 5, comm, GPU, 0, comm.size, learner_bytes=lambda: 2**30)
    sharing = comm.size if shared else 1
    memory = tuner.read_memory()
    assert (memory.used, memory.cap) == ((total - free) / sharing, total / sharing)
    assert memory.room_for_one_more == (sharing * (memory.used + 2**30) <= total)


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("stages", [2, 4])
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_the_nccl_link_under_rendezvous_sends_runs_both_schedules_with_the_mpi_links_bits(
    comm, gpus, monkeypatch, stages, schedule
):
    """With 1 to 4 micro-batches of a batch of 5 (so the micro-batches' shapes differ and repeat), each stage's
    loss and gradients through the NCCL link, whose groups complete only when every message in them is matched,
    equal those through the MPI link; a deadlock fails the test after a minute instead of hanging it."""
    needs_stages(comm, stages)
    stage = comm.split(comm.rank // stages, comm.rank)
    gpus(p2p=stage.mpi_comm.Dup())
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: types.SimpleNamespace(cuda_stream=0))
    links = [build_link(stage, "auto", torch.device("cpu")), build_link(stage, "nccl", GPU)]
    assert [type(link) for link in links] == [StageLink, NcclLink]
    faulthandler.dump_traceback_later(60, exit=True)
    try:
        for micro_batches in (1, 2, 3, 4):
            mpi, nccl = (_stage_gradients(link, schedule, micro_batches) for link in links)
            assert all(torch.equal(a, b) for a, b in zip(mpi, nccl, strict=True))
    finally:
        faulthandler.cancel_dump_traceback_later()


def _stage_gradients(link: StageLink, schedule: str, micro_batches: int) -> list[torch.Tensor]:
    """Return this stage's loss (zero but on the last stage) and gradients of one batch through `link`."""
    torch.manual_seed(0)
    model = deep_mlp()
    cut = param_cut(model, link.stages)
    module = PipelineStage(split_model(model, link.stages, cut)[link.index], link)
    batch = torch.randn(5, 1, 6, 6), torch.randint(10, (5,))
    loss = PipelineEngine(F.cross_entropy, 1, link, cut, micro_batches, schedule, "fp32").forward_backward(
        module, batch
    )
    return [loss, *(parameter.grad for parameter in module.parameters())]


@pytest.mark.mpi(min_size=2)
def test_a_cpu_rank_beside_gpu_ranks_decides_with_them_and_nobody_waits(comm, gpus):
    gpus()
    device = GPU if comm.rank == 0 else torch.device("cpu")
    assert type(build_communicator(comm.mpi_comm, "auto", device)) is MpiCommunicator
    on_cpu = ", ".join(map(str, range(1, comm.size)))
    with pytest.raises(ConfigError, match=rf"^--comm nccl needs every rank on a GPU, but rank\(s\) {on_cpu} are on"):
        build_communicator(comm.mpi_comm, "nccl", device)
    assert type(build_link(comm, "auto", device)) is StageLink
    with pytest.raises(ConfigError, match=r"^--comm nccl needs every rank on a GPU"):
        build_link(comm, "nccl", device)


@pytest.mark.mpi(min_size=1)
def test_closing_the_nccl_communicator_destroys_it_once(comm, gpus, monkeypatch):
    nccl = gpus()
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device: None)
    communicator = build_communicator(comm.mpi_comm, "nccl", GPU)
    started = communicator.comm
    communicator.close()
    communicator.close()
    assert nccl.destroyed == [started] and communicator.comm is None


def test_cupy_kernels_take_torchs_stream_through_cupy_14s_stream_protocol_else_cupy_13s_external_stream():
    """CuPy 14 deprecates ExternalStream (warned 33 times in the GPU tests on an H200) for Stream.from_external."""
    from crossbow_mpi.replicas import kernels

    class Stream14:
        @staticmethod
        def from_external(stream):
            return "from_external", stream.__cuda_stream__()

    def deprecated(address):
        raise AssertionError("ExternalStream used where Stream.from_external exists")

    cupy14 = types.SimpleNamespace(cuda=types.SimpleNamespace(Stream=Stream14, ExternalStream=deprecated))
    cupy13 = types.SimpleNamespace(cuda=types.SimpleNamespace(Stream=object, ExternalStream=lambda a: ("external", a)))
    assert kernels._cupy_stream(cupy14, 1234) == ("from_external", (0, 1234))
    assert kernels._cupy_stream(cupy13, 1234) == ("external", 1234)
