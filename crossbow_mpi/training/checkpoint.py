"""HDF5 checkpoints of named parts: written by rank 0 from every rank's snapshot, read back on any number of ranks.

Layout (format version 2; every JSON value is a string attribute, so `h5dump` shows the whole file):
    /                    attrs: format_version, complete, config (JSON), layout_signature, world_size,
                         pipeline_stages (absent: 1), pipeline_cut (JSON: the cut into the stages; absent: by
                         parameter count, see `stages`)
    /train               attrs: state (JSON TrainState; its loss window summed over every rank), tuner and
                         algorithm (JSON: the auto-tuner's and the algorithm's own state), choice (JSON: the
                         algorithm's name and compute groups, `Run.choice`; absent: the configured ones)
    /central/z           [num_state]           central model: parameters then float buffers
    /central/u           [num_params]          central momentum
    /central/extra       uint8                 z's frozen parameters and non-float buffers, raw, in name order
    /central/optimizer/<name>                  z's optimizer state (S-SGD, eager, Omnivore's server with another
                                               optimizer than sgd: [num_params] per-weight state, [] a count;
                                               absent: none)
    /ranks/<r>           attrs: hyperparams (JSON HyperParams of rank r), controllers (JSON: the state of each
                         hyper-parameter controller on rank r, null for one without; absent: none)
    /ranks/<r>/weights   [k_r, num_state]      rank r's learners
    /ranks/<r>/momentum  [k_r, num_params]
    /ranks/<r>/optimizer/<name>                rank r's learners' optimizer state (SMA, elastic with another
                                               optimizer than sgd: [k_r, num_params], or [k_r] for a count)
    /ranks/<r>/rng       uint8                 JSON of rank r's Python, NumPy and torch generator states
    /ranks/<r>/wire/<name>                     rank r's residuals of its int8 sync casts (`--sync-dtype int8`,
                                               crossbow_mpi.comm.int8; absent: none)

With pipeline stages (M > 1) the central model is sharded by stage: /stages/<s>/central/{z,u,extra} hold stage s's
shard (from rank s), rank r's learners are of stage r mod M, and layout_signature joins the stages' signatures.

Resuming on another number of ranks or learners reshards: rank r takes the part of rank r where it exists; a new
rank takes rank 0's hyper-parameters, starts its learners from z and keeps the RNGs seeded from the seed and
its rank. See `Run.load_state_dict` for the learners.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
from pathlib import Path
from typing import cast

import h5py
import numpy as np
import torch

from crossbow_mpi.comm import Communicator
from crossbow_mpi.config import ConfigError
from crossbow_mpi.runtime import process

FORMAT_VERSION = 2
NAME = re.compile(r"^checkpoint-(\d{9})\.h5$")
TEMPORARY = re.compile(r"^checkpoint-\d{9}\.h5\.tmp$")
"""A checkpoint being written; one that outlived its run was never renamed (the run was killed while writing it)."""
ARRAYS = ("z", "u", "extra")
"""The central model's arrays, in its group."""


class CheckpointError(RuntimeError):
    """A checkpoint could not be written."""


def checkpoint_path(run_dir: str, iteration: int) -> Path:
    return Path(run_dir) / f"checkpoint-{iteration:09d}.h5"


def temporary(path: Path) -> Path:
    """Where a checkpoint is written before it is renamed to `path`, complete."""
    return path.with_name(path.name + ".tmp")


def central_group(stage: int, stages: int) -> str:
    """Return the group that holds a stage's shard of the central model."""
    return "central" if stages == 1 else f"stages/{stage}/central"


