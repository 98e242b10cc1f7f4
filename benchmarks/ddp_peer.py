"""PyTorch DistributedDataParallel peer: S-SGD with momentum over gloo, one process per MPI rank.

    MASTER_ADDR=127.0.0.1 MASTER_PORT=29500 mpirun -n 2 python -m benchmarks.ddp_peer --run-dir DIR [--flags]

A plain training loop that takes the flags and writes the metrics.jsonl records of `crossbow_mpi.train`, so the
two compare run for run: each epoch is a seeded shuffle cut into disjoint per-rank shards, the model is evaluated
on the whole test set (each rank a part) every --eval-every training samples of all ranks, and the clock starts
at the first step and keeps running through evaluations.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager
from torch.distributed.optim import PostLocalSGDOptimizer
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DistributedSampler

from crossbow_mpi.config import ConfigError
from crossbow_mpi.data import build_dataset
from crossbow_mpi.models import LANGUAGE_MODELS, build_model, token_cross_entropy
from crossbow_mpi.replicas.kernels import require_compiler
from crossbow_mpi.training.hooks import hits

EVAL_BATCH = 1000


@dataclass
class Syncs:
    """Another peer's way of keeping the ranks' models together than DDP's or local SGD's (torchft_peer)."""

    name: str
    every: int
    """Steps between syncs of every parameter (for `comm_bytes`)."""
    open: Callable[[torch.nn.Module, torch.optim.Optimizer], contextlib.AbstractContextManager]
    """What the training loop runs inside, given the model and its (inner) optimizer."""


def parse_args(
    extra: Callable[[argparse.ArgumentParser], None] | None = None, prog: str = "benchmarks.ddp_peer"
) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog=f"python -m {prog}", description=__doc__.splitlines()[0])
    if extra is not None:
        extra(parser)
    parser.add_argument("--run-dir", required=True, help="directory for metrics.jsonl")
    parser.add_argument("--model", default="lenet")
    parser.add_argument("--dataset", default="mnist")
    parser.add_argument("--data-dir", default="datasets/mnist")
    parser.add_argument("--model-args", default="", help="the model's size, as crossbow_mpi.train --model-args")
    parser.add_argument("--seq-len", type=int, default=64, help="--dataset text: bytes per window")
    parser.add_argument("--batch-size", type=int, default=64, help="samples per rank per step")
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument("--momentum", type=float, default=0.9)
    parser.add_argument("--optimizer", choices=("sgd", "adamw"), default="sgd", help="as crossbow_mpi.train's")
    parser.add_argument("--beta1", type=float, default=0.9)
    parser.add_argument("--beta2", type=float, default=0.999)
    parser.add_argument("--eps", type=float, default=1e-8)
    parser.add_argument("--weight-decay", type=float, default=0.0005)
    parser.add_argument("--epochs", type=float, default=10.0, help="upper bound on training epochs")
    parser.add_argument("--target-accuracy", type=float, default=0.99, help="stop once reached (0: never)")
    parser.add_argument("--target-loss", type=float, default=None, help="stop once the test loss is at most this")
    parser.add_argument(
        "--eval-every", type=int, default=15000, help="training samples (all ranks) between evaluations"
    )
    parser.add_argument("--time-limit", type=float, default=0, help="stop after this many seconds (0: no limit)")
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads per rank")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument(
        "--local-sgd-every",
        type=int,
        default=0,
        help="local SGD instead of DDP: PyTorch's PostLocalSGDOptimizer with a PeriodicModelAverager averaging the "
        "parameters every this many steps (0: DDP)",
    )
    parser.add_argument(
        "--compile",
        nargs="?",
        const=True,
        default=False,
        type=lambda value: value.lower() in ("true", "1", "yes"),
        metavar="true|false",
        help="torch.compile the forward and backward pass, as crossbow_mpi.train --compile (summary: compile_s)",
    )
    parser.add_argument(
        "--memory-format",
        choices=("contiguous", "channels_last"),
        default="contiguous",
        help="the model's 4-D weights and the batches channels-last, as crossbow_mpi.train --memory-format",
    )
    args = parser.parse_args()
    if args.compile:
        try:
            require_compiler("--compile")
        except ConfigError as err:
            parser.error(str(err))
    return args


def init_process_group() -> tuple[int, int]:
    """Join the gloo group: rank and size from Open MPI's environment, the rendezvous from MASTER_ADDR/PORT."""
    os.environ["RANK"] = os.environ["OMPI_COMM_WORLD_RANK"]
    os.environ["WORLD_SIZE"] = os.environ["OMPI_COMM_WORLD_SIZE"]
    dist.init_process_group("gloo", init_method="env://")
    return dist.get_rank(), dist.get_world_size()


