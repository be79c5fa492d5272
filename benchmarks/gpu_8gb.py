"""The 8 GB check: fine-tune a real-size UNet under an 8 GiB cap, ours vs the plain recipe.

    python benchmarks/gpu_8gb.py [--steps 20] [--cap-gib 8] [--preset configs/finetune/sd15-8gb.yaml]
    python benchmarks/gpu_8gb.py --family sdxl [--steps 10]     # sdxl-8gb.yaml, SDXL at 1024 px
    python benchmarks/gpu_8gb.py --family sd35-medium [--steps 10]   # sd35m-8gb.yaml, SD3.5 Medium at 1024 px

SD 1.5 (default): the preset is Colossal-AI's, so this needs the Colossal-AI environment
(`pip install -e .[colossalai]`, plus `pip install --no-deps open_clip_torch` for the CLIP vocabulary);
512 px. SDXL: `configs/finetune/sdxl-8gb.yaml` (bf16 UNet, LowMemoryAdamW fused and offloaded, cached
latents and captions, frozen networks on the CPU) in the main environment; 1024 px. SD3.5 Medium:
`configs/finetune/sd35m-8gb.yaml` (the same, for the MMDiT and its three text encoders; ~16 GB of random weights
written to the temporary folder, T5-XXL's 9.5 of them); 1024 px. Weights are random
(the real component configs in configs/models/, so sizes and speed are real); the data is random images.
Each side runs in its own process, capped with `torch.cuda.set_per_process_memory_fraction`.
Each run is `ldm.training.run.train` on the preset, so it is the path users run; the baseline swaps in
Lightning's default strategy, mixed-precision autocast and torch AdamW on fp32 weights (expected to run
out of memory). Prints one line per run and a JSON line; the last line is the headline.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

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


def random_sdxl(out: Path) -> Path:
    """A diffusers folder with SDXL 1.0 base's real component configs, random bf16 weights, real CLIP tokenizers."""
    from diffusers import AutoencoderKL, EulerDiscreteScheduler, UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

    from ldm.components.tokenizers import write_clip_tokenizer

    src = REPO / "configs" / "models" / "sdxl"
    for name, cls in (("unet", UNet2DConditionModel), ("vae", AutoencoderKL)):
        cls.from_config(cls.load_config(src / name)).to(torch.bfloat16).save_pretrained(out / name)
    for name, cls in (("text_encoder", CLIPTextModel), ("text_encoder_2", CLIPTextModelWithProjection)):
        cls(CLIPTextConfig.from_pretrained(src / name)).to(torch.bfloat16).save_pretrained(out / name)
    EulerDiscreteScheduler.from_config(EulerDiscreteScheduler.load_config(src / "scheduler")).save_pretrained(
        out / "scheduler"
    )
    write_clip_tokenizer(out / "tokenizer")
    write_clip_tokenizer(out / "tokenizer_2", pad_token="!")
    index = {"_class_name": "StableDiffusionXLPipeline", "_diffusers_version": "0.30.0"}
    for name, (library, cls) in {"unet": ("diffusers", "UNet2DConditionModel"), "vae": ("diffusers", "AutoencoderKL"),
                                 "text_encoder": ("transformers", "CLIPTextModel"),
                                 "text_encoder_2": ("transformers", "CLIPTextModelWithProjection"),
                                 "tokenizer": ("transformers", "CLIPTokenizer"),
                                 "tokenizer_2": ("transformers", "CLIPTokenizer"),
                                 "scheduler": ("diffusers", "EulerDiscreteScheduler")}.items():  # fmt: skip
        index[name] = [library, cls]
    (out / "model_index.json").write_text(json.dumps(index, indent=2))
    return out


