"""Training throughput: images/s of our training path (`main.py`'s) against the plain diffusers-style loop.

    python benchmarks/throughput.py [--models tiny,mid] [--steps 6] [--repeats 3] [--smoke]

Both sides fine-tune the UNet of the same randomly initialised SD-shaped pipeline on the same folder of
PNG images with captions (written here), same batch, data loading in the timed loop. `tiny` is the test
model (16 px images); `mid` is SD 1.5's block layout (four levels, two layers each, attention in three,
8 heads, SD's VAE and a CLIP text encoder) at a fifth of SD's width: a 35 M-parameter UNet, 128 px.

Then our path again with one speed feature switched on at a time (precomputed latents and text
embeddings, channels-last, math attention instead of SDPA, bf16 autocast), and with
the features that helped together. Each figure is the median step time over the timed steps of a
run, then the median over repeats; plain and ours alternate within each repeat so machine noise hits
both. Setup (loading, encoding the data once, compiling) is reported apart and not in images/s.
Prints a table, a JSON line, and last the headline: the fastest of our variants against plain, on the
largest model.
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import lightning.pytorch as pl
import numpy as np
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.baseline import load_plain_parts, plain_train  # noqa: E402
from benchmarks.common import REPO, median, parser, quiet, report  # noqa: E402

SD_FOLDER = REPO / "configs" / "finetune" / "sd-folder.yaml"

# SD 1.5's layouts at a fifth of its width (UNet 320 -> 64 channels), for a 2-core CPU.
MID_UNET = dict(
    sample_size=16,
    in_channels=4,
    out_channels=4,
    block_out_channels=(64, 128, 256, 256),
    layers_per_block=2,
    down_block_types=("CrossAttnDownBlock2D",) * 3 + ("DownBlock2D",),
    up_block_types=("UpBlock2D",) + ("CrossAttnUpBlock2D",) * 3,
    cross_attention_dim=256,
    attention_head_dim=8,
    norm_num_groups=32,
)
MID_VAE = dict(
    in_channels=3,
    out_channels=3,
    latent_channels=4,
    block_out_channels=(32, 64, 128, 128),
    down_block_types=("DownEncoderBlock2D",) * 4,
    up_block_types=("UpDecoderBlock2D",) * 4,
    layers_per_block=2,
    norm_num_groups=32,
    sample_size=128,
)
MID_TEXT_ENCODER = dict(
    vocab_size=49408,
    hidden_size=256,
    intermediate_size=1024,
    num_hidden_layers=4,
    num_attention_heads=4,
    max_position_embeddings=77,
    bos_token_id=49406,
    eos_token_id=49407,
    pad_token_id=49407,
)


@dataclass
class Model:
    name: str
    image_size: int
    batch_size: int
    images: int  # in the data folder


MODELS = {"tiny": Model("tiny", 16, 8, 64), "mid": Model("mid", 128, 4, 32)}

# Our path with one feature at a time: (label, config overrides). The first is our path as shipped.
FEATURES = [
    ("ours (as shipped)", []),
    ("+ precomputed latents & text", ["data.params.cache_latents=true", "data.params.cache_text=true"]),
    ("+ channels-last", ["model.params.channels_last=true"]),
    ("math attention (not SDPA)", ["model.params.attention=math"]),
    ("+ bf16 autocast", ["lightning.trainer.precision=bf16-mixed"]),
]


class StepClock(pl.Callback):
    """Record the wall time at the end of every training batch, and the fit's setup time, into `path`."""

    def __init__(self, path: str) -> None:
        self.path, self.times, self.start = Path(path), [], time.perf_counter()

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.setup_seconds = time.perf_counter() - self.start
        self.times = [time.perf_counter()]

    def on_train_batch_end(self, trainer: pl.Trainer, *args) -> None:
        self.times.append(time.perf_counter())

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        steps = list(np.diff(self.times))
        self.path.write_text(json.dumps({"setup": self.setup_seconds, "steps": steps}))


def write_model(model: Model, out: Path) -> Path:
    """The model's SD-shaped pipeline folder, random weights."""
    from examples.tiny_sd import write_tiny_sd

    if model.name == "tiny":
        return write_tiny_sd(out)
    return write_tiny_sd(out, unet=MID_UNET, vae=MID_VAE, text_encoder=MID_TEXT_ENCODER)


def write_images(root: Path, count: int, size: int) -> Path:
    """`count` smooth random RGB images (PNG, a bit larger than `size`, so they are resized) with captions."""
    root.mkdir(parents=True)
    rng = np.random.default_rng(0)
    side = size + size // 4
    for i in range(count):
        coarse = rng.integers(0, 255, (8, 8, 3), dtype=np.uint8)
        Image.fromarray(coarse).resize((side, side), Image.BICUBIC).save(root / f"{i:04d}.png")
        (root / f"{i:04d}.txt").write_text(f"a photo of pattern {i % 17} in colour {i % 5}")
    return root


def ours(model: Model, sd: Path, images: Path, work: Path, label: str, overrides: list[str], steps: int) -> dict:
    """Images/s of `ldm.training.run.train` (what `main.py -t` runs) with `overrides`; setup seconds apart."""
    data = [f"data.params.root={images}", f"data.params.size={model.image_size}", "data.params.flip=false"]
    return timed_train([str(SD_FOLDER)], model, sd, work, [*data, *overrides], steps)


