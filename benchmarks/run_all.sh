#!/usr/bin/env bash
# Run every benchmark in full mode, writing benchmarks/results/NAME.json, then render benchmarks/RESULTS.md from
# them. Extra arguments go to every benchmark (e.g. --reps 5). On 2 cores this takes well over an hour: tta and
# stat_efficiency train LeNet to 99 % on MNIST (minutes per run) 21 and 8 times.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
source "${CROSSBOW_VENV:-$root/.venv}/bin/activate"
cd "$root"
for name in tta stat_efficiency throughput sync_cost overhead hw_limit; do
    echo "== $name"
    python -m "benchmarks.$name" "$@"
done
python -m benchmarks.report
