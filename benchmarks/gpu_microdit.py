"""GPU throughput of MicroDiT_XL_2 at 256 px, masked (75 %) and unmasked: images/s, MFU and peak memory, each
at the largest batch that fits.

    python benchmarks/gpu_microdit.py [--steps 10] [--batches 64,128,256,512,1024] [--peak-tflops 989]

Needs a CUDA GPU (`--smoke` runs the same code on a CPU with a tiny MicroDiT). The network has
`MICRODIT_XL_2`'s configuration with random weights (1.16 B parameters), trained as `LatentDiffusion` trains
it: EDM's loss through `ldm.diffusion.edm_loss` on random 4x32x32 latents (256 px) and 77 caption tokens of
1024 channels (precomputed, as shards hold them), bf16 autocast over fp32 weights, SDPA attention, fused
AdamW. Each variant runs in its own process at every batch of `--batches`, rising, until one runs out of
memory or `--budget` seconds are spent. The training FLOPs per image (forward and backward, at the variant's
mask ratio) are counted with torch's FLOP counter on each run's first step, a warm-up step that is not timed;
MFU = FLOPs per image x images/s / peak. H100 and H200 (SXM): 989 dense bf16 TFLOP/s. The last line is the
headline: masked against unmasked.
"""

from __future__ import annotations

import contextlib
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import parser, quiet, report, run_child  # noqa: E402

VARIANTS = {"masked 75 %": 0.75, "unmasked": 0.0}
TEXT_LENGTH = 77


def network_config(smoke: bool) -> dict:
    from ldm.backbones.microdit import MICRODIT_DIGITS, MICRODIT_XL_2

    return {**MICRODIT_DIGITS, "caption_channels": 64} if smoke else dict(MICRODIT_XL_2)


def child(mask_ratio: float, batch: int, steps: int, warmup: int, smoke: bool) -> dict:
    """Train at one batch size in this process; images/s from the median step time."""
    from torch.utils.flop_counter import FlopCounterMode

    from ldm import diffusion
    from ldm.backbones.microdit import MicroDiT

    device = "cpu" if smoke else "cuda"
    config = network_config(smoke)
    torch.manual_seed(0)
    model = MicroDiT(**config).to(device).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=2.4e-4, betas=(0.9, 0.999), weight_decay=0.1,
                                  fused=device == "cuda")  # fmt: skip
    size, patch = config["sample_size"], config["patch_size"]
    latents = torch.randn(batch, config["in_channels"], size, size, device=device)
    cond = {"encoder_hidden_states": torch.randn(batch, TEXT_LENGTH, config["caption_channels"], device=device)}
    times, flops = [], 0
    for step in range(warmup + steps):
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        counter = FlopCounterMode(display=False) if step == 0 else contextlib.nullcontext()
        with counter, torch.autocast(device, dtype=torch.bfloat16):
            keep = None
            if mask_ratio:
                keep = diffusion.random_keep(batch, model.num_patches(size, size), mask_ratio, device=device)
            loss = diffusion.edm_loss(model, latents, cond, -0.6, 1.2, 0.9, keep, patch)
            loss.backward()
        if step == 0:  # a warm-up step: counting does not slow a timed one
            flops = counter.get_total_flops()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.25)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    peak = torch.cuda.max_memory_allocated() if device == "cuda" else 0
    return {"images_per_s": batch / statistics.median(times[warmup:]), "peak_gib": peak / 1024**3,
            "flops_per_image": flops / batch}  # fmt: skip


def attempt(variant: str, batch: int, args) -> dict:
    """One child process: its result, or why it failed (out of memory, or another error's last line)."""
    command = [sys.executable, __file__, "--child", variant, "--batch", str(batch), "--steps", str(args.steps)]
    return run_child(command + (["--smoke"] if args.smoke else []), variant, batch, timeout=args.budget)


