"""Stable Diffusion 3.5: the family's configs, conditioning and a tiny pipeline (`ldm.families.sd35`)."""

import inspect
import json

import numpy as np
import pytest
import torch
from diffusers import SD3Transformer2DModel

from examples.tiny_sd35 import write_t5_tokenizer, write_tiny_sd35
from ldm.families import CONFIGS
from ldm.families.sd35 import FAMILIES, sd35_text

pytestmark = pytest.mark.skipif(
    "dual_attention_layers" not in inspect.signature(SD3Transformer2DModel.__init__).parameters,
    reason="this diffusers predates SD3.5's layers (MMDiT-X, QK-norm): the Colossal-AI stack's 0.29 does",
)
CAPTIONS = ["a photo of a cat", "", "a very long caption " * 40]


@pytest.fixture(scope="module", params=[True, False], ids=["with-t5", "without-t5"])
def tiny_sd35(request, tmp_path_factory):
    from diffusers import StableDiffusion3Pipeline

    folder = write_tiny_sd35(tmp_path_factory.mktemp("sd35"), "sd35-medium", t5=request.param)
    without = {} if request.param else {"text_encoder_3": None, "tokenizer_3": None}  # as diffusers loads one
    return StableDiffusion3Pipeline.from_pretrained(folder, local_files_only=True, **without)


def _parts(pipe) -> dict:
    return {**pipe.components, "unet": pipe.transformer}


@pytest.mark.parametrize("t5_length", [256, 77])
def test_the_conditioning_is_what_encode_prompt_makes(tiny_sd35, t5_length):
    """CLIP-L and CLIP-G penultimate states side by side, zero-padded to T5's width, then T5's states (zeros
    without T5); the pooled embeddings side by side: bit for bit what the pipeline encodes."""
    with torch.no_grad():
        ours = sd35_text(_parts(tiny_sd35), CAPTIONS, torch.device("cpu"), t5_length)
        states, _, pooled, _ = tiny_sd35.encode_prompt(
            CAPTIONS, None, None, do_classifier_free_guidance=False, max_sequence_length=t5_length
        )
    assert ours["encoder_hidden_states"].shape == (3, 77 + t5_length, 48)
    assert torch.equal(ours["encoder_hidden_states"], states)
    assert torch.equal(ours["pooled_projections"], pooled)
    clip_width = 16 + 24
    assert not ours["encoder_hidden_states"][:, :77, clip_width:].any()  # the padding
    if tiny_sd35.text_encoder_3 is None:
        assert not ours["encoder_hidden_states"][:, 77:].any()


def test_the_tiny_pipeline_samples_offline(tiny_sd35):
    images = tiny_sd35("a cat", num_inference_steps=2, height=16, width=16, output_type="np").images
    assert images.shape == (1, 16, 16, 3) and images.min() >= 0 and images.max() <= 1


def test_the_tiny_t5_tokenizer_has_t5s_special_tokens(tmp_path):
    from transformers import T5TokenizerFast

    tokenizer = T5TokenizerFast.from_pretrained(write_t5_tokenizer(tmp_path / "t5"), local_files_only=True)
    ids = tokenizer(["a photo of a cat"], padding="max_length", max_length=12).input_ids[0]
    assert (tokenizer.pad_token_id, tokenizer.eos_token_id, tokenizer.unk_token_id) == (0, 1, 2)
    assert 1 in ids and ids[ids.index(1) + 1 :] == [0] * (11 - ids.index(1))  # </s> ends it, then padding
    assert tokenizer.decode(ids, skip_special_tokens=True) == "a photo of a cat"


@pytest.mark.parametrize(
    ("name", "millions", "dual"), [("sd35-medium", 2243.2, list(range(13))), ("sd35-large", 8056.6, [])]
)
def test_real_size_transformers_have_the_published_shape(name, millions, dual):
    """The shipped configs on the meta device: MMDiT-X self-attention in Medium's first 13 blocks, RMS QK-norm,
    hidden width 64 x depth; the parameter counts README.md prints."""
    config = json.loads((CONFIGS / name / "unet" / "config.json").read_text())
    with torch.device("meta"):
        model = SD3Transformer2DModel.from_config(config)
    assert round(sum(p.numel() for p in model.parameters()) / 1e6, 1) == millions
    assert [i for i, block in enumerate(model.transformer_blocks) if block.attn2 is not None] == dual
    assert model.transformer_blocks[0].attn.norm_q.__class__.__name__ == "RMSNorm"
    assert model.config.num_attention_heads * model.config.attention_head_dim == 64 * model.config.num_layers


