"""LoRA files for other tools: diffusers' `pytorch_lora_weights.safetensors`."""

from __future__ import annotations

from pathlib import Path

from ldm.components import Parts
from ldm.components.lora import lora_layers

LORA_FILE = "pytorch_lora_weights.safetensors"


def save_lora(parts: Parts, out_dir: str | Path) -> Path:
    """Write the parts' adapters as `pytorch_lora_weights.safetensors`, for `pipe.load_lora_weights(out_dir)`."""
    from diffusers import StableDiffusionPipeline
    from peft.tuners.tuners_utils import BaseTunerLayer

    layers = {}
    for name, module in parts.networks.items():
        if any(isinstance(m, BaseTunerLayer) for m in module.modules()):
            layers[f"{name}_lora_layers"] = lora_layers(module)
    if not layers:
        raise ValueError("no LoRA adapters to export: this checkpoint was not trained with model.params.lora")
    out_dir = Path(out_dir)
    StableDiffusionPipeline.save_lora_weights(out_dir, **layers, safe_serialization=True)
    return out_dir / LORA_FILE
