"""The memory planner: fake-tensor traces agree with real-tensor traces, per part and at the peak."""

import importlib.util
from pathlib import Path

import pytest
import torch

from ldm.config import load_config
from ldm.training.memory import GIB, plan_training_step
from ldm.training.optim import LowMemoryAdamW
from ldm.training.placement import place
from tests.helpers import NO_SD35, has_sd35_layers

SD_FOLDER = Path(__file__).resolve().parents[1] / "configs" / "finetune" / "sd-folder.yaml"


def config(tiny_sd, image_folder, *extra):
    cfg, _ = load_config(
        [SD_FOLDER], [f"model.params.pretrained={tiny_sd}", f"data.params.root={image_folder}", *extra]
    )
    return cfg


def test_fake_trace_matches_real_trace_and_static_bytes(tiny_sd, image_folder):
    cfg = config(
        tiny_sd, image_folder, "data.params.size=16", "data.params.batch_size=2", "model.params.frozen_dtype=float16"
    )
    fake, real = plan_training_step(cfg), plan_training_step(cfg, fake=False)
    assert fake.peak == real.peak > 0
    assert fake.peak_by_category == real.peak_by_category
    assert fake.parts == real.parts
    parts = {p.name: p for p in fake.parts}
    unet, vae = parts["unet"], parts["vae"]
    assert unet.trainable and unet.weights == unet.gradients == 4 * unet.parameters
    assert unet.optimizer_states == 8 * unet.parameters, "AdamW: two fp32 moments per trained parameter"
    assert not vae.trainable and vae.weights == 2 * vae.parameters and vae.gradients == vae.optimizer_states == 0
    assert fake.peak >= sum(p.weights for p in fake.parts) + unet.gradients
    assert "fits a 8 GiB GPU" in fake.table(gpu_gib=8)
    assert "does NOT fit" in fake.table(gpu_gib=fake.peak / GIB / 2)


def test_activations_grow_with_batch_and_resolution(tiny_sd, image_folder):
    cfg = config(tiny_sd, image_folder, "model.params.trainable=[unet,text_encoder]")
    small = plan_training_step(cfg, batch_size=1, resolution=16, fake=False)  # real tensors: faster here
    large = plan_training_step(cfg, batch_size=4, resolution=32, fake=False)
    assert {p.name: p.trainable for p in small.parts} == {"unet": True, "vae": False, "text_encoder": True}
    assert large.peak_by_category["Activation"] > small.peak_by_category["Activation"]
    assert large.peak > small.peak


def test_a_colossal_preset_is_planned_without_colossal_ai(tiny_sd, image_folder):
    """Planning is arithmetic: it runs before Colossal-AI is installed, and says in one line what the run needs."""
    from tests.helpers import run_script

    preset = SD_FOLDER.parent / "sd15-8gb.yaml"
    printed = run_script(
        "plan_memory.py", "-b", preset, f"model.params.pretrained={tiny_sd}", f"data.params.root={image_folder}",
        "data.params.size=16", "--gpu-gib", "8",
    )  # fmt: skip
    assert "placement under ColossalAIStrategy (gemini)" in printed and "fits a 8 GiB GPU" in printed
    lacks = [line for line in printed.splitlines() if line.startswith("to train this config")]
    if importlib.util.find_spec("colossalai") is None:
        (line,) = lacks
        assert "HybridAdam and ColossalAIStrategy need Colossal-AI" in line and "pip install -e .[colossalai]" in line
    else:
        assert lacks == []


TEXT_ENCODERS = ("text_encoder", "text_encoder_2", "text_encoder_3")


@pytest.mark.parametrize(
    ("preset", "tiny", "text_encoders"),
    [("sdxl-8gb", "tiny_sdxl", 2), ("sdxl-lora-8gb", "tiny_sdxl", 2), ("sd35m-8gb", "tiny_sd35_medium", 3),
     ("sd35m-lora-8gb", "tiny_sd35_medium", 3), ("sd35l-lora-24gb", "tiny_sd35_medium", 3)],
)  # fmt: skip
def test_low_memory_presets_are_traced_as_they_train(preset, tiny, text_encoders, request, image_folder):
    """bf16 weights, LowMemoryAdamW fused and offloaded (its state made before the step), LoRA adapters, cached
    latents and captions, SD3.5's MMDiT and its three text encoders: the fake trace agrees with a real one, and the
    placement keeps the frozen networks and the offloaded state off the GPU."""
    cfg, _ = load_config(
        [SD_FOLDER.parent / f"{preset}.yaml"],
        [f"model.params.pretrained={request.getfixturevalue(tiny)}", f"data.params.root={image_folder}",
         "data.params.size=32"],
    )  # fmt: skip
    fake, real = plan_training_step(cfg), plan_training_step(cfg, fake=False)
    assert fake.peak == real.peak > 0 and fake.parts == real.parts
    names = TEXT_ENCODERS[:text_encoders]
    assert [p.name for p in fake.parts] == ["unet", "vae", *names]
    parts = {p.name: p for p in fake.parts}
    unet = parts["unet"]
    if "lora" not in preset:
        assert unet.weights == 2 * unet.parameters, "bf16 weights"
        assert unet.gradients == 0, "the fused step keeps no gradients"
        assert unet.parameters < unet.optimizer_states < 2 * unet.parameters, "8-bit moment + factored (AdamW: 8 bytes)"
    else:
        adapters = unet.gradients // 4  # fp32 adapters, the only weights with gradients
        assert unet.weights == 2 * (unet.parameters - adapters) + 4 * adapters, "bf16 base weights, fp32 adapters"
        assert unet.optimizer_states == 2 * unet.gradients > 0, "AdamW's two fp32 moments of the adapters only"
    placement = place(fake, cfg)
    on_cpu = {(part, state) for part, state, device, nbytes in placement.rows if device == "cpu" and nbytes}
    frozen = {(name, "weights (frozen)") for name in ("vae", *names)}
    assert on_cpu == (frozen if "lora" in preset else frozen | {("unet", "optimizer state")})
    assert placement.total("gpu") + placement.total("cpu") == fake.peak