def save(
    world: Communicator,
    run_dir: str,
    snapshot: dict,
    config_json: str,
    layout_signature: str,
    keep: int,
    stages: int = 1,
    cut: list[int] | None = None,
) -> Path:
    """Write every rank's snapshot (`Run.state_dict` plus the tuner's) as one checkpoint (collective); keep the
    newest `keep` checkpoints. The ranks' training-loss windows are summed into rank 0's state. With `stages`,
    rank s < stages gives stage s's central model, the model cut into them at `cut`."""
    train = dict(snapshot["train"])
    train["loss_sum"], train["loss_count"] = world.allreduce_sum_numbers([train["loss_sum"], train["loss_count"]])
    train["loss_count"] = int(train["loss_count"])
    learners = snapshot["learners"]
    rank_parts = [
        json.dumps(snapshot["hyperparams"]).encode(),
        json.dumps(snapshot.get("controllers", [])).encode(),
        _bytes(learners["weights"]),
        _bytes(learners["momentum"]),
        json.dumps(snapshot["rng"], default=process.jsonable).encode(),
        _pack(learners.get("optimizer", {})),
        _pack(snapshot.get("wire", {})),
    ]
    gathered = [world.gather_bytes(part) for part in rank_parts]
    central = snapshot["central"]
    central_parts = [_bytes(central["z"]), _bytes(central["u"]), central["extra"], _pack(central.get("optimizer", {}))]
    centrals = [world.gather_bytes(part if world.rank < stages else b"") for part in central_parts]
    path = checkpoint_path(run_dir, train["iteration"])
    error = None
    if world.rank == 0:
        try:
            stage_centrals = [c[:stages] for c in _on_root(centrals)]
            _write(path, snapshot, train, _on_root(gathered), stage_centrals, config_json, layout_signature, cut)
            _prune(run_dir, keep)
        except (OSError, RuntimeError) as err:  # h5py on a full disk: an OSError, then a RuntimeError at close
            temporary(path).unlink(missing_ok=True)
            error = f"cannot write checkpoint {path}: {_reason(err)}"
    error = world.bcast_json(error)
    if error:
        raise CheckpointError(error)
    return path


def _reason(err: Exception) -> str:
    """One line for a failed write: the errno's text where there is one (h5py's own message spans lines)."""
    cause = err.__context__ if isinstance(err.__context__, OSError) else err
    errno = getattr(cause, "errno", None)
    return os.strerror(errno) if errno else (str(cause).strip().splitlines() or [type(cause).__name__])[0]


def _bytes(tensor: torch.Tensor) -> bytes:
    return np.ascontiguousarray(tensor.detach().cpu().numpy()).tobytes()


def _pack(state: dict[str, torch.Tensor]) -> bytes:
    """Optimizer state as bytes: an 8-byte length, JSON {name: [dtype, shape]}, then each tensor's raw bytes."""
    meta = json.dumps({name: [t.cpu().numpy().dtype.str, list(t.shape)] for name, t in state.items()}).encode()
    return len(meta).to_bytes(8, "little") + meta + b"".join(_bytes(t) for t in state.values())


def _unpack(data: bytes) -> dict[str, np.ndarray]:
    """Read what `_pack` wrote."""
    length = int.from_bytes(data[:8], "little")
    state, offset = {}, 8 + length
    for name, (dtype, shape) in json.loads(data[8 : 8 + length]).items():
        array = np.frombuffer(data, dtype=np.dtype(dtype), count=int(np.prod(shape)), offset=offset)
        state[name], offset = array.reshape(shape), offset + array.nbytes
    return state


def _write_optimizer(group, data: bytes, name: str = "optimizer") -> None:
    """Write packed optimizer state as the datasets of `group`/`name` (nothing for none)."""
    state = _unpack(data)
    if state:
        optimizer = group.create_group(name)
        for name, array in state.items():
            optimizer.create_dataset(name, data=array)


def _read_optimizer(f, group: str, name: str = "optimizer") -> bytes:
    """Pack the optimizer state under `group`/`name` (none where absent)."""
    held = f.get(f"{group}/{name}")
    return _pack({} if held is None else {name: torch.from_numpy(held[name][...]) for name in held})


def _on_root(gathered: list[list[bytes] | None]) -> list[list[bytes]]:
    """`gather_bytes`' results on its root, where every one is there."""
    assert None not in gathered
    return cast(list[list[bytes]], gathered)