def test_real_size_encoders_and_vae():
    from diffusers import AutoencoderKL
    from transformers import CLIPTextConfig, CLIPTextModelWithProjection, T5Config, T5EncoderModel

    folder = CONFIGS / "sd35-large"
    sizes = {}
    with torch.device("meta"):
        for part, cls, config_cls in (
            ("text_encoder", CLIPTextModelWithProjection, CLIPTextConfig),
            ("text_encoder_2", CLIPTextModelWithProjection, CLIPTextConfig),
            ("text_encoder_3", T5EncoderModel, T5Config),
        ):
            model = cls(config_cls(**json.loads((folder / part / "config.json").read_text())))
            sizes[part] = round(sum(p.numel() for p in model.parameters()) / 1e6, 1)
        vae = AutoencoderKL.from_config(json.loads((folder / "vae" / "config.json").read_text()))
    sizes["vae"] = round(sum(p.numel() for p in vae.parameters()) / 1e6, 1)
    assert sizes == {"text_encoder": 123.7, "text_encoder_2": 694.7, "text_encoder_3": 4762.3, "vae": 83.8}
    assert (vae.config.latent_channels, vae.config.scaling_factor, vae.config.shift_factor) == (16, 1.5305, 0.0609)
    scheduler = json.loads((folder / "scheduler" / "scheduler_config.json").read_text())
    assert (scheduler["_class_name"], scheduler["shift"]) == ("FlowMatchEulerDiscreteScheduler", 3.0)
    assert [f.name for f in FAMILIES] == ["sd35-medium", "sd35-large"]


FLOW = ("model.params.objective=flow", "model.params.snr_gamma=null")


@pytest.fixture(scope="module")
def tiny_sd35_folder(tmp_path_factory):
    return write_tiny_sd35(tmp_path_factory.mktemp("sd35-folder"), "sd35-medium")


def _images(pipe, seed=0):
    from ldm.sampling import sample

    return np.stack([np.asarray(i) for i in sample(pipe, ["a cat"], steps=2, seed=seed, height=16, width=16)])


def test_a_tiny_sd35_fine_tunes_samples_and_exports_the_same_images(tiny_sd35_folder, image_folder, tmp_path):
    """Through main.py from the diffusers folder (its `transformer` is our `unet`): the MMDiT trains by flow
    matching, the image logger samples with StableDiffusion3Pipeline, and the exported folder, loaded by diffusers
    offline, samples the very images the checkpoint does."""
    from diffusers import StableDiffusion3Pipeline

    from ldm.export import export_pipeline
    from ldm.sampling import build_pipeline
    from ldm.weights.checkpoint import load_checkpoint
    from ldm.weights.read import parts_from_checkpoint
    from tests.helpers import finetune_args, train_once

    run = train_once(finetune_args(tiny_sd35_folder, image_folder, tmp_path / "logs", *FLOW), tmp_path / "logs")
    assert sorted(p.name for p in (run / "images").iterdir()) == ["step_000002.png", "step_000003.png"]
    ckpt = load_checkpoint(run / "checkpoints" / "last.ckpt")
    base = StableDiffusion3Pipeline.from_pretrained(tiny_sd35_folder, local_files_only=True)
    trained = {k.removeprefix("unet."): v for k, v in ckpt["state_dict"].items() if k.startswith("unet.")}
    assert trained.keys() == base.transformer.state_dict().keys()
    assert any(not torch.equal(v, base.transformer.state_dict()[k]) for k, v in trained.items())
    folder = export_pipeline(run / "checkpoints" / "last.ckpt", tmp_path / "export", sampler="euler")
    exported = StableDiffusion3Pipeline.from_pretrained(folder, local_files_only=True)
    assert type(exported.scheduler).__name__ == "FlowMatchEulerDiscreteScheduler"
    ours = build_pipeline(parts_from_checkpoint(ckpt), "euler")
    assert np.array_equal(_images(exported), _images(ours))


