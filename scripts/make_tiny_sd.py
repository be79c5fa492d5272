"""Write a tiny Stable-Diffusion-shaped pipeline with random weights: `python scripts/make_tiny_sd.py OUT`."""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ldm.models.tiny import write_tiny_sd  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("out", help="output folder (a diffusers pipeline)")
    parser.add_argument(
        "--tokenizer",
        choices=["clip"],
        default="clip",
        help="clip: the real SD 1.x CLIP tokenizer, built offline from open_clip_torch's BPE file",
    )
    parser.add_argument("--prediction-type", choices=["epsilon", "v_prediction"], default="epsilon")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    print(write_tiny_sd(args.out, args.prediction_type, args.seed))


if __name__ == "__main__":
    main()