def main() -> None:
    import argparse

    p = parser(__doc__)
    p.add_argument("--steps", type=int, default=10, help="timed steps per run (after 3 warm-up steps)")
    p.add_argument("--batches", default="64,128,256,512,1024", help="batch sizes to try, rising")
    p.add_argument("--peak-tflops", type=float, default=989.0, help="the GPU's dense bf16 peak (H100/H200: 989)")
    p.add_argument("--budget", type=float, default=420.0, help="seconds for all runs; none starts after it")
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--batch", type=int, help=argparse.SUPPRESS)
    args = p.parse_args()
    quiet()
    if args.child:
        result = child(VARIANTS[args.child], args.batch, args.steps, 3, args.smoke)
        print(json.dumps({"child": args.child, "batch": args.batch, **result}), flush=True)
        return
    if not args.smoke and not torch.cuda.is_available():
        sys.exit("gpu_microdit.py needs a CUDA GPU (or --smoke, on a CPU with a tiny MicroDiT)")
    if args.smoke:
        args.steps, args.batches = 2, "2"
    began = time.perf_counter()
    results: dict[str, list[dict]] = {}
    for variant in VARIANTS:
        for batch in map(int, args.batches.split(",")):
            if time.perf_counter() - began > args.budget:
                results.setdefault(variant, []).append({"child": variant, "batch": batch, "error": "budget spent"})
                break
            started = time.perf_counter()
            outcome = attempt(variant, batch, args)
            outcome["seconds"] = round(time.perf_counter() - started, 1)
            print(json.dumps(outcome), flush=True)
            results.setdefault(variant, []).append(outcome)
            if "error" in outcome:
                break

    device = "cpu (smoke)" if args.smoke else torch.cuda.get_device_name()
    flops = {v: next((o["flops_per_image"] for o in runs if "error" not in o), 0.0) for v, runs in results.items()}
    table = [f"{device}: MicroDiT training FLOPs per image (counted on each run's first step): "
             + ", ".join(f"{v} {f / 1e12:.4f} TFLOP" for v, f in flops.items())
             + f"; peak {args.peak_tflops:g} TFLOP/s"]  # fmt: skip
    table.append(f"  {'variant':<14}{'batch':>6}{'images/s':>10}{'MFU':>8}{'peak GiB':>10}")
    best: dict[str, dict] = {}
    for variant, outcomes in results.items():
        for o in outcomes:
            if "error" in o:
                table.append(f"  {variant:<14}{o['batch']:>6}  {o['error']}")
                continue
            o["mfu"] = o["flops_per_image"] * o["images_per_s"] / (args.peak_tflops * 1e12)
            table.append(
                f"  {variant:<14}{o['batch']:>6}{o['images_per_s']:>10.1f}{o['mfu']:>8.1%}{o['peak_gib']:>10.1f}"
            )
            if o["images_per_s"] > best.get(variant, {}).get("images_per_s", 0):
                best[variant] = o
    result = {"flops_per_image": flops, "peak_tflops": args.peak_tflops, "runs": results}
    if len(best) == 2:
        masked, unmasked = best["masked 75 %"], best["unmasked"]
        ratio = masked["images_per_s"] / unmasked["images_per_s"]
        name = "tiny MicroDiT on a CPU (smoke)" if args.smoke else "XL_2 at 256 px"
        headline = (f"gpu microdit: {name}, masked {masked['images_per_s']:.0f} images/s (batch "
                    f"{masked['batch']}, MFU {masked['mfu']:.1%}, {masked['peak_gib']:.0f} GiB) vs unmasked "
                    f"{unmasked['images_per_s']:.0f} (batch {unmasked['batch']}, MFU {unmasked['mfu']:.1%}, "
                    f"{unmasked['peak_gib']:.0f} GiB) = {ratio:.2f}x")  # fmt: skip
    else:
        headline = "gpu microdit: no comparison (a variant did not run; see the errors above)"
    report("gpu_microdit", table, result, headline, args.json)


if __name__ == "__main__":
    main()
