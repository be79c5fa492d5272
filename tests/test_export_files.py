"""What exports leave on disk: every file and folder with the mode the umask gives, and merged weights in
the dtype of the model merged into."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from ldm.components import Parts
from ldm.components.describe import describe_parts
from ldm.components.lora import add_lora, is_lora_key, merged
from ldm.export import convert
from ldm.weights.lora_file import save_lora
from ldm.weights.read import read_parts
from ldm.weights.text_model import with_prefix
from tests.helpers import run_script

LORA_PARTS = ("unet", "text_encoder")
WEIGHTS = {"unet": "unet/diffusion_pytorch_model.safetensors", "text_encoder": "text_encoder/model.safetensors"}


def with_adapters(base: Path, seed: int = 0) -> Parts:
    """The parts of `base` with rank-4 LoRA adapters on the UNet and text encoder, up weights not zero (a merge
    changes every adapted weight)."""
    parts = read_parts(base)
    add_lora(parts, LORA_PARTS, {"rank": 4, "alpha": 2})
    torch.manual_seed(seed)
    with torch.no_grad():
        for name in LORA_PARTS:
            for key, param in parts[name].named_parameters():
                if "lora_B" in key:
                    param.normal_(std=0.5)
    return parts


@pytest.fixture(scope="module")
def lora_file(tiny_sd, tmp_path_factory) -> Path:
    return save_lora(with_adapters(tiny_sd), tmp_path_factory.mktemp("lora") / "my-lora.safetensors")


def lora_checkpoint(base: Path, path: Path) -> Path:
    """A LoRA run's checkpoint, as main.py writes it: the adapters, and the base model it trained on."""
    parts = with_adapters(base, seed=1)
    state = {f"{n}.{k}": v for n in LORA_PARTS for k, v in parts[n].state_dict().items() if is_lora_key(k)}
    ldm = {
        "parts": describe_parts(read_parts(base)),
        "lora": {"spec": {"rank": 4, "alpha": 2}, "trainable": list(LORA_PARTS)},
        "config": {"model": {"params": {"pretrained": str(base), "trainable": list(LORA_PARTS)}}},
    }
    torch.save({"state_dict": state, "ldm": ldm, "global_step": 1}, path)
    return path


def modes(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder.parent)): oct(p.stat().st_mode & 0o777) for p in [folder, *folder.rglob("*")]}


def script(name: str, *args) -> Path:
    """Run `scripts/NAME`; the path it printed."""
    return Path(run_script(name, *args).strip())


@pytest.mark.parametrize("umask", [0o022, 0o077], ids=["umask-022", "umask-077"])
def test_every_exported_file_and_folder_honours_the_umask(tiny_sd, lora_file, tmp_path, umask):
    """diffusers' and transformers' `save_pretrained` leave weights 0600; what we write is 0644 / 0755 under
    umask 022 (readable from a shared model folder or a container), 0600 / 0700 under 077."""
    parts = read_parts(tiny_sd)
    full = tmp_path / "full.ckpt"
    state = {f"{name}.{k}": v for name, module in parts.networks.items() for k, v in module.state_dict().items()}
    config = {"model": {"params": {"pretrained": str(tiny_sd)}}}
    torch.save({"state_dict": state, "ldm": {"parts": describe_parts(parts), "config": config}}, full)
    lora_ckpt = lora_checkpoint(tiny_sd, tmp_path / "lora.ckpt")
    previous = os.umask(umask)
    try:
        written = [
            script("export_diffusers.py", "--ckpt", full, "--out", tmp_path / "exported"),
            script("export_lora.py", "--ckpt", lora_ckpt, "--out", tmp_path / "run-merged", "--merge"),
            script("export_lora.py", "--lora", lora_file, "--pretrained", tiny_sd, "--merge", "--out", tmp_path / "m"),
            convert(tiny_sd, tmp_path / "converted"),
            save_lora(with_adapters(tiny_sd), tmp_path / "diffusers-lora", "diffusers").parent,
            save_lora(with_adapters(tiny_sd), tmp_path / "kohya-lora", "kohya").parent,
        ]
    finally:
        os.umask(previous)
    assert (written[0] / "ldm_config.json").is_file() and (written[2] / "unet" / "config.json").is_file()
    for folder in written:
        found = modes(folder)
        expected = {name: oct((0o777 if (folder.parent / name).is_dir() else 0o666) & ~umask) for name in found}
        assert found == expected


def merged_reference(base: Path, lora: Path) -> Parts:
    """`lora` merged into `base` in fp32: the weights a merge writes, before they are cast."""
    parts = read_parts(base)
    add_lora(parts, LORA_PARTS, {"init_from": str(lora)}, key="--lora", where="--lora")
    for name in LORA_PARTS:
        parts[name] = merged(parts[name])
    return parts


def test_a_merge_keeps_the_dtype_of_the_base(tiny_sd, lora_file, tmp_path):
    """An fp16 base (folder or single file) gives fp16 files, equal to the fp32 merge cast to fp16, not fp32 files
    of twice the size; an fp32 base stays fp32; --half still gives fp16."""
    half_base = convert(tiny_sd, tmp_path / "fp16-base", half=True)
    cases = {
        "fp16": (half_base, torch.float16, ()),
        "fp16-file": (convert(tiny_sd, tmp_path / "fp16.safetensors", half=True), torch.float16, ()),
        "fp32": (tiny_sd, torch.float32, ()),
        "half": (tiny_sd, torch.float16, ("--half",)),
    }
    for name, (base, dtype, extra) in cases.items():
        out = tmp_path / f"merged-{name}"
        run_script("export_lora.py", "--lora", lora_file, "--pretrained", base, "--merge", "--out", out, *extra)
        expected = merged_reference(base, lora_file)
        for part, file in WEIGHTS.items():
            written = load_file(out / file)
            state = expected[part].state_dict()
            state = with_prefix(state) if part == "text_encoder" else state  # as the folder keeps it
            reference = {k: v.to(dtype) if v.is_floating_point() else v for k, v in state.items()}
            assert {k: v.dtype for k, v in written.items()} == {k: v.dtype for k, v in reference.items()}, name
            assert [k for k in written if not torch.equal(written[k], reference[k])] == [], name
        vae = load_file(out / "vae" / "diffusion_pytorch_model.safetensors")
        assert {v.dtype for v in vae.values()} == {dtype}, name
    base_unet = load_file(half_base / WEIGHTS["unet"])
    merged_unet = load_file(tmp_path / "merged-fp16" / WEIGHTS["unet"])
    assert any(not torch.equal(base_unet[k], merged_unet[k]) for k in base_unet), "the LoRA changed the weights"


def test_a_merged_lora_checkpoint_keeps_the_dtype_of_its_base(tiny_sd, tmp_path):
    half_base = convert(tiny_sd, tmp_path / "fp16-base", half=True)
    ckpt = lora_checkpoint(half_base, tmp_path / "lora.ckpt")
    out = script("export_lora.py", "--ckpt", ckpt, "--out", tmp_path / "merged", "--merge")
    for file in (*WEIGHTS.values(), "vae/diffusion_pytorch_model.safetensors"):
        assert {v.dtype for v in load_file(out / file).values()} == {torch.float16}, file
