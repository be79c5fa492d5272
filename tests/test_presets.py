"""Every shipped preset, on this CPU with a tiny model: it trains a step, or refuses in one line."""

import importlib.util
import logging
from pathlib import Path

import pytest
import torch

from ldm.weights.checkpoint import load_checkpoint
from main import main

REPO = Path(__file__).resolve().parents[1]
PRESETS = sorted(p.stem for p in (REPO / "configs" / "finetune").glob("*.yaml"))
COLOSSAL = {"sd15-8gb", "sd15-24gb", "sd15-nvme", "sd2-base-8gb", "sdxl-gemini-8gb"}  # ColossalAIStrategy presets
HAS_COLOSSAL = importlib.util.find_spec("colossalai") is not None
SD35 = {"sd35m-8gb", "sd35m-lora-8gb", "sd35l-lora-24gb"}  # trained here on a tiny SD3.5 Medium


def test_every_preset_is_covered():
    assert (
        set(PRESETS)
        == {"sd-folder", "sd15-cpu-lowmem", "sd15-lora", "sdxl-8gb", "sdxl-24gb", "sdxl-lora-8gb"} | SD35 | COLOSSAL
    )


@pytest.mark.parametrize("preset", PRESETS)
def test_preset_trains_a_step_on_the_cpu_or_refuses_in_one_line(preset, request, image_folder, tmp_path, capsys):
    if preset in COLOSSAL and HAS_COLOSSAL:
        pytest.skip("the Colossal-AI presets train on a CPU only with tests/colossalai_cpu.py (test_colossalai.py)")
    tiny = "tiny_sd35_medium" if preset in SD35 else "tiny_sdxl" if preset.startswith("sdxl") else "tiny_sd"
    weights = request.getfixturevalue(tiny)
    argv = [
        "-t", "-b", str(REPO / "configs" / "finetune" / f"{preset}.yaml"), "-l", str(tmp_path / "logs"),
        f"model.params.pretrained={weights}", f"data.params.root={image_folder}", "data.params.size=16",
        "data.params.batch_size=2", "data.params.num_workers=0", "lightning.trainer.max_steps=1",
        "lightning.trainer.accumulate_grad_batches=1", "lightning.callbacks.image_logger=null",
    ]  # fmt: skip
    if preset == "sd15-nvme":
        argv.append(f"model.params.optimizer.params.nvme_offload_dir={tmp_path}")
    code = main(argv)
    if preset in COLOSSAL:
        (line,) = capsys.readouterr().err.strip().splitlines()
        assert code == 2
        assert "need Colossal-AI" in line and "pip install -e .[colossalai]" in line
        return
    assert code == 0
    (ckpt,) = (tmp_path / "logs").glob("*/checkpoints/step-000001.ckpt")
    assert load_checkpoint(ckpt)["global_step"] == 1


def test_half_precision_becomes_bf16_on_a_cpu_in_one_log_line(tiny_sd, image_folder, tmp_path, caplog):
    """The LoRA preset asks for fp16 frozen weights under 16-mixed: on a CPU both become bf16, said once."""
    if torch.cuda.is_available():
        pytest.skip("the rule applies where training runs on the CPU")
    from ldm.config import load_config
    from ldm.training.checks import check_config

    cfg, sources = load_config(
        [REPO / "configs" / "finetune" / "sd15-lora.yaml"],
        [f"model.params.pretrained={tiny_sd}", f"data.params.root={image_folder}"],
    )
    with caplog.at_level(logging.INFO, logger="ldm"):
        check_config(cfg, sources)
    assert cfg.lightning.trainer.precision == "bf16-mixed" and cfg.model.params.frozen_dtype == "bfloat16"
    (line,) = [r.getMessage() for r in caplog.records if "fp16" in r.getMessage()]
    assert "lightning.trainer.precision: 16-mixed -> bf16-mixed" in line
    assert "model.params.frozen_dtype: float16 -> bfloat16" in line


@pytest.mark.parametrize(
    "strategy", ["ldm.training.strategies.ColossalAIStrategy", "lightning.pytorch.strategies.ColossalAIStrategy"]
)
def test_colossal_ai_keeps_its_precision_on_a_cpu(strategy):
    """Colossal-AI runs its own fp16 (with fp32 masters), also under an old config's strategy target."""
    from omegaconf import OmegaConf

    from ldm.training.checks import half_precision_on_a_cpu

    trainer = {"accelerator": "cpu", "precision": 16, "strategy": {"target": strategy}}
    cfg = OmegaConf.create({"model": {"params": {"frozen_dtype": "float16"}}, "lightning": {"trainer": trainer}})
    half_precision_on_a_cpu(cfg)
    assert cfg.lightning.trainer.precision == 16 and cfg.model.params.frozen_dtype == "float16"
