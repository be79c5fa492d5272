"""LoRA files in kohya's format (ComfyUI, AUTOMATIC1111, sd-scripts): names, export, merge, and back to training."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from diffusers import AutoencoderKL, DDIMScheduler, StableDiffusionPipeline, UNet2DConditionModel
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from transformers import CLIPTextConfig, CLIPTextModel

from ldm.components import Parts
from ldm.components.lora import add_lora, lora_layers, merged
from ldm.components.lora_keys import kohya_name, kohya_names, kohya_state_dict
from ldm.config import ConfigError
from ldm.families.sd import KOHYA_PREFIXES
from ldm.weights.checkpoint import load_checkpoint
from ldm.weights.lora_file import LORA_FILE, kohya_metadata
from ldm.weights.read import parts_from_checkpoint, read_parts
from main import main
from tests import test_lora
from tests.helpers import run_script
from tests.test_lora import lora_args, outputs

REPO = Path(__file__).resolve().parents[1]
UNET_PROJECTIONS = ("to_q", "to_k", "to_v", "to_out.0")
TEXT_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "out_proj")
lora_run = test_lora.lora_run  # the fixture: a tiny LoRA run on the UNet and text encoder (rank 4, alpha 2)


def family_parts(family: str) -> Parts:
    """A released family's networks at real size on the meta device (no memory), and its scheduler."""
    from accelerate import init_empty_weights

    folder = REPO / "configs" / "models" / family
    text = {k: v for k, v in json.loads((folder / "text_encoder" / "config.json").read_text()).items() if k[0] != "_"}
    with init_empty_weights():
        unet = UNet2DConditionModel.from_config(json.loads((folder / "unet" / "config.json").read_text()))
        text_encoder = CLIPTextModel(CLIPTextConfig(**text))
        vae = AutoencoderKL.from_config(json.loads((folder / "vae" / "config.json").read_text()))
    scheduler = DDIMScheduler.from_config(json.loads((folder / "scheduler" / "scheduler_config.json").read_text()))
    return Parts(unet=unet, vae=vae, text_encoder=text_encoder, scheduler=scheduler)


def projections(module: torch.nn.Module, names: tuple[str, ...]) -> list[str]:
    return [path for path, _ in module.named_modules() if path.endswith(tuple(f".{n}" for n in names))]


@pytest.fixture(scope="module")
def sd15() -> Parts:
    return family_parts("sd15")


def test_every_sd15_attention_projection_has_one_kohya_name(sd15):
    """SD 1.5 at real size: 16 transformer blocks x 2 attentions x 4 projections = 128 UNet modules, 12 CLIP
    layers x 4 = 48 text encoder modules; 176 in all, the 352 keys (down, up) of a diffusers-format file."""
    expected = {"unet": 128, "text_encoder": 48}
    for part, names in (("unet", UNET_PROJECTIONS), ("text_encoder", TEXT_PROJECTIONS)):
        module = sd15[part]
        table = kohya_names(part, module)
        paths = [path for path, _ in module.named_modules() if path]
        assert len(table) == len(paths), "two modules share a kohya name"
        assert sorted(table.values()) == sorted(paths), "the table covers every module once"
        covered = projections(module, names)
        assert len(covered) == expected[part]
        assert all(table[kohya_name(part, path)] == path for path in covered)  # name -> module -> name
    # sd-scripts builds these as prefix + module path with . as _; ComfyUI and A1111 read exactly these
    assert sd15.unet.get_submodule(kohya_names("unet", sd15.unet)[KNOWN_UNET]) is not None
    text_table = kohya_names("text_encoder", sd15.text_encoder)
    assert text_table[KNOWN_TEXT].endswith("encoder.layers.0.self_attn.q_proj")  # with or without text_model.
    assert kohya_name("unet", "mid_block.attentions.0.transformer_blocks.0.attn2.to_out.0") == (
        "lora_unet_mid_block_attentions_0_transformer_blocks_0_attn2_to_out_0"
    )


KNOWN_UNET = "lora_unet_down_blocks_0_attentions_0_transformer_blocks_0_attn1_to_q"
KNOWN_TEXT = "lora_te_text_model_encoder_layers_0_self_attn_q_proj"


