"""Plan the memory of one training step of a config, on fake tensors (no GPU, no weights needed).

With a ColossalAIStrategy config, it also splits that memory over GPU, CPU and NVMe. Planning needs no
Colossal-AI: where the run itself needs a package this environment lacks, the plan says so in its last line.

    python scripts/plan_memory.py -b configs/finetune/sd-folder.yaml model.params.pretrained=configs/models/sd15 \
        data.params.root=. --gpu-gib 8
"""

from __future__ import annotations

import argparse
import logging
import sys

from ldm.cli import console
from ldm.config import ConfigError, ConfigErrors, load_config
from ldm.training.checks import MissingPackage, check_config
from ldm.training.memory import plan_training_step
from ldm.training.placement import place


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-b", "--base", action="append", required=True, metavar="CONFIG")
    parser.add_argument("--batch-size", type=int, default=None, help="default: data.params.batch_size")
    parser.add_argument("--resolution", type=int, default=None, help="image side in px; default: data.params.size")
    parser.add_argument("--gpu-gib", type=float, default=None, help="say whether the step fits a card this size")
    parser.add_argument("overrides", nargs="*", metavar="key.path=value")
    parser.add_argument("-v", "--verbose", action="store_true", help="show other libraries' messages too")
    args = parser.parse_intermixed_args(argv)
    console.setup(args.verbose)
    if not args.verbose:
        logging.getLogger().setLevel(logging.WARNING)  # the plan is the output
    missing: list[ConfigError] = []
    try:
        cfg, sources = load_config(args.base, args.overrides)
        try:
            check_config(cfg, sources)
        except ConfigError as err:
            errors = err.errors if isinstance(err, ConfigErrors) else [err]
            missing = [e for e in errors if isinstance(e, MissingPackage)]
            if len(missing) < len(errors):
                raise ConfigErrors([e for e in errors if not isinstance(e, MissingPackage)]) from None
        plan = plan_training_step(cfg, args.batch_size, args.resolution)
    except ConfigError as err:
        sys.exit(str(err))
    placement = place(plan, cfg)
    print(plan.table(None if placement else args.gpu_gib))
    if placement:
        print()
        print(placement.table(args.gpu_gib))
    for err in missing:
        print(f"\nto train this config, this environment lacks: {err}")