def test_an_sd35_step_is_planned_with_its_objective(tiny_sd35_medium, image_folder):
    """The traced step is the one the config trains: SD3.5's flow step; a DDPM objective is refused, as in training."""
    from ldm.config import ConfigError

    preset = SD_FOLDER.parent / "sd35m-lora-8gb.yaml"
    args = [f"model.params.pretrained={tiny_sd35_medium}", f"data.params.root={image_folder}", "data.params.size=16"]
    cfg, _ = load_config([preset], [*args, "model.params.objective=ddpm"])
    with pytest.raises(ConfigError, match="objective: ddpm cannot train with the scheduler FlowMatchEulerDiscrete"):
        plan_training_step(cfg)


@pytest.mark.skipif(not has_sd35_layers(), reason=NO_SD35)
def test_an_architecture_folder_is_planned_with_its_family_classes():
    """`configs/models/<family>/` holds configs only, no `model_index.json`: its family gives the parts' classes
    (SD3.5's transformer, CLIP with projection, flow scheduler) and its further text encoders are found."""
    from ldm.families import CONFIGS
    from ldm.training.memory import _network_names, _part_config, _spec

    params = {"pretrained": str(CONFIGS / "sd35-medium")}
    assert _network_names(params) == ("unet", "vae", "text_encoder", "text_encoder_2", "text_encoder_3")
    classes = {name: _part_config(params, name)[0].__name__ for name in _network_names(params)}
    assert classes == {"unet": "SD3Transformer2DModel", "vae": "AutoencoderKL",
                       "text_encoder": "CLIPTextModelWithProjection", "text_encoder_2": "CLIPTextModelWithProjection",
                       "text_encoder_3": "T5EncoderModel"}  # fmt: skip
    assert _spec(params, "scheduler")["target"] == "diffusers.FlowMatchEulerDiscreteScheduler"
    assert _network_names({"pretrained": str(CONFIGS / "sdxl")}) == ("unet", "vae", "text_encoder", "text_encoder_2")


def test_shards_are_planned_as_precomputed_latents_and_captions(tiny_sd, image_folder):
    """A shards config trains on stored latents and caption embeddings: planned as a folder with both caches (the
    VAE and text encoder do not run in the step), not as one that encodes images every step."""
    args = (tiny_sd, image_folder, "data.params.size=32", "model.params.frozen_dtype=float16")
    shards = plan_training_step(config(*args, "data.target=ldm.data.shards.ShardDataModule"), fake=False)
    cached = plan_training_step(config(*args, "data.params.cache_latents=true", "data.params.cache_text=true"),
                                fake=False)  # fmt: skip
    encoding = plan_training_step(config(*args), fake=False)
    assert shards.peak == cached.peak != encoding.peak
    assert shards.peak_by_category == cached.peak_by_category


class SubclassedLowMemoryAdamW(LowMemoryAdamW):
    """A user's own variant: the planner must trace it as the low-memory optimizer it is."""


@pytest.mark.parametrize(("target", "low_memory"), [("ldm.training.optim.LowMemoryAdamW", True),
                                                    ("tests.test_memory_plan.SubclassedLowMemoryAdamW", True),
                                                    ("torch.optim.AdamW", False), (None, False)])  # fmt: skip
def test_the_planner_knows_the_low_memory_optimizer_by_its_class(target, low_memory):
    from types import SimpleNamespace

    from ldm.training.memory import _optimizer

    weights = [torch.nn.Parameter(torch.zeros(4, 4))]
    system = SimpleNamespace(trained_parameters=lambda: weights)
    optimizer = _optimizer({"optimizer": {"target": target, "params": {"lr": 1e-3}} if target else None}, system)
    assert isinstance(optimizer, LowMemoryAdamW) is low_memory
