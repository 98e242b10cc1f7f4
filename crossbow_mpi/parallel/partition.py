"""Splitting a model into pipeline stages: contiguous groups of its modules, balanced by parameter count or by
measured forward+backward time.

A cut is the list of the M − 1 indices into the model's units (`stage_units`) at which stages 1 … M − 1 begin.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch
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


def stage_units(model, stages: int) -> list[list[nn.Module]]:
    """Return the model's modules grouped into the units a cut may separate: each module with trainable
    parameters, with the modules without parameters after it (leading ones join the first); ValueError when
    there are fewer units than stages."""
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
    return units


def split_model(model, stages: int, cut: list[int] | None = None) -> list[list[nn.Module]]:
    """Cut the model's units into `stages` contiguous groups at `cut` (default: `param_cut`'s); ValueError when
    `cut` does not fit the model."""
    units = stage_units(model, stages)
    cut = param_cut(model, stages) if cut is None else cut
    if len(cut) != stages - 1 or cut != sorted(set(cut)) or (cut and not 0 < cut[0] <= cut[-1] < len(units)):
        raise ValueError(f"the pipeline cut {cut} does not split the model's {len(units)} units into {stages} stages")
    return [[m for unit in units[a:b] for m in unit] for a, b in zip([0, *cut], [*cut, len(units)], strict=True)]


def param_cut(model, stages: int) -> list[int]:
    """The cut that minimises the largest stage's trainable parameter count."""
    return _balanced_cuts([_trainable(*unit) for unit in stage_units(model, stages)], stages)


def time_cut(model, stages: int, inputs: torch.Tensor, reps: int = 5) -> list[int]:
    """The cut that minimises the largest stage's forward+backward time, each unit run on the output of the units
    before it, starting from `inputs` (a micro-batch). The units are timed in turn for `reps` rounds and each keeps
    its fastest pass, so that a burst of load from other processes slows a round, not one unit's every pass."""
    passes = []
    for i, unit in enumerate(stage_units(model, stages)):
        once = _forward_backward(nn.Sequential(*unit), inputs, input_grad=i > 0)
        inputs = once()  # untimed: it warms the unit up and feeds the next
        passes.append(once)
    fastest = [min(row) for row in zip(*([_seconds(once) for once in passes] for _ in range(reps)), strict=True)]
    return _balanced_cuts(fastest, stages)


def forward_backward_s(
    module: nn.Module, inputs: torch.Tensor, reps: int, loss_fn=None, input_grad: bool = True
) -> tuple[float, torch.Tensor]:
    """Return the median time of `reps` forward+backward passes of `module` on `inputs` (after one untimed pass)
    and its output; the backward pass is of `loss_fn(output)`, by default of the output's sum, and with
    `input_grad` (as in every stage but the first) also computes the gradient of floating-point inputs."""
    once = _forward_backward(module, inputs, loss_fn, input_grad)
    y = once()
    return statistics.median(_seconds(once) for _ in range(reps)), y


def _forward_backward(
    module: nn.Module, inputs: torch.Tensor, loss_fn=None, input_grad: bool = True
) -> Callable[[], torch.Tensor]:
    """A function that runs one forward+backward pass (see `forward_backward_s`) and returns the output."""

    def once() -> torch.Tensor:
        x = inputs.detach().requires_grad_(input_grad and inputs.is_floating_point())
        y = module(x)
        (loss_fn(y) if loss_fn else y.sum()).backward()
        if y.is_cuda:
            torch.cuda.synchronize(y.device)
        return y.detach()

    return once


def _seconds(run: Callable[[], object]) -> float:
    started = time.perf_counter()
    run()
    return time.perf_counter() - started


def _trainable(*modules: nn.Module) -> int:
    return sum(p.numel() for m in modules for p in m.parameters() if p.requires_grad)


def _balanced_cuts(costs: list[float], parts: int) -> list[int]:
    """Return the parts - 1 cut points of `costs` into non-empty contiguous parts that minimise the largest sum."""
    n = len(costs)
    prefix: list[float] = [0]
    for cost in costs:
        prefix.append(prefix[-1] + cost)
    # best[p][i]: (largest part, cuts) of the first i costs in p parts
    best: dict[tuple[int, int], tuple[float, list[int]]] = {(1, i): (prefix[i], []) for i in range(1, n + 1)}
    for p in range(2, parts + 1):
        for i in range(p, n + 1):
            best[(p, i)] = min(
                (max(best[(p - 1, j)][0], prefix[i] - prefix[j]), best[(p - 1, j)][1] + [j]) for j in range(p - 1, i)
            )
    return best[(parts, n)][1]