@torch.no_grad()
def evaluate(model: torch.nn.Module, test_set, loss_fn, rank: int, world: int) -> tuple[float, float]:
    """Return (accuracy, mean loss) on the whole test set, each rank evaluating a contiguous part: accuracy per
    sample, or per token for a language model, as crossbow_mpi evaluates."""
    model.eval()
    n = len(test_set)
    start, stop = n * rank // world, n * (rank + 1) // world
    totals = torch.zeros(3, dtype=torch.float64)
    for first in range(start, stop, EVAL_BATCH):
        inputs, targets = test_set.get_batch(torch.arange(first, min(first + EVAL_BATCH, stop)))
        outputs = model(inputs)
        right = hits(outputs, targets)
        totals += torch.tensor([float(right.sum()), right.numel(), float(loss_fn(outputs, targets)) * len(targets)])
    dist.all_reduce(totals)
    model.train()
    return totals[0].item() / totals[1].item(), totals[2].item() / n


def past(started: float, limit: float) -> bool:
    """Tell, alike on every rank, whether any rank's clock has passed `limit` seconds."""
    flag = torch.tensor([float(time.perf_counter() - started > limit)])
    dist.all_reduce(flag)
    return flag.item() > 0


def shards(sampler: DistributedSampler, batch_size: int, epochs: float, epoch_samples: int):
    """Yield (epoch progress after the step, this rank's batch indices) up to the epoch limit."""
    step_samples = sampler.num_replicas * batch_size
    epoch = 0
    while True:
        sampler.set_epoch(epoch)
        shard = torch.tensor(list(sampler))
        for step in range(len(shard) // batch_size):
            if epoch + step * step_samples / epoch_samples >= epochs:
                return
            yield epoch + (step + 1) * step_samples / epoch_samples, shard[step * batch_size : (step + 1) * batch_size]
        epoch += 1


@dataclass
class Progress:
    """The run's counters since its first step, and the training window since the last evaluation."""

    started: float
    samples: int = 0
    iterations: int = 0
    epoch: float = 0.0
    losses: list[float] = field(default_factory=list)
    window_samples: int = 0
    window_time: float = 0.0

    def step(self, samples: int, loss: float, seconds: float) -> None:
        self.samples += samples
        self.iterations += 1
        self.losses.append(loss)
        self.window_samples += samples
        self.window_time += seconds

    def new_window(self) -> None:
        self.losses, self.window_samples, self.window_time = [], 0, 0.0


def main(
    extra: Callable[[argparse.ArgumentParser], None] | None = None,
    syncs: Callable[[argparse.Namespace], Syncs] | None = None,
    prog: str = "benchmarks.ddp_peer",
) -> None:
    """Train with DDP or local SGD, or with `syncs(args)` (made once the gloo group is up), the flags given `extra`."""
    args = parse_args(extra, prog)
    torch.set_num_threads(args.threads)
    rank, _ = init_process_group()
    peer = syncs(args) if syncs is not None else None
    train_set, test_set = build_dataset(args.dataset, args.data_dir, args.seed, args.seq_len)
    torch.manual_seed(args.seed)
    net = build_model(args.model, train_set.input_shape, train_set.num_classes, args.model_args)
    metrics = Path(args.run_dir) / "metrics.jsonl"
    if rank == 0:
        metrics.parent.mkdir(parents=True, exist_ok=True)
        metrics.unlink(missing_ok=True)

    def write(record: dict) -> None:
        if rank == 0:
            with metrics.open("a") as fh:
                fh.write(json.dumps(record) + "\n")

    write(train(args, net, train_set, test_set, write, peer))
    dist.destroy_process_group()


def train(
    args: argparse.Namespace, net: torch.nn.Module, train_set, test_set, write, peer: Syncs | None = None
) -> dict:
    """Train DDP S-SGD (local SGD, `peer`) to the target or a limit, writing each evaluation's record; return the
    summary record."""
    rank, world = dist.get_rank(), dist.get_world_size()
    channels_last = args.memory_format == "channels_last"
    if channels_last:
        net = net.to(memory_format=torch.channels_last)  # type: ignore[call-overload]  # torch's hints omit it
    averaged = args.local_sgd_every or peer is not None
    model = DistributedDataParallel(net) if not averaged else broadcast(net)  # rank 0's initial weights
    forward = torch.compile(model) if args.compile else model
    compile_s = None
    optimizer = make_optimizer(args, model)
    syncing = contextlib.ExitStack()
    if peer is not None:
        syncing.enter_context(peer.open(net, optimizer))
    sampler = DistributedSampler(train_set, num_replicas=world, rank=rank, shuffle=True, seed=args.seed, drop_last=True)
    next_eval, record, time_to_target, time_limited = args.eval_every, None, None, False
    loss_fn = token_cross_entropy if args.model in LANGUAGE_MODELS else F.cross_entropy

    def evaluate_and_write() -> dict:
        result = evaluation_record(net, test_set, loss_fn, progress, args.lr)
        write(result)
        return result

    progress = Progress(time.perf_counter())
    for progress.epoch, indices in shards(sampler, args.batch_size, args.epochs, len(train_set)):
        step_started = time.perf_counter()
        inputs, targets = train_set.get_batch(indices)
        if channels_last and inputs.dim() == 4:
            inputs = inputs.contiguous(memory_format=torch.channels_last)
        optimizer.zero_grad()
        loss = loss_fn(forward(inputs), targets)
        loss.backward()
        optimizer.step()
        if args.compile and compile_s is None:
            compile_s = time.perf_counter() - step_started  # the first step compiles
        progress.step(world * args.batch_size, loss.item(), time.perf_counter() - step_started)
        if progress.samples >= next_eval:
            next_eval += args.eval_every
            record = evaluate_and_write()
            progress.new_window()
            by_loss = args.target_loss is not None and record["test_loss"] <= args.target_loss
            if record["test_accuracy"] >= args.target_accuracy > 0 or by_loss:
                time_to_target = record["time_s"]
                break
            if not math.isfinite(record["train_loss"]):
                break  # diverged: it will not reach the target
            if args.time_limit and past(progress.started, args.time_limit):
                time_limited = True
                break
    syncing.close()
    if record is None or record["iteration"] != progress.iterations:
        record = evaluate_and_write()
    return summary(args, net, record, progress, time_to_target, time_limited, compile_s, peer)


def make_optimizer(args: argparse.Namespace, model: torch.nn.Module) -> torch.optim.Optimizer:
    """The inner optimizer of `--optimizer`, wrapped for local SGD with `--local-sgd-every`."""
    if args.optimizer == "adamw":
        betas = (args.beta1, args.beta2)
        optimizer: torch.optim.Optimizer = torch.optim.AdamW(
            model.parameters(), lr=args.lr, betas=betas, eps=args.eps, weight_decay=args.weight_decay
        )
    else:
        optimizer = torch.optim.SGD(
            model.parameters(), lr=args.lr, momentum=args.momentum, weight_decay=args.weight_decay
        )
    if args.local_sgd_every:
        optimizer = PostLocalSGDOptimizer(optimizer, PeriodicModelAverager(period=args.local_sgd_every))
    return optimizer


def summary(
    args: argparse.Namespace,
    net: torch.nn.Module,
    record: dict,
    progress: Progress,
    time_to_target: float | None,
    time_limited: bool,
    compile_s: float | None,
    peer: Syncs | None,
) -> dict:
    """The run's summary record, with the fields of crossbow_mpi's."""
    world = dist.get_world_size()
    every = peer.every if peer is not None else args.local_sgd_every
    name = peer.name if peer is not None else f"local-sgd H={every}" if every else "ddp"
    return {
        "event": "summary",
        "reached": time_to_target is not None,
        "time_to_target_s": time_to_target,
        "time_limited": time_limited,
        "target_accuracy": args.target_accuracy,
        "target_loss": args.target_loss,
        "final_test_accuracy": record["test_accuracy"],
        "final_test_loss": record["test_loss"],
        "time_s": time.perf_counter() - progress.started,
        "iterations": progress.iterations,
        "epochs": progress.epoch,
        "samples": progress.samples,
        "learners": 1,
        "world_size": world,
        "algorithm": name,
        "comm_bytes": comm_bytes(net, world, progress.iterations, every),
        "threads_per_rank": torch.get_num_threads(),
        "device": "cpu",
        **({"compile_s": compile_s} if args.compile else {}),
    }


def broadcast(net: torch.nn.Module) -> torch.nn.Module:
    """Give every rank rank 0's parameters and buffers (what DDP's constructor does)."""
    for tensor in [*net.parameters(), *net.buffers()]:
        dist.broadcast(tensor.data, src=0)
    return net


def comm_bytes(net: torch.nn.Module, world: int, steps: int, every: int) -> int:
    """Bytes each rank sent, by the ring allreduce's model (2 (P − 1) / P of the payload): DDP reduces every
    gradient every step; the averager every parameter every `every` steps."""
    payload = sum(p.numel() * p.element_size() for p in net.parameters())
    syncs = steps // every if every else steps
    return syncs * 2 * (world - 1) * payload // world


def evaluation_record(net: torch.nn.Module, test_set, loss_fn, progress: Progress, lr: float) -> dict:
    """Evaluate on the whole test set; return the record of the evaluation and of the window before it."""
    accuracy, test_loss = evaluate(net, test_set, loss_fn, dist.get_rank(), dist.get_world_size())
    train_loss = torch.tensor([sum(progress.losses), len(progress.losses)], dtype=torch.float64)
    dist.all_reduce(train_loss)
    return {
        "time_s": time.perf_counter() - progress.started,
        "epoch": progress.epoch,
        "iteration": progress.iterations,
        "samples": progress.samples,
        "test_accuracy": accuracy,
        "test_loss": test_loss,
        "train_loss": (train_loss[0] / train_loss[1].clamp(min=1)).item(),
        "samples_per_s": progress.window_samples / max(progress.window_time, 1e-9),
        "lr": lr,
    }


if __name__ == "__main__":
    main()
