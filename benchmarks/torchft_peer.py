"""torchft's DiLoCo peer: benchmarks/ddp_peer.py's loop and records, the ranks' models kept together by torchft.

    MASTER_ADDR=127.0.0.1 MASTER_PORT=29500 mpirun -n 2 python -m benchmarks.torchft_peer --run-dir DIR \\
        --diloco-every H [--flags]

Needs the `torchft` package (torchft 0.2.0 runs on CPU over gloo; its wheel pulls no CUDA torch when installed
with torch pinned to this one). Each MPI rank is one torchft replica of one process: rank 0 starts the
lighthouse, every replica its own store and `Manager`, and torchft's `DiLoCo` (torchft/local_sgd.py; Douillard
et al., arXiv 2311.08105) wraps the inner SGD optimizer: every H steps the replicas average the pseudo-gradient
z − w over the manager's gloo group and z takes the outer step (SGD, Nesterov momentum; DiLoCo's lr 0.7, momentum
0.9), every replica restarting from z. The default gloo group of ddp_peer shards the data and evaluates.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import socket
from collections.abc import Iterator
from datetime import timedelta

import torch
import torch.distributed as dist

from benchmarks.ddp_peer import Syncs, main

TIMEOUT = timedelta(seconds=120)


def add_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--diloco-every", type=int, required=True, help="inner steps H between DiLoCo's syncs")
    parser.add_argument("--outer-lr", type=float, default=0.7, help="the outer Nesterov SGD's step size")
    parser.add_argument("--outer-momentum", type=float, default=0.9, help="the outer Nesterov SGD's momentum")


def own_address(peer: str) -> str:
    """Return this host's address on the route to `peer` (a UDP socket's connect sends nothing)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((peer, 9))
        return probe.getsockname()[0]


@contextlib.contextmanager
def diloco(args: argparse.Namespace, net: torch.nn.Module, inner: torch.optim.Optimizer) -> Iterator[None]:
    """Train inside torchft's DiLoCo: rank 0's lighthouse, this replica's store and manager (collective)."""
    from torch.distributed import TCPStore
    from torchft import Manager, ProcessGroupGloo
    from torchft._torchft import LighthouseServer
    from torchft.checkpointing.http_transport import HTTPTransport
    from torchft.local_sgd import DiLoCo

    class AddressedTransport(HTTPTransport):
        """torchft's checkpoint server, advertised at `address`: its own names the hostname, which a namespace
        node's peers cannot resolve (the recovery at the first quorum then fails, and the replicas wait)."""

        def address(self) -> str:
            return f"http://{address}:{self._server.socket.getsockname()[1]}/checkpoint/"

    rank, world, master = dist.get_rank(), dist.get_world_size(), os.environ["MASTER_ADDR"]
    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=world) if rank == 0 else None
    port = torch.tensor([int(lighthouse.address().rsplit(":", 1)[1]) if lighthouse else 0])
    dist.broadcast(port, src=0)
    address = own_address(master)  # the other replicas' process group meets at the quorum's store: not localhost
    store = TCPStore(address, 0, is_master=True, wait_for_workers=False)
    manager = Manager(
        pg=ProcessGroupGloo(timeout=TIMEOUT),
        load_state_dict=net.load_state_dict,
        state_dict=net.state_dict,
        min_replica_size=world,
        use_async_quorum=False,
        timeout=TIMEOUT,
        quorum_timeout=TIMEOUT,
        connect_timeout=TIMEOUT,
        rank=0,
        world_size=1,
        store_addr=address,
        store_port=store.port,
        lighthouse_addr=f"http://{master}:{int(port)}",
        replica_id=str(rank),
        hostname=address,
        checkpoint_transport=AddressedTransport(timeout=TIMEOUT, num_chunks=0),
    )
    outer = torch.optim.SGD(net.parameters(), lr=args.outer_lr, momentum=args.outer_momentum, nesterov=True)
    try:
        with DiLoCo(manager, [net], inner, outer, args.diloco_every, torch.device("cpu"), pin_memory=False):
            yield
    finally:
        dist.barrier()  # every replica is done with the lighthouse
        manager.shutdown(wait=False)
        if lighthouse is not None:
            lighthouse.shutdown()


def syncs(args: argparse.Namespace) -> Syncs:
    h = args.diloco_every
    return Syncs(f"torchft-diloco H={h}", h, lambda net, inner: diloco(args, net, inner))


if __name__ == "__main__":
    main(add_flags, syncs, prog="benchmarks.torchft_peer")
