"""The cost claim of precomputed latents: training from shards against the plain loop encoding every step.

    python benchmarks/pretrain.py [--models mid] [--steps 6] [--repeats 3] [--smoke]

The same SD-shaped pipeline as `benchmarks/throughput.py` (`mid`: SD 1.5's layout at a fifth of its width,
batch 4 at 128 px) and the same folder of captioned PNGs, in one run:

1. precompute: `scripts/precompute.py` encodes the folder once into shards (VAE posterior, text encoder
   states); its encoding images/s is the one-off cost (model loading not counted);
2. ours, from shards: `main.py` training from those shards (`ldm.data.shards.ShardDataModule`: the VAE
   encoder and the text encoder do not run);
3. ours, from images: `main.py` training from the folder, encoding every step;
4. plain: `benchmarks/baseline.py`'s loop on the images, encoding every step (the baseline).

All train the same UNet at the same batch and resolution; the three alternate within each repeat; each figure
is the median step time of a run, then the median over repeats. It prints the online cost (time per image
from images over from shards, ours against ours; MosaicML: 1.4x), the number of passes over the data after
which precomputing has paid for itself, and the share of the total precomputing would take at MosaicML's
number of passes, beside theirs (16 %: 3,784 of 23,835 A100-hours; 550 k + 850 k steps at global batch
2048 over 790 M images is 3.6 passes).
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import parser, quiet, report  # noqa: E402
from benchmarks.throughput import MODELS, SD_FOLDER, ours, plain, summarize, timed_train, write_images, write_model  # noqa: E402,E501

MOSAIC_ONLINE_COST = 1.4  # their online training cost over training from precomputed latents
MOSAIC_PRECOMPUTE_SHARE = 3784 / 23835  # of all A100-hours
MOSAIC_PASSES = (550_000 + 850_000) * 2048 / 790e6  # samples seen over the dataset's size


def precompute_shards(sd: Path, images: Path, out: Path, size: int) -> dict:
    """Encode `images` once into shards at `out`; the encoding rate (from the manifest) and the wall time."""
    from ldm.cli.precompute import main as precompute
    from ldm.data.shard_format import MANIFEST

    start = time.perf_counter()
    overrides = [f"model.params.pretrained={sd}", f"data.params.root={images}", f"data.params.size={size}",
                 "data.params.num_workers=0", "data.params.flip=false"]  # fmt: skip
    if precompute(["-b", str(SD_FOLDER), "--out", str(out), *overrides]) != 0:
        raise SystemExit("precompute failed (see above)")
    manifest = json.loads((out / MANIFEST).read_text())
    return {"images_per_s": manifest["images_per_second"], "encode_s": manifest["seconds"],
            "wall_s": time.perf_counter() - start, "bytes": manifest["bytes"], "count": manifest["count"]}  # fmt: skip


def shards_config(work: Path, shards: Path) -> Path:
    """sd-folder.yaml with its data replaced by the shards: what a user of scripts/precompute.py trains."""
    from omegaconf import OmegaConf

    cfg = OmegaConf.load(SD_FOLDER)
    cfg.data = {"target": "ldm.data.shards.ShardDataModule",
                "params": {"sources": [{"path": str(shards)}], "caption_dropout": 0.1, "seed": 0}}  # fmt: skip
    path = work / "from-shards.yaml"
    OmegaConf.save(cfg, path)
    return path


def break_even(pre: float, online: float, shards: float) -> dict:
    """From images/s of precomputing, of training from images and from shards: the online cost, the
    passes over the data after which precomputing has paid for itself, and its share at MosaicML's passes."""
    saved = 1 / online - 1 / shards  # seconds per image and pass
    once = 1 / pre
    return {
        "online_cost": shards / online,
        "break_even_passes": once / saved if saved > 0 else None,
        "precompute_share_at_mosaic_passes": once / (once + MOSAIC_PASSES / shards),
    }


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--models", default="mid", help="comma-separated: tiny, mid")
    p.add_argument("--steps", type=int, default=6, help="timed optimizer steps per run")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps at the start of each run")
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    if args.smoke:
        args.models, args.steps, args.warmup, args.repeats = "tiny", 2, 1, 1
    quiet()
    table, result, headline = [], {"steps": args.steps, "repeats": args.repeats, "models": {}}, ""
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models.split(","):
            model, work, samples = MODELS[name], Path(tmp) / name, {}
            sd, images, shards = work / "sd", work / "images", work / "shards"
            write_model(model, sd)
            write_images(images, model.images, model.image_size)
            pre = precompute_shards(sd, images, shards, model.image_size)
            config = [str(shards_config(work, shards))]
            steps = args.steps + args.warmup
            for _ in range(args.repeats):
                samples.setdefault("plain", []).append(plain(model, sd, images, steps))
                samples.setdefault("ours, from images", []).append(ours(model, sd, images, work, "", [], steps))
                samples.setdefault("ours, from shards", []).append(timed_train(config, model, sd, work, [], steps))
            rates = summarize(samples, model.batch_size, args.warmup)
            baseline = rates["plain"]["images_per_s"]
            online, from_shards = rates["ours, from images"]["images_per_s"], rates["ours, from shards"]["images_per_s"]
            cost = break_even(pre["images_per_s"], online, from_shards)
            table += [
                f"{name}: batch {model.batch_size} at {model.image_size} px, the UNet trains, fp32",
                f"  {'':<44}{'images/s':>10}{'vs plain':>10}",
                f"  {'plain loop (VAE + text encoder every step)':<44}{baseline:>10.2f}{1.0:>9.2f}x",
                f"  {'ours, from images (encoders every step)':<44}{online:>10.2f}{online / baseline:>9.2f}x",
                f"  {'ours, from shards (encoders do not run)':<44}{from_shards:>10.2f}{from_shards / baseline:>9.2f}x",
                f"  {'precompute (encoding once)':<44}{pre['images_per_s']:>10.2f}",
                f"  shards: {pre['count']} images, {pre['bytes'] / 1e6:.2f} MB, "
                f"{pre['wall_s']:.1f} s wall incl. loading",
                f"  online cost {cost['online_cost']:.2f}x (MosaicML {MOSAIC_ONLINE_COST}x); precompute pays for "
                f"itself after {_passes(cost['break_even_passes'])}; at MosaicML's {MOSAIC_PASSES:.1f} passes it "
                f"would be {cost['precompute_share_at_mosaic_passes']:.0%} of the total (theirs "
                f"{MOSAIC_PRECOMPUTE_SHARE:.0%})",
            ]
            result["models"][name] = {"rates": rates, "precompute": pre, **cost}
            headline = (f"pretrain: {name} model, from shards {from_shards:.2f} images/s vs from images {online:.2f} = "
                        f"{cost['online_cost']:.2f}x (plain loop {baseline:.2f}); break-even after "
                        f"{_passes(cost['break_even_passes'])}")  # fmt: skip
    report("pretrain", table, result, headline, args.json)


def _passes(passes: float | None) -> str:
    return "never (shards are not faster here)" if passes is None else f"{passes:.2f} passes over the data"


if __name__ == "__main__":
    main()
