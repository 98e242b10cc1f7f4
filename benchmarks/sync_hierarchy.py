"""Time the sync's sum, flat against by node, for model-sized float32 vectors (run under mpirun on several nodes;
see docs/clusters.md). Rank 0 prints one line per size: milliseconds per sum, median of --repeats."""

import argparse
import time

import torch

from crossbow_mpi.comm import MpiCommunicator
from crossbow_mpi.comm.hierarchical import HierarchicalCommunicator
from crossbow_mpi.runtime import process


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--sizes", default="61706,470218,4000000", help="vector lengths (LeNet, ResNet-32, 4M)")
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    world = process.mpi().COMM_WORLD
    scopes = {"flat": MpiCommunicator(world), "node": HierarchicalCommunicator(world)}
    if world.rank == 0:
        print(f"ranks {world.size}, nodes {scopes['node'].nodes}")
    for numel in map(int, args.sizes.split(",")):
        times = {}
        for name, scope in scopes.items():
            vector, samples = torch.ones(numel), []
            for _ in range(args.repeats + 2):
                world.Barrier()
                started = time.perf_counter()
                scope.allreduce_sum_(vector)
                samples.append(time.perf_counter() - started)
            times[name] = sorted(samples[2:])[args.repeats // 2] * 1e3
        if world.rank == 0:
            print(
                f"{numel} floats ({numel * 4 / 1e6:.1f} MB): flat {times['flat']:.2f} ms, node {times['node']:.2f} ms"
            )


if __name__ == "__main__":
    main()