def test_a_tiny_sd35_lora_trains_only_its_adapters(tiny_sd35_folder, image_folder, tmp_path):
    from diffusers import StableDiffusion3Pipeline

    from ldm.export import export_pipeline
    from tests.helpers import finetune_args, train_once

    lora = ("model.params.lora.rank=2", "model.params.lora.alpha=2", "lightning.callbacks.image_logger=null")
    run = train_once(finetune_args(tiny_sd35_folder, image_folder, tmp_path, *FLOW, *lora), tmp_path)
    ckpt = run / "checkpoints" / "last.ckpt"
    loaded = torch.load(ckpt, map_location="cpu", weights_only=False)
    state = loaded["state_dict"]
    assert state and all("lora_" in k for k in state)
    assert {k.split(".lora_")[0].rsplit(".", 1)[-1] for k in state} == {"to_q", "to_k", "to_v", "0"}
    merged = StableDiffusion3Pipeline.from_pretrained(export_pipeline(ckpt, tmp_path / "merged"), local_files_only=True)
    base = StableDiffusion3Pipeline.from_pretrained(tiny_sd35_folder, local_files_only=True).transformer.state_dict()
    changed = [k for k, v in merged.transformer.state_dict().items() if not torch.equal(v, base[k])]
    assert changed and all(k.rsplit(".", 2)[-2] in ("to_q", "to_k", "to_v", "0") for k in changed)


def test_a_tiny_sd35_run_resumes_to_the_weights_of_an_unbroken_run(tiny_sd35_folder, image_folder, tmp_path):
    """Stopped after 2 steps and resumed with `-r auto`, a run with EMA ends where 4 unbroken steps do: the
    transformer's weights and the EMA's average to the bit."""
    from ldm.weights.checkpoint import load_checkpoint
    from tests.helpers import finetune_args, train_once

    def run(logs, steps, *extra):
        argv = finetune_args(tiny_sd35_folder, image_folder, logs, *FLOW, "lightning.callbacks.image_logger=null",
                             f"lightning.trainer.max_steps={steps}",
                             "lightning.modelcheckpoint.params.every_n_train_steps=2", *extra)  # fmt: skip
        return load_checkpoint(train_once(argv, logs) / "checkpoints" / "last.ckpt")

    unbroken = run(tmp_path / "unbroken", 4)
    run(tmp_path / "broken", 2)
    resumed = run(tmp_path / "broken", 4, "-r", "auto")
    assert unbroken["global_step"] == resumed["global_step"] == 4
    unet = {k: v for k, v in unbroken["state_dict"].items() if k.startswith("unet.")}
    assert unet and all(torch.equal(v, resumed["state_dict"][k]) for k, v in unet.items())
    ema_a, ema_b = unbroken["ema_state_dict"], resumed["ema_state_dict"]
    assert ema_a and all(torch.equal(v, ema_b[k]) for k, v in ema_a.items())


def test_a_cached_sd35_run_trains_exactly_as_encoding_every_step(tiny_sd35_folder, image_folder, tmp_path):
    """Latents (shifted, then scaled) and the three encoders' states encoded once train as encoding them every
    step; with the caches, T5 never runs in a step."""
    from tests.helpers import recorded_losses

    every_step = recorded_losses(tiny_sd35_folder, image_folder, tmp_path, "every_step", *FLOW)
    cached = recorded_losses(tiny_sd35_folder, image_folder, tmp_path, "cached", *FLOW,
                             "data.params.cache_latents=true", "data.params.cache_text=true")  # fmt: skip
    torch.testing.assert_close(torch.tensor(cached), torch.tensor(every_step), rtol=1e-5, atol=1e-6)