@pytest.mark.parametrize(
    "family, version, architecture",
    [
        ("sd15", "sd_v1", "stable-diffusion-v1/lora"),
        ("sd2-base", "sd_v2", "stable-diffusion-v2-512/lora"),
        ("sd2-768-v", "sd_v2_v", "stable-diffusion-v2-768-v/lora"),
    ],
)
def test_real_size_kohya_file_keys_and_metadata(family, version, architecture):
    """528 keys for SD 1.5 (176 modules x down, up, alpha); the metadata sd-scripts writes, with its values."""
    parts = family_parts(family)
    add_lora(parts, ("unet", "text_encoder"), {"rank": 4, "alpha": 2})
    state = kohya_state_dict(parts)
    diffusers_keys = sum(len(lora_layers(parts[name])) for name in ("unet", "text_encoder"))
    modules = {key.partition(".")[0] for key in state}
    assert len(state) == 3 * len(modules) and diffusers_keys == 2 * len(modules)
    if family == "sd15":
        assert (len(modules), len(state), diffusers_keys) == (176, 528, 352)
        assert {KNOWN_UNET, KNOWN_TEXT} <= modules
    assert state[f"{KNOWN_UNET}.alpha"].shape == () and state[f"{KNOWN_UNET}.alpha"].dtype == torch.float32
    assert tuple(state[f"{KNOWN_UNET}.lora_down.weight"].shape) == (4, 320)
    assert tuple(state[f"{KNOWN_UNET}.lora_up.weight"].shape) == (320, 4)
    meta = kohya_metadata(parts, "my-lora")
    assert meta["ss_network_module"] == "networks.lora"
    assert (meta["ss_network_dim"], meta["ss_network_alpha"]) == ("4", "2.0")
    assert meta["ss_base_model_version"] == version
    assert meta["ss_v2"] == str(family != "sd15")
    assert meta["modelspec.architecture"] == architecture
    assert meta["modelspec.prediction_type"] == ("v" if family == "sd2-768-v" else "epsilon")
    assert meta["ss_output_name"] == "my-lora"


