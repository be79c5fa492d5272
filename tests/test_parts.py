"""Parts come from a local diffusers folder or a config; mistakes name the key and the path."""

import pytest

from ldm.components.build import build_part, build_parts
from ldm.config import ConfigError


def test_parts_from_a_pipeline_folder(tiny_sd):
    parts = build_parts(str(tiny_sd))
    assert type(parts.unet).__name__ == "UNet2DConditionModel"
    assert type(parts.scheduler).__name__ == "DDPMScheduler", "training always uses the DDPM noise schedule"
    assert parts.scheduler.config.beta_schedule == "scaled_linear"
    assert parts.tokenizer("a photo of a cat").input_ids == [49406, 320, 1125, 539, 320, 2368, 49407]


def test_a_part_can_be_replaced_by_config(tiny_sd):
    parts = build_parts(
        str(tiny_sd), scheduler={"config": {"num_train_timesteps": 10, "prediction_type": "v_prediction"}}
    )
    assert parts.scheduler.config.num_train_timesteps == 10 and len(parts.scheduler.alphas_cumprod) == 10


@pytest.mark.parametrize(
    ("name", "spec", "message"),
    [
        ("unet", {"pretrained": "/no/such"}, r"model\.params\.unet: no folder /no/such"),
        (
            "unet",
            {"config": {"block_out_chanels": [8]}},
            r"model\.params\.unet\.config\.block_out_chanels: unknown key",
        ),
        (
            "text_encoder",
            {"config": {"hiden_size": 8}},
            r"model\.params\.text_encoder\.config\.hiden_size: unknown key",
        ),
        (
            "tokenizer",
            {"config": {"vocab": "bytes"}},
            r"model\.params\.tokenizer\.config\.vocab: got 'bytes'; valid: 'clip'",
        ),
        ("vae", {}, r"model\.params\.vae: give exactly one of `pretrained`"),
        ("vae", {"target": "diffusers.NoSuchModel", "config": {}}, r"model\.params\.vae\.target: cannot import"),
    ],
)
def test_part_mistakes(name, spec, message):
    with pytest.raises(ConfigError, match=message):
        build_part(name, spec, f"model.params.{name}")


def test_missing_subfolder_names_the_path(tiny_sd, tmp_path):
    with pytest.raises(ConfigError, match=rf"model\.params\.unet: no folder {tmp_path}/unet"):
        build_parts(str(tmp_path))
    with pytest.raises(ConfigError, match=r"model\.params\.unet: missing; give `model\.params\.pretrained"):
        build_parts(None)


def test_the_vae_downscale_is_diffusers_vae_scale_factor(tiny_sd):
    from diffusers import AutoencoderKL, StableDiffusionPipeline
    from diffusers.configuration_utils import FrozenDict

    from ldm.components import vae_downscale
    from tests.conftest import REPO

    pipe = StableDiffusionPipeline.from_pretrained(tiny_sd, local_files_only=True, safety_checker=None)
    assert vae_downscale(pipe.vae.config) == pipe.vae_scale_factor
    sd15 = FrozenDict(AutoencoderKL.load_config(REPO / "configs" / "models" / "sd15" / "vae"))
    assert vae_downscale(sd15) == 8, "SD 1.5: 512 px are 64 latent cells"
