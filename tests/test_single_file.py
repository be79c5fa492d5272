"""Original SD single files in and out, cross-checked against diffusers' own single-file loader."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from diffusers import StableDiffusionPipeline
from safetensors.torch import load_file, save_file

from ldm.components.build import build_parts
from ldm.components.describe import parts_from_description
from ldm.export import convert
from ldm.sampling import build_pipeline, inference_scheduler, sample
from ldm.weights.read import read_parts
from ldm.weights.single_file import (
    FAMILIES,
    SingleFileError,
    detect_family,
    family_description,
    family_of,
    load_single_file,
    save_single_file,
    to_original,
)

REPO = Path(__file__).resolve().parents[1]


def plain(module: torch.nn.Module) -> dict:
    """A state dict with CLIPTextModel's `text_model.` level removed (transformers 4 has it, 5 not)."""
    return {k.removeprefix("text_model."): v for k, v in module.state_dict().items()}


def assert_same_weights(a, b) -> None:
    for name in ("unet", "vae", "text_encoder"):
        left, right = plain(getattr(a, name)), plain(getattr(b, name))
        assert left.keys() == right.keys(), f"{name}: {sorted(set(left) ^ set(right))[:4]}"
        different = [k for k in left if not torch.equal(left[k], right[k])]
        assert not different, f"{name}: {different[:4]}"


@pytest.fixture(scope="module", params=["epsilon", "v_prediction"])
def sd_layout(request, tmp_path_factory) -> Path:
    """A tiny diffusers folder with SD's block layout; v_prediction stands for SD 2.x (OpenCLIP layout)."""
    from examples.tiny_sd import SD_LAYOUT_UNET, SD_LAYOUT_VAE, write_tiny_sd

    unet = dict(SD_LAYOUT_UNET, use_linear_projection=request.param == "v_prediction")
    folder = tmp_path_factory.mktemp(f"sd-layout-{request.param}")
    return write_tiny_sd(folder, request.param, seed=1, unet=unet, vae=SD_LAYOUT_VAE)


def layout_of(folder: Path) -> str:
    return "open_clip" if "v_prediction" in folder.name else "clip"


def test_diffusers_from_single_file_reads_our_export_as_we_do(sd_layout, tmp_path):
    parts = build_parts(pretrained=str(sd_layout))
    file = save_single_file(parts, tmp_path / "model.safetensors", text_layout=layout_of(sd_layout))
    theirs = StableDiffusionPipeline.from_single_file(
        str(file), config=str(sd_layout), local_files_only=True, safety_checker=None
    )
    ours, line = load_single_file(file)
    assert "from the file's ldm metadata" in line
    assert_same_weights(parts, theirs)
    assert_same_weights(parts, ours)
    assert ours.scheduler.config.prediction_type == parts.scheduler.config.prediction_type

    theirs.scheduler = inference_scheduler(theirs.scheduler)
    ours_pipe = build_pipeline(ours)
    images = [sample(pipe, ["a photo of a cat"], steps=3, height=64, width=64)[0] for pipe in (theirs, ours_pipe)]
    # The weights are bit-identical (above), but not laid out alike: diffusers' tensors are the file's memory map,
    # at the file's offsets, ours are copies (aligned), and CPU kernels sum in another order on other alignments.
    apart = np.abs(np.asarray(images[0], dtype=int) - np.asarray(images[1], dtype=int))
    assert apart.max() <= 1 and (apart > 0).mean() < 1e-3, (apart.max(), (apart > 0).sum())


