"""ColossalAIStrategy's checkpoints: folders written and read through the booster, no Colossal-AI import here.

    step-000500.ckpt/
      model/                  booster.save_model, sharded safetensors + index (all parts)
      optimizer/              booster.save_optimizer, sharded
      master.safetensors      ZeRO in fp16/bf16 only: the fp32 master weights of the trained parameters
      trainer.pt              the rest of Lightning's checkpoint (loops, LR schedule, EMA, ldm config)

`ldm.weights.checkpoint.load_checkpoint` reads such a folder back as one ordinary checkpoint dict,
so export and sampling need neither Colossal-AI nor a GPU.
"""

from __future__ import annotations

import contextlib
import math
import os
import types
from collections.abc import Generator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch.trainer.states import TrainerFn
from torch.optim import Optimizer

from ldm.utils.atomic import PARTIAL_SUFFIX, honour_umask, remove_path, replace_path
from ldm.weights.formats import COLOSSAL_FILES, Format, detect

# torch reads this at every `torch.load` call (torch >= 2.4).
FORCE_WEIGHTS_ONLY = "TORCH_FORCE_WEIGHTS_ONLY_LOAD"


def unwrap(optimizer: Any) -> Any:
    """The booster's optimizer under Lightning's wrapper."""
    return getattr(optimizer, "_optimizer", optimizer)


