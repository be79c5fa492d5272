"""`FSDPStrategy`: fully sharded data parallel (FSDP2, `torch.distributed.fsdp.fully_shard`) over every process,
through Lightning's `ModelParallelStrategy` (its current path for FSDP2), on GPUs and, over gloo, on CPUs.

`lightning.trainer.strategy: fsdp` selects it with its defaults; `{target: ldm.training.strategies.fsdp.FSDPStrategy,
params: {...}}` sets them. Each process holds 1/N of the trained parts' parameters, gradients and optimizer state:
the parts in `model.params.trainable` are sharded, each of their blocks on its own (the classes the model lists in
`_no_split_modules`, as diffusers and transformers models do: a UNet's resnet and transformer blocks, MicroDiT's
blocks), then the part itself. Frozen parts (the VAE, a frozen text encoder) are kept whole on every process: they
do not train, and the sample grids run them on the first process alone.

Checkpoints hold the full state dict, gathered on the first process (`state_dict: full`, the default): the same
file as one process writes, so it resumes on any number of processes and strategies and exports as any
checkpoint does. `state_dict: sharded` writes a folder with one shard per process through
`torch.distributed.checkpoint` instead (no gather; resume it with this strategy).
"""

from __future__ import annotations

import logging
from typing import Any, Literal

import torch
from lightning.pytorch.strategies import ModelParallelStrategy

from ldm.config import ConfigError

log = logging.getLogger(__name__)

PRECISIONS = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}
# FSDP2 runs on CPUs (over gloo) from torch 2.6; earlier it needs CUDA streams
CPU_CAPABLE = tuple(int(v) for v in torch.__version__.split("+")[0].split(".")[:2]) >= (2, 6)


class FSDPStrategy(ModelParallelStrategy):
    """FSDP2 over all processes (data parallel only).

    `mixed_precision`: the dtype blocks compute and all-gather in (`bf16` | `fp16`), with fp32 master weights
    and fp32 gradient reduction; `fp32` (default) computes in the weights' dtype. `activation_checkpointing`
    recomputes each block's activations in backward (the part's own `enable_gradient_checkpointing`).
    `reshard_after_forward` frees gathered weights after each block's forward (ZeRO-3; `false`: ZeRO-2, keeps
    them until backward). `state_dict`: `full` | `sharded` checkpoints (module docstring)."""

    def __init__(
        self,
        mixed_precision: Literal["fp32", "bf16", "fp16"] = "fp32",
        activation_checkpointing: bool = False,
        reshard_after_forward: bool = True,
        state_dict: Literal["full", "sharded"] = "full",
        **kwargs: Any,
    ) -> None:
        if mixed_precision not in PRECISIONS:
            raise ConfigError(
                f"lightning.trainer.strategy.params.mixed_precision: got {mixed_precision!r}; valid: "
                f"{', '.join(PRECISIONS)}"
            )
        if state_dict not in ("full", "sharded"):
            raise ConfigError(f"lightning.trainer.strategy.params.state_dict: got {state_dict!r}; valid: full, sharded")
        super().__init__(tensor_parallel_size=1, save_distributed_checkpoint=state_dict == "sharded", **kwargs)
        self.mixed_precision, self.activation_checkpointing = mixed_precision, activation_checkpointing
        self.reshard_after_forward = reshard_after_forward

    def setup_environment(self) -> None:
        self._data_parallel_size = self.num_nodes * self.num_processes  # every process is a data-parallel rank
        super().setup_environment()

    def setup(self, trainer: Any) -> None:
        if self.root_device.type == "cpu" and not CPU_CAPABLE:
            raise ConfigError(
                f"lightning.trainer.strategy: fsdp on a CPU needs torch >= 2.6 (FSDP2 in torch {torch.__version__} "
                "runs on CUDA only); use strategy: ddp here, or this strategy on GPUs"
            )
        self._shard(self.lightning_module)
        super().setup(trainer)

    def _shard(self, system: torch.nn.Module) -> None:
        """Shard each trained part: its blocks, then the part (FSDP2 groups parameters per call)."""
        try:
            from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
        except ImportError:  # torch < 2.6 (the Colossal-AI stack) has FSDP2 in its composable API
            from torch.distributed._composable.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

        if getattr(system, "lora", None) is not None:
            raise ConfigError(
                "lightning.trainer.strategy: fsdp shards whole parts; a LoRA run trains adapters of a few MB, "
                "which data parallelism (strategy: ddp) handles without sharding"
            )
        dtype = PRECISIONS[self.mixed_precision]
        policy = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32 if dtype else None)
        mesh = self.device_mesh["data_parallel"]
        options = {"mesh": mesh, "mp_policy": policy, "reshard_after_forward": self.reshard_after_forward}
        for name in getattr(system, "trainable", ()):
            part = getattr(system, name)
            if isinstance(part, FSDPModule):  # set up again (a second fit in the same process)
                continue
            if self.activation_checkpointing:
                if not getattr(part, "_supports_gradient_checkpointing", False):
                    raise ConfigError(
                        f"lightning.trainer.strategy.params.activation_checkpointing: the {name} "
                        f"({type(part).__name__}) does not support gradient checkpointing"
                    )
                part.enable_gradient_checkpointing()
            kinds = set(getattr(part, "_no_split_modules", None) or ())
            blocks = [m for m in part.modules() if m is not part and type(m).__name__ in kinds]
            for block in reversed(blocks):  # inner blocks first: a block inside another is its own group
                fully_shard(block, **options)
            fully_shard(part, **options)
            if self.global_rank != 0:
                continue
            log.info(
                "fsdp: %s sharded over %d processes in %d groups (%s), %s",
                name,
                mesh.size(),
                len(blocks) + 1,
                ", ".join(sorted(kinds)) or "the whole part",
                f"computing in {self.mixed_precision}" if dtype else "fp32",
            )
