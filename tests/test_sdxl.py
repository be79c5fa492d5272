"""SDXL: the family's real-size configs, its conditioning as diffusers computes it, and a tiny SDXL-shaped
pipeline fine-tuned through main.py, resumed, exported and read back by diffusers."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from diffusers import StableDiffusionXLPipeline

from ldm.components.describe import family_description, parts_from_description
from ldm.components.lora_keys import lora_modules
from ldm.config import ConfigError
from ldm.export import export_pipeline, load_pipeline
from ldm.families import CONDITIONINGS, FAMILIES, conditioning_for, family_of
from ldm.families.sdxl import sdxl_time_ids
from ldm.sampling import build_pipeline, sample
from ldm.weights.checkpoint import load_checkpoint
from ldm.weights.read import parts_from_checkpoint, read_parts
from tests.helpers import finetune_args, train_once

REPO = Path(__file__).resolve().parents[1]


def test_the_sdxl_family_is_sdxl_base_at_full_size():
    """configs/models/sdxl/ builds SDXL 1.0 base's parts (on the meta device) with its parameter counts; the
    parts are told apart from SD 1.x by the second text encoder and condition with both."""
    parts = parts_from_description(family_description(FAMILIES["sdxl"]))
    counts = {name: sum(p.numel() for p in module.parameters()) for name, module in parts.networks.items()}
    assert counts == {"unet": 2_567_463_684, "vae": 83_653_863, "text_encoder": 123_060_480,
                      "text_encoder_2": 694_659_840}  # fmt: skip
    assert family_of(parts) is FAMILIES["sdxl"] and conditioning_for(parts) == "sdxl"
    assert parts.tokenizer.pad_token == "<|endoftext|>" and parts.tokenizer_2.pad_token == "!"
    assert parts.scheduler.config.prediction_type == "epsilon" and parts.vae.config.scaling_factor == 0.13025


def test_sdxl_conditioning_is_what_the_diffusers_pipeline_computes(tiny_sdxl):
    """Both encoders' penultimate states side by side, the second's pooled projection, and the size and crop ids
    in diffusers' order (original height, width; crop top, left; target height, width)."""
    parts = read_parts(tiny_sdxl)
    assert family_of(parts) is None and conditioning_for(parts) == "sdxl"  # SDXL-shaped; not the released size
    pipe = build_pipeline(parts)
    captions = ["a photo of a cat", ""]
    with torch.no_grad():
        ours = CONDITIONINGS["sdxl"].text(parts, captions, torch.device("cpu"))
        embeds, _, pooled, _ = pipe.encode_prompt(captions, device="cpu", do_classifier_free_guidance=False)
    assert ours["encoder_hidden_states"].shape == (2, 77, 80) and torch.equal(ours["encoder_hidden_states"], embeds)
    assert torch.equal(ours["text_embeds"], pooled)
    batch = {"caption": captions, "original_size": [torch.tensor([300, 20]), torch.tensor([400, 16])],
             "crop_top_left": [torch.tensor([7, 0]), torch.tensor([0, 3])]}  # fmt: skip
    ids = sdxl_time_ids(batch, (16, 24), torch.device("cpu"))["time_ids"]
    expected = [pipe._get_add_time_ids(size, crop, (16, 24), torch.float32, text_encoder_projection_dim=32)[0]
                for size, crop in (((300, 400), (7, 0)), ((20, 16), (0, 3)))]  # fmt: skip
    assert torch.equal(ids, torch.stack(expected))
    assert torch.equal(sdxl_time_ids({"caption": ["x"]}, (16, 24), torch.device("cpu"))["time_ids"],
                       torch.tensor([[16.0, 24, 0, 0, 16, 24]]))  # fmt: skip


def test_sdxl_time_ids_come_from_the_images_sizes_and_crops(tmp_path):
    """A folder batch's time ids are each image's size before resizing and its crop, at the size trained."""
    from ldm.data.folder import FolderDataModule
    from tests.conftest import write_images

    root = write_images(tmp_path / "images", n=2, size=(30, 20))  # 30 wide, 20 high
    data = FolderDataModule(root=str(root), size=16, batch_size=2, num_workers=0)
    data.setup("fit")
    batch = next(iter(data.train_dataloader()))
    ids = sdxl_time_ids(batch, (16, 16), torch.device("cpu"))["time_ids"]
    assert ids.tolist() == [[20, 30, 0, 4, 16, 16]] * 2  # resized to 16 x 24, the centre 16 columns kept


