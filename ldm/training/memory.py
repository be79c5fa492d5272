"""Plan the memory of one training step without a GPU: trace it on fake tensors.

The networks are built from their configs on the meta device and given fake storage (no weights, no real
memory), and the system's own training step (`LatentDiffusion.loss`, what `training_step` computes: text and
VAE encoding unless cached, the denoiser's forward and backward) and the optimizer's step run under torch's
`MemTracker`, which attributes every allocation to parameters, gradients, optimizer states, activations or
temporaries and records the peak. Where a strategy or offload puts each part: `ldm.training.placement`.
"""

from __future__ import annotations

import contextlib
import copy
import json
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch.distributed._tools.mem_tracker import MemTracker

from ldm.components import vae_downscale
from ldm.components.build import (
    build_part,
    folder_parts,
    module_from_config,
    part_folder,
    part_spec,
)
from ldm.components.memory import DTYPES
from ldm.config import ConfigError, import_target, to_plain
from ldm.families import ARCHITECTURES, DEFAULT_CLASSES, FAMILIES, NETWORK_PARTS, OPTIONAL_PARTS
from ldm.training.model import latent_diffusion
from ldm.training.optim import LowMemoryAdamW

GIB = 1024**3
SHARDS = "ldm.data.shards.ShardDataModule"
CATEGORIES = ("Parameter", "Buffer", "Gradient", "Optstate", "Activation", "Temp", "Other")


@dataclass
class PartMemory:
    """Bytes one part holds for the whole step: its weights, gradients and optimizer states."""

    name: str
    parameters: int
    trainable: bool
    weights: int
    gradients: int
    optimizer_states: int


@dataclass
class MemoryPlan:
    """The traced step: per-part static bytes, and the peak with its breakdown by category."""

    batch_size: int
    resolution: int
    precision: str
    parts: list[PartMemory]
    peak: int
    peak_by_category: dict[str, int] = field(default_factory=dict)
    backward_peak_by_category: dict[str, int] = field(default_factory=dict)

    @property
    def activations(self) -> int:
        """Activations and temporaries at the forward/backward peak: what the GPU holds beyond the states."""
        return self.backward_peak_by_category.get("Activation", 0) + self.backward_peak_by_category.get("Temp", 0)

    def table(self, gpu_gib: float | None = None) -> str:
        """A plain-text report; with `gpu_gib`, whether the step fits that card with no offload."""
        rows = [f"batch {self.batch_size} at {self.resolution} px, precision {self.precision}, no offload"]
        rows.append(f"{'part':<14}{'params':>10}{'weights':>10}{'grads':>10}{'optim':>10}   (GiB)")
        for p in self.parts:
            rows.append(
                f"{p.name:<14}{p.parameters / 1e6:>9.1f}M{p.weights / GIB:>10.2f}{p.gradients / GIB:>10.2f}"
                f"{p.optimizer_states / GIB:>10.2f}{'' if p.trainable else '   frozen'}"
            )
        at_peak = ", ".join(f"{k.lower()} {v / GIB:.2f}" for k, v in self.peak_by_category.items() if v)
        rows.append(f"peak of the step: {self.peak / GIB:.2f} GiB ({at_peak})")
        if gpu_gib is not None:
            verdict = "fits" if self.peak <= gpu_gib * GIB else "does NOT fit"
            rows.append(
                f"{verdict} a {gpu_gib:g} GiB GPU without offload (CUDA context and allocator slack not counted)"
            )
        return "\n".join(rows)


def _spec(params: dict, name: str) -> Any:
    """The spec of one part, as training reads it (`part_spec`); a part of an architecture folder of
    `configs/models/` (no `model_index.json` names its family) as the class its family gives it."""
    spec = part_spec(name, params.get(name), params.get("pretrained"))
    target = _folder_classes(params.get("pretrained")).get(name)
    return {"target": target, **spec} if target and isinstance(spec, dict) else spec


