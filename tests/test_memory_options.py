"""Attention kernels, gradient checkpointing, channels-last and half-precision frozen parts."""

import pytest
import torch

from ldm.config import ConfigError
from ldm.models.diffusion.ddpm import LatentDiffusion as _LatentDiffusion


def LatentDiffusion(**params) -> _LatentDiffusion:  # noqa: N802 - built at once, as Lightning's configure_model would
    model = _LatentDiffusion(**params)
    model.configure_model()
    return model


def batch():
    g = torch.Generator().manual_seed(0)
    return {"pixel_values": torch.rand(2, 3, 16, 16, generator=g) * 2 - 1, "caption": ["a cat", "a dog"]}


def unet_grads(model: LatentDiffusion) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    model.train()
    loss = model.training_step(batch(), 0)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.unet.named_parameters() if p.grad is not None}


def test_attention_kernels_agree(tiny_sd):
    sdpa = LatentDiffusion(pretrained=str(tiny_sd), attention="sdpa")
    math = LatentDiffusion(pretrained=str(tiny_sd), attention="math")
    assert {type(p).__name__ for p in sdpa.unet.attn_processors.values()} == {"AttnProcessor2_0"}
    assert {type(p).__name__ for p in math.unet.attn_processors.values()} == {"AttnProcessor"}
    (loss_a, grads_a), (loss_b, grads_b) = unet_grads(sdpa), unet_grads(math)
    torch.testing.assert_close(loss_a, loss_b, rtol=1e-5, atol=1e-6)
    for name in grads_a:
        torch.testing.assert_close(grads_a[name], grads_b[name], rtol=1e-4, atol=1e-6)


def test_gradient_checkpointing_gives_the_same_gradients(tiny_sd):
    plain = LatentDiffusion(pretrained=str(tiny_sd))
    checkpointed = LatentDiffusion(pretrained=str(tiny_sd), gradient_checkpointing=True)
    assert checkpointed.unet.is_gradient_checkpointing and not plain.unet.is_gradient_checkpointing
    (loss_a, grads_a), (loss_b, grads_b) = unet_grads(plain), unet_grads(checkpointed)
    torch.testing.assert_close(loss_a, loss_b)
    assert grads_a.keys() == grads_b.keys()
    for name in grads_a:
        torch.testing.assert_close(grads_a[name], grads_b[name], rtol=1e-4, atol=1e-6)


def test_channels_last(tiny_sd):
    model = LatentDiffusion(pretrained=str(tiny_sd), channels_last=True)
    assert model.unet.conv_in.weight.is_contiguous(memory_format=torch.channels_last)
    assert not LatentDiffusion(pretrained=str(tiny_sd)).unet.conv_in.weight.is_contiguous(
        memory_format=torch.channels_last
    )
    loss, _ = unet_grads(model)
    assert torch.isfinite(loss)


def test_frozen_parts_in_half_precision(tiny_sd):
    model = LatentDiffusion(pretrained=str(tiny_sd), frozen_dtype="bfloat16")
    assert model.vae.dtype == model.text_encoder.dtype == torch.bfloat16
    assert model.unet.dtype == torch.float32, "the trained part keeps full-precision weights"
    loss, grads = unet_grads(model)
    assert torch.isfinite(loss) and grads
    both = LatentDiffusion(pretrained=str(tiny_sd), frozen_dtype="bfloat16", trainable=["unet", "text_encoder"])
    assert both.text_encoder.dtype == torch.float32, "a trained text encoder is not cast"


def test_xformers_without_cuda_is_a_config_error(tiny_sd):
    with pytest.raises(ConfigError, match=r"^model\.params\.attention: xformers is not usable here"):
        LatentDiffusion(pretrained=str(tiny_sd), attention="xformers")


def test_frozen_device_keeps_the_frozen_networks_where_they_are(tiny_sdxl):
    """`frozen_device: cpu`: moving or casting the system changes what trains, not the VAE or text encoders, which
    still encode, their outputs following the system. A cast stands in for the move to a GPU on this CPU."""
    model = LatentDiffusion(pretrained=str(tiny_sdxl), frozen_device="cpu")
    model.to(torch.float64)
    dtypes = {name: next(getattr(model, name).parameters()).dtype for name in model.parts.networks}
    assert dtypes == {"unet": torch.float64, "vae": torch.float32, "text_encoder": torch.float32,
                      "text_encoder_2": torch.float32}  # fmt: skip
    assert list(model._modules) == list(model.parts.networks), "the parts keep their order (and state dict's)"
    unet_grads(model)  # a step encodes images and captions with the networks held back
    plain = LatentDiffusion(pretrained=str(tiny_sdxl)).to(torch.float64)
    assert next(plain.vae.parameters()).dtype == torch.float64


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_frozen_device_on_a_gpu(tiny_sdxl):
    model = LatentDiffusion(pretrained=str(tiny_sdxl), frozen_device="cpu").to("cuda")
    assert next(model.unet.parameters()).is_cuda and not next(model.text_encoder_2.parameters()).is_cuda
    assert model.encode_text(["a cat"])["encoder_hidden_states"].is_cuda
    with model.frozen_parts_on_device():
        assert next(model.vae.parameters()).is_cuda
    assert not next(model.vae.parameters()).is_cuda


def test_frozen_device_is_refused_under_a_strategy(tiny_sd):
    from ldm.config import load_config
    from ldm.training.checks import check_config
    from tests.helpers import SD_FOLDER

    cfg, sources = load_config(
        [SD_FOLDER],
        [f"model.params.pretrained={tiny_sd}", "data.params.root=.", "model.params.frozen_device=cpu",
         "lightning.trainer.strategy=ddp", "lightning.trainer.devices=2"],
    )  # fmt: skip
    with pytest.raises(
        ConfigError, match=r"model.params.frozen_device \(command line\): keeps the frozen networks on the CPU.*'ddp'"
    ):
        check_config(cfg, sources)
    with pytest.raises(ConfigError, match=r"model.params.frozen_device: got 'cuda'; valid: cpu"):
        LatentDiffusion(pretrained=str(tiny_sd), frozen_device="cuda")