def test_a_tiny_sdxl_fine_tunes_resumes_exports_and_reloads_in_diffusers(tiny_sdxl, image_folder, tmp_path):
    """Full fine-tune of the UNet and both text encoders through main.py; a resume goes on from the last
    checkpoint; the export loads in diffusers' StableDiffusionXLPipeline with the checkpoint's exact weights and
    draws the same image for a seed."""
    logs = tmp_path / "logs"
    args = finetune_args(tiny_sdxl, image_folder, logs, "model.params.trainable=[unet,text_encoder,text_encoder_2]")
    run_dir = train_once(args, logs)
    ckpt_path = run_dir / "checkpoints" / "last.ckpt"
    ckpt = load_checkpoint(ckpt_path)
    assert ckpt["global_step"] == 3 and sorted(ckpt["ldm"]["parts"]) == sorted(
        ["unet", "vae", "text_encoder", "text_encoder_2", "tokenizer", "tokenizer_2", "scheduler"]
    )
    base, trained = read_parts(tiny_sdxl), parts_from_checkpoint(ckpt)
    for name in ("unet", "text_encoder", "text_encoder_2"):
        before, after = base[name].state_dict(), trained[name].state_dict()
        assert any(not torch.equal(before[k], after[k]) for k in before), f"{name} did not train"
    assert all(torch.equal(v, trained.vae.state_dict()[k]) for k, v in base.vae.state_dict().items())
    assert list((run_dir / "images").glob("step_*.png")), "the image logger sampled through the SDXL pipeline"

    from main import main

    assert main([*args, "lightning.trainer.max_steps=4", "-r", "auto"]) == 0
    assert list(logs.iterdir()) == [run_dir] and load_checkpoint(ckpt_path)["global_step"] == 4

    out = export_pipeline(ckpt_path, tmp_path / "exported")
    reloaded = StableDiffusionXLPipeline.from_pretrained(out, local_files_only=True)
    parts = parts_from_checkpoint(load_checkpoint(ckpt_path))
    for name in ("unet", "vae", "text_encoder", "text_encoder_2"):
        ours, theirs = parts[name].state_dict(), getattr(reloaded, name).state_dict()
        assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours), name
    images = [sample(pipe, ["a photo of thing 1"], steps=2, seed=5, height=16, width=16)[0]
              for pipe in (load_pipeline(ckpt_path), load_pipeline(out))]  # fmt: skip
    assert np.array_equal(np.asarray(images[0]), np.asarray(images[1]))


def test_training_the_second_text_encoder_needs_weights_that_have_one(tiny_sd):
    from ldm.models.diffusion.ddpm import LatentDiffusion

    with pytest.raises(ConfigError, match="model.params.trainable: 'text_encoder_2', but these weights have no"):
        LatentDiffusion(pretrained=str(tiny_sd), trainable=["unet", "text_encoder_2"]).configure_model()


def test_a_cached_sdxl_run_trains_exactly_as_encoding_every_step(tiny_sdxl, image_folder, tmp_path, capsys):
    """Latents and both encoders' states encoded once train as encoding them every step: the cache keeps each
    image's size and crop (20 x 24 here, trained at 16 x 16), so the size conditioning is the same too."""
    from main import main
    from tests.helpers import recorded_losses

    every_step = recorded_losses(tiny_sdxl, image_folder, tmp_path, "every_step")
    cached = recorded_losses(tiny_sdxl, image_folder, tmp_path, "cached", "data.params.cache_latents=true",
                             "data.params.cache_text=true")  # fmt: skip
    torch.testing.assert_close(torch.tensor(cached), torch.tensor(every_step), rtol=1e-5, atol=1e-6)
    argv = finetune_args(tiny_sdxl, image_folder, tmp_path / "refused", "data.params.cache_text=true",
                         "model.params.trainable=[unet,text_encoder_2]")  # fmt: skip
    assert main(argv) == 2
    assert "cache_text: the text encoder trains (model.params.trainable includes text_encoder_2)" in (
        capsys.readouterr().err
    )