def _folder_classes(pretrained: str | None) -> dict[str, str]:
    """The part classes of the family whose architecture folder (`configs/models/<name>/`) `pretrained` is."""
    folder = Path(pretrained).expanduser().resolve() if pretrained else None
    for family in FAMILIES.values():
        if folder in (family.folder.resolve(), family.network_folder.resolve()):
            return dict(ARCHITECTURES[family.architecture].part_classes)
    return {}


def _part_config(params: dict, name: str) -> tuple[type, dict]:
    """The class and config dict of one part, from its spec or from `pretrained/<name>/config.json`."""
    spec = _spec(params, name)
    cls = import_target(spec.get("target", DEFAULT_CLASSES[name]), f"model.params.{name}.target")
    if "config" in spec:
        return cls, dict(spec["config"])
    path = part_folder(spec) / "config.json"
    if not path.is_file():
        raise ConfigError(f"model.params.{name}: no {path} to size the {name} from")
    return cls, json.loads(path.read_text())


def _network_names(params: dict) -> tuple[str, ...]:
    """The networks of the configured model: every model's, and a family's further text encoders where they are
    given or the `pretrained` folder has them (a diffusers folder lists them in its `model_index.json`; an
    architecture folder of `configs/models/` holds their configs)."""
    pretrained = params.get("pretrained")
    if pretrained and not (Path(pretrained) / "model_index.json").is_file():
        listed = {name for name in OPTIONAL_PARTS if (Path(pretrained) / name / "config.json").is_file()}
    else:
        listed = folder_parts(pretrained)
    given = {name for name in OPTIONAL_PARTS if params.get(name) is not None}
    return (*NETWORK_PARTS, *(n for n in OPTIONAL_PARTS if n.startswith("text_encoder") and n in listed | given))


def _tokenizer(params: dict, text_config: dict, name: str = "tokenizer") -> Any:
    """The configured tokenizer, or (for the architecture folders of `configs/models/`, which hold none)
    the CLIP tokenizer at the text encoder's length: token ids only set the sizes the step traces (a text encoder
    with no length of its own, T5, is given its ids at the length the family's conditioning asks for)."""
    spec = params.get(name)
    if spec is None and params.get("pretrained") and (Path(params["pretrained"]) / name).is_dir():
        spec = part_spec(name, None, params["pretrained"])
    length = text_config.get("max_position_embeddings", 77)
    spec = spec or {"target": DEFAULT_CLASSES["tokenizer"], "config": {"vocab": "clip", "model_max_length": length}}
    return build_part(name, spec, f"model.params.{name}")


def _build(cls: type, config: dict, dtype: torch.dtype) -> torch.nn.Module:
    """Build a part and cast it to `dtype`, as training does (built with `dtype` as the default, transformers'
    text models would keep fp32 weights)."""
    return module_from_config(cls, config).to(dtype)


class _Tracker(MemTracker):
    """torch's `MemTracker`, leaving alone the weights that take no gradient (it hooks every weight's gradient,
    which a frozen one cannot have): frozen parts and a LoRA's base weights stay frozen in the trace. It keeps
    the whole step's peak only: the per-module peaks cost a walk over every module at every operation, which
    made a full-size two-encoder UNet step with a fused optimizer take hours."""

    def _update_peak_stats(self, peak_state: Any) -> None:
        for device, snapshot in self._curr_mem_snap.items():
            if self._peak_mem.get(device, 0) < snapshot["Total"]:
                self._peak_mem[device] = snapshot["Total"]
                self._peak_mem_snap[device] = copy.deepcopy(snapshot)

    def _track_module_params_and_buffers(self, module: torch.nn.Module, install_grad_hooks: bool = True) -> Any:
        for p in module.parameters():
            if not p.requires_grad:
                self._param_to_grad_hook_handles.setdefault(p, (_NoHook(), _NoHook()))
        return super()._track_module_params_and_buffers(module, install_grad_hooks)


class _NoHook:
    def remove(self) -> None:
        pass


