"""HDF5 checkpoints: written by rank 0 from every rank's state, read by rank 0 and scattered on resume.

Layout (format version 1):
    attrs: format_version, complete, config (JSON), state (JSON), layout_signature, world_size, learners
    /central/z           [num_state]           central model: parameters then float buffers
    /central/u           [num_params]          central momentum
    /learners/weights    [P, k, num_state]     every learner of every rank
    /learners/momentum   [P, k, num_params]
    /rng/rank_<r>        uint8                 JSON of rank r's Python, NumPy and torch generator states
"""

from __future__ import annotations

import json
import os
import random
import re
from pathlib import Path

import h5py
import numpy as np
import torch

from crossbow_mpi.comm import Communicator
from crossbow_mpi.config import ConfigError
from crossbow_mpi.learners import CentralModel, Learners

FORMAT_VERSION = 1
NAME = re.compile(r"^checkpoint-(\d{9})\.h5$")


class CheckpointError(RuntimeError):
    """A checkpoint could not be written."""


def checkpoint_path(run_dir: str, iteration: int) -> Path:
    return Path(run_dir) / f"checkpoint-{iteration:09d}.h5"


def save(comm: Communicator, run_dir: str, central: CentralModel, learners: Learners, state: dict,
         config_json: str, keep: int) -> Path:
    """Write a checkpoint of every rank's state (collective); keep the newest `keep` checkpoints."""
    weights = _gather_rows(comm, learners.weights)
    momentum = _gather_rows(comm, learners.momentum)
    rng_states = comm.allgather_bytes(_rng_state())
    path = checkpoint_path(run_dir, state["iteration"])
    error = None
    if comm.rank == 0:
        try:
            _write(path, central, weights, momentum, rng_states, state, config_json, learners)
            _prune(run_dir, keep)
        except OSError as err:
            error = f"cannot write checkpoint {path}: {err.strerror or err}"
    error = comm.bcast_json(error)
    if error:
        raise CheckpointError(error)
    return path


def _write(path, central, weights, momentum, rng_states, state, config_json, learners) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with h5py.File(tmp, "w") as f:
        f.attrs["format_version"] = FORMAT_VERSION
        f.attrs["config"] = config_json
        f.attrs["state"] = json.dumps(state)
        f.attrs["layout_signature"] = learners.layout.signature
        f.attrs["world_size"] = weights.shape[0]
        f.attrs["learners"] = weights.shape[1]
        f.create_dataset("central/z", data=central.z.cpu().numpy())
        f.create_dataset("central/u", data=central.u.cpu().numpy())
        f.create_dataset("learners/weights", data=weights)
        f.create_dataset("learners/momentum", data=momentum)
        for rank, blob in enumerate(rng_states):
            f.create_dataset(f"rng/rank_{rank}", data=np.frombuffer(blob, dtype=np.uint8))
        f.attrs["complete"] = True
        f.flush()
        os.fsync(f.id.get_vfd_handle())
    os.replace(tmp, path)


def _prune(run_dir: str, keep: int) -> None:
    for old in list_checkpoints(run_dir)[:-keep]:
        old.unlink()


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
            for name in ("central/z", "central/u", "learners/weights", "learners/momentum"):
                if name not in f:
                    return f"missing {name}"
    except (OSError, KeyError) as err:
        return f"unreadable ({err})"
    return None


def newest_valid(run_dir: str) -> tuple[Path | None, list[str]]:
    """Return the newest usable checkpoint and a line for each newer one that was skipped."""
    skipped = []
    for path in reversed(list_checkpoints(run_dir)):
        problem = check(path)
        if problem is None:
            return path, skipped
        skipped.append(f"skipped {path.name}: {problem}")
    return None, skipped