def test_round_trips_are_bit_identical(sd_layout, tmp_path):
    single = convert(sd_layout, tmp_path / "one.safetensors")  # diffusers -> single file
    folder = convert(single, tmp_path / "back")  # -> diffusers
    for part, weights in (
        ("unet", "diffusion_pytorch_model"),
        ("vae", "diffusion_pytorch_model"),
        ("text_encoder", "model"),
    ):
        before = load_file(sd_layout / part / f"{weights}.safetensors")
        after = load_file(folder / part / f"{weights}.safetensors")
        assert before.keys() == after.keys()
        assert all(torch.equal(before[k], after[k]) for k in before), part
    again = convert(folder, tmp_path / "again.ckpt")  # and the reverse: -> single file (pickle) again
    first, second = load_file(single), torch.load(again, weights_only=True)["state_dict"]
    assert first.keys() == second.keys()
    assert all(torch.equal(first[k], second[k]) for k in first)


def test_half_export_is_fp16_and_reads_back_as_fp32(tiny_sd, tmp_path):
    half = convert(tiny_sd, tmp_path / "half.safetensors", half=True)
    assert {t.dtype for t in load_file(half).values()} == {torch.float16}
    parts, _ = load_single_file(half)
    reference = build_parts(pretrained=str(tiny_sd))
    unet = plain(parts.unet)
    assert all(t.dtype == torch.float32 for t in unet.values())
    for key, value in plain(reference.unet).items():
        assert torch.equal(unet[key], value.half().float())


@pytest.fixture(scope="module")
def real_size() -> dict:
    """Each family's parts at full size on the meta device (shapes, no memory), in the original layout."""
    made = {}
    for name in ("sd15", "sd2-768-v"):
        parts = parts_from_description(family_description(FAMILIES[name]))
        made[name] = (parts, to_original(parts, FAMILIES[name].text_layout))
    return made


def test_real_size_layout_matches_diffusers_conversion(real_size):
    import diffusers.loaders.single_file_utils as reference

    for name, (parts, state) in real_size.items():
        assert family_of(parts) is FAMILIES[name]
        unet = reference.convert_ldm_unet_checkpoint(state, dict(parts.unet.config))
        vae = reference.convert_ldm_vae_checkpoint(state, dict(parts.vae.config))
        if FAMILIES[name].text_layout == "clip":
            text = reference.convert_ldm_clip_checkpoint(state)
        else:
            text = reference.convert_open_clip_checkpoint(parts.text_encoder, state)
        text = {k.removeprefix("text_model."): v for k, v in text.items() if not k.endswith("position_ids")}
        for part, converted in (("unet", unet), ("vae", vae), ("text_encoder", text)):
            mine = plain(getattr(parts, part))
            assert converted.keys() == mine.keys(), f"{name} {part}: {sorted(set(converted) ^ set(mine))[:4]}"
            assert all(converted[k].shape == mine[k].shape for k in mine), f"{name} {part}"
        unet_params = sum(v.numel() for k, v in state.items() if k.startswith("model.diffusion_model."))
        assert unet_params == {"sd15": 859_520_964, "sd2-768-v": 865_910_724}[name]


@pytest.mark.parametrize("name", ["sd15", "sd2-base", "sd2-768-v"])
def test_shipped_original_yamls_describe_the_shipped_configs(name, real_size):
    import diffusers.loaders.single_file_utils as reference

    family = FAMILIES[name]
    parts, state = real_size["sd15" if name == "sd15" else "sd2-768-v"]
    original = yaml.safe_load((REPO / "configs" / "models" / "original" / family.original_config).read_text())
    size = json.loads((family.folder / "unet" / "config.json").read_text())["sample_size"]
    derived = reference.create_unet_diffusers_config_from_ldm(original, state, image_size=size * 8)
    ours = {**parts.unet.config, **json.loads((family.folder / "unet" / "config.json").read_text())}
    for key, value in derived.items():
        assert list(np.atleast_1d(value)) == list(np.atleast_1d(ours[key])), key
    assert ("parameterization" in original["model"]["params"]) == (family.prediction_type == "v_prediction")


