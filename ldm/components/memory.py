"""Memory formats of the networks: attention kernel, precision of frozen parts, checkpointing, layout."""

from __future__ import annotations

import torch

from ldm.components import Parts
from ldm.config import ConfigError

ATTENTION = ("sdpa", "xformers", "math")
# The attention processors of self- and cross-attention that `set_attention` may swap for one another.
PLAIN_PROCESSORS = {"AttnProcessor", "AttnProcessor2_0", "XFormersAttnProcessor"}
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def set_attention(parts: Parts, attention: str, key: str = "model.params.attention") -> None:
    """Choose the attention kernel of every network that lets one choose (diffusers and transformers models).

    `sdpa`: PyTorch's `scaled_dot_product_attention` (flash / memory-efficient kernels on CUDA);
    `xformers`: xformers' memory-efficient attention (CUDA only); `math`: plain softmax(QK^T)V.
    """
    from diffusers.models.attention_processor import AttnProcessor, AttnProcessor2_0

    if attention not in ATTENTION:
        raise ConfigError(f"{key}: got {attention!r}; valid: {', '.join(ATTENTION)}")
    for module in parts.networks.values():
        if attention == "xformers" and hasattr(module, "enable_xformers_memory_efficient_attention"):
            try:
                module.enable_xformers_memory_efficient_attention()
            except (ImportError, ModuleNotFoundError, NotImplementedError, ValueError, RuntimeError) as err:
                raise ConfigError(
                    f"{key}: xformers is not usable here ({' '.join(str(err).split())[:200]}); "
                    "use sdpa (the same kernels through PyTorch) or install ldm[xformers] on CUDA"
                ) from None
        elif attention != "xformers" and hasattr(module, "set_attn_processor"):
            if all(type(p).__name__ in PLAIN_PROCESSORS for p in module.attn_processors.values()):
                module.set_attn_processor(AttnProcessor2_0() if attention == "sdpa" else AttnProcessor())
            elif attention == "math":  # its own processors (joint attention, say) call SDPA already
                raise ConfigError(f"{key}: math: {type(module).__name__} has no plain attention here; use sdpa")
        elif attention != "xformers" and hasattr(module, "set_attn_implementation"):
            module.set_attn_implementation("sdpa" if attention == "sdpa" else "eager")


def prepare_for_training(
    parts: Parts,
    trainable: tuple[str, ...],
    gradient_checkpointing: bool,
    channels_last: bool,
    frozen_dtype: str | None,
    adapters: bool = False,
) -> None:
    """Freeze what does not train, and apply the memory options to the networks.

    With `adapters` (LoRA), every network's own weights are frozen; adapters added later train.
    Gradient checkpointing applies to the trained networks, channels-last to the convolutional ones."""
    for name, module in parts.networks.items():
        trains_own_weights = name in trainable and not adapters
        module.requires_grad_(trains_own_weights)
        if not trains_own_weights and frozen_dtype is not None:
            module.to(DTYPES[frozen_dtype])
        if gradient_checkpointing and name in trainable:
            if hasattr(module, "enable_gradient_checkpointing"):  # diffusers models
                module.enable_gradient_checkpointing()
            elif hasattr(module, "gradient_checkpointing_enable"):  # transformers models
                # Non-reentrant: transformers 4.x checkpoints re-entrantly by default, which passes no gradient
                # to adapters inside a checkpointed layer when the layer's input (frozen embeddings) has none.
                module.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if channels_last and any(isinstance(m, torch.nn.Conv2d) for m in module.modules()):
            module.to(memory_format=torch.channels_last)