def kohya_export(lora_run, out: Path, *extra) -> Path:
    printed = run_script("export_lora.py", "--ckpt", lora_run / "checkpoints" / "last.ckpt", "--out", out, *extra)
    return Path(printed.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def kohya_file(lora_run, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("kohya") / "my-lora"
    path = kohya_export(lora_run, out)
    assert path == out / "my-lora.safetensors", "kohya's format is the default; the file is named after --out"
    return path


def test_kohya_formula_reproduces_our_merged_export(lora_run, kohya_file, tiny_sd):
    """W + up @ down * alpha / rank, as the other tools merge, is our merged model, weight for weight."""
    ckpt = load_checkpoint(lora_run / "checkpoints" / "last.ckpt")
    ours = parts_from_checkpoint(ckpt, merge=True)
    base = read_parts(tiny_sd)
    state = load_file(str(kohya_file))
    with safe_open(str(kohya_file), "pt") as f:
        meta = f.metadata()
    assert meta["ss_network_module"] == "networks.lora" and meta["ss_steps"] == str(ckpt["global_step"])
    assert (meta["ss_network_dim"], meta["ss_network_alpha"]) == ("4", "2.0")
    assert meta["ss_output_name"] == "my-lora" and meta["ss_base_model_version"] == ""  # the tiny model is no family
    assert {k.partition("_")[2].partition("_")[0] for k in state} == {"unet", "te"}
    changed = 0
    for part in ("unet", "text_encoder"):
        table = kohya_names(part, base[part])
        expected = {k: v.clone() for k, v in base[part].state_dict().items()}
        for name in {k.partition(".")[0] for k in state if k.startswith(KOHYA_PREFIXES[part])}:
            down, up, alpha = state[f"{name}.lora_down.weight"], state[f"{name}.lora_up.weight"], state[f"{name}.alpha"]
            assert alpha.shape == () and alpha.dtype == down.dtype == torch.float32
            expected[f"{table[name]}.weight"] += up @ down * (alpha / down.shape[0])
            changed += 1
        mine = ours[part].state_dict()
        assert set(mine) == set(expected)
        for key, value in expected.items():
            torch.testing.assert_close(mine[key], value, rtol=1e-5, atol=1e-6, msg=key)
    assert changed == len(state) // 3


def test_diffusers_reads_our_kohya_file(lora_run, kohya_file, tiny_sd):
    """A third reader of the format: diffusers' own kohya converter gives our model's outputs."""
    ours = parts_from_checkpoint(load_checkpoint(lora_run / "checkpoints" / "last.ckpt"), merge=False)
    expected = outputs(ours.unet, ours.text_encoder, ours.tokenizer)
    pipe = StableDiffusionPipeline.from_pretrained(tiny_sd, local_files_only=True, safety_checker=None)
    pipe.load_lora_weights(str(kohya_file.parent), weight_name=kohya_file.name)
    for mine, theirs in zip(expected, outputs(pipe.unet, pipe.text_encoder, pipe.tokenizer)):
        torch.testing.assert_close(theirs, mine, rtol=1e-5, atol=1e-5)


def lora_system(tiny_sd, **lora):
    from ldm.models.diffusion.ddpm import LatentDiffusion

    system = LatentDiffusion(pretrained=str(tiny_sd), trainable=["unet", "text_encoder"], lora=lora)
    system.configure_model()
    return system


def test_init_from_starts_the_adapters_at_the_file(kohya_file, tiny_sd):
    """Rank, alpha and modules come from the file; a set alpha rescales up so the adapted model is the file's."""
    system = lora_system(tiny_sd, init_from=str(kohya_file))
    parts = Parts({name: system.parts[name] for name in ("unet", "text_encoder")})
    state = load_file(str(kohya_file))
    again = kohya_state_dict(parts)
    assert set(again) == set(state)
    for key, value in state.items():
        torch.testing.assert_close(again[key], value, rtol=0, atol=0, msg=key)

    rescaled = lora_system(tiny_sd, init_from=str(kohya_file), rank=4, alpha=8)
    for name in ("unet", "text_encoder"):
        one, other = merged(system.parts[name]).state_dict(), merged(rescaled.parts[name]).state_dict()
        for key in one:
            torch.testing.assert_close(other[key], one[key], rtol=1e-5, atol=1e-6, msg=key)


def test_training_goes_on_from_a_kohya_file(kohya_file, tiny_sd, image_folder, tmp_path):
    """`model.params.lora.init_from` in a run: one step later the adapters are the file's, moved by one step."""
    logdir = tmp_path / "logs"
    assert main(lora_args(tiny_sd, image_folder, logdir, f"model.params.lora.init_from={kohya_file}", *ONE_STEP)) == 0
    (run,) = logdir.iterdir()
    ckpt = load_checkpoint(run / "checkpoints" / "last.ckpt")
    assert ckpt["ldm"]["lora"]["spec"]["init_from"] == str(kohya_file)
    trained = kohya_state_dict(parts_from_checkpoint(ckpt, merge=False))
    start = load_file(str(kohya_file))
    moved = max((trained[k] - start[k]).abs().max().item() for k in start)
    assert 0 < moved < 0.05, "one Adam step at lr 1e-2 from the file's adapters, not from a fresh start"


ONE_STEP = ["lightning.trainer.max_steps=1", "lightning.callbacks.image_logger.params.every_n_steps=100"]


def test_init_from_errors(kohya_file, tiny_sd, tmp_path):
    state = load_file(str(kohya_file))
    stray = tmp_path / "stray.safetensors"
    save_file({**state, "lora_unet_no_such_block_to_q.lora_down.weight": torch.zeros(4, 8)}, str(stray))
    with pytest.raises(ConfigError, match=f"init_from: {stray}: key 'lora_unet_no_such_block_to_q.lora_down.weight'"):
        lora_system(tiny_sd, init_from=str(stray))
    with pytest.raises(
        ConfigError, match="model.params.lora.rank: 8, but .* rank-4 adapters.*set model.params.lora.rank: 4"
    ):
        lora_system(tiny_sd, init_from=str(kohya_file), rank=8)
    with pytest.raises(ConfigError, match="which model.params.lora.target_modules does not target"):
        lora_system(tiny_sd, init_from=str(kohya_file), target_modules=["to_q"])
    from ldm.models.diffusion.ddpm import LatentDiffusion

    with pytest.raises(
        ConfigError, match="adapters for the text encoder .* add text_encoder to model.params.trainable"
    ):
        LatentDiffusion(pretrained=str(tiny_sd), lora={"init_from": str(kohya_file)}).configure_model()
    locon = tmp_path / "locon.safetensors"
    save_file({f"{KNOWN_UNET}.hada_w1_a": torch.zeros(4, 4)}, str(locon))
    with pytest.raises(ConfigError, match="is not a LoRA weight"):
        lora_system(tiny_sd, init_from=str(locon))
    with pytest.raises(ConfigError, match="no such file"):
        lora_system(tiny_sd, init_from=str(tmp_path / "missing.safetensors"))


def test_a_diffusers_format_file_loads_back_too(lora_run, tiny_sd, tmp_path):
    """Our diffusers file (alpha / rank folded into up) starts training at the same model, whatever alpha is set."""
    out = kohya_export(lora_run, tmp_path / "diffusers", "--format", "diffusers")
    assert out == tmp_path / "diffusers" / LORA_FILE
    ours = parts_from_checkpoint(load_checkpoint(lora_run / "checkpoints" / "last.ckpt"), merge=True)
    system = lora_system(tiny_sd, init_from=str(out), rank=4, alpha=2)
    for name in ("unet", "text_encoder"):
        mine, loaded = ours[name].state_dict(), merged(system.parts[name]).state_dict()
        for key in mine:
            torch.testing.assert_close(loaded[key], mine[key], rtol=1e-5, atol=1e-6, msg=key)


def test_merge_a_kohya_file_into_a_pretrained_model(lora_run, kohya_file, tiny_sd, tmp_path):
    ours = parts_from_checkpoint(load_checkpoint(lora_run / "checkpoints" / "last.ckpt"), merge=True)
    expected = outputs(ours.unet, ours.text_encoder, ours.tokenizer)
    out = tmp_path / "merged"
    run_script("export_lora.py", "--lora", kohya_file, "--pretrained", tiny_sd, "--merge", "--out", out)
    pipe = StableDiffusionPipeline.from_pretrained(out, local_files_only=True, safety_checker=None)
    for mine, theirs in zip(expected, outputs(pipe.unet, pipe.text_encoder, pipe.tokenizer)):
        torch.testing.assert_close(theirs, mine, rtol=1e-5, atol=1e-5)
    assert not any("lora" in k for k in pipe.unet.state_dict())


def test_cli_file_naming_overwrite_and_argument_errors(lora_run, kohya_file, tmp_path, capsys):
    named = tmp_path / "sub" / "mine.safetensors"
    assert kohya_export(lora_run, named) == named
    with safe_open(str(named), "pt") as f:
        assert f.metadata()["ss_output_name"] == "mine"
    named.write_bytes(b"an older file")
    umask = os.umask(0o027)
    try:
        assert kohya_export(lora_run, named) == named  # replaced, atomically, as the other exports do
    finally:
        os.umask(umask)
    assert load_file(str(named)).keys() == load_file(str(kohya_file)).keys()
    assert named.stat().st_mode & 0o777 == 0o640, "the umask gives the file's mode"
    assert sorted(p.name for p in named.parent.iterdir()) == ["mine.safetensors"], "nothing half-written left"
    ckpt = ["--ckpt", lora_run / "checkpoints" / "last.ckpt"]
    for args, message in [
        (["--lora", kohya_file, "--out", tmp_path / "x"], "give --pretrained BASE and --merge"),
        ([*ckpt, "--out", tmp_path / "x", "--merge", "--format", "kohya"], "--format is for LoRA files"),
        ([*ckpt, "--pretrained", tmp_path, "--out", tmp_path / "x"], "--pretrained goes with --lora"),
        ([*ckpt, "--out", tmp_path / "x.safetensors", "--format", "diffusers"], "diffusers' LoRA format is a folder"),
    ]:
        with pytest.raises(SystemExit) as exit_info:
            run_script("export_lora.py", *args)
        assert exit_info.value.code != 0
        assert message in f"{exit_info.value.code} {capsys.readouterr().err}"
