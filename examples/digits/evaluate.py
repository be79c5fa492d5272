"""Score a digits pipeline: does each prompt "a handwritten digit D" produce a D, and how far are the samples
from the real digits (the Fréchet distance of the judge's features; lower is better)?

python -m examples.digits.evaluate outputs/quickstart/pipeline [--json scores.json]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch


def main(argv: list[str] | None = None) -> dict:
    """Parse arguments, evaluate the pipeline, print the scores and optionally save them."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("pipeline_dir", help="an exported pipeline folder (UNet or MicroDiT), or a checkpoint")
    parser.add_argument("--samples-per-digit", type=int, default=10)
    parser.add_argument("--steps", type=int, default=25)
    parser.add_argument("--guidance", type=float, default=5.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, default=None, help="write the scores here")
    args = parser.parse_args(argv)

    from examples.digits.data import DigitsDataset
    from examples.digits.judge import (
        classifier_accuracy,
        evaluate_pipeline,
        frechet_distance,
        judge_features,
        real_digit_features,
        train_digit_classifier,
    )
    from ldm.export import load_pipeline

    pipe = load_pipeline(args.pipeline_dir).to("cpu")
    pipe.set_progress_bar_config(disable=True)
    classifier = train_digit_classifier(seed=args.seed)
    test = DigitsDataset(split="test")
    held_out = classifier_accuracy(classifier, test.images, test.labels)
    result = evaluate_pipeline(
        pipe,
        samples_per_digit=args.samples_per_digit,
        num_inference_steps=args.steps,
        guidance_scale=args.guidance,
        seed=args.seed,
        classifier=classifier,
    )
    result.pop("samples")
    result["classifier_test_accuracy"] = held_out
    # the floor: as many real digits as there are samples, against all of them
    count = 10 * args.samples_per_digit
    everything = DigitsDataset().images
    real = everything[torch.randperm(len(everything), generator=torch.Generator().manual_seed(args.seed))[:count]]
    floor = frechet_distance(judge_features(classifier, real), real_digit_features(classifier))
    result["frechet_distance_real"] = floor
    print(f"classifier held-out accuracy: {held_out:.3f}")
    print(f"prompt accuracy: {result['accuracy']:.3f}")
    print(f"Fréchet distance to the real digits: {result['frechet_distance']:.2f} ({count} real digits: {floor:.2f})")
    print("per digit: " + "  ".join(f"{d}:{a:.2f}" for d, a in enumerate(result["per_digit"])))
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