def _is_low_memory(target: str | None) -> bool:
    """Whether `target` names `LowMemoryAdamW` or a subclass: the class decides, not its spelling. A target that
    cannot be imported here (Colossal-AI's HybridAdam, planned without Colossal-AI) is not."""
    try:
        optimizer = import_target(target, "model.params.optimizer.target") if target else None
    except ConfigError:
        return False
    return isinstance(optimizer, type) and issubclass(optimizer, LowMemoryAdamW)


def _optimizer(params: dict, system: Any) -> torch.optim.Optimizer:
    """The configured optimizer where the planner can trace it (`LowMemoryAdamW`, its state created first, as in
    every step after the first); AdamW otherwise (Colossal-AI's place their states by `place`'s arithmetic)."""
    spec = params.get("optimizer") or {}
    if _is_low_memory(spec.get("target")):
        optimizer = LowMemoryAdamW(system.trained_parameters(), **(spec.get("params") or {}))
        optimizer.init_state()
        return optimizer
    return torch.optim.AdamW(system.trained_parameters(), lr=1e-4, foreach=False)


def _batch(system: Any, params: dict, data: dict, batch_size: int, resolution: int) -> dict:
    """A batch as the data gives it: images and captions, or latents and encoded captions where they are cached
    (`cache_latents` / `cache_text`) or precomputed (shards)."""
    vae = system.vae.config
    batch: dict = {"caption": [""] * batch_size}
    if not data.get("cache_latents"):
        batch["pixel_values"] = torch.zeros(batch_size, vae.in_channels, resolution, resolution)
    else:
        side = resolution // vae_downscale(vae)
        batch["latents"] = torch.zeros(batch_size, vae.latent_channels, side, side)
        if params.get("sample_latents", True):
            batch["latent_std"] = torch.zeros_like(batch["latents"])
    if data.get("cache_text"):
        with torch.no_grad():
            batch["cond"] = system.encode_text(batch["caption"])
    return batch


