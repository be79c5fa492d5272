"""MicroDiT against the UNet on the digits: the two quickstart recipes, trained one after the other in one run.

    python benchmarks/microdit_vs_unet.py [--target 0.8] [--eval-every 15] [--seed 0]
        [--vae outputs/quickstart/vae] [--smoke]

Two sides, each its config as `main.py -t -b CONFIG -s SEED` trains it, on the latents of the same stage-1
autoencoder (trained here first and not timed, unless `--vae` names one) and the same digit judge:
- unet: `configs/quickstart/digits-ldm.yaml`, the quickstart (a UNet, DDPM noise prediction with Min-SNR
  weighting, DDIM sampling);
- microdit: `configs/quickstart/digits-microdit.yaml` (a MicroDiT: EDM, 75 % of the patches dropped behind a
  patch mixer, expert-choice feed-forwards, EDM Euler sampling).
Both train 800 steps at batch 128, learning rate 1e-3 after 20 warm-up steps, gradient clip 1.0, caption
dropout 0.1, with latents and captions cached.

Until a side first reaches `--target`, it is paused every `--eval-every` seconds of training and judged at
guidance 2 (10 samples per digit, 25 steps): the time to the target is the training time (caching included,
judging not) at the first judgement at or above it. After its last step, the side's checkpoint is loaded as a
pipeline and judged once more at guidance 2: the final prompt accuracy and the Fréchet distance of the judge's
features to the real digits (lower is better; the diversity check).
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import REPO, SMOKE_DIGITS, parser, quiet, report  # noqa: E402
from benchmarks.masking import autoencoder_and_judge, judge  # noqa: E402
from benchmarks.time_to_quality import AccuracyClock  # noqa: E402

SIDES = {
    "unet": REPO / "configs" / "quickstart" / "digits-ldm.yaml",
    "microdit": REPO / "configs" / "quickstart" / "digits-microdit.yaml",
}
GUIDANCE = 2.0
CLOCK: AccuracyClock | None = None  # the clock of the side training now (runs here are one at a time)
SUMMARY: dict[str, Any] = {}  # what the callback saw of that side: its training seconds, steps, parameters


class JudgeUntilReached(pl.Callback):
    """Judge after optimizer steps, when due, until the target is first reached; then let the run finish."""

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args) -> None:
        if CLOCK.reached() is None:
            CLOCK.check(trainer.global_step, pl_module.parts)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        SUMMARY.update(train_s=CLOCK.elapsed(), steps=trainer.global_step,
                       denoiser_parameters=sum(p.numel() for p in pl_module.parts.unet.parameters()))  # fmt: skip


def run_side(config: Path, name: str, clock_args: dict, vae: Path, work: Path, seed: int, overrides: list[str]) -> dict:
    """Train one side's recipe with the judging callback; its clock points, time to target and final scores."""
    from benchmarks import microdit_vs_unet as this  # the module the config's callback target imports
    from ldm.training.run import train

    this.CLOCK = AccuracyClock(**clock_args)
    this.SUMMARY.clear()
    run = train(
        [str(config)],
        [
            f"model.params.vae.pretrained={vae}",
            "lightning.trainer.enable_progress_bar=false",
            "lightning.trainer.enable_model_summary=false",
            "lightning.callbacks.image_logger=null",
            "lightning.callbacks.judge.target=benchmarks.microdit_vs_unet.JudgeUntilReached",
            *overrides,
        ],
        work / "logs",
        f"versus-{name}",
        seed=seed,
    )
    final = judge(run / "checkpoints" / "last.ckpt", clock_args["classifier"], clock_args["samples_per_digit"],
                  clock_args["inference_steps"])  # fmt: skip
    return {**this.SUMMARY, "reached_s": this.CLOCK.reached(), "points": this.CLOCK.points, **final}


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--target", type=float, default=0.8, help="prompt accuracy to reach")
    p.add_argument("--eval-every", type=float, default=15.0, help="seconds of training between judgements")
    p.add_argument("--seed", type=int, default=0, help="the training seed of both sides (main.py -s)")
    p.add_argument("--vae", type=Path, help="a stage-1 autoencoder folder (default: train one first)")
    args = p.parse_args()
    quiet()
    samples, steps, overrides = 10, 25, []
    if args.smoke:
        samples, steps, args.eval_every = 1, 2, 0.0
        overrides = ["data.params.batch_size=8", "lightning.trainer.max_steps=3",
                     "lightning.modelcheckpoint.params.every_n_train_steps=3", SMOKE_DIGITS]  # fmt: skip
    sides: dict[str, dict] = {}
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        vae, classifier = autoencoder_and_judge(args.vae, work, args.smoke)
        clock_args = dict(target=args.target, budget_s=float("inf"), every_s=args.eval_every,
                          samples_per_digit=samples, inference_steps=steps, classifier=classifier,
                          guidance_scale=GUIDANCE)  # fmt: skip
        for name, config in SIDES.items():
            sides[name] = run_side(config, name, clock_args, vae, work, args.seed, overrides)
            side = sides[name]
            print(f"  {name}: {side['steps']} steps in {side['train_s']:.0f} s, accuracy {side['accuracy']:.2f}, "
                  f"FD {side['frechet_distance']:.2f}", flush=True)  # fmt: skip

    def reached(side: dict) -> str:
        if side["reached_s"] is not None:
            step = next(n for s, n, _ in side["points"] if s == side["reached_s"])
            return f"{side['reached_s']:.0f} s (step {step})"
        return "not reached"

    table = [
        f"MicroDiT vs UNet on the digits, seed {args.seed}, judged at guidance {GUIDANCE:g} "
        f"({samples} samples per digit, {steps} steps); training seconds include caching, not judging",
        f"| | denoiser parameters | time to {args.target:.0%} | training | final accuracy | Fréchet distance |",
        "|---|---|---|---|---|---|",
        *(
            f"| {name} | {side['denoiser_parameters']:,} | {reached(side)} | {side['steps']} steps, "
            f"{side['train_s']:.0f} s | {side['accuracy']:.2f} | {side['frechet_distance']:.2f} |"
            for name, side in sides.items()
        ),  # fmt: skip
        *(
            f"  {name} judged: " + ", ".join(f"{s:.0f} s (step {n}): {a:.0%}" for s, n, a in side["points"])
            for name, side in sides.items()
        ),  # fmt: skip
        f"  whole run {time.perf_counter() - started:.0f} s",
    ]
    result = {"target": args.target, "eval_every_s": args.eval_every, "seed": args.seed,
              "guidance_scale": GUIDANCE, "sides": sides}  # fmt: skip
    headline = f"microdit vs unet, digits, guidance {GUIDANCE:g}: " + "; ".join(
        f"{name} to {args.target:.0%} {reached(side)}, final acc {side['accuracy']:.2f} FD "
        f"{side['frechet_distance']:.2f}"
        for name, side in sides.items()
    )
    report("microdit_vs_unet", table, result, headline, args.json)


if __name__ == "__main__":
    main()
