#!/usr/bin/env bash
# Run every benchmark in full mode, writing benchmarks/results/NAME.json, then render benchmarks/RESULTS.md from
# them. Extra arguments go to every benchmark (e.g. --reps 5). On 2 cores this takes an estimated 8–10 hours: tta
# and stat_efficiency train LeNet to 99 % on MNIST (one to two minutes per run) about 350 and 8 times (tta: 7–9 h),
# eager trains to 97 % 36 times, eager_inherent about 21 short runs (7 min). The learners sweep (11 min) and the soak (20 min) run on their own (python -m benchmarks.learners,
# python -m benchmarks.soak).
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
source "${CROSSBOW_VENV:-$root/.venv}/bin/activate"
cd "$root"
for name in tta stat_efficiency eager eager_inherent throughput sync_cost overhead hw_limit hybrid; do
    echo "== $name"
    python -m "benchmarks.$name" "$@"
done
python -m benchmarks.results_md
