"""GPU throughput of SD 1.5 at 512 px: images/s and model FLOPs utilisation, plain vs ours, each at its
largest batch.

    python benchmarks/gpu_throughput.py [--steps 8] [--batches 8,16,32,64,128] [--peak-tflops 989]

Needs a CUDA GPU (`--smoke` runs the same code on a CPU with the tiny model). Weights are random, with
SD 1.5's real component configs (`configs/models/sd15`), so sizes and speed are real; data is random
512 px images. Variants, each in its own process at every batch of `--batches` until one runs out of
memory:
- plain: the diffusers-style loop of `benchmarks/baseline.py` under bf16 autocast (what the diffusers
  example scripts do with `--mixed_precision bf16`): fp32 weights, torch AdamW, VAE and text encoder
  every step;
- ours: `main.py`'s path (`configs/finetune/sd-folder.yaml`) with bf16-mixed, SDPA, latents and text
  embeddings precomputed once;
- ours + ZeRO-2: the same under `ldm.training.strategies.ColossalAIStrategy` (when Colossal-AI is installed).
The UNet's training FLOPs per image (forward and backward) are counted once with torch's FLOP counter
on fake tensors; MFU = FLOPs per image x images/s / peak. The H200's dense bf16 peak is 989 TFLOP/s
(SXM; 835 for the NVL card). The last line is the headline: our best against plain, each at its best batch.
"""

from __future__ import annotations

import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import REPO, parser, quiet, report, run_child  # noqa: E402

SD_FOLDER = REPO / "configs" / "finetune" / "sd-folder.yaml"
VARIANTS = {
    "plain": None,
    "ours": ["data.params.cache_latents=true", "data.params.cache_text=true"],
    "ours + ZeRO-2": [
        "data.params.cache_latents=true",
        "data.params.cache_text=true",
        "lightning.trainer.strategy.target=ldm.training.strategies.ColossalAIStrategy",
        "lightning.trainer.strategy.params.plugin=zero",
        "lightning.trainer.strategy.params.zero.stage=2",
        "model.params.optimizer.target=ldm.training.strategies.HybridAdam",
    ],
}


def unet_training_flops(unet_config: dict, latent_size: int, text_length: int, text_width: int) -> int:
    """FLOPs of one UNet forward and backward for one image, counted on fake tensors (no memory, any machine)."""
    from diffusers import UNet2DConditionModel
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils.flop_counter import FlopCounterMode

    with FakeTensorMode():
        unet = UNet2DConditionModel.from_config(unet_config)
        latents = torch.randn(1, unet.config.in_channels, latent_size, latent_size)
        cond = torch.randn(1, text_length, text_width)
        with FlopCounterMode(display=False) as counter:
            unet(latents, torch.tensor([500]), encoder_hidden_states=cond).sample.sum().backward()
    return counter.get_total_flops()


def child(variant: str, batch: int, steps: int, warmup: int, work: Path, size: int, device: str) -> dict:
    """Run one variant at one batch size in this process; images/s from the median step time."""
    if VARIANTS[variant] is None:
        from benchmarks.baseline import load_plain_parts, plain_train
        from ldm.data.folder import FolderDataset

        parts = load_plain_parts(str(work / "sd"))
        dataset = FolderDataset(work / "images", size=size)
        autocast = torch.bfloat16 if device == "cuda" else None
        run = plain_train(parts, dataset, batch, steps + warmup, learning_rate=1e-5, device=device, autocast=autocast)
        times = [b - a for a, b in zip([0.0, *run.seconds], run.seconds)]
    else:
        from benchmarks.throughput import StepClock  # noqa: F401 - the config's callback target
        from ldm.training.run import train

        clock = work / f"clock-{variant}-{batch}.json".replace(" ", "")
        logdir = work / "logs"  # removed after each run: a checkpoint of SD 1.5 with Adam states is ~10 GB
        try:
            train(
                [str(SD_FOLDER)],
                [
                    f"model.params.pretrained={work / 'sd'}",
                    f"data.params.root={work / 'images'}",
                    f"data.params.size={size}",
                    f"data.params.batch_size={batch}",
                    "data.params.num_workers=4",
                    "data.params.flip=false",
                    f"lightning.trainer.max_steps={steps + warmup}",
                    "lightning.trainer.accumulate_grad_batches=1",
                    "lightning.trainer.enable_progress_bar=false",
                    "lightning.callbacks.image_logger=null",
                    "lightning.callbacks.ema=null",
                    f"lightning.modelcheckpoint.params.every_n_train_steps={10 * (steps + warmup)}",
                    "lightning.callbacks.clock.target=benchmarks.throughput.StepClock",
                    f"lightning.callbacks.clock.params.path={clock}",
                    *VARIANTS[variant],
                ],
                logdir,
                name=f"{variant.replace(' ', '')}-{batch}",
                seed=0,
            )
        finally:
            shutil.rmtree(logdir, ignore_errors=True)
        times = json.loads(clock.read_text())["steps"]
    peak = torch.cuda.max_memory_allocated() if device == "cuda" else 0
    return {"images_per_s": batch / statistics.median(times[warmup:]), "peak_gib": peak / 1024**3}


