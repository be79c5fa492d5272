"""Time to quality on the quickstart's digits task: wall time until generated digits are right 80 % of the time.

    python benchmarks/time_to_quality.py [--target 0.8] [--budget 900] [--eval-every 15]
        [--set KEY=VALUE ...] [--ours KEY=VALUE ...] [--smoke]

Both sides train the same text-to-image model from scratch (the quickstart's, as
`configs/quickstart/digits-ldm.yaml` describes it, on latents of the same stage-1 autoencoder, trained here first
and not timed) with the same batch, learning rate, warm-up, clipping and caption dropout:
- ours: the quickstart recipe through `ldm.training.run.train` (latents and captions encoded once, Min-SNR
  weighting, full batches only);
- plain: the diffusers-style loop of `benchmarks/baseline.py` (VAE and text encoder every step, plain
  MSE). It trains the parts the config trains, and drops the last partial batch as it always does.
Every `--eval-every` seconds of training each side is paused and judged: 10 samples per digit prompt
(DDIM, 25 steps, guidance 5), scored by the quickstart's digit classifier. Judging is not timed. A
side stops at the target or at `--budget` seconds. Prints a table, a JSON line, and last the ratio
of our time to the plain loop's (the target is at most 0.5).
"""

from __future__ import annotations

import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from omegaconf import OmegaConf

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.baseline import PlainParts, plain_train  # noqa: E402
from benchmarks.common import REPO, SMOKE_DIGITS, parser, quiet, report  # noqa: E402

LDM_CONFIG = REPO / "configs" / "quickstart" / "digits-ldm.yaml"
CLOCK: AccuracyClock | None = None  # the clock the callback below reports to (set by `run_ours`)


@dataclass
class AccuracyClock:
    """Training wall time with judging paused, and prompt accuracy every `every_s` seconds of it."""

    target: float
    budget_s: float
    every_s: float
    samples_per_digit: int
    inference_steps: int
    classifier: torch.nn.Module
    guidance_scale: float = 5.0
    points: list[tuple[float, int, float]] = field(default_factory=list)  # (seconds, step, accuracy)
    start: float = field(default_factory=time.perf_counter)
    paused: float = 0.0

    def elapsed(self) -> float:
        return time.perf_counter() - self.start - self.paused

    def reached(self) -> float | None:
        """Seconds of training at the first judgement at or above the target, if any."""
        return next((s for s, _, accuracy in self.points if accuracy >= self.target), None)

    def check(self, step: int, parts: Any) -> bool:
        """Judge the model when due; True when the side should stop (target reached or budget spent)."""
        from examples.digits.judge import evaluate_pipeline
        from ldm.sampling import build_pipeline

        seconds = self.elapsed()
        last = self.points[-1][0] if self.points else 0.0
        if seconds - last < self.every_s and seconds < self.budget_s:
            return False
        paused_at = time.perf_counter()
        modules = [parts.unet, parts.text_encoder]
        modes = [m.training for m in modules]
        for m in modules:
            m.eval()
        pipe = build_pipeline(parts)
        pipe.set_progress_bar_config(disable=True)
        result = evaluate_pipeline(
            pipe, self.samples_per_digit, self.inference_steps, self.guidance_scale, classifier=self.classifier
        )
        for m, mode in zip(modules, modes):
            m.train(mode)
        self.points.append((round(seconds, 1), step, result["accuracy"]))
        self.paused += time.perf_counter() - paused_at
        return result["accuracy"] >= self.target or seconds >= self.budget_s


class JudgeEvery(pl.Callback):
    """Our side's hook into the clock: judge after optimizer steps, stop the Trainer when told."""

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args) -> None:
        if CLOCK.check(trainer.global_step, pl_module.parts):
            trainer.should_stop = True


def run_ours(clock_args: dict, vae_dir: Path, work: Path, max_steps: int, overrides: list[str] = ()) -> AccuracyClock:
    """The quickstart recipe, as `main.py -t -b configs/quickstart/digits-ldm.yaml` runs it."""
    from benchmarks import time_to_quality as this  # the module the config's callback target imports
    from ldm.training.run import train

    this.CLOCK = AccuracyClock(**clock_args)
    train(
        [str(LDM_CONFIG)],
        [
            f"model.params.vae.pretrained={vae_dir}",
            f"lightning.trainer.max_steps={max_steps}",
            "lightning.trainer.enable_progress_bar=false",
            "lightning.trainer.enable_model_summary=false",
            "lightning.callbacks.image_logger=null",
            f"lightning.modelcheckpoint.params.every_n_train_steps={max_steps}",
            "lightning.callbacks.judge.target=benchmarks.time_to_quality.JudgeEvery",
            *overrides,
        ],
        work / "logs",
        "digits-ours",
        seed=0,
    )
    return this.CLOCK