def timed_train(configs: list[str], model: Model, sd: Path, work: Path, overrides: list[str], steps: int) -> dict:
    """`steps` training steps of `configs` on `sd` at the model's batch: each step's seconds, setup apart."""
    from ldm.training.run import train

    clock = work / f"clock-{time.perf_counter_ns()}.json"
    train(
        configs,
        [
            f"model.params.pretrained={sd}",
            f"data.params.batch_size={model.batch_size}",
            "data.params.num_workers=0",
            f"lightning.trainer.max_steps={steps}",
            "lightning.trainer.accumulate_grad_batches=1",
            "lightning.trainer.enable_progress_bar=false",
            "lightning.trainer.enable_model_summary=false",
            "lightning.callbacks.image_logger=null",
            "lightning.callbacks.ema=null",
            f"lightning.modelcheckpoint.params.every_n_train_steps={steps}",
            "lightning.callbacks.clock.target=benchmarks.throughput.StepClock",
            f"lightning.callbacks.clock.params.path={clock}",
            *overrides,
        ],
        work / "logs",
        name=f"{model.name}-{time.perf_counter_ns()}",
        seed=0,
    )
    result = json.loads(clock.read_text())
    return {"setup": result["setup"], "steps": result["steps"]}


def plain(model: Model, sd: Path, images: Path, steps: int) -> dict:
    """Images/s of the plain loop (benchmarks/baseline.py) on the same pipeline, folder and batch."""
    from ldm.data.folder import FolderDataset

    start = time.perf_counter()
    parts = load_plain_parts(str(sd))
    dataset = FolderDataset(images, size=model.image_size)
    setup = time.perf_counter() - start
    run = plain_train(parts, dataset, model.batch_size, steps, learning_rate=1e-5, caption_dropout=0.1)
    return {"setup": setup, "steps": list(np.diff([0.0, *run.seconds]))}


def sample(model: Model, work: Path, variants: list, steps: int, repeats: int, samples: dict) -> None:
    """Run every variant (`(label, overrides)`; overrides None: the plain loop) `repeats` times, alternating."""
    sd, images = work / f"{model.name}-sd", work / f"{model.name}-images"
    for _ in range(repeats):
        for label, overrides in variants:
            if overrides is None:
                run = plain(model, sd, images, steps)
            else:
                run = ours(model, sd, images, work, label, overrides, steps)
            samples.setdefault(label, []).append(run)


def summarize(samples: dict[str, list[dict]], batch_size: int, warmup: int) -> dict[str, dict]:
    """Per variant: images/s (median step time of each run, median over runs) and setup seconds."""
    results = {}
    for label, runs in samples.items():
        per_run = [batch_size / statistics.median(run["steps"][warmup:]) for run in runs]
        results[label] = {"images_per_s": median(per_run), "setup_s": median([run["setup"] for run in runs]),
                          "runs": [round(x, 3) for x in per_run]}  # fmt: skip
    return results


def best_overrides(results: dict[str, dict], features: list) -> list[str]:
    """The overrides of every feature that beat our as-shipped path by more than 3 %."""
    shipped = results[features[0][0]]["images_per_s"]
    chosen = []
    for label, overrides in features[1:]:
        if label.startswith("+") and results[label]["images_per_s"] > 1.03 * shipped:
            chosen += overrides
    return chosen


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--models", default="tiny,mid", help="comma-separated: tiny, mid")
    p.add_argument("--steps", type=int, default=6, help="timed optimizer steps per run")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps at the start of each run")
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    features = FEATURES
    if args.smoke:
        args.models, args.steps, args.warmup, args.repeats = "tiny", 2, 1, 1
    quiet()

    table, result, headline = [], {"steps": args.steps, "repeats": args.repeats, "models": {}}, ""
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models.split(","):
            model, work, samples = MODELS[name], Path(tmp), {}
            write_model(model, work / f"{model.name}-sd")
            write_images(work / f"{model.name}-images", model.images, model.image_size)
            steps = args.steps + args.warmup
            sample(model, work, [("plain", None), *features], steps, args.repeats, samples)
            chosen = best_overrides(summarize(samples, model.batch_size, args.warmup), features)
            best = f"ours, best ({', '.join(o.split('.')[-1].split('=')[0] for o in chosen) or 'as shipped'})"
            if chosen:  # measured again beside the plain loop, whose runs join its earlier ones
                sample(model, work, [("plain", None), (best, chosen)], steps, args.repeats, samples)
            results = summarize(samples, model.batch_size, args.warmup)
            if not chosen:
                results[best] = results[features[0][0]]
            base = results["plain"]["images_per_s"]
            table.append(f"{name}: batch {model.batch_size} at {model.image_size} px, UNet fine-tune, fp32 weights")
            table.append(f"  {'variant':<54}{'images/s':>10}{'vs plain':>10}{'setup s':>9}")
            for label, r in results.items():
                table.append(f"  {label:<54}{r['images_per_s']:>10.2f}{r['images_per_s'] / base:>9.2f}x"
                             f"{r['setup_s']:>9.1f}")  # fmt: skip
            result["models"][name] = {k: {**v, "vs_plain": v["images_per_s"] / base} for k, v in results.items()}
            top = max((k for k in results if k != "plain"), key=lambda k: results[k]["images_per_s"])
            headline = (f"throughput: {name} model, fastest of ours ({top}): {results[top]['images_per_s']:.2f} "
                        f"images/s vs plain {base:.2f} = {results[top]['images_per_s'] / base:.2f}x")  # fmt: skip
    report("throughput", table, result, headline, args.json)


if __name__ == "__main__":
    main()