@pytest.mark.parametrize(
    "keys, named",
    [
        (["double_blocks.0.img_attn.qkv.weight"], "Flux"),
        (["conditioner.embedders.0.model.token_embedding.weight"], "the SDXL refiner"),
        (["conditioner.embedders.0.transformer.x", "conditioner.embedders.1.model.x", "inpaint"], "SDXL inpainting"),
    ],
)
def test_single_files_of_other_models_are_refused_by_name(keys, named):
    from ldm.weights.single_file import SingleFileError, detect_family

    channels = 9 if "inpaint" in keys else 4
    state = {k: torch.zeros(1) for k in keys if k != "inpaint"}
    state["model.diffusion_model.input_blocks.0.0.weight"] = torch.zeros(320, channels, 3, 3)
    with pytest.raises(SingleFileError, match=named):
        detect_family(state, {}, where="x.safetensors")


def test_diffusers_folders_of_other_models_are_refused_by_name(tmp_path):
    import json

    from ldm.models.diffusion.ddpm import LatentDiffusion

    folder = tmp_path / "refiner"
    folder.mkdir()
    index = {"_class_name": "StableDiffusionXLImg2ImgPipeline", "text_encoder": [None, None],
             "text_encoder_2": ["transformers", "CLIPTextModelWithProjection"]}  # fmt: skip
    (folder / "model_index.json").write_text(json.dumps(index))
    with pytest.raises(ConfigError, match=r"model.params.pretrained: .*refiner is the SDXL refiner .*Img2Img"):
        LatentDiffusion(pretrained=str(folder)).configure_model()


def test_real_size_sdxl_single_file_layout_is_what_diffusers_converts(tmp_path):
    """SDXL base's parts at full size (meta tensors) written in the original layout: diffusers' own converters map
    it onto exactly our parts' keys and shapes (UNet with its label_emb, VAE, CLIP ViT-L under embedders.0,
    OpenCLIP ViT-bigG under embedders.1 with fused q/k/v and the transposed text_projection); the family is
    detected from the keys, and the file says it is SDXL base at 1024 px."""
    import diffusers.loaders.single_file_utils as reference

    from ldm.weights.single_file import detect_family, modelspec, to_original

    parts = parts_from_description(family_description(FAMILIES["sdxl"]))
    state = to_original(parts, "sdxl")
    converted = {
        "unet": reference.convert_ldm_unet_checkpoint(state, dict(parts.unet.config)),
        "vae": reference.convert_ldm_vae_checkpoint(state, dict(parts.vae.config)),
        "text_encoder": reference.convert_ldm_clip_checkpoint(state),
        "text_encoder_2": reference.convert_open_clip_checkpoint(
            parts.text_encoder_2, state, prefix="conditioner.embedders.1.model."
        ),
    }
    for name, theirs in converted.items():
        theirs = {k.removeprefix("text_model."): v for k, v in theirs.items() if not k.endswith("position_ids")}
        ours = {k.removeprefix("text_model."): v for k, v in parts[name].state_dict().items()}
        assert theirs.keys() == ours.keys(), f"{name}: {sorted(set(theirs) ^ set(ours))[:4]}"
        assert all(theirs[k].shape == ours[k].shape for k in ours), name
    assert state["conditioner.embedders.1.model.text_projection"].shape == (1280, 1280)
    assert sum(v.numel() for k, v in state.items() if k.startswith("model.diffusion_model.")) == 2_567_463_684
    assert detect_family(state, {}) == (FAMILIES["sdxl"], "from its SDXL text encoders (no v_pred key: epsilon)")
    spec = modelspec(parts, FAMILIES["sdxl"], "my-sdxl")
    assert spec["modelspec.architecture"] == "stable-diffusion-xl-v1-base"
    assert spec["modelspec.resolution"] == "1024x1024"