def test_sd35_trains_from_precomputed_shards_without_running_an_encoder(tiny_sd35_folder, tmp_path, monkeypatch):
    """`ldm-precompute` encodes images and captions once (latents shifted and scaled, the three encoders' states);
    the transformer then trains on the shards with neither the VAE nor any text encoder running."""
    from ldm.cli.precompute import main as precompute
    from ldm.systems.latent_diffusion import LatentDiffusion
    from main import main
    from tests.conftest import REPO, write_images
    from tests.helpers import SD_FOLDER

    write_images(tmp_path / "images", n=6, size=(24, 20))
    common = (f"model.params.pretrained={tiny_sd35_folder}", *FLOW)
    assert precompute(["-b", str(SD_FOLDER), "--out", str(tmp_path / "shards"), *common,
                       f"data.params.root={tmp_path / 'images'}", "data.params.size=16",
                       "data.params.num_workers=0"]) == 0  # fmt: skip
    manifest = json.loads((tmp_path / "shards" / "ldm_shards.json").read_text())
    assert (manifest["conditioning"], manifest["shift_factor"]) == ("sd35", 0.0609)
    assert manifest["cond_shapes"]["encoder_hidden_states"][0] == 77 + 256

    def refuse(*args, **kwargs):
        raise AssertionError("an encoder ran in training")

    monkeypatch.setattr(LatentDiffusion, "encode_posterior", refuse)
    monkeypatch.setattr(LatentDiffusion, "encode_text", refuse)
    argv = ["-t", "-b", str(REPO / "configs" / "pretrain" / "tiny-shards.yaml"), "-l", str(tmp_path / "logs"),
            *common, "model.params.unet=null", f"data.params.sources=[{{path: {tmp_path / 'shards'}}}]",
            "data.params.batch_size=2", "lightning.trainer.max_steps=2"]  # fmt: skip
    assert main(argv) == 0


def test_each_text_encoder_drops_on_its_own_and_t5_takes_its_length(tiny_sd35_folder):
    """`model.params.text_dropout` zeroes one encoder's share of a sample's conditioning (SD3's recipe): CLIP-L's
    features of the CLIP tokens and its pooled embedding, or T5's tokens, the rest as encoded; the draws are
    keyed per sample. `max_sequence_length` sets T5's token count, for training and the image logger."""
    from ldm.config import ConfigError
    from ldm.models.diffusion.ddpm import LatentDiffusion

    seen = []

    def run(**settings):
        system = LatentDiffusion(pretrained=str(tiny_sd35_folder), objective="flow", snr_gamma=None, **settings)
        system.configure_model()
        system.unet.register_forward_pre_hook(lambda m, args, kwargs: seen.append(kwargs), with_kwargs=True)
        batch = {
            "pixel_values": torch.randn(2, 3, 16, 16),
            "caption": ["a cat", "a dog"],
            "sample_id": torch.tensor([0, 1]),
        }
        system.loss(batch)
        return system.encode_text(batch["caption"]), seen.pop()

    plain, used = run()
    assert plain["encoder_hidden_states"].shape[1] == 77 + 256
    assert all(torch.equal(used[k], plain[k]) for k in plain)
    for dropped, states, pooled in (("text_encoder_3", (slice(77, None), slice(None)), None),
                                    ("text_encoder", (slice(0, 77), slice(0, 16)), slice(0, 16))):  # fmt: skip
        _, used = run(text_dropout={dropped: 1.0})
        zero = torch.zeros_like(plain["encoder_hidden_states"])
        zero[:, states[0], states[1]] = 1
        assert not (used["encoder_hidden_states"] * zero).any(), f"{dropped}: its share is zeros"
        assert torch.equal(used["encoder_hidden_states"] * (1 - zero), plain["encoder_hidden_states"] * (1 - zero))
        kept = torch.ones_like(plain["pooled_projections"])
        if pooled is not None:
            kept[:, pooled] = 0
            assert not used["pooled_projections"][:, pooled].any()
        assert torch.equal(used["pooled_projections"] * kept, plain["pooled_projections"] * kept)
    short, _ = run(max_sequence_length=77)
    assert short["encoder_hidden_states"].shape[1] == 77 + 77
    for settings, message in (({"text_dropout": {"vae": 0.5}}, "text_dropout.vae: the sd35 conditioning drops"),
                              ({"text_dropout": {"text_encoder": 2.0}}, r"text_dropout.text_encoder: got 2.0"),
                              ({"max_sequence_length": 0}, "max_sequence_length: got 0")):  # fmt: skip
        with pytest.raises(ConfigError, match=message):
            run(**settings)


def test_families_without_t5_refuse_its_settings(tiny_sd):
    from ldm.config import ConfigError
    from ldm.models.diffusion.ddpm import LatentDiffusion

    refused = (({"max_sequence_length": 77}, "max_sequence_length: the clip conditioning takes no"),
               ({"text_dropout": {"text_encoder": 0.5}}, "text_dropout.text_encoder: the clip"))  # fmt: skip
    for settings, message in refused:
        with pytest.raises(ConfigError, match=message):
            LatentDiffusion(pretrained=str(tiny_sd), **settings).configure_model()