def random_sd35(out: Path, src: Path = REPO / "configs" / "models" / "sd35-medium") -> Path:
    """A diffusers folder with SD3.5's real component configs (in `src`: Medium's), random bf16 weights, the real
    CLIP tokenizers and a T5 tokenizer trained offline (no T5 vocabulary ships in a package; its ids are T5's)."""
    from diffusers import (
        AutoencoderKL,
        FlowMatchEulerDiscreteScheduler,
        SD3Transformer2DModel,
        StableDiffusion3Pipeline,
    )
    from transformers import CLIPTextConfig, CLIPTextModelWithProjection, T5Config, T5EncoderModel

    from examples.tiny_sd35 import write_sd35_tokenizers

    def from_config(cls: type, name: str) -> Any:  # a diffusers class
        return cls.from_config(cls.load_config(src / name))

    def clip(name: str) -> CLIPTextModelWithProjection:
        return CLIPTextModelWithProjection(CLIPTextConfig.from_pretrained(src / name)).to(torch.bfloat16)

    pipe = StableDiffusion3Pipeline(
        transformer=from_config(SD3Transformer2DModel, "unet").to(torch.bfloat16),
        vae=from_config(AutoencoderKL, "vae").to(torch.bfloat16),
        text_encoder=clip("text_encoder"),
        text_encoder_2=clip("text_encoder_2"),
        text_encoder_3=T5EncoderModel(T5Config.from_pretrained(src / "text_encoder_3")).to(torch.bfloat16),
        scheduler=from_config(FlowMatchEulerDiscreteScheduler, "scheduler"),
        **write_sd35_tokenizers(out),
    )
    pipe.save_pretrained(out)
    return out


FAMILIES = {  # weights, preset, image size
    "sd15": (random_sd15, REPO / "configs" / "finetune" / "sd15-8gb.yaml", 512),
    "sdxl": (random_sdxl, REPO / "configs" / "finetune" / "sdxl-8gb.yaml", 1024),
    "sd35-medium": (random_sd35, REPO / "configs" / "finetune" / "sd35m-8gb.yaml", 1024),
}


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


PLAIN = {  # Lightning's default strategy, mixed-precision autocast and torch AdamW: the usual recipe
    "sd15": ["lightning.trainer.strategy=auto", "model.params.optimizer.target=torch.optim.AdamW",
             "lightning.trainer.precision=16-mixed"],
    "sdxl": ["model.params.optimizer.target=torch.optim.AdamW", "model.params.optimizer.params={weight_decay: 0.01}",
             "model.params.trainable_dtype=null", "model.params.frozen_device=null"],
}  # fmt: skip
PLAIN["sd35-medium"] = PLAIN["sdxl"]  # the same recipe: fp32 weights and AdamW, every network on the GPU


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--cap-gib", type=float, default=8.0)
    parser.add_argument("--family", choices=sorted(FAMILIES), default="sd15")
    parser.add_argument("--preset", default=None, help="default: the family's 8 GB preset")
    parser.add_argument("--only", choices=("preset", "plain"), help="run one side in this process (internal)")
    parser.add_argument("--workdir", type=Path, help="weights and images made by the parent run (internal)")
    args = parser.parse_args()
    write_weights, preset, size = FAMILIES[args.family]
    args.preset = args.preset or str(preset)
    if not torch.cuda.is_available():
        sys.exit("gpu_8gb.py needs a CUDA GPU")
    if args.only:  # one side per process, so the other side's allocations cannot count against it
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, args.cap_gib * GIB / total))
        overrides = [
            f"model.params.pretrained={args.workdir / args.family}",
            f"data.params.root={args.workdir / 'images'}",
            "data.params.num_workers=2",
            "lightning.trainer.accumulate_grad_batches=1",
            "lightning.modelcheckpoint.params.every_n_train_steps=100000",
            *(PLAIN[args.family] if args.only == "plain" else []),
        ]
        run(args.only, args.preset, overrides, args.steps, args.workdir / "logs")
        return
    name, total = torch.cuda.get_device_name(0), torch.cuda.get_device_properties(0).total_memory
    print(f"{name}: each run capped at {args.cap_gib:g} GiB of {total / GIB:.0f} GiB", flush=True)
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        write_weights(work / args.family)
        random_images(work / "images", size=size)
        for side in ("preset", "plain"):
            command = [sys.executable, __file__, "--only", side, "--workdir", str(work), "--steps", str(args.steps),
                       "--cap-gib", str(args.cap_gib), "--preset", args.preset, "--family", args.family]  # fmt: skip
            done = subprocess.run(command, capture_output=True, text=True)
            lines = [line for line in done.stdout.splitlines() if line.startswith('{"run"')]
            results[side] = json.loads(lines[-1]) if lines else {"run": side, "status": f"exit {done.returncode}"}
            if not lines:
                print(done.stderr[-3000:], file=sys.stderr)
    print(json.dumps({"family": args.family, "cap_gib": args.cap_gib, "steps": args.steps, **results}))


if __name__ == "__main__":
    main()
