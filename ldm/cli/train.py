"""Train a latent diffusion model: `python main.py -t -b config.yaml [key.path=value ...]`."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ldm.cli import console
from ldm.config import ConfigError
from ldm.training.checkpoint_io import CheckpointError
from ldm.training.run import RunStopped, dry_run, train


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("-t", "--train", action="store_true", help="train (the only mode)")
    parser.add_argument(
        "-b", "--base", action="append", default=[], metavar="CONFIG", help="YAML config; later files win"
    )
    parser.add_argument("-l", "--logdir", default="logs", help="folder for run folders (default: logs)")
    parser.add_argument("-n", "--name", default=None, help="run name (default: first config's file name)")
    parser.add_argument("-s", "--seed", type=int, default=23, help="global seed (default: 23)")
    parser.add_argument("-r", "--resume", default=None, metavar="PATH|auto", help="continue a run or checkpoint")
    parser.add_argument(
        "--scale_lr",
        type=_boolean,
        default=True,
        metavar="true|false",
        help="scale model.base_learning_rate by accumulation x devices x batch size, as CompVis (default: true)",
    )
    parser.add_argument(
        "--dry-run", action="store_true", help="check the config, print the run's plan and exit without training"
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="show other libraries' noise (ldm.cli.noise)")
    parser.add_argument("overrides", nargs="*", metavar="key.path=value", help="config overrides; win over files")
    return parser.parse_intermixed_args(argv)  # overrides may come before or after flags


def _boolean(value: str) -> bool:
    if value.lower() not in ("true", "false", "yes", "no", "1", "0"):
        raise argparse.ArgumentTypeError(f"got {value!r}; valid: true, false")
    return value.lower() in ("true", "yes", "1")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    console.setup(args.verbose)
    if not (args.train or args.dry_run):
        print(f"{Path(sys.argv[0]).name}: nothing to do; pass -t to train, or --dry-run for its plan", file=sys.stderr)
        return 2
    try:
        if args.dry_run:
            print("\n".join(dry_run(args.base, args.overrides, args.logdir, args.name, args.resume, args.scale_lr)))
            return 0
        train(args.base, args.overrides, args.logdir, args.name, args.seed, args.resume, args.scale_lr)
    except ConfigError as err:  # every mistake found, one line each, the key path first
        print(err, file=sys.stderr)
        return 2
    except CheckpointError as err:
        print(f"checkpoint error: {err}", file=sys.stderr)
        return 1
    except RunStopped as stop:
        print(stop, file=sys.stderr)
        return stop.exit_code
    return 0
