"""GPU path: NCCL through CuPy (and as each algorithm's transport), the CUDA-stream engine (--fused-step's bits, no
host wait in a warm step), bf16, the tuner's GPU memory cap, the pipeline's NCCL link.

Skipped without a CUDA device (and, for NCCL, without CuPy). Run under mpirun like the other MPI tests;
launch/gpu_selftest.sh runs them on one GPU, and the NCCL link's test where it sees a GPU per rank (NCCL cannot
put two ranks on one GPU).
"""

from __future__ import annotations

import hashlib
import warnings

import pytest
import torch
from torch import nn

from crossbow_mpi import Config, ConfigError, Trainer
from crossbow_mpi.comm import build_communicator
from crossbow_mpi.comm.gpus import gpu_owners, ranks_per_gpu
from crossbow_mpi.comm.nccl import NcclCommunicator, nccl_module
from crossbow_mpi.control.learner_tuner import AutoTuner, Policy
from crossbow_mpi.data import synthetic_dataset
from crossbow_mpi.data.prefetch import BatchPrefetcher, to_device
from crossbow_mpi.data.sampler import GlobalSampler, fetch_batch
from crossbow_mpi.parallel.pipeline import NcclLink, build_link

from reference import relative_error, sma_reference

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
needs_nccl = pytest.mark.skipif(nccl_module() is None, reason="no CuPy with NCCL")
STEPS, BATCH = 20, 4


def mlp_bn_float64() -> nn.Module:
    return nn.Sequential(nn.Flatten(), nn.Linear(36, 16), nn.BatchNorm1d(16), nn.Tanh(), nn.Linear(16, 10)).double()


def mlp() -> nn.Module:
    return nn.Sequential(nn.Flatten(), nn.Linear(36, 16), nn.Tanh(), nn.Linear(16, 10))