def _write(
    path: Path,
    snapshot: dict,
    train: dict,
    gathered: list[list[bytes]],
    centrals: list[list[bytes]],
    config_json: str,
    layout_signature: str,
    cut: list[int] | None,
) -> None:
    dtype, stages = snapshot["central"]["z"].cpu().numpy().dtype, len(centrals[0])
    tmp = temporary(path)
    with h5py.File(tmp, "w") as f:
        f.attrs["format_version"] = FORMAT_VERSION
        f.attrs["config"] = config_json
        f.attrs["layout_signature"] = layout_signature
        f.attrs["world_size"] = len(gathered[0])
        f.attrs["pipeline_stages"] = stages
        if cut is not None:
            f.attrs["pipeline_cut"] = json.dumps(cut)
        group = f.create_group("train")
        group.attrs["state"] = json.dumps(train)
        group.attrs["tuner"] = json.dumps(snapshot.get("tuner"))
        group.attrs["algorithm"] = json.dumps(snapshot["algorithm"])
        group.attrs["choice"] = json.dumps(snapshot["choice"])
        sizes = []
        for stage, (z, u, extra, optimizer) in enumerate(zip(*centrals, strict=True)):
            group = f.create_group(central_group(stage, stages))
            group.create_dataset("z", data=np.frombuffer(z, dtype=dtype))
            group.create_dataset("u", data=np.frombuffer(u, dtype=dtype))
            group.create_dataset("extra", data=np.frombuffer(extra, dtype=np.uint8))
            _write_optimizer(group, optimizer)
            sizes.append((group["z"].size, group["u"].size))
        for rank, parts in enumerate(zip(*gathered, strict=True)):
            hyperparams, controllers, weights, momentum, rng, optimizer, wire = parts
            group = f.create_group(f"ranks/{rank}")
            group.attrs["hyperparams"] = hyperparams.decode()
            group.attrs["controllers"] = controllers.decode()
            num_state, num_params = sizes[rank % stages]
            group.create_dataset("weights", data=np.frombuffer(weights, dtype=dtype).reshape(-1, num_state))
            group.create_dataset("momentum", data=np.frombuffer(momentum, dtype=dtype).reshape(-1, num_params))
            group.create_dataset("rng", data=np.frombuffer(rng, dtype=np.uint8))
            _write_optimizer(group, optimizer)
            _write_optimizer(group, wire, "wire")
        f.attrs["complete"] = True
        f.flush()
        os.fsync(f.id.get_vfd_handle())
    os.replace(tmp, path)


def _prune(run_dir: str, keep: int) -> None:
    for old in list_checkpoints(run_dir)[:-keep]:
        old.unlink()


RUN_RECORDS = ("metrics.jsonl", "config.json")
"""The files besides its checkpoints that make up a run's records."""
HDF5_SIGNATURE = b"\x89HDF\r\n\x1a\n"


def refuse_overwrite(out: str | Path, flag: str = "--out") -> None:
    """Raise ConfigError when writing `out` would overwrite a checkpoint (by name or content) or a run's records."""
    path = Path(out)
    if path.is_dir():
        raise ConfigError(f"{flag} {out} is a directory: name a file")
    if not path.exists():
        return
    in_run = any((path.parent / name).exists() for name in RUN_RECORDS)
    if NAME.match(path.name) or (in_run and path.name in RUN_RECORDS) or _is_hdf5(path):
        raise ConfigError(f"{flag} {out} would overwrite a checkpoint or a run's records: choose another file")


def _is_hdf5(path: Path) -> bool:
    try:
        with path.open("rb") as f:
            return f.read(len(HDF5_SIGNATURE)) == HDF5_SIGNATURE
    except OSError:
        return False


def remove_temporaries(run_dir: str) -> list[Path]:
    """Remove the checkpoint files that a killed run left half-written (call only from the run that owns the run
    directory, before it writes); return those removed."""
    removed = []
    for path in Path(run_dir).iterdir():
        if TEMPORARY.match(path.name) and path.is_file() and not path.is_symlink():
            with contextlib.suppress(OSError):  # one that cannot be removed is only clutter
                path.unlink()
                removed.append(path)
    return removed