class BoosterCheckpoints:
    """Save and load checkpoint folders through `self.booster`; mixed into ColossalAIStrategy."""

    def save_checkpoint(self, checkpoint: dict, filepath: Any, storage_options: Any = None) -> None:
        """Write a checkpoint folder next to the old one, then swap it in: a crash never leaves a half-written
        `last.ckpt` in place of a good one."""
        if storage_options is not None:
            raise TypeError("ColossalAIStrategy.save_checkpoint does not take storage_options")
        path = Path(self.broadcast(str(filepath)))
        partial = path.with_name(path.name + PARTIAL_SUFFIX)
        if self.is_global_zero:
            remove_path(partial)
            partial.mkdir(parents=True)
        self.barrier("colossalai_checkpoint_dir")
        shard = {"shard": True, "size_per_shard": self.checkpoint_shard_mb}
        self.booster.save_model(self.model, str(partial / COLOSSAL_FILES["model"]), use_safetensors=True, **shard)
        masters = self._gather_master_weights()
        if self.optimizers:
            with self._nvme_states_in_memory():
                self.booster.save_optimizer(
                    unwrap(self.optimizers[0]), str(partial / COLOSSAL_FILES["optimizer"]), **shard
                )
        if self.is_global_zero:
            if masters:
                from safetensors.torch import save_file

                save_file(masters, str(partial / COLOSSAL_FILES["master"]))
            rest = {k: v for k, v in checkpoint.items() if k not in ("state_dict", "optimizer_states")}
            rest["colossalai"] = {"plugin": self.plugin_name, "precision": self.precision_plugin.plugin_precision}
            torch.save(rest, partial / COLOSSAL_FILES["trainer"])
            honour_umask(partial)  # safetensors leaves its files 0600
            replace_path(partial, path)
        self.barrier("colossalai_checkpoint_saved")

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        path = Path(self.broadcast(str(checkpoint_path)))
        if detect(path) is not Format.COLOSSAL:
            raise ValueError(
                f"{path}: not a ColossalAIStrategy checkpoint folder (no {COLOSSAL_FILES['trainer']}); "
                "to start from plain weights, set model.params.pretrained instead of -r"
            )
        with _weights_only_loads():
            self.booster.load_model(self.model, str(path / COLOSSAL_FILES["model"]))
            if (path / COLOSSAL_FILES["master"]).is_file():
                self._restore_master_weights(path / COLOSSAL_FILES["master"])
            fitting = self.lightning_module.trainer.state.fn == TrainerFn.FITTING
            if fitting and self.optimizers and (path / COLOSSAL_FILES["optimizer"]).exists():
                inner = self._nvme_optimizer()
                with _plain_state_dict(inner) if inner is not None else contextlib.nullcontext():
                    self.booster.load_optimizer(unwrap(self.optimizers[0]), str(path / COLOSSAL_FILES["optimizer"]))
                self._offload_loaded_states_to_nvme()
        return torch.load(path / COLOSSAL_FILES["trainer"], map_location="cpu", weights_only=True)

    def remove_checkpoint(self, filepath: Any) -> None:
        if self.is_global_zero:
            remove_path(Path(filepath))

    def _zero_optimizer(self) -> Any:
        optimizer = unwrap(self.optimizers[0]) if self.optimizers else None
        return optimizer if hasattr(optimizer, "working_to_master_param") else None

    def _gather_master_weights(self) -> dict[str, torch.Tensor]:
        """ZeRO with fp16/bf16 weights: the fp32 masters of the trained parameters, whole, on rank 0.

        The booster saves the working (half-precision) weights; resuming from those alone would
        round the masters to fp16 and lose the sub-ulp progress a small learning rate makes."""
        optimizer = self._zero_optimizer()
        if optimizer is None or self.precision_plugin.plugin_precision == "fp32":
            return {}
        world = dist.get_world_size() if dist.is_initialized() else 1
        masters = {}
        for name, param in self.lightning_module.named_parameters():
            shard = optimizer.working_to_master_param.get(id(param))
            if shard is None:
                continue
            if world > 1:
                device_shard = shard.to(self.root_device)
                pieces = [torch.empty_like(device_shard) for _ in range(world)]
                dist.all_gather(pieces, device_shard)
                shard = torch.cat(pieces)
            masters[name] = shard.detach().float()[: param.numel()].view(param.shape).cpu().contiguous()
        return masters if self.is_global_zero else {}

    def _restore_master_weights(self, path: Path) -> None:
        from safetensors.torch import load_file

        optimizer = self._zero_optimizer()
        if optimizer is None:
            return
        saved = load_file(str(path))
        world = dist.get_world_size() if dist.is_initialized() else 1
        rank = dist.get_rank() if dist.is_initialized() else 0
        for name, param in self.lightning_module.named_parameters():
            shard = optimizer.working_to_master_param.get(id(param))
            if shard is None or name not in saved:
                continue
            flat = saved[name].flatten()
            padded = torch.nn.functional.pad(flat, (0, shard.numel() * world - flat.numel()))
            shard.data.copy_(padded.chunk(world)[rank].to(shard.device, shard.dtype))

    def _nvme_optimizer(self) -> Any:
        """The HybridAdam / CPUAdam under the wrappers, if it offloads states to NVMe."""
        optimizer = unwrap(self.optimizers[0]) if self.optimizers else None
        inner = getattr(optimizer, "optim", optimizer)
        return inner if getattr(inner, "offloader", None) is not None else None

    @staticmethod
    def _state_tensors(inner: Any, param: torch.Tensor) -> list[torch.Tensor]:
        return [t for t in inner.state[param].values() if torch.is_tensor(t) and t.dim() > 0]

    @contextlib.contextmanager
    def _nvme_states_in_memory(self) -> Generator[None, None, None]:
        """Bring optimizer states offloaded to NVMe back into memory while they are saved, then offload again."""
        inner = self._nvme_optimizer()
        if inner is None:
            yield
            return
        on_disk = [p for p, offloaded in inner.is_on_nvme.items() if offloaded and inner.state.get(p)]
        tensors = [t for p in on_disk for t in self._state_tensors(inner, p)]
        for tensor in tensors:
            inner.offloader.sync_read(tensor)
        try:
            with _plain_state_dict(inner):
                yield
        finally:
            for tensor in tensors:
                inner.offloader.sync_write(tensor)

    def _offload_loaded_states_to_nvme(self) -> None:
        """Put loaded optimizer states where a running optimizer keeps them: on NVMe, up to its fraction.

        Colossal-AI's NVMe optimizer only registers a parameter's states for offload when it creates
        them in its first step; states loaded from a checkpoint would otherwise stay unregistered and
        its next step fails looking them up."""
        inner = self._nvme_optimizer()
        if inner is None:
            return
        if inner.total_numel is None:
            inner.total_numel = inner._get_numel()
            inner.can_offload_numel = math.floor(inner.total_numel * inner.nvme_offload_fraction)
        for group in inner.param_groups:
            for param in group["params"]:
                if inner.state.get(param) and param not in inner.is_on_nvme:
                    inner._post_state_init(param)
                    if inner.is_on_nvme[param]:
                        for tensor in self._state_tensors(inner, param):
                            inner.offloader.sync_write(tensor)


@contextlib.contextmanager
def _plain_state_dict(optimizer: Optimizer) -> Generator[None, None, None]:
    """Let an NVMe optimizer be saved and loaded like any torch optimizer while its states are in memory.

    Colossal-AI's NVMeOptimizer refuses `state_dict` / `load_state_dict` outright (its states may be
    on disk); the booster's checkpoint I/O calls them."""
    optimizer.state_dict = types.MethodType(Optimizer.state_dict, optimizer)
    optimizer.load_state_dict = types.MethodType(Optimizer.load_state_dict, optimizer)
    try:
        yield
    finally:
        del optimizer.state_dict, optimizer.load_state_dict


@contextlib.contextmanager
def _weights_only_loads() -> Generator[None, None, None]:
    """Make every `torch.load` inside (Colossal-AI's, for optimizer shards) weights-only, as ours are: its
    own calls leave it to torch's default, which is to unpickle anything on torch 2.5."""
    before = os.environ.get(FORCE_WEIGHTS_ONLY)
    os.environ[FORCE_WEIGHTS_ONLY] = "1"
    try:
        yield
    finally:
        if before is None:
            del os.environ[FORCE_WEIGHTS_ONLY]
        else:
            os.environ[FORCE_WEIGHTS_ONLY] = before