def test_family_detection(real_size):
    sd15, sd2 = real_size["sd15"][1], real_size["sd2-768-v"][1]
    assert detect_family(sd15, {})[0].name == "sd15"
    with pytest.raises(SingleFileError, match="cannot tell 512-base .* from 768-v .*pretrained_family"):
        detect_family(sd2, {})
    assert detect_family(sd2, {}, declared="sd2-768-v")[0].name == "sd2-768-v"
    assert detect_family(sd2, {}, global_step=875000)[0].name == "sd2-base"
    with pytest.raises(SingleFileError, match="open_clip text encoder, so it is sd2-base or sd2-768-v, not sd15"):
        detect_family(sd2, {}, declared="sd15")
    inpainting = dict(sd15)
    inpainting["model.diffusion_model.input_blocks.0.0.weight"] = torch.empty(320, 9, 3, 3, device="meta")
    with pytest.raises(SingleFileError, match="9 input channels"):
        detect_family(inpainting, {})
    with pytest.raises(SingleFileError, match="SDXL"):
        detect_family({"conditioner.embedders.0.x": torch.empty(1)}, {})
    with pytest.raises(SingleFileError, match="not a Stable Diffusion checkpoint"):
        detect_family({"foo": torch.empty(1)}, {})


def test_file_without_metadata_uses_the_family_configs(sd_layout, tmp_path):
    """A tiny model posing as SD 1.x: the family's real shapes reject it, naming the key."""
    file = save_single_file(build_parts(pretrained=str(sd_layout)), tmp_path / "m.safetensors", text_layout="clip")
    bare = tmp_path / "bare.safetensors"
    save_file(load_file(file), str(bare))
    with pytest.raises(
        SingleFileError, match="bare.safetensors: .* has shape .* expects .*not the family it looks like"
    ):
        load_single_file(bare)


def test_ema_weights_are_chosen_when_asked(tiny_sd, tmp_path):
    parts = build_parts(pretrained=str(tiny_sd))
    state = to_original(parts, "clip")
    ema = {
        "model_ema." + "".join(k[len("model.") :].split(".")): v + 1
        for k, v in state.items()
        if k.startswith("model.diffusion_model.")
    }
    meta = {"ldm": json.dumps({"family": "custom", "text_layout": "clip", "parts": _described(parts)})}
    save_file({**state, **ema}, str(tmp_path / "both.safetensors"), metadata=meta)
    raw, _ = load_single_file(tmp_path / "both.safetensors")
    averaged, _ = load_single_file(tmp_path / "both.safetensors", ema=True)
    assert torch.equal(raw.unet.conv_in.weight, parts.unet.conv_in.weight)
    assert torch.equal(averaged.unet.conv_in.weight, parts.unet.conv_in.weight + 1)
    assert torch.equal(averaged.vae.encoder.conv_in.weight, parts.vae.encoder.conv_in.weight)
    save_file(state, str(tmp_path / "one.safetensors"), metadata=meta)
    with pytest.raises(SingleFileError, match="has no EMA weights .*emaonly"):
        load_single_file(tmp_path / "one.safetensors", ema=True)


def _described(parts) -> dict:
    from ldm.components.describe import describe_parts

    return describe_parts(parts)


