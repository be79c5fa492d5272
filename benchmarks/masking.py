"""What deferred masking buys: four MicroDiT arms on the digits task at equal training FLOPs.

    python benchmarks/masking.py [--budgets 200 400 800] [--seeds 0 1 2] [--batch-size 64]
        [--vae outputs/quickstart/vae] [--results runs.jsonl] [--smoke]

The MicroDiT paper (Sehwag et al. 2024) claims that dropping 75 % of the patches *after* a light patch mixer
keeps most of the quality of unmasked training at a fraction of its compute, where dropping them before any
mixing (naive masking) loses badly. Four arms of `configs/quickstart/digits-microdit.yaml` (EDM, 4x8x8
latents, patch 1: 64 tokens; 16 kept when masked) test it:

- A: an unmasked DiT (no mixer, no masking);
- B: naive 75 % masking: the same DiT, patches dropped right after the embedding;
- C: deferred 75 % masking behind the config's one-block patch mixer (MicroDiT);
- D: an unmasked DiT made smaller (width and depth) to cost what C costs per step.

Each arm trains to the same FLOPs: a budget of N is N steps of arm A. The FLOPs of one step (the denoiser's
forward and backward at the batch size; the latents and text states are cached, so the encoders do not run)
are counted with `torch.utils.flop_counter`. Masked arms spend their last 10 % of steps unmasked, as the
paper does, so their step count comes from 0.9 masked + 0.1 unmasked steps. Each run is then judged at
guidance 2 (10 samples per digit, EDM Euler, 25 steps): prompt accuracy by the digits classifier, and the
Fréchet distance of its features to the real digits (lower is better). Prints per arm and budget the mean
and spread over seeds, with wall time; the headline is the largest budget. The stage-1 autoencoder is
trained first (not timed) unless `--vae` names one. With `--results FILE` each finished run is appended to
FILE (JSON lines) and runs already there are skipped, so a long benchmark can be run in parts (one budget at
a time) or continued after it was stopped; the table is made from every run in FILE that the arguments ask for.
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from omegaconf import OmegaConf

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import REPO, SMOKE_DIGITS, parser, quiet, report  # noqa: E402

CONFIG = REPO / "configs" / "quickstart" / "digits-microdit.yaml"
UNMASKED_SHARE = 0.1  # the last share of a masked arm's steps, trained unmasked
ARMS = {
    "A": ("unmasked DiT", {"mask_ratio": 0.0, "patch_mixer_depth": 0}),
    "B": ("naive 75 % masking, no mixer", {"mask_ratio": 0.75, "patch_mixer_depth": 0}),
    "C": ("deferred 75 % masking, mixer", {"mask_ratio": 0.75}),
    "D": ("unmasked DiT, smaller to C's FLOPs", {"mask_ratio": 0.0, "patch_mixer_depth": 0}),
}


class UnmaskAt(pl.Callback):
    """From optimizer step `step` on, train on every patch (the paper's short unmasked finish)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args) -> None:
        if trainer.global_step >= self.step:
            pl_module.objective.mask_ratio = 0.0


class TrainingClock(pl.Callback):
    """Seconds from the first training batch to the end of training (setup and caching apart). The newest one
    is `LAST`: runs here are one at a time."""

    def __init__(self) -> None:
        global LAST
        self.start: float | None = None
        self.seconds = 0.0
        LAST = self

    def on_train_batch_start(self, *args) -> None:
        if self.start is None:
            self.start = time.perf_counter()

    def on_train_end(self, *args) -> None:
        self.seconds = time.perf_counter() - (self.start or time.perf_counter())


LAST: TrainingClock | None = None


def denoiser_config(overrides: dict) -> dict:
    cfg = OmegaConf.to_container(OmegaConf.load(CONFIG), resolve=True)
    return {**cfg["model"]["params"]["unet"]["config"], **overrides}


def step_flops(config: dict, batch: int, mask_ratio: float) -> float:
    """FLOPs of one training step of the denoiser: forward and backward at `batch`, `mask_ratio` dropped."""
    from torch.utils.flop_counter import FlopCounterMode

    from ldm.backbones.microdit import MicroDiT
    from ldm.diffusion import random_keep

    model = MicroDiT(**config)
    size = config["sample_size"]
    noisy = torch.randn(batch, config["in_channels"], size, size)
    cond = {"encoder_hidden_states": torch.randn(batch, 16, config["caption_channels"])}
    keep = random_keep(batch, model.num_patches(size, size), mask_ratio) if mask_ratio else None
    with FlopCounterMode(display=False) as counter:
        model(noisy, torch.rand(batch), cond, keep).square().mean().backward()
    return float(counter.get_total_flops())


def smaller_to_match(target: float, batch: int) -> dict:
    """Arm D: the unmasked DiT (widths in steps of 16, depths 1 to the config's) whose step FLOPs are nearest
    `target`."""
    base = denoiser_config({})
    best: tuple[float, dict] | None = None
    for depth in range(1, base["depth"] + 1):
        for width in range(16, base["width"] + 1, 16):
            config = {**ARMS["D"][1], "width": width, "depth": depth, "caption_channels": base["caption_channels"]}
            config.pop("mask_ratio")
            gap = abs(step_flops(denoiser_config(config), batch, 0.0) - target)
            if best is None or gap < best[0]:
                best = (gap, config)
    return best[1]


def arm_overrides(arm: str, d_shape: dict) -> tuple[float, dict]:
    """The arm's mask ratio and its denoiser config overrides."""
    settings = dict(ARMS[arm][1])
    mask_ratio = settings.pop("mask_ratio")
    if arm == "D":
        settings.update({k: v for k, v in d_shape.items() if k in ("width", "depth")})
    return mask_ratio, settings


def unmasked_from(arm: str, steps: int) -> int:
    """The step from which a run of `arm` trains unmasked (`steps`: never)."""
    return steps - round(UNMASKED_SHARE * steps) if ARMS[arm][1]["mask_ratio"] else steps


def train_arm(vae: Path, work: Path, arm: str, d_shape: dict, steps: int, batch: int, seed: int,
              overrides: list[str] = ()) -> tuple[Path, float]:  # fmt: skip
    """Train one arm for `steps` optimizer steps (`overrides` last); the checkpoint and the training seconds."""
    from benchmarks import masking as this  # the module the run's config imports (this file runs as __main__)
    from ldm.training.run import train

    mask_ratio, denoiser = arm_overrides(arm, d_shape)
    run = train(
        [str(CONFIG)],
        [
            f"model.params.vae.pretrained={vae}",
            f"model.params.mask_ratio={mask_ratio}",
            *(f"model.params.unet.config.{k}={v}" for k, v in denoiser.items()),
            f"data.params.batch_size={batch}",
            f"lightning.trainer.max_steps={steps}",
            "lightning.trainer.enable_progress_bar=false",
            "lightning.trainer.enable_model_summary=false",
            "lightning.callbacks.image_logger=null",
            f"lightning.modelcheckpoint.params.every_n_train_steps={steps}",
            "lightning.callbacks.unmask.target=benchmarks.masking.UnmaskAt",
            f"lightning.callbacks.unmask.params.step={unmasked_from(arm, steps)}",
            "lightning.callbacks.clock.target=benchmarks.masking.TrainingClock",
            *overrides,
        ],
        work / "logs",
        f"masking-{arm}-{steps}-{seed}",
        seed=seed,
    )
    return run / "checkpoints" / "last.ckpt", this.LAST.seconds


def judge(checkpoint: Path, classifier: torch.nn.Module, samples: int, steps: int) -> dict[str, float]:
    from examples.digits.judge import evaluate_pipeline
    from ldm.export import load_pipeline

    pipe = load_pipeline(checkpoint).to("cpu")
    pipe.set_progress_bar_config(disable=True)
    result = evaluate_pipeline(pipe, samples, steps, guidance_scale=2.0, classifier=classifier)
    return {"accuracy": result["accuracy"], "frechet_distance": result["frechet_distance"]}


def autoencoder_and_judge(vae: Path | None, work: Path, smoke: bool) -> tuple[Path, torch.nn.Module]:
    """The stage-1 autoencoder folder (`vae`, or one trained into `work`) and a freshly trained digit judge."""
    from examples.digits.judge import train_digit_classifier
    from examples.digits.quickstart import train_autoencoder

    if vae is None:
        train_autoencoder(work, 5 if smoke else None)
        vae = work / "vae"
    return vae, train_digit_classifier(epochs=1 if smoke else 10)


def finished_runs(path: Path | None, batch: int) -> list[dict[str, Any]]:
    """The runs at `batch` already recorded in the `--results` file (none without one)."""
    if path is None or not path.exists():
        return []
    rows = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError as e:
            raise SystemExit(f"{path}:{number}: not a recorded run ({e}); delete that line to run it again") from e
    return [r for r in rows if r["batch_size"] == batch]


def spread(values: list[float]) -> str:
    mean = statistics.fmean(values)
    return f"{mean:.2f} ± {statistics.stdev(values):.2f}" if len(values) > 1 else f"{mean:.2f}"


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--budgets", type=int, nargs="+", default=[200, 400, 800], help="in steps of arm A")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ARMS))
    p.add_argument("--vae", type=Path, help="a stage-1 autoencoder folder (default: train one first)")
    p.add_argument("--results", type=Path, help="a JSON-lines file of finished runs: each run is appended as it "
                   "ends, and runs already in it (same arm, budget, seed, batch size) are not run again")  # fmt: skip
    args = p.parse_args()
    quiet()
    samples, inference_steps = (10, 25)
    if args.smoke:
        args.budgets, args.seeds, args.batch_size, samples, inference_steps = [2], [0], 8, 1, 2
    batch = args.batch_size
    per_step: dict[str, float] = {}  # FLOPs of a step, over a run
    d_shape: dict = {}
    for arm in ARMS:  # in order: D is sized by C
        if arm == "D":
            d_shape = smaller_to_match(per_step["C"], batch)
        mask_ratio, denoiser = arm_overrides(arm, d_shape)
        config = denoiser_config(denoiser)
        unmasked = step_flops(config, batch, 0.0)
        masked = step_flops(config, batch, mask_ratio) if mask_ratio else unmasked
        per_step[arm] = (1 - UNMASKED_SHARE) * masked + UNMASKED_SHARE * unmasked

    rows = finished_runs(args.results, batch)
    pending = [(budget, arm, max(round(budget * per_step["A"] / per_step[arm]), 1), seed)
            for budget in args.budgets for arm in args.arms for seed in args.seeds
            if not any(r["arm"] == arm and r["budget"] == budget and r["seed"] == seed for r in rows)]  # fmt: skip
    data = [SMOKE_DIGITS] if args.smoke else []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        if pending:  # with every run recorded, no autoencoder or judge is needed
            vae, classifier = autoencoder_and_judge(args.vae, work, args.smoke)
        for budget, arm, steps, seed in pending:
            checkpoint, seconds = train_arm(vae, work, arm, d_shape, steps, batch, seed, data)
            scores = judge(checkpoint, classifier, samples, inference_steps)
            rows.append({"arm": arm, "budget": budget, "seed": seed, "steps": steps,
                         "unmasked_from": unmasked_from(arm, steps), "train_s": round(seconds, 1),
                         "batch_size": batch, **scores})  # fmt: skip
            if args.results is not None:
                with args.results.open("a") as f:
                    f.write(json.dumps(rows[-1]) + "\n")
            accuracy, distance = scores["accuracy"], scores["frechet_distance"]
            print(f"  {arm} budget {budget} seed {seed}: {steps} steps, {seconds:.0f} s, "
                  f"accuracy {accuracy:.2f}, FD {distance:.2f}", flush=True)  # fmt: skip

    table = [
        f"masking at equal training FLOPs, digits, batch {batch}, seeds {args.seeds}; judged at guidance 2",
        f"  D is width {d_shape['width']}, depth {d_shape['depth']}; FLOPs per step (mean over the run): "
        + ", ".join(f"{arm} {per_step[arm] / 1e9:.2f} G" for arm in ARMS),
        "| budget (A steps) | arm | steps | train s | prompt accuracy | Fréchet distance |",
        "|---|---|---|---|---|---|",
    ]
    summary: dict[str, dict[str, Any]] = {}
    for budget in args.budgets:
        for arm in args.arms:
            runs = [r for r in rows if r["arm"] == arm and r["budget"] == budget and r["seed"] in args.seeds]
            acc, fd = [r["accuracy"] for r in runs], [r["frechet_distance"] for r in runs]
            secs = statistics.fmean(r["train_s"] for r in runs)
            summary[f"{arm}@{budget}"] = {"accuracy": statistics.fmean(acc), "frechet_distance": statistics.fmean(fd)}
            table.append(f"| {budget} | {arm}: {ARMS[arm][0]} | {runs[0]['steps']} | {secs:.0f} | {spread(acc)} | "
                         f"{spread(fd)} |")  # fmt: skip
    top = max(args.budgets)
    headline = f"masking at equal FLOPs, budget {top}: " + "; ".join(
        f"{arm} acc {summary[f'{arm}@{top}']['accuracy']:.2f} FD {summary[f'{arm}@{top}']['frechet_distance']:.2f}"
        for arm in args.arms
    )
    result = {"batch_size": batch, "budgets": args.budgets, "seeds": args.seeds, "d_shape": d_shape,
              "flops_per_step": per_step, "summary": summary,
              "runs": [r for r in rows if r["budget"] in args.budgets and r["arm"] in args.arms
                       and r["seed"] in args.seeds]}  # fmt: skip
    report("masking", table, result, headline, args.json)


if __name__ == "__main__":
    main()