def test_a_tiny_sdxl_single_file_reads_back_here_and_in_diffusers(tiny_sdxl, tmp_path):
    """A single file of an SDXL-shaped model holds every weight in the original layout; ldm and diffusers'
    `StableDiffusionXLPipeline.from_single_file` read it back to identical tensors, and a fine-tune's export
    goes the same way through scripts/convert.py's `convert`."""
    from safetensors import safe_open

    from ldm.export import convert

    parts = read_parts(tiny_sdxl)
    file = convert(tiny_sdxl, tmp_path / "tiny-sdxl.safetensors")
    with safe_open(str(file), "pt") as handle:
        keys = set(handle.keys())
    assert {"model.diffusion_model.label_emb.0.0.weight", "conditioner.embedders.1.model.text_projection",
            "conditioner.embedders.0.transformer.text_model.final_layer_norm.weight"} <= keys  # fmt: skip
    ours = read_parts(file)
    theirs = StableDiffusionXLPipeline.from_single_file(str(file), config=str(tiny_sdxl), local_files_only=True)
    for name, module in parts.networks.items():
        want = module.state_dict()
        for got in (ours[name].state_dict(), getattr(theirs, name).state_dict()):
            assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want), name
    assert conditioning_for(ours) == "sdxl" and ours.tokenizer_2.pad_token == "!"
    from ldm.weights.lora_file import stored_dtypes  # what a LoRA merged into this file is written in

    half = convert(tiny_sdxl, tmp_path / "half.safetensors", half=True)
    assert stored_dtypes(half) == dict.fromkeys(["unet", "vae", "text_encoder", "text_encoder_2"], torch.float16)

    from safetensors.torch import load_file, save_file

    state = load_file(str(file))  # a file as released holds tensors no part takes: they come back on export
    state["conditioner.embedders.1.model.logit_scale"] = torch.tensor(4.6052)
    with safe_open(str(file), "pt") as handle:
        save_file(state, str(tmp_path / "with-extras.safetensors"), metadata=handle.metadata())
    folder = convert(tmp_path / "with-extras.safetensors", tmp_path / "folder")
    again = load_file(str(convert(folder, tmp_path / "again.safetensors")))
    assert again.keys() == state.keys() and all(torch.equal(again[k], v) for k, v in state.items())


def test_an_sdxl_lora_on_the_unet_and_both_encoders_exports_as_kohya_and_diffusers_read_it(
    tiny_sdxl, image_folder, tmp_path
):
    """LoRA adapters on the UNet and both text encoders through main.py; the kohya file names them as
    sd-scripts' SDXL files do (lora_unet_ by the UNet's original paths, lora_te1_, lora_te2_), and diffusers'
    `load_lora_weights` + `fuse_lora` of it, or of the diffusers-format file, gives exactly our merged weights;
    the kohya file starts a new run's adapters where they were."""
    from safetensors.torch import load_file

    from ldm.components.lora_keys import read_adapters
    from ldm.weights.lora_file import save_lora

    logs = tmp_path / "logs"
    run_dir = train_once(finetune_args(tiny_sdxl, image_folder, logs, "lightning.callbacks.image_logger=null",
                                       "model.params.trainable=[unet,text_encoder,text_encoder_2]",
                                       "model.params.lora={rank: 4, alpha: 8}", "model.params.learning_rate=1e-2"),
                         logs)  # fmt: skip
    ckpt = load_checkpoint(run_dir / "checkpoints" / "last.ckpt")
    adapters, merged = parts_from_checkpoint(ckpt, merge=False), parts_from_checkpoint(ckpt)
    base = read_parts(tiny_sdxl)
    kohya = save_lora(adapters, tmp_path / "kohya", "kohya")
    names = {key.partition(".")[0] for key in load_file(str(kohya))}
    assert {name.split("_")[1] for name in names} == {"unet", "te1", "te2"}
    assert "lora_unet_input_blocks_3_1_transformer_blocks_0_attn1_to_q" in names  # down_blocks.1.attentions.0
    assert "lora_te2_text_model_encoder_layers_1_self_attn_v_proj" in names
    for file in (kohya, save_lora(adapters, tmp_path / "diffusers", "diffusers")):
        pipe = StableDiffusionXLPipeline.from_pretrained(tiny_sdxl, local_files_only=True)
        pipe.load_lora_weights(str(file.parent), weight_name=file.name)  # diffusers 0.29 offline needs the name
        pipe.fuse_lora()
        pipe.unload_lora_weights()
        for name in ("unet", "text_encoder", "text_encoder_2"):
            ours, theirs, before = merged[name].state_dict(), getattr(pipe, name).state_dict(), base[name].state_dict()
            assert any(not torch.equal(ours[k], before[k]) for k in ours), f"{name}: the LoRA changed nothing"
            torch.testing.assert_close(theirs, ours, rtol=0, atol=1e-6, msg=f"{file.name}: {name}")
    read = read_adapters(kohya, base, "--lora")
    assert sorted(read) == ["text_encoder", "text_encoder_2", "unet"]
    trained = {name: {path: layer.lora_B["default"].weight for path, layer in lora_modules(adapters[name]).items()}
               for name in read}  # fmt: skip
    for name, modules in read.items():
        assert modules.keys() == trained[name].keys()
        assert all(torch.equal(adapter.up, trained[name][path]) for path, adapter in modules.items())


