"""Round trips keep every tensor: original single file -> diffusers folder -> single file gives back each one,
bit for bit; a written file says what it is (modelspec metadata, the original YAML beside SD 2.x files)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from diffusers import StableDiffusionPipeline
from safetensors.torch import load_file, safe_open, save_file

from ldm.components import Parts
from ldm.components.build import build_parts
from ldm.components.describe import describe_parts, family_description, parts_from_description
from ldm.export import convert
from ldm.families import CONFIGS, FAMILIES
from ldm.families.sd import OPEN_CLIP
from ldm.weights.extras import EXTRAS_FILE, extras_of
from ldm.weights.keymaps import UNET, ema_name
from ldm.weights.read import read_parts, with_base_extras
from ldm.weights.single_file import (
    MODELSPEC_ARCHITECTURES,
    config_beside,
    extra_keys,
    save_single_file,
    to_original,
)


def schedule_buffers(steps: int = 1000) -> dict[str, torch.Tensor]:
    """The noise schedule buffers the original LatentDiffusion saves (scaled-linear betas, as SD 1.x / 2.x)."""
    betas = torch.linspace(0.00085**0.5, 0.012**0.5, steps, dtype=torch.float64) ** 2
    alphas = torch.cumprod(1 - betas, 0)
    previous = torch.cat([torch.ones(1, dtype=torch.float64), alphas[:-1]])
    variance = betas * (1 - previous) / (1 - alphas)
    buffers = {
        "betas": betas,
        "alphas_cumprod": alphas,
        "alphas_cumprod_prev": previous,
        "sqrt_alphas_cumprod": alphas.sqrt(),
        "sqrt_one_minus_alphas_cumprod": (1 - alphas).sqrt(),
        "log_one_minus_alphas_cumprod": (1 - alphas).log(),
        "sqrt_recip_alphas_cumprod": (1 / alphas).sqrt(),
        "sqrt_recipm1_alphas_cumprod": (1 / alphas - 1).sqrt(),
        "posterior_variance": variance,
        "posterior_log_variance_clipped": variance.clamp(min=1e-20).log(),
        "posterior_mean_coef1": betas * previous.sqrt() / (1 - alphas),
        "posterior_mean_coef2": (1 - previous) * (1 - betas).sqrt() / (1 - alphas),
    }
    return {k: v.float() for k, v in buffers.items()}


def what_sd_files_hold_beyond_the_parts(state: dict, layout: str, make=torch.randn) -> dict[str, torch.Tensor]:
    """What real SD files carry that no diffusers part holds, for an original-layout `state` of the parts."""
    extra = {**schedule_buffers(), "some_tool.marker": torch.arange(3)}
    extra["model_ema.decay"] = torch.tensor(0.9999)
    extra["model_ema.num_updates"] = torch.tensor(1234, dtype=torch.int32)
    extra.update({ema_name(k): make(v.shape) for k, v in state.items() if k.startswith(UNET)})
    if layout == "open_clip":
        blocks = sorted({int(k.split(".")[4]) for k in state if k.startswith(OPEN_CLIP + "transformer.resblocks.")})
        last = f"{OPEN_CLIP}transformer.resblocks.{blocks[-1]}."
        for key, value in state.items():  # the layer after the last one CLIPTextModel has (SD 2 skips it)
            if key.startswith(last):
                extra[key.replace(last, f"{OPEN_CLIP}transformer.resblocks.{blocks[-1] + 1}.")] = make(value.shape)
        extra[OPEN_CLIP + "logit_scale"] = torch.tensor(4.6052)
        width = state[OPEN_CLIP + "ln_final.weight"].shape[0]
        extra[OPEN_CLIP + "text_projection"] = make((width, width))  # the real one, not the identity we write
    else:
        extra["cond_stage_model.transformer.text_model.embeddings.position_ids"] = torch.arange(77)[None]
    return extra


@pytest.fixture(scope="module", params=["sd2", "sd15"])
def original(request, tmp_path_factory) -> Path:
    """A tiny original-layout file holding everything real SD files hold: SD 2 (OpenCLIP, .safetensors) or
    SD 1.5 (CLIP, a .ckpt). Tiny, so it names its architecture in our metadata (real files need not)."""
    from examples.tiny_sd import SD_LAYOUT_UNET, SD_LAYOUT_VAE, write_tiny_sd

    v2 = request.param == "sd2"
    unet = dict(SD_LAYOUT_UNET, use_linear_projection=v2)
    folder = tmp_path_factory.mktemp(f"tiny-{request.param}")
    parts = build_parts(
        pretrained=str(write_tiny_sd(folder / "diffusers", "v_prediction" if v2 else "epsilon", 2, unet, SD_LAYOUT_VAE))
    )
    layout = "open_clip" if v2 else "clip"
    torch.manual_seed(3)
    state = to_original(parts, layout)
    state.update(what_sd_files_hold_beyond_the_parts(state, layout))
    meta = {"family": "custom", "text_layout": layout, "parts": describe_parts(parts)}
    if v2:
        save_file(state, str(folder / "model.safetensors"), metadata={"ldm": json.dumps(meta)})
        return folder / "model.safetensors"
    torch.save({"state_dict": state, "ldm": meta, "global_step": 10}, folder / "model.ckpt")
    return folder / "model.ckpt"


def tensors_of(path: Path) -> dict[str, torch.Tensor]:
    return load_file(path) if path.suffix == ".safetensors" else torch.load(path, weights_only=True)["state_dict"]


def assert_same_tensors(before: dict, after: dict) -> None:
    assert sorted(before) == sorted(after), sorted(set(before) ^ set(after))[:6]
    assert [k for k in before if before[k].dtype != after[k].dtype] == []
    assert [k for k in before if not torch.equal(before[k], after[k])] == []


def test_original_to_folder_and_back_gives_every_tensor(original, tmp_path):
    folder = convert(original, tmp_path / "folder")
    assert (folder / EXTRAS_FILE).is_file()
    back = convert(folder, tmp_path / "back.safetensors")
    assert_same_tensors(tensors_of(original), load_file(back))
    again = convert(back, tmp_path / "again.ckpt")  # and file to file, into the other format
    assert_same_tensors(tensors_of(original), tensors_of(again))


def test_diffusers_loads_a_folder_that_carries_extras(original, tmp_path):
    folder = convert(original, tmp_path / "folder")
    pipe = StableDiffusionPipeline.from_pretrained(folder, local_files_only=True, safety_checker=None)
    ours = build_parts(pretrained=str(folder))
    assert torch.equal(pipe.unet.conv_in.weight, ours.unet.conv_in.weight)
    assert torch.equal(pipe.unet.conv_in.weight, read_parts(original).unet.conv_in.weight)


def test_half_round_trip_keeps_the_ema_copy_and_the_schedule_in_fp32(original, tmp_path):
    folder = convert(original, tmp_path / "folder", half=True)
    first = load_file(convert(folder, tmp_path / "back.safetensors", half=True))
    source = tensors_of(original)
    assert sorted(first) == sorted(source)
    assert first["alphas_cumprod"].dtype == torch.float32 and first["model_ema.decay"].dtype == torch.float32
    flat = ema_name(UNET + "out.2.weight")
    assert first[flat].dtype == torch.float16 and torch.equal(first[flat], source[flat].half())
    second = load_file(convert(tmp_path / "back.safetensors", tmp_path / "again.safetensors", half=True))
    assert_same_tensors(first, second)


def test_ema_conversion_takes_the_ema_weights_and_keeps_the_rest(original, tmp_path):
    source = tensors_of(original)
    back = load_file(convert(convert(original, tmp_path / "folder", ema=True), tmp_path / "back.safetensors"))
    unet = [k for k in source if k.startswith(UNET)]
    assert all(torch.equal(back[k], source[ema_name(k)]) for k in unet)
    assert not any(ema_name(k) in back for k in unet), "the EMA copy became the model; it is not written twice"
    rest = [k for k in source if not k.startswith(UNET) and k not in {ema_name(u) for u in unet}]
    assert sorted(set(back) - set(unet)) == sorted(rest)
    assert all(torch.equal(back[k], source[k]) for k in rest)


def test_a_changed_unet_drops_the_stale_ema_copy_only(original, tmp_path):
    parts = read_parts(convert(original, tmp_path / "folder"))
    with torch.no_grad():
        parts.unet.conv_in.weight += 1
    written = load_file(save_single_file(parts, tmp_path / "tuned.safetensors"))
    source = tensors_of(original)
    assert not any(k.startswith("model_ema.") for k in written)
    assert sorted(written) == sorted(k for k in source if not k.startswith("model_ema."))
    assert torch.equal(written["alphas_cumprod"], source["alphas_cumprod"])


def test_export_of_a_checkpoint_reads_its_base_file_again(original, tmp_path):
    from tests.helpers import run_script

    def checkpoint_of(parts, name: str) -> Path:
        state = {
            f"{part}.{k}": v for part in ("unet", "vae", "text_encoder") for k, v in parts[part].state_dict().items()
        }
        config = {"model": {"params": {"pretrained": str(original)}}}
        torch.save({"state_dict": state, "ldm": {"parts": describe_parts(parts), "config": config}}, tmp_path / name)
        return tmp_path / name

    parts = read_parts(original)
    frozen = checkpoint_of(parts, "frozen.ckpt")  # a run that trained the text encoder only (here: nothing)
    with torch.no_grad():
        parts.unet.conv_in.weight += 1
    tuned = checkpoint_of(parts, "tuned.ckpt")
    source = tensors_of(original)
    out = run_script("export_single_file.py", "--ckpt", frozen, "--out", tmp_path / "frozen.safetensors")
    assert_same_tensors(source, load_file(out.strip()))
    out = run_script("export_single_file.py", "--ckpt", tuned, "--out", tmp_path / "tuned.safetensors")
    assert sorted(load_file(out.strip())) == sorted(k for k in source if not k.startswith("model_ema."))


def test_a_base_that_is_gone_exports_without_extras(original, tmp_path, caplog):
    parts = Parts(read_parts(original))  # as rebuilt from a checkpoint: no extras
    ckpt = {"ldm": {"config": {"model": {"params": {"pretrained": str(tmp_path / "moved.safetensors")}}}}}
    with caplog.at_level("INFO"):
        assert extras_of(with_base_extras(parts, ckpt)) is None
    assert "moved.safetensors (model.params.pretrained): nothing (no such file or folder)" in caplog.text


@pytest.mark.parametrize("name", ["sd15", "sd2-768-v"])
def test_real_size_extras_are_what_the_parts_do_not_take(name):
    """The key sets of a real-size file (meta tensors): OpenCLIP's 24th layer, logit_scale, the real
    text_projection, the schedule, the EMA copy and unknown keys are extras; the rest the parts take."""
    family = FAMILIES[name]
    parts = parts_from_description(family_description(family))
    ours = to_original(parts, family.text_layout)
    extra = what_sd_files_hold_beyond_the_parts(
        ours, family.text_layout, lambda shape: torch.empty(shape, device="meta")
    )
    state = {**ours, **extra}
    if name == "sd2-768-v":
        assert OPEN_CLIP + "transformer.resblocks.23.attn.in_proj_weight" in extra
        assert OPEN_CLIP + "transformer.resblocks.22.attn.in_proj_weight" in ours
    found = extra_keys(state, parts, family.text_layout)
    assert sorted(found) == sorted(extra)
    assert set(ours) | set(found) == set(state)
    with_ema = extra_keys(state, parts, family.text_layout, ema=True)
    assert not any(k.startswith(UNET) or k in {ema_name(u) for u in ours} for k in with_ema)


@pytest.fixture
def as_family(monkeypatch):
    """Make tiny parts pass for a released family (whose real-size weights are too big for a test)."""

    def set_family(name: str) -> None:
        monkeypatch.setattr("ldm.weights.single_file.family_of", lambda parts: FAMILIES[name])

    return set_family


@pytest.mark.parametrize(
    ("name", "yaml", "architecture", "prediction"),
    [
        ("sd2-768-v", "v2-inference-v.yaml", "stable-diffusion-v2-768-v", "v"),
        ("sd2-base", "v2-inference.yaml", "stable-diffusion-v2-512", "epsilon"),
        ("sd15", None, "stable-diffusion-v1", "epsilon"),
    ],
)
def test_exports_say_what_they_are(original, tmp_path, as_family, name, yaml, architecture, prediction):
    as_family(name)
    parts = read_parts(original)
    file = save_single_file(parts, tmp_path / "my.model.safetensors", text_layout=FAMILIES[name].text_layout)
    beside = tmp_path / "my.model.yaml"  # where A1111 looks: the file name without its suffix, plus .yaml
    if yaml:
        assert beside.read_bytes() == (CONFIGS / "original" / yaml).read_bytes()
    else:
        assert not beside.exists()
    with safe_open(str(file), "pt") as handle:
        meta = handle.metadata()
    assert meta["modelspec.sai_model_spec"] == "1.0.0"
    assert meta["modelspec.architecture"] == architecture
    assert meta["modelspec.prediction_type"] == prediction
    assert meta["modelspec.title"] == "my.model"
    assert meta["modelspec.resolution"] == "64x64"  # the tiny model's; 512x512 / 768x768 at real size
    assert meta["modelspec.implementation"]
    ckpt = save_single_file(parts, tmp_path / "other.ckpt", text_layout=FAMILIES[name].text_layout)
    assert ckpt.with_suffix(".yaml").exists() == bool(yaml)


def test_every_family_has_a_modelspec_architecture():
    assert set(MODELSPEC_ARCHITECTURES) == set(FAMILIES)
    assert config_beside("x.safetensors", None) is None


def test_a_custom_architecture_gets_no_modelspec_and_no_yaml(original, tmp_path):
    file = save_single_file(read_parts(original), tmp_path / "custom.safetensors")
    with safe_open(str(file), "pt") as handle:
        assert not any(k.startswith("modelspec.") for k in handle.metadata())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["custom.safetensors"]


@pytest.mark.parametrize("umask", [0o022, 0o077])
def test_exports_honour_the_umask(original, tmp_path, as_family, umask):
    as_family("sd2-768-v")
    previous = os.umask(umask)
    try:
        folder = convert(original, tmp_path / "folder")
        file = convert(folder, tmp_path / "model.safetensors")
    finally:
        os.umask(previous)
    written = [file, file.with_suffix(".yaml"), folder / EXTRAS_FILE, *(p for p in folder.rglob("*") if p.is_file())]
    assert (folder / "unet" / "diffusion_pytorch_model.safetensors") in written  # diffusers leaves it 0600
    assert {str(p): oct(p.stat().st_mode & 0o777) for p in written} == {str(p): oct(0o666 & ~umask) for p in written}
    folders = [folder, *(p for p in folder.rglob("*") if p.is_dir())]
    assert {str(p): oct(p.stat().st_mode & 0o777) for p in folders} == {str(p): oct(0o777 & ~umask) for p in folders}


@pytest.mark.slow
def test_real_size_sd2_768_v_file_round_trips_every_tensor(tmp_path):
    """Full-size random fp16 weights without our metadata, as A1111 has them, with everything a real SD 2
    file holds (a 4.3 GB file; 14 GB RAM, 2.5 min here): every tensor back, the YAML and modelspec too."""
    family = FAMILIES["sd2-768-v"]
    parts = parts_from_description(family_description(family))
    generator = torch.Generator().manual_seed(0)

    def make(shape) -> torch.Tensor:
        return (torch.randn(shape, generator=generator) * 0.02).half()

    for name in ("unet", "vae", "text_encoder"):
        module = parts[name].half().to_empty(device="cpu")
        with torch.no_grad():
            for param in module.parameters():
                param.copy_(make(param.shape))
        parts[name] = module
    state = to_original(parts, family.text_layout)
    state.update(what_sd_files_hold_beyond_the_parts(state, family.text_layout, make))
    del parts
    save_file(state, str(tmp_path / "v2-1_768.safetensors"))
    del state
    folder = convert(tmp_path / "v2-1_768.safetensors", tmp_path / "folder", half=True, family=family.name)
    back = convert(folder, tmp_path / "back.safetensors", half=True)
    assert_same_tensors(load_file(tmp_path / "v2-1_768.safetensors"), load_file(back))
    assert back.with_suffix(".yaml").read_bytes() == (CONFIGS / "original" / family.original_config).read_bytes()
    with safe_open(str(back), "pt") as handle:
        meta = handle.metadata()
    assert (meta["modelspec.architecture"], meta["modelspec.resolution"]) == ("stable-diffusion-v2-768-v", "768x768")
