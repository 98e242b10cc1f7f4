"""Run records: metrics.jsonl (and optionally TensorBoard scalars) on rank 0, and a progress display."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

from crossbow_mpi.config import ConfigError

TENSORBOARD_DIR = "tensorboard"


def summary_writer_class():
    """Return torch's TensorBoard SummaryWriter; ConfigError when the tensorboard package is not installed."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        raise ConfigError(
            "--tensorboard needs the tensorboard package: pip install 'crossbow_mpi[tensorboard]'"
        ) from None
    return SummaryWriter


class MetricsLog:
    """Append JSON records to RUN_DIR/metrics.jsonl (rank 0 only; other ranks write nothing). With `tensorboard`,
    also write each evaluation record's numbers as scalars at its iteration to RUN_DIR/tensorboard; metrics.jsonl
    stays the complete record."""

    def __init__(self, run_dir: str, enabled: bool, tensorboard: bool = False):
        self.enabled = enabled
        self.path = Path(run_dir) / "metrics.jsonl"
        self.board = summary_writer_class()(str(Path(run_dir) / TENSORBOARD_DIR)) if enabled and tensorboard else None

    def write(self, record: dict) -> None:
        """Append the record as one line of strict JSON: a NaN or infinite value is written as null, and its key is
        listed under `non_finite`."""
        if self.enabled:
            non_finite = [key for key, value in record.items() if isinstance(value, float) and not math.isfinite(value)]
            if non_finite:
                record = {**record, **dict.fromkeys(non_finite), "non_finite": non_finite}
            with self.path.open("a") as fh:
                fh.write(json.dumps(record, allow_nan=False) + "\n")
        if self.board is not None and "event" not in record:
            for name, value in record.items():
                if isinstance(value, (int, float)) and not isinstance(value, bool) and name != "iteration":
                    self.board.add_scalar(name, value, global_step=record["iteration"])
            self.board.flush()

    def close(self) -> None:
        if self.board is not None:
            self.board.close()


class Progress:
    """A tqdm bar over samples on a terminal, plain lines otherwise; silent on ranks other than 0."""

    def __init__(self, total_samples: int, enabled: bool, initial: int = 0):
        self.enabled = enabled
        self.bar = None
        if enabled and sys.stderr.isatty():
            from tqdm import tqdm

            self.bar = tqdm(total=total_samples, initial=initial, unit="sample", unit_scale=True, dynamic_ncols=True)
        self.position = initial

    def advance(self, samples: int) -> None:
        self.position += samples
        if self.bar is not None:
            self.bar.update(samples)

    def report(self, record: dict) -> None:
        if not self.enabled:
            return
        accuracy = "" if record["test_accuracy"] is None else f"test_acc {record['test_accuracy']:.4f} "
        perplexity = f"test_ppl {record['test_perplexity']:.2f} " if "test_perplexity" in record else ""
        line = (
            f"epoch {record['epoch']:.2f} iter {record['iteration']} "
            f"{accuracy}test_loss {record['test_loss']:.4f} {perplexity}"
            f"train_loss {record['train_loss']:.4f} {record['samples_per_s']:.0f} samples/s "
            f"k={record['learners']} t={record['time_s']:.1f}s"
        )
        if self.bar is not None:
            self.bar.set_postfix_str(accuracy or f"test_loss {record['test_loss']:.4f}")
            self.bar.write(line, file=sys.stderr)
        else:
            print(line, file=sys.stderr, flush=True)

    def note(self, text: str) -> None:
        if self.enabled:
            (self.bar.write if self.bar is not None else print)(text, file=sys.stderr)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