def convnet() -> nn.Module:
    return nn.Sequential(nn.Conv2d(1, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.Flatten(), nn.Linear(128, 10))


def one_epoch(run_dir, **values) -> Config:
    """The configuration of a one-epoch CUDA run without evaluation: 2 learners, batches of 8, seed 3."""
    defaults = dict(device="cuda", learners=2, batch_size=8, epochs=1, eval_every=0, target_accuracy=0, seed=3, lr=0.05)
    return Config(run_dir=str(run_dir), **{**defaults, **values})


def one_gpu_per_rank(comm) -> bool:
    return torch.cuda.device_count() >= comm.size


@needs_nccl
@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_nccl_allreduce_and_broadcast(comm, dtype):
    if not one_gpu_per_rank(comm):
        pytest.skip("fewer GPUs than ranks")
    device = torch.device("cuda", comm.rank % torch.cuda.device_count())
    nccl = NcclCommunicator(comm.mpi_comm, device)
    tensor = (torch.arange(4096, device=device) % 8 + comm.rank).to(dtype)
    expected = (torch.arange(4096, device=device) % 8 * comm.size + sum(range(comm.size))).to(dtype)
    nccl.allreduce_sum_(tensor)
    torch.cuda.synchronize()
    assert torch.equal(tensor, expected)
    mine = torch.full((100,), float(comm.rank), device=device, dtype=dtype)
    nccl.broadcast_(mine, root=comm.size - 1)
    torch.cuda.synchronize()
    assert torch.equal(mine, torch.full_like(mine, comm.size - 1))


@pytest.mark.mpi(min_size=2)
def test_two_ranks_on_one_gpu_with_nccl_is_a_clear_error(comm):
    if one_gpu_per_rank(comm) or nccl_module() is None:
        pytest.skip("needs more ranks than GPUs, and CuPy")
    device = torch.device("cuda", comm.rank % torch.cuda.device_count())
    with pytest.raises(ConfigError, match=r"^--comm nccl: ranks .* share GPUs"):
        build_communicator(comm.mpi_comm, "nccl", device)


@needs_nccl
@pytest.mark.mpi(min_size=1)
def test_nccl_inside_the_trainer_with_streams_matches_the_sequential_mpi_run(comm, shared_tmp):
    if not one_gpu_per_rank(comm):
        pytest.skip("fewer GPUs than ranks")
    train = synthetic_dataset((1, 6, 6), 10, 128 * comm.size, seed=0)
    results = {}
    for transport, engine in (("nccl", "streams"), ("mpi", "sequential")):
        cfg = one_epoch(shared_tmp / transport, comm=transport, engine=engine)
        trainer = Trainer(cfg)
        assert isinstance(trainer.topology.data, NcclCommunicator) == (transport == "nccl")
        results[transport] = trainer.fit(convnet, train, train)
    assert relative_error(results["nccl"].central, results["mpi"].central) < 1e-4


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("learners", [1, 3])
def test_sma_on_gpu_with_streams_matches_the_float64_reference(comm, shared_tmp, learners):
    train = synthetic_dataset((1, 6, 6), 10, STEPS * comm.size * learners * BATCH, seed=0)
    cfg = Config(
        run_dir=str(shared_tmp / "gpu"),
        device="cuda",
        engine="streams",
        learners=learners,
        batch_size=BATCH,
        epochs=1,
        eval_every=0,
        target_accuracy=0,
        seed=7,
        lr=0.05,
        weight_decay=0.001,
        lr_steps=(0.5,),
        lr_gamma=0.5,
    )
    result = Trainer(cfg, comm).fit(mlp_bn_float64, train, train)
    reference = sma_reference(mlp_bn_float64, cfg, train, comm.size, [learners] * STEPS)
    assert relative_error(result.central, reference) < 1e-6


@pytest.mark.mpi(min_size=1)
def test_stream_engine_agrees_with_sequential_on_gpu(comm, shared_tmp):
    train = synthetic_dataset((1, 6, 6), 10, 256 * comm.size, seed=0)
    results = {}
    for engine in ("sequential", "streams"):
        cfg = one_epoch(shared_tmp / engine, engine=engine, learners=4)
        results[engine] = Trainer(cfg, comm).fit(convnet, train, train)
    assert relative_error(results["streams"].central, results["sequential"].central) < 1e-4


@pytest.mark.mpi(min_size=1)
def test_bf16_on_gpu_runs_the_learners_convolutions_in_bfloat16(comm, shared_tmp):
    train = synthetic_dataset((1, 6, 6), 10, 512 * comm.size, seed=0)
    convolution_dtypes = {"fp32": set(), "bf16": set()}
    for precision, seen in convolution_dtypes.items():

        def recording_convnet(seen: set = seen) -> nn.Module:
            model = convnet()
            model[0].register_forward_hook(lambda module, inputs, output: seen.add(output.dtype))
            return model

        cfg = Config(
            run_dir=str(shared_tmp / precision),
            device="cuda",
            precision=precision,
            learners=2,
            batch_size=16,
            epochs=3,
            eval_every=0,
            target_accuracy=0,
            seed=4,
            lr=0.05,
        )
        result = Trainer(cfg, comm).fit(recording_convnet, train, train)
        assert torch.isfinite(result.central).all() and result.test_accuracy > 0.3
    assert convolution_dtypes["fp32"] == {torch.float32} and torch.bfloat16 in convolution_dtypes["bf16"]


@pytest.mark.mpi(min_size=1)
def test_tuner_reads_this_ranks_share_of_the_gpus_memory_and_what_it_allocates(comm):
    device = torch.device("cuda", comm.rank % torch.cuda.device_count())
    sharing = ranks_per_gpu(gpu_owners(comm, device), comm.rank)
    total = torch.cuda.get_device_properties(device).total_memory
    tuner = AutoTuner(Policy(0.1, 8), 5, comm, device, max_memory_gib=0, local_size=1, learner_bytes=lambda: 1e6)
    torch.cuda.empty_cache()
    comm.barrier()
    before = tuner.read_memory()
    comm.barrier()
    block = torch.empty(2**30, dtype=torch.uint8, device=device)
    torch.cuda.synchronize(device)
    comm.barrier()
    after = tuner.read_memory()
    assert abs(before.cap * sharing - total) <= 0.01 * total
    assert abs(after.used - before.used - block.numel()) < 64 * 2**20
    huge = AutoTuner(Policy(0.1, 8), 5, comm, device, 0, 1, learner_bytes=lambda: float(total))
    assert not huge.read_memory().room_for_one_more


@pytest.mark.mpi(min_size=1)
def test_prefetched_batches_equal_fetched_ones_and_a_stale_prefetch_is_fetched_again(comm):
    device = torch.device("cuda", comm.rank % torch.cuda.device_count())
    data = synthetic_dataset((1, 6, 6), 10, 64 * comm.size, seed=0)
    sampler = GlobalSampler(len(data), 5, comm.rank, comm.size)
    prefetcher = BatchPrefetcher(data, sampler, device, torch.float32)
    for ahead, wanted in (((0, 16, 2, 4), (0, 16, 2, 4)), ((0, 16, 2, 4), (0, 16, 1, 4))):
        prefetcher.prefetch(*ahead)
        batches = prefetcher.batches(*wanted)
        for batch, row in zip(batches, sampler.indices(*wanted), strict=True):
            expected = to_device(fetch_batch(data, row), device, torch.float32)
            assert all(torch.equal(a, b) for a, b in zip(batch, expected, strict=True))


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("algorithm", ["ssgd", "eager"])
def test_ssgd_and_eager_on_streams_agree_with_sequential_on_gpu(comm, shared_tmp, algorithm):
    train = synthetic_dataset((1, 6, 6), 10, 128 * comm.size, seed=0)
    results = {}
    for engine in ("sequential", "streams"):
        cfg = one_epoch(
            shared_tmp / f"{algorithm}-{engine}", engine=engine, comm="mpi", algorithm=algorithm, eager_sync_every=1
        )
        results[engine] = Trainer(cfg, comm).fit(convnet, train, train)
    assert relative_error(results["streams"].central, results["sequential"].central) < 1e-4


@pytest.mark.mpi(min_size=1)
def test_mixed_devices_with_unequal_batches_train_like_single_process_sgd(comm, shared_tmp):
    from torch.nn.utils import parameters_to_vector

    from helpers import mlp
    from reference import sgd_reference

    sizes, steps = (8, 2, 2, 2)[: comm.size], 10
    train = synthetic_dataset((1, 6, 6), 10, steps * sum(sizes), seed=0)
    test = synthetic_dataset((1, 6, 6), 10, 30, seed=1)
    values = dict(epochs=1, eval_every=0, target_accuracy=0, seed=7, lr=0.05, momentum=0.9, weight_decay=0.001)
    cfg = Config(
        run_dir=str(shared_tmp / "run"), device="mixed", algorithm="ssgd", learners=1, batch_size=sizes, **values
    )
    trainer = Trainer(cfg, comm)
    on_gpu = trainer.topology.local_rank < torch.cuda.device_count()
    assert trainer.device.type == ("cuda" if on_gpu else "cpu")
    result = trainer.fit(mlp, train, test)
    model = sgd_reference(mlp, cfg, train, sum(sizes), steps)
    assert relative_error(result.central, parameters_to_vector(model.parameters())) < 1e-4


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("adaptive", [False, True])
def test_mixed_devices_hogbatch_takes_every_sample_once(comm, shared_tmp, adaptive):
    """A GPU rank beside CPU ranks (`--device mixed`): Hogbatch, and Adaptive Hogbatch, run to the end of the epoch
    with every rank making updates and no sample taken twice."""
    from helpers import metrics_records, rounds_run

    extra = {"adaptive_batch": True, "adapt_every": 1, "batch_min": 2} if adaptive else {}
    result, taken, records, num_samples, largest = rounds_run(comm, shared_tmp, device="mixed", **extra)
    assert torch.isfinite(result.central).all()
    assert len(taken) == len(set(taken)) and len(taken) > num_samples - comm.size * 4 * largest
    assert all(sum(r["async_updates"][rank] for r in records) > 0 for rank in range(comm.size))
    if adaptive:
        changes = [r for r in metrics_records(comm, shared_tmp / "run") if r.get("event") == "hyperparams"]
        assert all(len(c["measured"]["shares"]) == comm.size for c in changes)


@pytest.mark.mpi(min_size=1)
def test_the_cupy_fused_sma_step_gives_the_bits_of_the_in_place_step(comm):
    pytest.importorskip("cupy")
    from crossbow_mpi.replicas.kernels import cupy_sma_update

    device = torch.device("cuda", comm.rank % torch.cuda.device_count())
    torch.manual_seed(0)
    k, n, lr, weight_decay, momentum, alpha = 3, 10_000, 0.05, 5e-4, 0.9, 0.1
    weights = torch.randn(k, n + 7, device=device)  # rows of [params | buffers], as the learners hold them
    staging = torch.ones(k, n + 8, device=device)  # the learners' staging rows: [gradient | buffers, weight]
    staging[:, :n].normal_()
    v0, z = torch.randn(k, n, device=device) * 0.01, torch.randn(n, device=device)
    w, v, g = weights[:, :n].clone(), v0.clone(), staging[:, :n].clone()
    g.add_(w, alpha=weight_decay)
    v.mul_(momentum).sub_(g, alpha=lr)
    torch.sub(w, z, out=g).mul_(alpha)  # the correction, staged over the gradient
    w.add_(v).sub_(g)
    fv, buffers = v0.clone(), weights[:, n:].clone()
    learner_stream = torch.cuda.Stream(device)
    learner_stream.wait_stream(torch.cuda.current_stream(device))  # the inputs were written on the default stream
    with torch.cuda.stream(learner_stream):  # the learner's stream, as the stream engine runs it
        cupy_sma_update(weights[:, :n], fv, staging[:, :n], z, lr, weight_decay, momentum, alpha)
        torch.cuda.current_stream(device).synchronize()
    assert torch.equal(fv, v) and torch.equal(weights[:, :n], w) and torch.equal(staging[:, :n], g)
    assert (staging[:, n:] == 1).all() and torch.equal(weights[:, n:], buffers), "buffers and weights untouched"


@pytest.mark.mpi(min_size=1)
def test_the_cupy_fused_sma_central_step_gives_the_bits_of_the_in_place_step(comm):
    pytest.importorskip("cupy")
    from crossbow_mpi.replicas.kernels import cupy_sma_central_update

    device = torch.device("cuda", comm.rank % torch.cuda.device_count())
    torch.manual_seed(0)
    n, central_momentum = 10_000, 0.9
    d0, z0, u0 = torch.randn(n, device=device), torch.randn(n, device=device), torch.randn(n, device=device) * 0.01
    d, z, u = d0.clone(), z0.clone(), u0.clone()
    d.add_(u, alpha=central_momentum)
    u.copy_(d)
    z.add_(d)
    fz, fu = z0.clone(), u0.clone()
    cupy_sma_central_update(d0, fz, fu, central_momentum)
    torch.cuda.current_stream(device).synchronize()
    assert torch.equal(fz, z) and torch.equal(fu, u)


@pytest.mark.mpi(min_size=1)
def test_the_cupy_fused_ssgd_step_gives_the_bits_of_the_in_place_step(comm):
    pytest.importorskip("cupy")
    from crossbow_mpi.replicas.kernels import cupy_ssgd_update

    device = torch.device("cuda", comm.rank % torch.cuda.device_count())
    torch.manual_seed(0)
    n, lr, weight_decay, momentum = 10_000, 0.05, 5e-4, 0.9
    g0, z0, u0 = torch.randn(n, device=device), torch.randn(n, device=device), torch.randn(n, device=device) * 0.01
    carried = torch.tensor([3.0], device=device)
    g, z, u = g0.clone(), z0.clone(), u0.clone()
    g.div_(carried)
    g.add_(z, alpha=weight_decay)
    u.mul_(momentum).add_(g)
    z.sub_(u, alpha=lr)
    fz, fu = z0.clone(), u0.clone()
    cupy_ssgd_update(g0, carried, fz, fu, lr, weight_decay, momentum)
    torch.cuda.current_stream(device).synchronize()
    assert torch.equal(fz, z) and torch.equal(fu, u)


@needs_nccl
@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_nccl_stage_link_trains_a_pipeline_as_the_mpi_link_does(comm, shared_tmp, schedule):
    """Two stages per pipeline, 3 micro-batches of 8 (two shapes), S-SGD over the MPI data scope: the activations
    and gradients by NCCL send/recv train the model that MPI's do (to 1e-6: cuDNN's convolutions need not give
    the same bits twice)."""
    if not one_gpu_per_rank(comm) or comm.size % 2:
        pytest.skip("the NCCL link needs a GPU per rank (NCCL cannot put two ranks on one GPU) and an even -n")
    device = torch.device("cuda", comm.rank % torch.cuda.device_count())
    assert isinstance(build_link(comm.split(comm.rank // 2, comm.rank), "nccl", device), NcclLink)
    train = synthetic_dataset((1, 6, 6), 10, 64 * comm.size, seed=0)
    results = {}
    for transport in ("nccl", "mpi"):
        cfg = one_epoch(
            shared_tmp / transport,
            comm=transport,
            algorithm="ssgd",
            pipeline_stages=2,
            micro_batches=3,
            schedule=schedule,
        )
        results[transport] = Trainer(cfg, comm).fit(convnet, train, train)
    assert relative_error(results["nccl"].central, results["mpi"].central) < 1e-6


@needs_nccl
@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("algorithm", ["ssgd", "eager", "hogbatch"])
def test_nccl_as_the_trainers_data_transport_matches_mpi(comm, shared_tmp, algorithm):
    """`comm="nccl"` puts NCCL under each algorithm's transport (the allreduce, eager-SGD's broadcast, Hogbatch's
    model server's broadcast); Hogbatch is compared on one rank only (asynchronous on more)."""
    if not one_gpu_per_rank(comm) or (algorithm == "hogbatch" and comm.size > 1):
        pytest.skip("fewer GPUs than ranks, or Hogbatch on more than one rank")
    train = synthetic_dataset((1, 6, 6), 10, 128 * comm.size, seed=0)
    results = {}
    for transport in ("nccl", "mpi"):
        cfg = one_epoch(shared_tmp / transport, comm=transport, algorithm=algorithm, eager_sync_every=1)
        trainer = Trainer(cfg)
        assert isinstance(trainer.topology.data, NcclCommunicator) == (transport == "nccl")
        results[transport] = trainer.fit(mlp, train, train)
    assert relative_error(results["nccl"].central, results["mpi"].central) < 1e-5


def sha256(tensor: torch.Tensor) -> str:
    return hashlib.sha256(tensor.cpu().numpy().tobytes()).hexdigest()


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("algorithm", ["sma", "ssgd"])
def test_fused_step_on_streams_ends_with_the_bits_of_the_unfused_run(comm, shared_tmp, algorithm):
    pytest.importorskip("cupy")
    train = synthetic_dataset((1, 6, 6), 10, 256 * comm.size, seed=0)
    digests = {}
    for fused in (False, True):
        cfg = one_epoch(shared_tmp / str(fused), engine="streams", algorithm=algorithm, fused_step=fused)
        digests[fused] = sha256(Trainer(cfg, comm).fit(mlp, train, train).central)
    assert digests[True] == digests[False]


SYNC_DEBUG_NOTICE = "Synchronization debug mode is a prototype feature"
"""The start of the notice torch warns once per process when the sync debug mode is first turned on: not a sync."""


class SyncDebugWindow:
    """A controller that turns torch's sync debug mode on after warm-up step `start` and off after step `end`,
    and keeps the warnings `caught` in between (any of them but torch's notice that the mode is a prototype: a sync
    is reported as a warning)."""

    def __init__(self, caught: list, start: int, end: int):
        self.caught, self.start, self.end, self.first, self.seen = caught, start, end, 0, None

    def __call__(self, run, step) -> None:
        if run.state.iteration == self.start:
            self.first = len(self.caught)
            torch.cuda.set_sync_debug_mode("warn")
        elif run.state.iteration == self.end:
            torch.cuda.set_sync_debug_mode(0)
            messages = [str(w.message).splitlines()[0] for w in self.caught[self.first :]]
            self.seen = [message for message in messages if not message.startswith(SYNC_DEBUG_NOTICE)]


@needs_nccl
@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("algorithm", ["sma", "ssgd"])
def test_a_warm_step_with_nccl_on_streams_never_makes_the_host_wait(comm, shared_tmp, algorithm):
    """20 warm steps of the training loop (after 5) under `torch.cuda.set_sync_debug_mode("warn")`: no warning."""
    if not one_gpu_per_rank(comm):
        pytest.skip("fewer GPUs than ranks")
    train = synthetic_dataset((1, 6, 6), 10, 512 * comm.size, seed=0)
    cfg = one_epoch(shared_tmp / algorithm, comm="nccl", engine="streams", algorithm=algorithm)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        window = SyncDebugWindow(caught, start=5, end=25)
        try:
            Trainer(cfg).fit(mlp, train, train, controllers=[window])
        finally:
            torch.cuda.set_sync_debug_mode(0)
    assert window.seen == []
