"""Train a tiny text-to-image model on handwritten digits on a CPU, then sample and score it.

    python -m examples.digits --out outputs/quickstart      (from the repository root; `make quickstart`)

Writes OUT/samples.png (one row per prompt), OUT/pipeline (a diffusers folder), OUT/report.json.
"""

import argparse
from pathlib import Path

from ldm.cli import console  # first: it hides listed warnings that importing the libraries raises


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="outputs/quickstart")
    parser.add_argument("--autoencoder-steps", type=int, default=None, help="override stage 1's max_steps")
    parser.add_argument("--ldm-steps", type=int, default=None, help="override stage 2's max_steps")
    parser.add_argument("--samples-per-digit", type=int, default=10)
    parser.add_argument("-v", "--verbose", action="store_true", help="show other libraries' messages too")
    args = parser.parse_args(argv)
    console.setup(args.verbose)
    from examples.digits.quickstart import run_quickstart

    report = run_quickstart(Path(args.out), args.autoencoder_steps, args.ldm_steps, args.samples_per_digit)
    out = Path(args.out)
    print(
        f"prompt accuracy {report['prompt_accuracy']:.2f} (digit classifier over {args.samples_per_digit} "
        f"samples per prompt); training {report['train_seconds']:.0f} s, total {report['total_seconds']:.0f} s"
    )
    print(f"samples: {out / 'samples.png'}   pipeline: {out / 'pipeline'}")


if __name__ == "__main__":
    main()
