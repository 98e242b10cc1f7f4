"""Command line: `python -m crossbow_mpi.export RUN_DIR [--checkpoint FILE] --out model.safetensors` writes a run's
trained model z (parameters and float buffers; a pipeline run's stages joined into the whole model) as a named
`state_dict` in safetensors format (plain tensors and a JSON header), to load with

    model.load_state_dict(safetensors.torch.load_file("model.safetensors"))

A tied weight is written once, under its first name; the header's `tied` metadata maps each name left out to the
name it is tied to, and `load_state_dict(..., strict=False)` loads such a model (the tie restores the rest).
With `--optimizer-out FILE` (a run with another optimizer than sgd) it also writes the optimizer state of what the
algorithm stepped, per parameter as `<parameter>.<state>` (AdamW: `.exp_avg`, `.exp_avg_sq`) and each count by its
name (`step`): z's for S-SGD and eager, the mean over every learner of every rank for SMA and elastic.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import h5py
import numpy as np
import torch
from safetensors.torch import save
from torch import nn

from crossbow_mpi.config import ArgumentParser, Config, ConfigError
from crossbow_mpi.data import dataset_shape
from crossbow_mpi.models import build_model
from crossbow_mpi.parallel.pipeline import load_stages, stage_modules
from crossbow_mpi.replicas.flat import FlatLayout
from crossbow_mpi.train import EXIT_USER_ERROR
from crossbow_mpi.training import checkpoint


def read_config(run_dir: str) -> Config:
    """Return the configuration a run directory was trained with (its config.json)."""
    if not Path(run_dir).is_dir():
        raise ConfigError(f"{run_dir}: no such run directory")
    path = Path(run_dir) / "config.json"
    try:
        values = json.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{path}: missing (not a crossbow_mpi run directory?)") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ConfigError(f"{path}: unreadable ({err})") from None
    if not isinstance(values, dict):
        raise ConfigError(f"{path}: not a crossbow_mpi configuration (not a JSON object)")
    try:
        return Config.from_dict(values)
    except ConfigError as err:
        raise ConfigError(f"{path}: {err}") from None
    except (TypeError, AttributeError) as err:
        raise ConfigError(f"{path}: not a crossbow_mpi configuration ({err})") from None


def load_model(run_dir: str, checkpoint_file: str | None = None) -> tuple[nn.Module, Config, Path]:
    """Rebuild the run's model from config.json and load z from a checkpoint (default: the newest valid one);
    return the model, the config and the checkpoint's path."""
    config = read_config(run_dir)
    path = Path(checkpoint_file) if checkpoint_file else _newest(run_dir)
    problem = "no such file" if not path.is_file() else checkpoint.check(path)
    if problem:
        raise ConfigError(f"{path}: {problem}")
    shards, signature = checkpoint.read_central(path)
    module = build_model(config.model, *dataset_shape(config.dataset, config.seq_len), config.model_args)
    cut = checkpoint.read_cut(path)
    stages = stage_modules(module, len(shards), cut)
    layouts = [FlatLayout(stage) for stage in stages]
    expected = "+".join(layout.signature for layout in layouts)
    sizes = [
        (layout.num_state, len(layout.extra_state_bytes(stage))) for stage, layout in zip(stages, layouts, strict=True)
    ]
    if (signature, [(z.numel(), len(extra)) for z, extra in shards]) != (expected, sizes):
        raise ConfigError(
            f"{path} holds another model (layout {signature}) than {run_dir}'s {config.model} "
            f"on {config.dataset} (layout {expected})"
        )
    return load_stages(module, shards, cut), config, path


def _newest(run_dir: str) -> Path:
    path, skipped = checkpoint.newest_valid(run_dir)
    if path is None:
        raise ConfigError(f"no valid checkpoint in {run_dir}" + (f" ({'; '.join(skipped)})" if skipped else ""))
    return path


def optimizer_state(path: Path, layout: FlatLayout) -> dict[str, torch.Tensor]:
    """Return a checkpoint's optimizer state by `<parameter>.<state>` (and a count by its name): z's, or the mean
    over the learners."""
    with h5py.File(path, "r") as f:
        if "central/optimizer" in f:
            groups = [{name: array[...][None] for name, array in f["central/optimizer"].items()}]
        else:
            held = [f[f"ranks/{r}/optimizer"] for r in f["ranks"] if "optimizer" in f[f"ranks/{r}"]]
            groups = [{name: array[...] for name, array in group.items()} for group in held]
    if not groups:
        raise ConfigError(f"--optimizer-out: {path} holds no optimizer state (the run trained with --optimizer sgd)")
    state = {}
    for name in groups[0]:
        rows = np.concatenate([group[name] for group in groups])
        mean = torch.from_numpy(np.asarray(rows.astype(np.float64).mean(0), dtype=rows.dtype))
        if mean.dim() == 0:
            state[name] = mean
            continue
        for slot, view in zip(layout.param_slots, layout.param_views(mean), strict=True):
            state[f"{slot.module}.{slot.name}.{name}".lstrip(".")] = view.contiguous()
    return state


def export(
    run_dir: str, out: str, checkpoint_file: str | None = None, optimizer_out: str | None = None
) -> tuple[Path, int]:
    """Write the run's model as a safetensors state_dict to `out` (and its optimizer state to `optimizer_out`);
    return the checkpoint used and the tensor count."""
    checkpoint.refuse_overwrite(out)
    if optimizer_out:
        checkpoint.refuse_overwrite(optimizer_out, "--optimizer-out")
    module, config, path = load_model(run_dir, checkpoint_file)
    optimizer = optimizer_state(path, FlatLayout(module)) if optimizer_out else {}
    tensors, tied = {}, {}
    first_name: dict[int, str] = {}
    for name, tensor in module.state_dict(keep_vars=True).items():
        kept = first_name.setdefault(id(tensor), name)
        if kept == name:
            tensors[name] = tensor.detach().contiguous()
        else:
            tied[name] = kept  # a tied weight (tinygpt's output layer) is written once, under its first name
    metadata = {"model": config.model, "dataset": config.dataset, "checkpoint": path.name}
    if tied:
        metadata["tied"] = json.dumps(tied)
    written = [(out, "--out", tensors)] + ([(optimizer_out, "--optimizer-out", optimizer)] if optimizer_out else [])
    for file, flag, contents in written:
        try:
            Path(file).write_bytes(save(contents, metadata=metadata))
        except OSError as err:
            raise ConfigError(f"{flag} {file}: {err.strerror or err}") from None
    return path, len(tensors)


def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(
        prog="python -m crossbow_mpi.export",
        description="Write a run's trained model as a safetensors state_dict.",
        allow_abbrev=False,
    )
    parser.add_argument("run_dir", metavar="RUN_DIR", help="run directory (config.json and checkpoints)")
    parser.add_argument("--checkpoint", metavar="FILE", help="checkpoint to export (default: the newest valid one)")
    parser.add_argument("--out", metavar="FILE", required=True, help="the .safetensors file to write")
    parser.add_argument(
        "--optimizer-out", metavar="FILE", help="also write the optimizer state (another optimizer than sgd)"
    )
    try:
        args = parser.parse_args(argv)
        path, count = export(args.run_dir, args.out, args.checkpoint, args.optimizer_out)
    except ValueError as err:
        print(f"crossbow_mpi.export: error: {err}", file=sys.stderr)
        return EXIT_USER_ERROR
    print(f"wrote {args.out}: {count} tensors from {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