def list_checkpoints(run_dir: str) -> list[Path]:
    """Return the run directory's checkpoints, oldest first."""
    directory = Path(run_dir)
    if not directory.is_dir():
        return []
    return sorted(p for p in directory.iterdir() if NAME.match(p.name))


def check(path: Path) -> str | None:
    """Return why a checkpoint file is unusable, or None when it is complete and of this format."""
    try:
        with h5py.File(path, "r") as f:
            if f.attrs.get("format_version") != FORMAT_VERSION:
                return f"format version {f.attrs.get('format_version')} (expected {FORMAT_VERSION})"
            if not f.attrs.get("complete", False):
                return "incomplete"
            central = central_group(0, int(f.attrs.get("pipeline_stages", 1)))
            for name in (*(f"{central}/{a}" for a in ARRAYS), "train", "ranks/0/weights"):
                if name not in f:
                    return f"missing {name}"
    except (OSError, KeyError) as err:
        return f"unreadable ({err})"
    return None


def newest_valid(run_dir: str) -> tuple[Path | None, list[str]]:
    """Return the newest usable checkpoint and a line for each newer one that was skipped."""
    skipped: list[str] = []
    for path in reversed(list_checkpoints(run_dir)):
        problem = check(path)
        if problem is None:
            return path, skipped
        skipped.append(f"skipped {path.name}: {problem}")
    return None, skipped


def read_central(path: Path) -> tuple[list[tuple[torch.Tensor, bytes]], str]:
    """Return a valid checkpoint's central model, as each pipeline stage's z and extra state (one without stages),
    and the layout signature."""
    with h5py.File(path, "r") as f:
        stages = int(f.attrs.get("pipeline_stages", 1))
        groups = [f[central_group(stage, stages)] for stage in range(stages)]
        return [(torch.from_numpy(g["z"][...]), g["extra"][...].tobytes()) for g in groups], f.attrs["layout_signature"]


def read_settings(path: Path) -> tuple[dict, dict]:
    """Return a valid checkpoint's stored configuration and its rank 0's hyper-parameters (JSON objects)."""
    with h5py.File(path, "r") as f:
        return json.loads(f.attrs["config"]), json.loads(f["ranks/0"].attrs["hyperparams"])


def read_cut(path: Path) -> list[int] | None:
    """Return where a valid checkpoint's model was cut into pipeline stages; None: by parameter count."""
    with h5py.File(path, "r") as f:
        return json.loads(f.attrs["pipeline_cut"]) if "pipeline_cut" in f.attrs else None


def load(world: Communicator, run_dir: str, layout_signature: str) -> tuple[dict, list[str]]:
    """Read the newest valid checkpoint (collective); return this rank's snapshot and notes.

    The snapshot has the keys of `save`'s and `k`, the rank's learners; for a rank the checkpoint does not hold,
    `learners` and `rng` are None and `hyperparams` and `k` are rank 0's."""
    header = _read_header(run_dir, layout_signature) if world.rank == 0 else None
    header = world.bcast_json(header)
    if "error" in header:
        raise ConfigError(header["error"])
    arrays = _read_arrays(header["path"], world.size) if world.rank == 0 else {}
    z = _tensor(world.scatter_bytes(arrays.get("z")), header["dtype"])
    u = _tensor(world.scatter_bytes(arrays.get("u")), header["dtype"])
    extra = world.scatter_bytes(arrays.get("extra"))
    weights, momentum, rng, optimizer, wire = (
        world.scatter_bytes(arrays.get(name)) for name in ("weights", "momentum", "rng", "optimizer", "wire")
    )
    central_optimizer = _torch(_unpack(world.scatter_bytes(arrays.get("central_optimizer"))))
    mine = world.rank < header["world_size"]
    learners = None
    if mine:
        learners = {
            "weights": _tensor(weights, header["dtype"]).view(-1, z.numel()),
            "momentum": _tensor(momentum, header["dtype"]).view(-1, u.numel()),
            "optimizer": _torch(_unpack(optimizer)),
        }
    source = world.rank if mine else 0
    snapshot = {
        "train": header["state"],
        "tuner": header["tuner"],
        "algorithm": header["algorithm"],
        "choice": header["choice"],
        "hyperparams": header["hyperparams"][source],
        "controllers": header["controllers"][world.rank] if mine else [],
        "k": header["learners"][source],
        "central": {"z": z, "u": u, "extra": extra, "optimizer": central_optimizer},
        "learners": learners,
        "rng": json.loads(rng) if mine else None,
        "wire": _torch(_unpack(wire)) if mine else {},
    }
    return snapshot, header["notes"]


