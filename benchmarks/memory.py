"""Memory per learner: one added learner's bytes against its minimum, and one learner against a bare PyTorch loop.

On 1 rank, crossbow_mpi trains each model with k = 1 and k = 2 learners on the threads engine (their passes run at
once, so each learner's activations are alive together) and reads the summary's `memory_bytes` (the bytes of the
rank's tensors by part, activations counted by saved-tensor hooks). An added learner's bytes are the difference
of the totals; its minimum is what it must hold: its gradient, its float buffers, its activations and, where the
algorithm gives it weights and momentum of its own (SMA), those. The bare loop (SGD with momentum, same model
and batch) counts the same way: parameters and buffers, gradients, momentum, the activations its forward pass
saves and the batch. Goals (issue 38): an added learner within 1.2× of its minimum, one learner within 1.3× of
the bare loop. Tensor bytes, not the allocator's: a CPU process's resident set is not measured here.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from benchmarks import harness

MODELS = {"lenet": "mnist", "resnet32": "synthetic-cifar"}
ALGORITHMS = ("ssgd", "sma")
SHARES_Z = {"ssgd": True, "sma": False}
"""Whether the algorithm's learners compute on z (no weights or momentum of their own)."""
GOAL_ADDED, GOAL_ONE = 1.2, 1.3
TEST_SAMPLES = 100
"""The test set's first samples: the one evaluation at the end measures nothing here."""
COLUMNS = ["model", "algorithm", "b", "bare_bytes", "one_learner_bytes", "vs_bare", "added_learner_bytes"]
COLUMNS += ["minimum_added_bytes", "vs_minimum"]


@dataclass
class Budget:
    models: tuple[str, ...]
    batch: int
    steps: int
    """Global steps of each training run (memory does not depend on how long it trains)."""
    timeout_s: float


FULL = Budget(models=tuple(MODELS), batch=64, steps=4, timeout_s=900)
QUICK = Budget(models=("lenet",), batch=16, steps=1, timeout_s=140)


def bare_bytes(model_fn, train_set, batch: int) -> dict:
    """Train one bare SGD step and count its tensors' bytes by part."""
    import torch
    import torch.nn.functional as F

    from crossbow_mpi.replicas.footprint import ActivationMeter

    model = model_fn()
    inputs, targets = train_set.get_batch(torch.arange(batch))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    meter = ActivationMeter()
    with meter.watch(model, inputs):
        loss = F.cross_entropy(model(inputs), targets)
    loss.backward()
    optimizer.step()
    params = [p for p in model.parameters() if p.requires_grad]
    parts = {
        "weights": sum(_nbytes(t) for t in (*model.parameters(), *model.buffers())),
        "grads": sum(_nbytes(p.grad) for p in params if p.grad is not None),
        "momenta": sum(_nbytes(optimizer.state[p]["momentum_buffer"]) for p in params),
        "activations": meter.bytes or 0,
        "batch": _nbytes(inputs) + _nbytes(targets),
    }
    return {**parts, "total": sum(parts.values())}


def worker(settings: dict) -> dict:
    """Return every model's bare loop bytes and crossbow_mpi's summary bytes for each algorithm and k."""
    from crossbow_mpi import Config
    from crossbow_mpi.data import ArrayDataset, build_dataset
    from crossbow_mpi.models import build_model
    from crossbow_mpi.replicas.flat import FlatLayout

    runs = []
    for model in settings["models"]:
        train_set, test = build_dataset(MODELS[model], str(harness.REPO / "datasets" / "mnist"), seed=1)
        test_set = ArrayDataset(
            test.inputs[:TEST_SAMPLES], test.targets[:TEST_SAMPLES], test.num_classes, test.mean, test.std
        )

        def model_fn(model=model, train_set=train_set):
            return build_model(model, train_set.input_shape, train_set.num_classes)

        layout = FlatLayout(model_fn())
        b = settings["batch"]
        runs.append({"variant": f"{model} bare", "rep": 0, **bare_bytes(model_fn, train_set, b)})
        for algorithm in ALGORITHMS:
            for k in (1, 2):
                config = Config(
                    algorithm=algorithm,
                    learners=k,
                    engine="threads",
                    threads=k,
                    batch_size=b,
                    lr=0.01,
                    epochs=settings["steps"] * k * b / len(train_set),
                    target_accuracy=0,
                    eval_every=0,
                    seed=1,
                )
                parts = harness.crossbow_summary(config, model_fn, train_set, test_set)["memory_bytes"][0]
                runs.append({"variant": f"{model} {algorithm} k={k}", "rep": 0, **parts})
        runs.append(
            {"variant": f"{model} layout", "rep": 0, "num_params": layout.num_params, "num_state": layout.num_state}
        )
    return {"runs": runs}


def row(runs: dict, model: str, algorithm: str, batch: int) -> dict:
    """One model's and algorithm's bytes against the bare loop and against an added learner's minimum."""
    bare, layout = runs[f"{model} bare"], runs[f"{model} layout"]
    one, two = runs[f"{model} {algorithm} k=1"], runs[f"{model} {algorithm} k=2"]
    n, state = layout["num_params"], layout["num_state"]
    own = 0 if SHARES_Z[algorithm] else 2 * n  # weights and momentum
    element = bare["weights"] // state
    minimum = (n + (state - n) + own) * element + one["activations_peak"]
    added = two["total"] - one["total"]
    return {
        "model": model,
        "algorithm": algorithm,
        "b": batch,
        "bare_bytes": bare["total"],
        "one_learner_bytes": one["total"],
        "vs_bare": harness.ratio(one["total"], bare["total"]),
        "added_learner_bytes": added,
        "minimum_added_bytes": minimum,
        "vs_minimum": harness.ratio(added, minimum),
    }


def measure(options: harness.Options) -> harness.Report:
    budget = QUICK if options.quick else FULL
    measured = harness.run_worker(options.name, 1, asdict(budget), budget.timeout_s)
    runs = measured["runs"]
    by_variant = {run["variant"]: run for run in runs}
    rows = [row(by_variant, m, a, budget.batch) for m in budget.models for a in ALGORITHMS]
    return harness.Report(
        question=f"Bytes of one rank's tensors (1 rank, threads engine, b = {budget.batch}): one added learner "
        f"against its minimum (goal ≤ {GOAL_ADDED}×) and one learner against a bare PyTorch loop (goal ≤ "
        f"{GOAL_ONE}×)",
        columns=COLUMNS,
        rows=rows,
        runs=runs,
        settings={"budget": asdict(budget), "goals": {"added": GOAL_ADDED, "one": GOAL_ONE}},
    )


def _nbytes(tensor) -> int:
    return tensor.numel() * tensor.element_size()


if __name__ == "__main__":
    harness.main(measure, worker, full_reps=1)
