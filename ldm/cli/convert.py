"""Convert weights between an original SD single file, a diffusers folder and our checkpoints, without training.

    python scripts/convert.py --src v1-5-pruned-emaonly.safetensors --dst sd15-diffusers
    python scripts/convert.py --src sd15-diffusers --dst sd15.safetensors --half
    python scripts/convert.py --src logs/RUN/checkpoints/last.ckpt --dst my-model.safetensors --ema
    python scripts/convert.py --src mmdit-only.safetensors --dst model-diffusers \
        --part text_encoder=clip_l.safetensors --part text_encoder_2=clip_g.safetensors \
        --part text_encoder_3=t5xxl_fp16.safetensors

The format follows the path: a folder is a diffusers pipeline, `.safetensors` / `.ckpt` a single
file; our checkpoints are recognised by their content.

A round trip gives back every tensor of an original single file: what no diffusers part holds (the
noise schedule buffers, the EMA copy beside the raw weights, OpenCLIP's last layer, `logit_scale`,
`text_projection`, unknown keys) waits in the folder's `single_file_extras.safetensors` and is
written back. With --ema the EMA weights become the model and the raw ones are not kept. A written
single file carries `modelspec.*` metadata; for SD 2.x the original YAML goes beside it (`<stem>.yaml`).
"""

from __future__ import annotations

import argparse
import sys

from ldm.cli import console
from ldm.export import convert
from ldm.families import FAMILIES


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--src", required=True, help="diffusers folder, original .safetensors/.ckpt, or our checkpoint")
    parser.add_argument("--dst", required=True, help="folder (diffusers) or .safetensors / .ckpt (single file)")
    parser.add_argument("--half", action="store_true", help="write fp16 weights")
    parser.add_argument(
        "--ema", action="store_true", help="take the source's EMA weights (the raw ones are then not kept)"
    )
    parser.add_argument(
        "--family", choices=list(FAMILIES), help="for SD 2.x single files: which one (the weights cannot tell)"
    )
    parser.add_argument(
        "--part",
        action="append",
        default=[],
        metavar="PART=FILE",
        help="a single file's text encoder from a file of its own (ComfyUI's clip_l / clip_g / t5xxl files)",
    )
    parser.add_argument(
        "--trust-pickle",
        action="store_true",
        help="allow a .ckpt that needs arbitrary unpickling (can run code): only for files you trust",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="show other libraries' messages too")
    args = parser.parse_args(argv)
    console.setup(args.verbose)
    parts = dict(given.partition("=")[::2] for given in args.part)
    if bad := [given for given in args.part if "=" not in given]:
        sys.exit(f"convert: --part {bad[0]}: expected PART=FILE (text_encoder=clip_l.safetensors, say)")
    try:
        out = convert(args.src, args.dst, args.half, args.ema, args.family, args.trust_pickle, parts)
    except (FileNotFoundError, FileExistsError, ValueError) as err:
        sys.exit(f"convert: {err}")
    print(out)