def test_offset_noise_adds_one_number_per_sample_and_channel():
    """With keyed draws the noise is the same with and without an offset, but for a constant per sample and
    channel of about `noise_offset`'s size."""
    from ldm import diffusion

    seen = []

    def denoiser(noisy, t, cond):
        seen.append(noisy)
        return torch.zeros_like(noisy)

    x0, pure_noise = torch.zeros(64, 4, 8, 8), torch.zeros(1000)  # alphas_cumprod 0: the noisy latent is the noise
    for offset in (0.0, 0.1):
        draws = diffusion.Draws(diffusion.sample_keys(0, 1, range(64)))
        diffusion.ddpm_loss(denoiser, x0, {}, pure_noise, "epsilon", draws=draws, noise_offset=offset)
    shift = seen[1] - seen[0]
    assert torch.allclose(shift, shift[:, :, :1, :1].expand_as(shift), atol=1e-6)
    assert 0.07 < float(shift[:, :, 0, 0].std()) < 0.13


def test_zero_terminal_snr_trains_a_v_prediction_sdxl_and_samples_with_trailing_steps(image_folder, tmp_path):
    """`noise_schedule: {rescale_betas_zero_snr: true, timestep_spacing: trailing}` on v-prediction weights: the
    last step keeps no signal in training, and the exported scheduler samples with the same schedule. Epsilon
    weights, a scheduler that cannot rescale, and a config that drops the weights' zero SNR are errors."""
    from examples.tiny_sd import write_tiny_sd, write_tiny_sdxl
    from ldm.models.diffusion.ddpm import LatentDiffusion

    vpred = write_tiny_sdxl(tmp_path / "vpred", prediction_type="v_prediction")
    zero_snr = ["model.params.noise_schedule={rescale_betas_zero_snr: true, timestep_spacing: trailing}",
                "model.params.noise_offset=0.05", "lightning.callbacks.image_logger=null"]  # fmt: skip
    logs = tmp_path / "logs"
    run_dir = train_once(finetune_args(vpred, image_folder, logs, *zero_snr), logs)
    parts = parts_from_checkpoint(load_checkpoint(run_dir / "checkpoints" / "last.ckpt"))
    config = parts.scheduler.config
    assert config.rescale_betas_zero_snr and config.timestep_spacing == "trailing"
    assert config.prediction_type == "v_prediction" and float(parts.scheduler.alphas_cumprod[-1]) < 1e-6
    schedule = {"rescale_betas_zero_snr": True}
    with pytest.raises(ConfigError, match="zero terminal SNR needs v-prediction, but the model predicts epsilon"):
        LatentDiffusion(pretrained=str(write_tiny_sdxl(tmp_path / "eps")), noise_schedule=schedule).configure_model()
    pndm = str(write_tiny_sd(tmp_path / "pndm", prediction_type="v_prediction"))
    scheduler = {"target": "diffusers.PNDMScheduler", "pretrained": pndm, "subfolder": "scheduler"}
    with pytest.raises(ConfigError, match="PNDMScheduler does not rescale its betas"):
        LatentDiffusion(pretrained=pndm, scheduler=scheduler, noise_schedule=schedule).configure_model()
    ddpm = LatentDiffusion(pretrained=pndm, noise_schedule=schedule)  # trains with its DDPM schedule, rescaled
    ddpm.configure_model()
    assert float(ddpm.alphas_cumprod[-1]) == 0.0
    exported = export_pipeline(run_dir / "checkpoints" / "last.ckpt", tmp_path / "exported")
    sampler = load_pipeline(exported).scheduler.config
    assert sampler.rescale_betas_zero_snr and sampler.timestep_spacing == "trailing"
    with pytest.raises(ConfigError, match="false contradicts the pretrained weights, trained with zero terminal"):
        LatentDiffusion(pretrained=str(exported), noise_schedule={"rescale_betas_zero_snr": False}).configure_model()
    with pytest.raises(ConfigError, match="model.params.noise_offset: got -0.1"):
        LatentDiffusion(pretrained=str(vpred), noise_offset=-0.1)


def test_the_memory_planner_traces_an_sdxl_step_with_both_text_encoders(tiny_sdxl, image_folder):
    """The planner builds SDXL's second text encoder and tokenizer too, and traces SDXL's own training step (its
    conditioning, size ids included): on fake tensors exactly as on real ones."""
    from ldm.config import load_config
    from ldm.training.memory import plan_training_step
    from tests.helpers import SD_FOLDER

    cfg, _ = load_config([SD_FOLDER], [f"model.params.pretrained={tiny_sdxl}", f"data.params.root={image_folder}",
                                       "data.params.size=16", "data.params.batch_size=2"])  # fmt: skip
    fake, real = plan_training_step(cfg), plan_training_step(cfg, fake=False)
    assert fake.peak == real.peak > 0 and fake.parts == real.parts
    parts = {p.name: p for p in fake.parts}
    assert list(parts) == ["unet", "vae", "text_encoder", "text_encoder_2"] and not parts["text_encoder_2"].trainable
    second = read_parts(tiny_sdxl).text_encoder_2
    assert parts["text_encoder_2"].parameters == sum(p.numel() for p in second.parameters())


