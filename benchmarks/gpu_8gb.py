"""The 8 GB check: fine-tune a real-size SD 1.5 UNet at 512 px under an 8 GiB cap, ours vs plain DDP-style.

    python benchmarks/gpu_8gb.py [--steps 20] [--cap-gib 8] [--preset configs/finetune/sd15-8gb.yaml]

Needs a CUDA GPU and the Colossal-AI environment (`pip install -e .[colossalai]`, plus
`pip install --no-deps open_clip_torch` for the CLIP vocabulary). Weights are random (the real
SD 1.5 component configs in configs/models/sd15, so sizes and speed are real); the data is
random 512 px images. The process is capped with `torch.cuda.set_per_process_memory_fraction`.
Each run is `ldm.training.run.train` on the preset, so it is the path users run; the baseline swaps in
Lightning's default strategy, 16-mixed autocast and torch AdamW (expected to run out of memory).
Prints one line per run and a JSON line; the last line is the headline.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import lightning.pytorch as pl
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
GIB = 1024**3


class StepTimer(pl.Callback):
    """Wall time of the steps after the first `skip` (warm-up: allocator, kernels, Gemini's first pass)."""

    def __init__(self, skip: int = 3) -> None:
        self.skip, self.start, self.steps = skip, None, 0

    def on_train_batch_end(self, trainer: pl.Trainer, *args) -> None:
        torch.cuda.synchronize()
        if trainer.global_step == self.skip:
            self.start = time.perf_counter()
        elif self.start is not None:
            self.steps = trainer.global_step - self.skip
            self.elapsed = time.perf_counter() - self.start


def random_sd15(out: Path) -> Path:
    """A diffusers folder with SD 1.5's real component configs, random weights and the real CLIP tokenizer."""
    from diffusers import AutoencoderKL, DDPMScheduler, UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel

    from ldm.components.tokenizers import write_clip_tokenizer

    src = REPO / "configs" / "models" / "sd15"
    UNet2DConditionModel.from_config(UNet2DConditionModel.load_config(src / "unet")).save_pretrained(out / "unet")
    AutoencoderKL.from_config(AutoencoderKL.load_config(src / "vae")).save_pretrained(out / "vae")
    CLIPTextModel(CLIPTextConfig.from_pretrained(src / "text_encoder")).save_pretrained(out / "text_encoder")
    DDPMScheduler.from_config(DDPMScheduler.load_config(src / "scheduler")).save_pretrained(out / "scheduler")
    write_clip_tokenizer(out / "tokenizer")
    return out


def random_images(out: Path, n: int = 32, size: int = 512) -> Path:
    import numpy as np
    from PIL import Image

    out.mkdir(parents=True)
    rng = np.random.default_rng(0)
    for i in range(n):
        Image.fromarray(rng.integers(0, 255, (size, size, 3), dtype=np.uint8)).save(out / f"{i}.png")
        (out / f"{i}.txt").write_text(f"a random picture number {i}")
    return out


def run(name: str, preset: str, overrides: list[str], steps: int, logdir: Path) -> dict:
    from ldm.training import run as ldm_run

    timer = StepTimer()
    original = ldm_run.build_trainer

    def with_timer(*args, **kwargs):  # the preset's own Trainer, plus our timer
        trainer = original(*args, **kwargs)
        trainer.callbacks.append(timer)
        return trainer

    ldm_run.build_trainer = with_timer
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    result = {"run": name}
    try:
        ldm_run.train([preset], [*overrides, f"lightning.trainer.max_steps={steps}"], logdir, name)
        result.update(status="ok", it_s=round(timer.steps / timer.elapsed, 3))
    except torch.cuda.OutOfMemoryError as err:
        result.update(status="out of memory", error=str(err).splitlines()[0][:200])
    finally:
        ldm_run.build_trainer = original
    result["peak_allocated_gib"] = round(torch.cuda.max_memory_allocated() / GIB, 2)
    print(json.dumps(result), flush=True)
    return result


PLAIN = [  # Lightning's default strategy (one-GPU DDP), AMP fp16 and torch AdamW: the usual recipe
    "lightning.trainer.strategy=auto",
    "model.params.optimizer.target=torch.optim.AdamW",
    "lightning.trainer.precision=16-mixed",
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--cap-gib", type=float, default=8.0)
    parser.add_argument("--preset", default=str(REPO / "configs" / "finetune" / "sd15-8gb.yaml"))
    parser.add_argument("--only", choices=("colossalai", "plain"), help="run one side in this process (internal)")
    parser.add_argument("--workdir", type=Path, help="weights and images made by the parent run (internal)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("gpu_8gb.py needs a CUDA GPU")
    if args.only:  # one side per process, so the other side's allocations cannot count against it
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, args.cap_gib * GIB / total))
        overrides = [
            f"model.params.pretrained={args.workdir / 'sd15'}",
            f"data.params.root={args.workdir / 'images'}",
            "data.params.num_workers=2",
            "lightning.trainer.accumulate_grad_batches=1",
            "lightning.modelcheckpoint.params.every_n_train_steps=100000",
            *(PLAIN if args.only == "plain" else []),
        ]
        run(args.only, args.preset, overrides, args.steps, args.workdir / "logs")
        return
    name, total = torch.cuda.get_device_name(0), torch.cuda.get_device_properties(0).total_memory
    print(f"{name}: each run capped at {args.cap_gib:g} GiB of {total / GIB:.0f} GiB", flush=True)
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        random_sd15(work / "sd15")
        random_images(work / "images")
        for side in ("colossalai", "plain"):
            command = [sys.executable, __file__, "--only", side, "--workdir", str(work), "--steps", str(args.steps),
                       "--cap-gib", str(args.cap_gib), "--preset", args.preset]  # fmt: skip
            done = subprocess.run(command, capture_output=True, text=True)
            lines = [line for line in done.stdout.splitlines() if line.startswith('{"run"')]
            results[side] = json.loads(lines[-1]) if lines else {"run": side, "status": f"exit {done.returncode}"}
            if not lines:
                print(done.stderr[-3000:], file=sys.stderr)
    print(json.dumps({"cap_gib": args.cap_gib, "steps": args.steps, **results}))


if __name__ == "__main__":
    main()
