"""Splitting a model into pipeline stages: contiguous groups of its modules, balanced by parameter count."""

from __future__ import annotations

from torch import nn


def pipeline_units(model) -> list[nn.Module]:
    """Return the modules a model runs in sequence: a built-in model's `pipeline_modules()`, an `nn.Sequential`'s
    children, or a list of modules."""
    if hasattr(model, "pipeline_modules"):
        return list(model.pipeline_modules())
    if isinstance(model, nn.Sequential):
        return list(model)
    if isinstance(model, (list, tuple)) and all(isinstance(m, nn.Module) for m in model):
        return list(model)
    raise ValueError(
        f"--pipeline-stages: a {type(model).__name__} cannot be split into stages; give an nn.Sequential, "
        "a list of modules, or a model with pipeline_modules()"
    )


def split_model(model, stages: int) -> list[list[nn.Module]]:
    """Cut the model's modules into `stages` contiguous groups, each with trainable parameters, that minimise the
    largest group's parameter count. A module without parameters joins the group of the module before it."""
    units: list[list[nn.Module]] = []
    for module in pipeline_units(model):
        if _trainable(module) or not units:
            units.append([module])
        else:
            units[-1].append(module)
    if len(units) > 1 and not _trainable(*units[0]):  # leading modules without parameters join the first that has
        units[1] = units[0] + units[1]
        del units[0]
    if len(units) < stages or not _trainable(*units[0]):
        raise ValueError(
            f"--pipeline-stages {stages}: the model has only {len(units)} modules with trainable parameters "
            "to split between stages"
        )
    costs = [_trainable(*unit) for unit in units]
    cuts = _balanced_cuts(costs, stages)
    return [[m for unit in units[a:b] for m in unit] for a, b in zip([0, *cuts], [*cuts, len(units)])]


def _trainable(*modules: nn.Module) -> int:
    return sum(p.numel() for m in modules for p in m.parameters() if p.requires_grad)


def _balanced_cuts(costs: list[int], parts: int) -> list[int]:
    """Return the parts - 1 cut points of `costs` into non-empty contiguous parts that minimise the largest sum."""
    n = len(costs)
    prefix = [0]
    for cost in costs:
        prefix.append(prefix[-1] + cost)
    # best[p][i]: (largest part, cuts) of the first i costs in p parts
    best = {(1, i): (prefix[i], []) for i in range(1, n + 1)}
    for p in range(2, parts + 1):
        for i in range(p, n + 1):
            best[(p, i)] = min(
                (max(best[(p - 1, j)][0], prefix[i] - prefix[j]), best[(p - 1, j)][1] + [j]) for j in range(p - 1, i)
            )
    return best[(parts, n)][1]
