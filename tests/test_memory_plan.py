"""The memory planner: fake-tensor traces agree with real-tensor traces, per part and at the peak."""

import importlib.util
from pathlib import Path

from ldm.config import load_config
from ldm.training.memory import GIB, plan_training_step

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
