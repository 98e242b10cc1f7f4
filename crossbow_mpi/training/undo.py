"""Put a run directory back as it was when a command that already wrote to it is refused (rank 0).

Taken before the command writes: the directories and files under the run directory, each file's size, inode and an
open descriptor. A run writes a file in one of two ways: it appends (metrics.jsonl, TensorBoard's events) or it
writes a new file and renames it over the old name (checkpoints, config.json); it deletes only old checkpoints.
So `restore` removes what is new, truncates an appended file to its old size, and copies a replaced or deleted
file back from its descriptor, which still reads the old contents. The descriptors stay open until the command
ends, so the space of a checkpoint that existed before and was pruned meanwhile is freed only then.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from pathlib import Path
from typing import BinaryIO


class RunDirUndo:
    """The state of a run directory before a command, to restore on its refusal."""

    def __init__(self, run_dir: str):
        self.root = Path(run_dir).absolute()
        self.created = next((p for p in (*reversed(self.root.parents), self.root) if not p.exists()), None)
        """The outermost directory the command may create (None: the run directory exists)."""
        self.dirs = {p for p in self.root.rglob("*") if p.is_dir()} if self.created is None else set()
        self.files: dict[Path, tuple[int, int, BinaryIO]] = {}
        """Each file: its size, its inode and an open descriptor of it."""
        for path in (p for p in self.root.rglob("*") if p.is_file()) if self.created is None else ():
            with contextlib.suppress(OSError):  # one the run cannot read it cannot change either
                handle = path.open("rb")
                status = os.fstat(handle.fileno())
                self.files[path] = (status.st_size, status.st_ino, handle)

    def restore(self) -> None:
        """Put the run directory back as it was at construction, and close."""
        for path in sorted(self.root.rglob("*"), reverse=True) if self.root.is_dir() else ():
            if path in self.files or path in self.dirs:
                continue
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path)
            else:
                path.unlink()
        for path, (size, inode, handle) in self.files.items():
            if path.exists() and path.stat().st_ino == inode:
                os.truncate(path, size)
                continue
            handle.seek(0)
            with path.open("wb") as out:
                shutil.copyfileobj(handle, out)
        if self.created is not None and self.created.exists():
            shutil.rmtree(self.created)
        self.close()

    def close(self) -> None:
        """Release the descriptors (the state can no longer be restored)."""
        for _, _, handle in self.files.values():
            handle.close()
        self.files.clear()