def plan_training_step(
    cfg: Any, batch_size: int | None = None, resolution: int | None = None, fake: bool = True
) -> MemoryPlan:
    """Trace one training step of the model in `cfg` (a loaded config) on fake tensors.

    The networks are built in their configured dtypes (`trainable_dtype`, `frozen_dtype`), with the configured
    LoRA adapters; `LowMemoryAdamW` is traced as configured (its state present, its step fused into backward),
    any other optimizer as AdamW. A data config that caches latents and captions gives batches of them.
    `fake=False` runs the same step on real tensors, to check the fake trace on a small model.
    """
    from torch._subclasses.fake_tensor import FakeTensorMode

    params = to_plain(cfg.model.params)
    data = to_plain(cfg.data.params) if "params" in cfg.data else {}
    if cfg.data.get("target") == SHARDS:  # latents and caption embeddings precomputed
        data = {**data, "cache_latents": True, "cache_text": True}
    trainer = to_plain((cfg.get("lightning") or {}).get("trainer") or {})
    batch_size = batch_size or int(data.get("batch_size", 1))
    resolution = resolution or int(data.get("size", 512))
    precision = str(trainer.get("precision", "32-true"))
    trainable = tuple(params.get("trainable", ("unet",)))
    frozen_dtype = DTYPES[params["frozen_dtype"]] if params.get("frozen_dtype") else torch.float32
    trained_dtype = DTYPES[params["trainable_dtype"]] if params.get("trainable_dtype") else torch.float32
    lora = params.get("lora")
    autocast = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}.get(precision)
    if precision not in ("32-true", "32", "bf16-mixed", "16-mixed"):
        raise ConfigError(
            f"lightning.trainer.precision: the planner knows 32-true, bf16-mixed, 16-mixed; got {precision}"
        )
    configs = {name: _part_config(params, name) for name in _network_names(params)}
    tokenizer_of = {name: name.replace("text_encoder", "tokenizer") for name in configs if "text_encoder" in name}
    tokenizers = {t: _tokenizer(params, configs[name][1], t) for name, t in tokenizer_of.items()}
    scheduler = build_part("scheduler", _spec(params, "scheduler"), "model.params.scheduler")

    tracker = _Tracker()
    # The networks are built on the meta device (no memory; fake tensors could not be cast, as LoRA's adapters are)
    # and then given fake storage; real tensors that meet fake ones (the noise schedule, token ids) become fake.
    with torch.device("meta") if fake else contextlib.nullcontext():
        modules = {
            name: _build(cls, config, trained_dtype if name in trainable and not lora else frozen_dtype)
            for name, (cls, config) in configs.items()
        }
    # The system's own training step: the one `main.py` runs, with the options that change memory.
    system = latent_diffusion(
        **modules,
        **tokenizers,
        scheduler=scheduler,
        trainable=trainable,
        snr_gamma=params.get("snr_gamma"),
        gradient_checkpointing=bool(params.get("gradient_checkpointing")),
        lora=lora,
        sample_latents=params.get("sample_latents", True),
        **{k: params[k] for k in ("objective", "flow", "edm", "mask_ratio", "max_sequence_length") if k in params},
    )
    with FakeTensorMode(allow_non_fake_inputs=True) if fake else contextlib.nullcontext():
        if fake:
            system.to_empty(device="cpu")
            modules = {name: getattr(system, name) for name in modules}
            for module in modules.values():  # `to_empty` parts the weights a model shares (T5's embedding): tie them
                if hasattr(module, "tie_weights"):
                    module.tie_weights()
        optimizer = _optimizer(params, system)
        system.train()
        trained, gradients = system.trained_parameters(), {}

        def closure() -> torch.Tensor:
            with torch.autocast("cpu", dtype=autocast or torch.float32, enabled=autocast is not None):
                loss = system.loss(batch)  # what training_step computes, before its NaN guard and logging
            loss.backward()
            gradients.update({p: p.grad.numel() * p.grad.element_size() for p in trained if p.grad is not None})
            return loss

        with tracker, warnings.catch_warnings():
            # the fused step frees each gradient before the tracker's own hook looks at it
            warnings.filterwarnings("ignore", "Expected a tensor or a traceable wrapper-subclass", UserWarning)
            tracker.track_external(system, optimizer)
            batch = _batch(system, params, data, batch_size, resolution)
            if isinstance(optimizer, LowMemoryAdamW):
                optimizer.step(closure)  # the update runs inside backward (fused), or right after it
                backward_peak = _by_category(tracker)
            else:
                closure()
                backward_peak = _by_category(tracker)
                optimizer.step()
            states = {
                p: sum(t.numel() * t.element_size() for t in s.values() if torch.is_tensor(t) and t.dim())
                for p, s in optimizer.state.items()
            }  # step counters not counted
            optimizer.zero_grad(set_to_none=True)
    totals = _by_category(tracker)
    parts = []
    for name, module in modules.items():
        weights = list(module.parameters())
        parts.append(
            PartMemory(
                name,
                sum(p.numel() for p in weights),
                name in trainable,
                sum(p.numel() * p.element_size() for p in weights),
                sum(gradients.get(p, 0) for p in weights),
                sum(states.get(p, 0) for p in weights),
            )
        )
    return MemoryPlan(
        batch_size,
        resolution,
        precision,
        parts,
        totals.get("Total", 0),
        {k: totals.get(k, 0) for k in CATEGORIES},
        {k: backward_peak.get(k, 0) for k in CATEGORIES},
    )


def _by_category(tracker: Any) -> dict[str, int]:
    """Bytes per category at the peak so far, summed over devices."""
    totals: dict[str, int] = {}
    for device_stats in tracker.get_tracker_snapshot("peak").values():
        for key, value in device_stats.items():
            label = getattr(key, "value", str(key))
            totals[label] = totals.get(label, 0) + value
    return totals
