"""Export a LoRA: a checkpoint's adapters as a LoRA file (kohya's format, or diffusers'), or (--merge) a
diffusers pipeline with them merged in; or merge a LoRA file into a pretrained model.

python scripts/export_lora.py --ckpt logs/RUN/checkpoints/last.ckpt --out my-lora [--ema]
    # my-lora/my-lora.safetensors, kohya's format: ComfyUI / AUTOMATIC1111 (models/Lora), sd-scripts,
    # and model.params.lora.init_from to train on; --out my-lora.safetensors names the file itself
python scripts/export_lora.py --ckpt logs/RUN/checkpoints/last.ckpt --out my-lora --format diffusers
    # my-lora/pytorch_lora_weights.safetensors: pipe.load_lora_weights("my-lora")
python scripts/export_lora.py --ckpt logs/RUN/checkpoints/last.ckpt --out my-model --merge
python scripts/export_lora.py --lora my-lora.safetensors --pretrained BASE --out my-model --merge
    # BASE: a diffusers folder, an original .safetensors / .ckpt, or one of our checkpoints

A merged pipeline keeps the dtype of its base's weights (an fp16 base gives fp16 files); --half makes it fp16.

An existing output is replaced, atomically: never by a half-written file.
"""

from __future__ import annotations

import argparse
import sys

from ldm.cli import console
from ldm.weights.checkpoint import load_checkpoint
from ldm.weights.lora_file import checkpoint_about, checkpoint_base, merge_lora_file, save_lora, write_merged
from ldm.weights.read import parts_from_checkpoint


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--ckpt", help="a checkpoint of a run with model.params.lora")
    source.add_argument("--lora", help="a LoRA file (kohya's or diffusers' format) to merge into --pretrained")
    parser.add_argument("--pretrained", help="with --lora: the base model to merge it into")
    parser.add_argument("--out", required=True, help="output folder, or FILE.safetensors for a kohya file")
    parser.add_argument("--format", choices=["kohya", "diffusers"], help="LoRA file format (default: kohya)")
    parser.add_argument("--merge", action="store_true", help="write a diffusers pipeline with the LoRA merged in")
    parser.add_argument("--ema", action="store_true", help="export the EMA of the adapters")
    parser.add_argument("--half", action="store_true", help="with --merge: fp16 weights (default: the base's dtype)")
    parser.add_argument("-v", "--verbose", action="store_true", help="show other libraries' messages too")
    args = parser.parse_args(argv)
    console.setup(args.verbose)
    if args.lora and not (args.merge and args.pretrained):
        parser.error("--lora FILE is merged into a model: give --pretrained BASE and --merge")
    if args.ckpt and args.pretrained:
        parser.error("--pretrained goes with --lora; a checkpoint names its base model (model.params.pretrained)")
    if args.merge and args.format:
        parser.error("--format is for LoRA files; --merge writes a diffusers pipeline folder")
    if args.lora and args.ema:
        parser.error("--ema is for checkpoints; a LoRA file holds one set of adapters")
    if args.half and not args.merge:
        parser.error("--half goes with --merge; LoRA files keep their adapters in fp32")
    try:
        if args.lora:
            out = merge_lora_file(args.lora, args.pretrained, args.out, args.half)
        else:
            ckpt = load_checkpoint(args.ckpt)
            if not ckpt["ldm"].get("lora"):
                raise ValueError(f"{args.ckpt}: not a LoRA checkpoint; export it with scripts/export_diffusers.py")
            parts = parts_from_checkpoint(ckpt, ema=args.ema, merge=args.merge)
            if args.merge:
                out = write_merged(parts, checkpoint_base(ckpt), args.out, args.half)
            else:
                out = save_lora(parts, args.out, args.format or "kohya", about=checkpoint_about(ckpt))
    except (FileNotFoundError, ValueError) as err:
        sys.exit(f"export_lora: {err}")
    print(out)