def _read_arrays(path: str, world_size: int) -> dict:
    """Return for each rank of this job its stage's z, u and extra state, and its weights', momentum's and RNG's
    bytes (empty for a rank the checkpoint does not hold)."""
    with h5py.File(path, "r") as f:
        held, stages = int(f.attrs["world_size"]), int(f.attrs.get("pipeline_stages", 1))

        def per_rank(name: str) -> list[bytes]:
            return [f[f"ranks/{r}/{name}"][...].tobytes() if r < held else b"" for r in range(world_size)]

        def per_stage(name: str) -> list[bytes]:
            return [f[f"{central_group(r % stages, stages)}/{name}"][...].tobytes() for r in range(world_size)]

        return {
            "z": per_stage("z"),
            "u": per_stage("u"),
            "extra": per_stage("extra"),
            "weights": per_rank("weights"),
            "momentum": per_rank("momentum"),
            "rng": per_rank("rng"),
            "optimizer": [_read_optimizer(f, f"ranks/{r}") if r < held else _pack({}) for r in range(world_size)],
            "wire": [_read_optimizer(f, f"ranks/{r}", "wire") if r < held else _pack({}) for r in range(world_size)],
            "central_optimizer": [_read_optimizer(f, central_group(r % stages, stages)) for r in range(world_size)],
        }


def _read_header(run_dir: str, layout_signature: str) -> dict:
    path, notes = newest_valid(run_dir)
    if path is None:
        return {"error": f"--resume: no valid checkpoint in {run_dir}" + (f" ({'; '.join(notes)})" if notes else "")}
    with h5py.File(path, "r") as f:
        if f.attrs["layout_signature"] != layout_signature:
            stages, held_stages = layout_signature.count("+") + 1, int(f.attrs.get("pipeline_stages", 1))
            if stages != held_stages:
                return {"error": f"--resume: {path} was written with --pipeline-stages {held_stages}: resume with it"}
            return {"error": f"--resume: {path} holds a different model (layout {f.attrs['layout_signature']})"}
        held = int(f.attrs["world_size"])
        return {
            "path": str(path),
            "world_size": held,
            "dtype": f[f"{central_group(0, int(f.attrs.get('pipeline_stages', 1)))}/z"].dtype.str,
            "state": json.loads(f["train"].attrs["state"]),
            "tuner": json.loads(f["train"].attrs["tuner"]),
            "algorithm": json.loads(f["train"].attrs["algorithm"]),
            "choice": json.loads(f["train"].attrs.get("choice", "null")),
            "hyperparams": [json.loads(f[f"ranks/{r}"].attrs["hyperparams"]) for r in range(held)],
            "controllers": [json.loads(f[f"ranks/{r}"].attrs.get("controllers", "[]")) for r in range(held)],
            "learners": [f[f"ranks/{r}/weights"].shape[0] for r in range(held)],
            "notes": [*notes, f"resumed from {path.name}"],
        }


def _torch(state: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
    return {name: torch.from_numpy(array.copy()) for name, array in state.items()}


def _tensor(data: bytes, dtype: str) -> torch.Tensor:
    return torch.from_numpy(np.frombuffer(data, dtype=np.dtype(dtype)).copy())