def run_plain(clock_args: dict, vae_dir: Path, max_steps: int, overrides: list[str] = ()) -> AccuracyClock:
    """The same model and hyperparameters in the plain loop."""
    from examples.digits.data import DigitsDataset
    from ldm.components.build import build_parts

    clock = AccuracyClock(**clock_args)
    cfg = OmegaConf.merge(OmegaConf.load(LDM_CONFIG), OmegaConf.from_dotlist(list(overrides)))
    cfg = OmegaConf.to_container(cfg, resolve=True)
    model, data = cfg["model"]["params"], cfg["data"]["params"]
    torch.manual_seed(0)
    specs = {name: model[name] for name in ("unet", "text_encoder", "tokenizer", "scheduler")}
    parts = build_parts(None, vae={"pretrained": str(vae_dir)}, **specs)
    plain_parts = PlainParts(parts.unet, parts.vae, parts.text_encoder, parts.tokenizer, parts.scheduler)
    plain_train(
        plain_parts,
        DigitsDataset(**data["dataset"]["params"]),
        batch_size=data["batch_size"],
        steps=max_steps,
        learning_rate=model["learning_rate"],
        trainable=model["trainable"],
        caption_dropout=data["caption_dropout"],
        max_grad_norm=cfg["lightning"]["trainer"]["gradient_clip_val"],
        lr_warmup_steps=model["lr_warmup_steps"],
        on_step=lambda step, run: clock.check(step, parts),
    )
    return clock


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--target", type=float, default=0.8, help="prompt accuracy to reach")
    p.add_argument("--budget", type=float, default=900.0, help="seconds of training at most, per side")
    p.add_argument("--eval-every", type=float, default=15.0, help="seconds of training between judgements")
    p.add_argument("--set", nargs="+", default=[], metavar="KEY=VALUE",
                   help="config overrides for both sides, e.g. model.params.learning_rate=2e-3")  # fmt: skip
    p.add_argument("--ours", nargs="+", default=[], metavar="KEY=VALUE",
                   help="config overrides for our side only, e.g. model.params.snr_gamma=null to ablate")  # fmt: skip
    args = p.parse_args()
    from examples.digits.judge import train_digit_classifier
    from examples.digits.quickstart import train_autoencoder

    quiet()
    autoencoder_steps, max_steps, samples, steps = (5, 3, 1, 2) if args.smoke else (None, 100_000, 10, 25)
    if args.smoke:
        args.eval_every, args.budget, args.set = 0.0, 0.0, [*args.set, "data.params.batch_size=8", SMOKE_DIGITS]
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        train_autoencoder(work, autoencoder_steps)
        classifier = train_digit_classifier(epochs=1 if args.smoke else 10)
        clock_args = dict(target=args.target, budget_s=args.budget, every_s=args.eval_every,
                          samples_per_digit=samples, inference_steps=steps, classifier=classifier)  # fmt: skip
        sides = {"ours": run_ours(clock_args, work / "vae", work, max_steps, args.set + args.ours)}
        sides["plain"] = run_plain(clock_args, work / "vae", max_steps, args.set)

    table = [f"digits task: seconds of training to {args.target:.0%} prompt accuracy (judging not timed)"]
    for name, clock in sides.items():
        reached = clock.reached()
        table.append(f"  {name:<6} " + (f"reached at {reached:.0f} s" if reached is not None else
                                          f"not reached in {clock.points[-1][0]:.0f} s"))  # fmt: skip
        table.append("         " + ", ".join(f"{s:.0f} s (step {n}): {a:.0%}" for s, n, a in clock.points))
    ours_s, plain_s = sides["ours"].reached(), sides["plain"].reached()
    plain_spent = sides["plain"].points[-1][0]
    result: dict[str, Any] = {"target": args.target, "budget_s": args.budget, "eval_every_s": args.eval_every,
                              "set": args.set, "ours_set": args.ours}  # fmt: skip
    result.update({name: {"reached_s": c.reached(), "points": c.points} for name, c in sides.items()})
    if ours_s is None:
        ratio, headline = None, f"ours did not reach {args.target:.0%} in {sides['ours'].points[-1][0]:.0f} s"
    elif plain_s is None:
        ratio = ours_s / max(plain_spent, 1e-9)
        headline = f"ours {ours_s:.0f} s; plain did not reach it in {plain_spent:.0f} s, so the ratio is below"
    else:
        ratio, headline = ours_s / plain_s, f"ours {ours_s:.0f} s vs plain {plain_s:.0f} s ="
    result["ratio"] = ratio
    suffix = f" {ratio:.2f}x (target <= 0.5)" if ratio is not None else ""
    report("time_to_quality", table, result, f"time to quality: digits to {args.target:.0%}: {headline}{suffix}",
           args.json)  # fmt: skip


if __name__ == "__main__":
    main()