def attempt(variant: str, batch: int, args, work: Path) -> dict:
    """One child process: its result, or why it failed (out of memory, or another error's last line)."""
    command = [sys.executable, __file__, "--child", variant, "--batch", str(batch), "--work", str(work),
               "--steps", str(args.steps), "--size", str(args.size)] + (["--smoke"] if args.smoke else [])  # fmt: skip
    return run_child(command, variant, batch)


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--steps", type=int, default=8, help="timed steps per run (after 3 warm-up steps)")
    p.add_argument("--batches", default="8,16,32,64,128", help="batch sizes to try, rising; stops at the first OOM")
    p.add_argument("--size", type=int, default=512)
    p.add_argument("--peak-tflops", type=float, default=989.0, help="the GPU's dense bf16 peak (H200 SXM: 989)")
    p.add_argument("--child", help=argparse_hidden())
    p.add_argument("--batch", type=int, help=argparse_hidden())
    p.add_argument("--work", type=Path, help=argparse_hidden())
    args = p.parse_args()
    quiet()
    device = "cpu" if args.smoke else "cuda"
    if args.child:
        result = child(args.child, args.batch, args.steps, 3, args.work, args.size, device)
        print(json.dumps({"child": args.child, "batch": args.batch, **result}), flush=True)
        return
    if not args.smoke and not torch.cuda.is_available():
        sys.exit("gpu_throughput.py needs a CUDA GPU (or --smoke, on a CPU with the tiny model)")
    if args.smoke:
        args.steps, args.batches, args.size = 2, "2", 16
    variants = [v for v in VARIANTS if v != "ours + ZeRO-2" or has_colossalai()]
    results: dict[str, list[dict]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        flops = write_inputs(work, args)
        for variant in variants:
            for batch in map(int, args.batches.split(",")):
                started = time.perf_counter()
                outcome = attempt(variant, batch, args, work)
                outcome["seconds"] = round(time.perf_counter() - started, 1)
                print(json.dumps(outcome), flush=True)
                results.setdefault(variant, []).append(outcome)
                if "error" in outcome:
                    break
    table = [f"{device}: UNet training FLOPs per image at {args.size} px: {flops / 1e12:.3f} TFLOP; "
             f"peak {args.peak_tflops:g} TFLOP/s"]  # fmt: skip
    table.append(f"  {'variant':<16}{'batch':>6}{'images/s':>10}{'MFU':>8}{'peak GiB':>10}")
    best: dict[str, dict] = {}
    for variant, outcomes in results.items():
        for o in outcomes:
            if "error" in o:
                table.append(f"  {variant:<16}{o['batch']:>6}  {o['error']}")
                continue
            o["mfu"] = flops * o["images_per_s"] / (args.peak_tflops * 1e12)
            table.append(
                f"  {variant:<16}{o['batch']:>6}{o['images_per_s']:>10.2f}{o['mfu']:>8.1%}{o['peak_gib']:>10.1f}"
            )
            if o["images_per_s"] > best.get(variant, {}).get("images_per_s", 0):
                best[variant] = o
    result = {"size": args.size, "flops_per_image": flops, "peak_tflops": args.peak_tflops, "runs": results}
    if "plain" in best and len(best) > 1:
        name, ours = max(((k, v) for k, v in best.items() if k != "plain"), key=lambda kv: kv[1]["images_per_s"])
        base = best["plain"]
        ratio = ours["images_per_s"] / base["images_per_s"]
        headline = (f"gpu throughput: SD 1.5 at {args.size} px, {name} {ours['images_per_s']:.1f} images/s "
                    f"(batch {ours['batch']}, MFU {ours['mfu']:.1%}) vs plain {base['images_per_s']:.1f} "
                    f"(batch {base['batch']}, MFU {base['mfu']:.1%}) = {ratio:.2f}x")  # fmt: skip
    else:
        headline = "gpu throughput: no comparison (a side did not run; see the errors above)"
    report("gpu_throughput", table, result, headline, args.json)


def argparse_hidden() -> str:
    import argparse

    return argparse.SUPPRESS


def has_colossalai() -> bool:
    import importlib.util

    return importlib.util.find_spec("colossalai") is not None


def write_inputs(work: Path, args) -> int:
    """The random SD 1.5 folder (tiny SD with --smoke) and images in `work`; returns the UNet's FLOPs per image."""
    from benchmarks.gpu_8gb import random_images, random_sd15
    from examples.tiny_sd import write_tiny_sd

    sd = write_tiny_sd(work / "sd") if args.smoke else random_sd15(work / "sd")
    random_images(
        work / "images", n=min(256, max(map(int, args.batches.split(","))) * (args.steps + 3)), size=args.size
    )
    config = json.loads((sd / "unet" / "config.json").read_text())
    text = json.loads((sd / "text_encoder" / "config.json").read_text())
    vae = json.loads((sd / "vae" / "config.json").read_text())
    latent = args.size // 2 ** (len(vae["block_out_channels"]) - 1)
    return unet_training_flops(config, latent, text["max_position_embeddings"], text["hidden_size"])


if __name__ == "__main__":
    main()