def test_v_prediction_sdxl_is_a_family_its_single_files_mark_and_readers_detect(tmp_path):
    """`sdxl-v` shares SDXL base's networks and has its own schedule (v-prediction, zero terminal SNR, trailing
    spacing); its single files carry the `v_pred` and `ztsnr` keys other tools read, and a file with `v_pred` is
    detected as it (or declared: `pretrained_family: sdxl-v`)."""
    from diffusers import EulerDiscreteScheduler
    from safetensors.torch import load_file

    from examples.tiny_sd import write_tiny_sdxl
    from ldm.weights.single_file import detect_family, save_single_file, to_original

    parts = parts_from_description(family_description(FAMILIES["sdxl-v"]))
    assert family_of(parts) is FAMILIES["sdxl-v"]
    assert dict(parts.unet.config) == dict(parts_from_description(family_description(FAMILIES["sdxl"])).unet.config)
    schedule = parts.scheduler.config
    assert (schedule.prediction_type, schedule.rescale_betas_zero_snr, schedule.timestep_spacing) == (
        "v_prediction",
        True,
        "trailing",
    )
    state = to_original(parts, "sdxl")
    assert detect_family({**state, "v_pred": torch.tensor([])}, {}) == (
        FAMILIES["sdxl-v"],
        "from its SDXL text encoders and its v_pred key",
    )
    assert detect_family(state, {}, declared="sdxl-v") == (FAMILIES["sdxl-v"], "as declared")
    tiny = read_parts(write_tiny_sdxl(tmp_path / "tiny", prediction_type="v_prediction"))
    tiny.scheduler = EulerDiscreteScheduler.from_config({**tiny.scheduler.config, "rescale_betas_zero_snr": True})
    written = load_file(str(save_single_file(tiny, tmp_path / "tiny-v.safetensors")))
    assert written["v_pred"].numel() == written["ztsnr"].numel() == 0


def test_the_sdxl_8gb_preset_resumes_to_the_weights_of_an_unbroken_run(tiny_sdxl, image_folder, tmp_path):
    """sdxl-8gb.yaml (bf16 UNet, LowMemoryAdamW fused with its state offloaded, caches, frozen networks held on the
    CPU) stopped after 2 steps and resumed with `-r auto` ends where 4 unbroken steps do, weights and 8-bit state
    to the bit (on this CPU the offloaded state and the weights share a device; the GPU case is unrun)."""
    preset = REPO / "configs" / "finetune" / "sdxl-8gb.yaml"

    def run(logs, steps, *extra):
        argv = ["-t", "-b", str(preset), "-l", str(logs), "-n", "xl", "-s", "3", f"model.params.pretrained={tiny_sdxl}",
                f"data.params.root={image_folder}", "data.params.size=16", "data.params.batch_size=2",
                "data.params.num_workers=0", "model.params.learning_rate=1e-3", f"lightning.trainer.max_steps={steps}",
                "lightning.modelcheckpoint.params.every_n_train_steps=2", *extra]  # fmt: skip
        return load_checkpoint(train_once(argv, logs) / "checkpoints" / "last.ckpt")

    unbroken = run(tmp_path / "unbroken", 4)
    run(tmp_path / "broken", 2)
    resumed = run(tmp_path / "broken", 4, "-r", "auto")
    assert unbroken["global_step"] == resumed["global_step"] == 4
    unet = {k: v for k, v in unbroken["state_dict"].items() if k.startswith("unet.")}
    assert unet and all(v.dtype == torch.bfloat16 and torch.equal(v, resumed["state_dict"][k]) for k, v in unet.items())
    (a,), (b,) = unbroken["optimizer_states"], resumed["optimizer_states"]
    for index, state in a["state"].items():
        assert state["exp_avg"].dtype == torch.int8
        assert all(torch.equal(v, b["state"][index][k]) if torch.is_tensor(v) else v == b["state"][index][k]
                   for k, v in state.items())  # fmt: skip