class Payload:
    """Pickles as a call that writes a file: what a malicious .ckpt does."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (Path.write_text, (self.marker, "code ran"))


def test_pickles_that_need_code_are_refused(tiny_sd, tmp_path):
    state = to_original(build_parts(pretrained=str(tiny_sd)), "clip")
    marker = tmp_path / "marker"
    torch.save({"state_dict": state, "callbacks": Payload(marker)}, tmp_path / "evil.ckpt")
    with pytest.raises(
        ValueError, match=r"refused: .*can run code.*scripts/convert.py --src .*evil.ckpt --dst .*--trust-pickle"
    ):
        read_parts(tmp_path / "evil.ckpt")
    assert not marker.exists()

    torch.save({"state_dict": state, "callbacks": Path("harmless")}, tmp_path / "lightning.ckpt")
    with pytest.raises(ValueError, match="refused"):
        read_parts(tmp_path / "lightning.ckpt")
    with pytest.raises(SingleFileError, match="not the family it looks like"):  # read with trust: a bare tiny file
        read_parts(tmp_path / "lightning.ckpt", trust_pickle=True)


def test_convert_script_converts_a_trusted_pickle_once(tiny_sd, tmp_path):
    from tests.helpers import run_script

    parts = build_parts(pretrained=str(tiny_sd))
    meta = {"family": "custom", "text_layout": "clip", "parts": _described(parts)}
    torch.save({"state_dict": to_original(parts, "clip"), "ldm": meta, "callbacks": Path("x")}, tmp_path / "old.ckpt")
    with pytest.raises(SystemExit, match="convert: .*old.ckpt: refused: loading it would unpickle pathlib"):
        run_script("convert.py", "--src", tmp_path / "old.ckpt", "--dst", tmp_path / "old.safetensors")
    printed = run_script(
        "convert.py", "--src", tmp_path / "old.ckpt", "--dst", tmp_path / "old.safetensors", "--trust-pickle"
    )
    assert printed.strip() == str(tmp_path / "old.safetensors")
    assert_same_weights(load_single_file(tmp_path / "old.safetensors")[0], parts)


def test_convert_refuses_to_overwrite_and_unknown_suffixes(tiny_sd, tmp_path):
    (tmp_path / "taken.safetensors").write_bytes(b"x")
    with pytest.raises(FileExistsError, match="nothing is overwritten"):
        convert(tiny_sd, tmp_path / "taken.safetensors")
    with pytest.raises(ValueError, match="--dst .*model.bin.x"):
        convert(tiny_sd, tmp_path / "model.bin.x")


def test_sampling_reads_single_files(tiny_sd, tmp_path):
    from ldm.export import load_pipeline

    single = convert(tiny_sd, tmp_path / "tiny.safetensors")
    assert_same_weights(load_pipeline(single), build_parts(pretrained=str(tiny_sd)))


@pytest.mark.slow
@pytest.mark.parametrize("name", ["sd15", "sd2-768-v"])
def test_real_size_file_reads_in_diffusers_as_we_convert_it(name, tmp_path):
    """Full-size random weights (~2 GiB fp16 file; 15 GB RAM, 2.5 min here): a file without our
    metadata, as A1111 has them, detected, converted, and read by diffusers to the same tensors."""
    parts = parts_from_description(family_description(FAMILIES[name]))
    generator = torch.Generator().manual_seed(0)
    for part in ("unet", "vae", "text_encoder"):
        module = getattr(parts, part).to_empty(device="cpu")
        with torch.no_grad():
            for param in module.parameters():
                param.copy_(torch.randn(param.shape, generator=generator) * 0.02)
        setattr(parts, part, module)
    bare = tmp_path / "bare.safetensors"
    save_file(to_original(parts, FAMILIES[name].text_layout, half=True), str(bare))
    del parts
    if name != "sd15":
        with pytest.raises(SingleFileError, match="cannot tell 512-base"):
            read_parts(bare)
    folder = convert(bare, tmp_path / "folder", half=True, family=None if name == "sd15" else name)
    theirs = StableDiffusionPipeline.from_single_file(
        str(bare), config=str(folder), local_files_only=True, safety_checker=None, torch_dtype=torch.float16
    )
    ours = StableDiffusionPipeline.from_pretrained(
        folder, local_files_only=True, safety_checker=None, torch_dtype=torch.float16
    )
    assert_same_weights(ours, theirs)
    assert ours.scheduler.config.prediction_type == FAMILIES[name].prediction_type
    again = convert(folder, tmp_path / "again.safetensors", half=True)
    first, second = load_file(bare), load_file(again)
    assert first.keys() == second.keys() and all(torch.equal(first[k], second[k]) for k in first)
