"""Refuse a `--resume` whose command sets a hyper-parameter otherwise than the run did.

A resume restores the hyper-parameters (`HyperParams`) from the checkpoint, because controllers (the auto-tuner,
the adaptive batch, Omnivore's search) may have changed them during the run; a new value given with `--resume`
would be ignored without a word. So the command's configuration is compared with the run's (the checkpoint's stored
config, not the tuned values) for those fields, and any difference is refused before anything is written.
"""

from __future__ import annotations

import dataclasses

from crossbow_mpi.config import Config, ConfigError, coerce
from crossbow_mpi.replicas.state import HyperParams
from crossbow_mpi.training import checkpoint


def refuse_changed_hyperparams(config: Config, data_ranks: int) -> None:
    """ConfigError naming each hyper-parameter that `config` sets otherwise than the run in its run directory (whose
    newest valid checkpoint a resume on `data_ranks` ranks of the data scope restores)."""
    path, _ = checkpoint.newest_valid(config.run_dir)
    if path is None:
        return  # checkpoint.load refuses, naming why
    stored, hyperparams = checkpoint.read_settings(path)
    sizes = hyperparams["batch_size"]
    fields = {f.name: f for f in dataclasses.fields(Config)}
    names = [f.name for f in dataclasses.fields(HyperParams) if f.name in stored]
    if isinstance(sizes, list) and len(sizes) != data_ranks:
        names.remove("batch_size")  # per-rank sizes of another number of ranks: the resume takes this command's
    changed = [
        f"--{name.replace('_', '-')} {_shown(run)} (this command: {_shown(new)})"
        for name in names
        if (run := coerce(fields[name], stored[name])) != (new := getattr(config, name))
    ]
    if changed:
        raise ConfigError(
            f"--resume: the run in {config.run_dir} was trained with {', '.join(changed)}; a resume continues with "
            "the run's hyper-parameters: drop those flags, or start a new --run-dir to change them (the Python API "
            "can start it from the model `python -m crossbow_mpi.export` writes)"
        )


def _shown(value) -> str:
    if isinstance(value, tuple):
        return ",".join(str(v) for v in value)
    return str(value).lower() if isinstance(value, bool) else str(value)