def load(comm: Communicator, run_dir: str, central: CentralModel, learners: Learners) -> tuple[dict, list[str]]:
    """Restore every rank's state from the newest valid checkpoint (collective); return the state and notes."""
    header = None
    if comm.rank == 0:
        header = _read_header(run_dir, learners, comm.size)
    header = comm.bcast_json(header)
    if "error" in header:
        raise ConfigError(header["error"])
    k = header["learners"]
    if k != learners.k:
        learners.resize(k, central.z)
    parts = _read_arrays(header["path"]) if comm.rank == 0 else None
    z, u, weights, momentum, rng = (comm.scatter_bytes(p) for p in _transpose(parts, comm.size, 5))
    central.z.copy_(_tensor(z, central.z))
    central.u.copy_(_tensor(u, central.u))
    learners.weights.copy_(_tensor(weights, learners.weights))
    learners.momentum.copy_(_tensor(momentum, learners.momentum))
    _restore_rng(rng)
    return header["state"], header["notes"]


def _read_header(run_dir: str, learners: Learners, world_size: int) -> dict:
    path, notes = newest_valid(run_dir)
    if path is None:
        return {"error": f"--resume: no valid checkpoint in {run_dir}" + (f" ({'; '.join(notes)})" if notes else "")}
    with h5py.File(path, "r") as f:
        if f.attrs["layout_signature"] != learners.layout.signature:
            return {"error": f"--resume: {path} holds a different model (layout {f.attrs['layout_signature']})"}
        if int(f.attrs["world_size"]) != world_size:
            return {"error": f"--resume: {path} was written by {int(f.attrs['world_size'])} ranks, this job has {world_size}"}
        state = json.loads(f.attrs["state"])
        k = int(f.attrs["learners"])
    return {"path": str(path), "state": state, "learners": k, "notes": notes + [f"resumed from {path.name}"]}


def _read_arrays(path: str) -> list[list[bytes]]:
    """Return, for each rank, its [z, u, weights, momentum, rng] bytes."""
    with h5py.File(path, "r") as f:
        z = f["central/z"][...].tobytes()
        u = f["central/u"][...].tobytes()
        weights, momentum = f["learners/weights"][...], f["learners/momentum"][...]
        return [[z, u, weights[r].tobytes(), momentum[r].tobytes(), f[f"rng/rank_{r}"][...].tobytes()]
                for r in range(weights.shape[0])]


def _transpose(parts, size: int, fields: int):
    if parts is None:
        return [None] * fields
    return [[parts[r][i] for r in range(size)] for i in range(fields)]


def _tensor(data: bytes, like: torch.Tensor) -> torch.Tensor:
    dtype = torch.empty(0, dtype=like.dtype).numpy().dtype
    return torch.from_numpy(np.frombuffer(data, dtype=dtype).copy()).view(like.shape)


def _gather_rows(comm: Communicator, rows: torch.Tensor) -> np.ndarray | None:
    send = np.ascontiguousarray(rows.detach().cpu().numpy())
    recv = np.empty((comm.size,) + send.shape, dtype=send.dtype) if comm.rank == 0 else None
    comm.mpi_comm.Gather(send, recv, root=0)
    return recv


def _rng_state() -> bytes:
    numpy_state = np.random.get_state(legacy=False)
    numpy_state["state"]["key"] = numpy_state["state"]["key"].tolist()
    state = {
        "python": random.getstate(),
        "numpy": numpy_state,
        "torch": torch.get_rng_state().tolist(),
        "cuda": [s.tolist() for s in torch.cuda.get_rng_state_all()] if torch.cuda.is_initialized() else [],
    }
    return json.dumps(state).encode()


def _restore_rng(blob: bytes) -> None:
    state = json.loads(blob)
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    numpy_state = state["numpy"]
    numpy_state["state"]["key"] = np.array(numpy_state["state"]["key"], dtype=np.uint32)
    np.random.set_state(numpy_state)
    torch.set_rng_state(torch.tensor(state["torch"], dtype=torch.uint8))
    if state["cuda"]:
        torch.cuda.set_rng_state_all([torch.tensor(s, dtype=torch.uint8) for s in state["cuda"]])
