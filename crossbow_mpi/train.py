"""Command line: `mpirun -np N python -m crossbow_mpi.train [--flags]`, a thin layer over Trainer."""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import itertools
import os
import sys

from crossbow_mpi.config import ArgumentParser, Config, ConfigError, coerce, load_toml
from crossbow_mpi.runtime import signals
from crossbow_mpi.runtime.launchers import launched

EXIT_USER_ERROR = 2
EXIT_DIVERGED = 3
EXIT_PREEMPTED = 75


def field_docs(cls) -> dict[str, str]:
    """Return each dataclass field's docstring (the string literal that follows it)."""
    tree = ast.parse(inspect.getsource(cls))
    class_def = tree.body[0]
    assert isinstance(class_def, ast.ClassDef)
    docs = {}
    for node, following in itertools.pairwise(class_def.body):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(following, ast.Expr)
            and isinstance(following.value, ast.Constant)
            and isinstance(following.value.value, str)
        ):
            docs[node.target.id] = following.value.value
    return docs


def build_parser(quiet: bool = False) -> argparse.ArgumentParser:
    parser = ArgumentParser(
        prog="python -m crossbow_mpi.train",
        description="Train a model over MPI ranks with several learners per device "
        "(SMA, synchronous SGD or eager-SGD).",
        argument_default=argparse.SUPPRESS,
        allow_abbrev=False,
    )
    parser.add_argument("--config", metavar="RUN.toml", help="TOML file with config keys; flags override it.")
    docs = field_docs(Config)
    for f in dataclasses.fields(Config):
        flag = "--" + f.name.replace("_", "-")
        default = f.default
        help_text = f"{docs.get(f.name, '')} (default: {default!r})".replace("%", "%%")
        if f.type == "bool":
            parser.add_argument(flag, nargs="?", const=True, metavar="true|false", help=help_text)
        else:
            parser.add_argument(flag, metavar=f.name.upper(), help=help_text)
    if quiet:
        parser.print_help = lambda file=None: None  # type: ignore[method-assign]  # this parser's help only
    return parser


def parse_config(argv: list[str] | None, quiet: bool = False) -> Config:
    """Merge defaults, the optional TOML file and flags into a Config."""
    args = vars(build_parser(quiet).parse_args(argv))
    values = load_toml(args.pop("config")) if "config" in args else {}
    fields = {f.name: f for f in dataclasses.fields(Config)}
    values = {k.replace("-", "_"): v for k, v in values.items()}
    values.update({name: coerce(fields[name], value) for name, value in args.items()})
    return Config.from_dict(values)


def refuse(err: ConfigError) -> int:
    print(f"crossbow_mpi: error: {err}", file=sys.stderr, flush=True)
    return EXIT_USER_ERROR


def check(argv: list[str]) -> int:
    """Parse and validate `argv` as the ranks will, in this one process: 0 when they would start (help is left to
    them), else crossbow_mpi's one line and EXIT_USER_ERROR. The launch scripts run it before the launcher, whose
    own report of a failed job would follow that line."""
    if {"-h", "--help"} & set(argv):
        return 0
    from crossbow_mpi.algorithms import ALGORITHMS

    try:
        parse_config(argv).validate(ALGORITHMS)
    except ConfigError as err:
        return refuse(err)
    return 0


def main(argv: list[str] | None = None) -> int:
    signals.install_stop_signals()  # first: a stop signal during the imports below is a stop, not a crash
    rank, size = launched()
    try:  # before torch and MPI load: a mistyped flag or value is one line, at once
        config: Config | ConfigError = parse_config(argv, quiet=rank != 0)
    except ConfigError as err:
        if size > 1:  # refuse once MPI runs: a rank that left before MPI_Init could end the job before rank 0 says
            config = err  # why, and a --config file may be missing on one node only, leaving the others in MPI_Init
        else:
            return refuse(err)
    from crossbow_mpi.runtime import process, ulfm
    from crossbow_mpi.training.checkpoint import CheckpointError
    from crossbow_mpi.training.trainer import DivergenceError

    process.install_abort_on_failure()
    rank = process.mpi().COMM_WORLD.Get_rank()
    launcher = process.launcher_taking_sigusr1() if rank == 0 else None
    if launcher:
        print(
            f"crossbow_mpi: note: the launcher {launcher} has LLVM loaded (by hwloc's OpenCL plugin), which takes "
            "SIGUSR1: one sent to it will not stop the ranks; start it with HWLOC_COMPONENTS=-opencl",
            file=sys.stderr,
            flush=True,
        )
    try:
        if isinstance(config, ConfigError):
            raise config
        return run(config, rank)
    except ulfm.RankLost as err:
        if ulfm.leader(rank):
            print(f"crossbow_mpi: error: {err}; resume with --resume on the ranks left", file=sys.stderr, flush=True)
        return ulfm.EXIT_RANK_LOST
    except (ConfigError, CheckpointError, DivergenceError) as err:
        if ulfm.leader(rank):
            print(f"crossbow_mpi: error: {err}", file=sys.stderr, flush=True)
        return EXIT_DIVERGED if isinstance(err, DivergenceError) else EXIT_USER_ERROR


def run(config: Config, rank: int) -> int:
    import torch.nn.functional as F

    from crossbow_mpi.data import build_dataset
    from crossbow_mpi.models import LANGUAGE_MODELS, build_model, token_cross_entropy
    from crossbow_mpi.runtime import ulfm
    from crossbow_mpi.training.trainer import Trainer, agree

    trainer = Trainer(config)
    train_set, test_set = agree(
        trainer.comm, lambda: build_dataset(config.dataset, config.data_dir, config.seed, config.seq_len)
    )

    def model_fn():
        return build_model(config.model, train_set.input_shape, train_set.num_classes, config.model_args)

    agree(trainer.comm, model_fn)  # a size the model cannot take is one line, before training
    loss_fn = token_cross_entropy if config.model in LANGUAGE_MODELS else F.cross_entropy
    result = trainer.fit(model_fn, train_set, test_set, loss_fn)
    speaks = ulfm.leader(rank)  # after a rank loss, rank 0 of the survivors
    if result.preempted:
        if speaks:
            print(
                f"stopped by a signal after {result.iterations} iterations; checkpoint written to "
                f"{config.run_dir}; continue with --resume",
                flush=True,
            )
        return EXIT_PREEMPTED
    if speaks:
        targets = " or ".join(
            ([f"{config.target_accuracy:.2%}"] if config.target_accuracy > 0 else [])
            + ([f"test loss {config.target_loss:g}"] if config.target_loss is not None else [])
        )
        outcome = (
            f"reached {targets} in {result.time_to_target_s:.1f} s"
            if result.reached
            else f"did not reach {targets}"
            if targets
            else "trained to the epoch limit"
        )
        tested = f"test loss {result.test_loss:.4f}" + (
            "" if result.test_accuracy is None else f", test accuracy {result.test_accuracy:.4f}"
        )
        print(
            f"{outcome}; {tested} after {result.epochs:.2f} epochs, "
            f"{result.iterations} iterations, {result.learners} learners/rank; "
            f"records in {os.path.join(config.run_dir, 'metrics.jsonl')}",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    code = main()
    if "mpi4py.MPI" in sys.modules:  # not after a refused command line, which MPI never saw
        from crossbow_mpi.runtime import process, ulfm

        if code == EXIT_PREEMPTED or ulfm.shrunk():
            process.exit_promptly(code, finalize=not ulfm.shrunk())
    sys.exit(code)
