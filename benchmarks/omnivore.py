"""Omnivore and `--algorithm auto` against S-SGD and eager-SGD: (a) the momentum and learning rate Omnivore's
optimizer tunes for each number of compute groups g, and (b) the time to the same test accuracy, tuning time
included, LeNet/MNIST on 4 ranks × 1 thread, with no imbalance, random stragglers and one slow rank.

(a) comes from the optimizer's probes of the `omnivore --groups auto` runs without imbalance: for each g, the probe
of the lowest score (median over the seeds). (b) gives medians, the speedup over S-SGD under the same imbalance
(S-SGD's time to accuracy / the algorithm's) and, for Omnivore and auto, the (g, momentum, lr) its optimizer chose
(medians) and, in `choice`, the algorithm chosen in each run.

Omnivore's `--batch-size` is the group's batch (the artifact's fixed group batch): its variants get S-SGD's
global batch, RANKS × the budget's, so that g = 1 is the S-SGD run and g changes the staleness only. The fixed-g
variants train with the default total momentum 0.9, whose explicit part is max(0, 0.9 − (1 − 1/g)).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from benchmarks import eager, harness
from crossbow_mpi.algorithms.omnivore import explicit_momentum

RANKS = eager.RANKS
ALGORITHMS = {
    "ssgd": {"algorithm": "ssgd"},
    "eager majority": {"algorithm": "eager", "eager_mode": "majority"},
    "omnivore g=2": {"algorithm": "omnivore", "groups": 2},
    f"omnivore g={RANKS}": {"algorithm": "omnivore", "groups": RANKS},
    "omnivore auto": {"algorithm": "omnivore", "groups": "auto"},
    "auto": {"algorithm": "auto"},
}


@dataclass
class Budget(eager.Budget):
    """eager's budget, with the optimizer's probe length."""

    probe_seconds: float


FULL = Budget(
    "lenet",
    "mnist",
    0.98,
    3200,
    epochs=1,
    batch_size=16,
    lr=0.02,
    imbalances={"none": "", "random": "random:30", "slow rank": f"slow-rank:{RANKS - 1}:2"},
    probe_seconds=2,
    timeout_s=600,
)
QUICK = Budget(
    "mlp",
    "synthetic-mnist",
    0.15,
    600,
    epochs=0.02,
    batch_size=16,
    lr=0.01,
    imbalances={"none": ""},
    probe_seconds=0.05,
    timeout_s=120,
)

COLUMNS = [
    "imbalance",
    "algorithm",
    "reached",
    "tta_s",
    "epochs",
    "samples_per_s",
    "speedup",
    "groups",
    "momentum",
    "lr",
    "choice",
]


def best_probes(runs: list[dict], variant: str) -> dict[int, list[dict]]:
    """Return, for each g, the best probe of each of a variant's runs."""
    best: dict[int, list[dict]] = {}
    for run in (run for run in runs if run["variant"] == variant):
        probes = [r for r in run.get("optimizer", []) if r["decision"] == "probe" and r["score"] is not None]
        for groups in sorted({p["groups"] for p in probes}):
            best.setdefault(groups, []).append(min((p for p in probes if p["groups"] == groups), key=score))
    return best


def score(probe: dict) -> float:
    return probe["score"]


def tuned(flags: dict) -> bool:
    """Tell whether the optimizer tunes a variant (`--groups auto` or `--algorithm auto`)."""
    return flags.get("groups") == "auto" or flags["algorithm"] == "auto"


def chosen(runs: list[dict], variant: str) -> dict:
    """Return the medians of the (g, momentum, lr) that a variant's optimizer chose, and the algorithm of each run."""
    choices = [
        r for run in runs if run["variant"] == variant for r in run.get("optimizer", []) if r["decision"] == "choice"
    ]
    return {
        **{key: harness.median([c[key] for c in choices]) for key in ("groups", "momentum", "lr")},
        "choice": ",".join(c["algorithm"] for c in choices),
    }


def fixed_setting(flags: dict, lr: float) -> dict:
    """Return the (g, explicit momentum, lr) of a variant that the optimizer does not tune."""
    groups = flags.get("groups", 1)
    return {"groups": groups, "momentum": explicit_momentum(0.9, groups), "lr": lr, "choice": flags["algorithm"]}


def measure(options: harness.Options) -> harness.Report:
    budget = QUICK if options.quick else FULL
    common = eager.common_flags(budget)
    algorithms = {
        name: {**common, **flags, **({"probe_seconds": budget.probe_seconds} if tuned(flags) else {})}
        for name, flags in ALGORITHMS.items()
    }
    for flags in algorithms.values():
        if flags["algorithm"] == "omnivore":
            flags["batch_size"] = RANKS * budget.batch_size  # the group's batch: S-SGD's global one
    variants, runs = eager.imbalanced_runs("omnivore", budget, algorithms, options.reps)
    first = next(iter(budget.imbalances))
    rows = [
        {
            **dict.fromkeys(COLUMNS),
            "imbalance": first,
            "algorithm": f"(a) omnivore g={groups}, best probe",
            "groups": groups,
            "momentum": harness.median([p["momentum"] for p in probes]),
            "lr": harness.median([p["lr"] for p in probes]),
        }
        for groups, probes in best_probes(runs, f"{first} / omnivore auto").items()
    ]
    for imbalance in budget.imbalances:
        reference = harness.train_row(runs, f"{imbalance} / ssgd")["tta_s"]
        for name, flags in ALGORITHMS.items():
            variant = f"{imbalance} / {name}"
            row = harness.train_row(runs, variant)
            setting = chosen(runs, variant) if tuned(flags) else fixed_setting(flags, budget.lr)
            rows.append(
                {
                    "imbalance": imbalance,
                    "algorithm": f"(b) {name}",
                    **row,
                    "speedup": harness.ratio(reference, row["tta_s"]),
                    **setting,
                }
            )
    return harness.Report(
        question=f"(a) Omnivore's tuned momentum and lr per number of groups g; (b) time to "
        f"{budget.target_accuracy:.0%} test accuracy, tuning included, {budget.model} on {budget.dataset}, {RANKS} "
        "ranks × 1 thread, under injected imbalance (medians; speedup = S-SGD's time / the algorithm's)",
        columns=COLUMNS,
        rows=rows,
        runs=runs,
        settings={"ranks": RANKS, "budget": asdict(budget), "variants": variants},
    )


if __name__ == "__main__":
    harness.main(measure)
