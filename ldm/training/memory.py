"""Plan the memory of one training step without a GPU: trace it on fake tensors.

The networks are built from their configs under `FakeTensorMode` (no weights, no real memory),
and the system's own training step (`LatentDiffusion.loss`, what `training_step` computes: text and VAE encoding, the
denoiser's forward and backward) and an AdamW step run under torch's `MemTracker`, which
attributes every allocation to parameters, gradients, optimizer states, activations or
temporaries and records the peak.
"""

from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ldm.components.build import (
    DEFAULT_CLASSES,
    NETWORK_PARTS,
    build_part,
    module_from_config,
    part_folder,
    part_spec,
)
from ldm.components.memory import DTYPES
from ldm.config import ConfigError, import_target, to_plain
from ldm.training.model import latent_diffusion
from ldm.training.strategies import TARGET as COLOSSAL_TARGET
from ldm.training.strategies.options import resolved

GIB = 1024**3
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


def _part_config(params: dict, name: str) -> tuple[type, dict]:
    """The class and config dict of one part, from its spec or from `pretrained/<name>/config.json`."""
    spec = part_spec(name, params.get(name), params.get("pretrained"))
    cls = import_target(spec.get("target", DEFAULT_CLASSES[name]), f"model.params.{name}.target")
    if "config" in spec:
        return cls, dict(spec["config"])
    path = part_folder(spec) / "config.json"
    if not path.is_file():
        raise ConfigError(f"model.params.{name}: no {path} to size the {name} from")
    return cls, json.loads(path.read_text())


def _network_names(params: dict) -> tuple[str, ...]:
    """The networks of the configured model: SD's, and SDXL's second text encoder where it is given or the
    `pretrained` folder (a diffusers folder, or an architecture folder such as `configs/models/sdxl`) has it."""
    pretrained = params.get("pretrained")
    has_second = params.get("text_encoder_2") is not None or bool(
        pretrained and (Path(pretrained) / "text_encoder_2" / "config.json").is_file()
    )
    return (*NETWORK_PARTS, "text_encoder_2") if has_second else NETWORK_PARTS


def _tokenizer(params: dict, text_config: dict, name: str = "tokenizer") -> Any:
    """The configured tokenizer, or (for architecture folders such as `configs/models/sd15`, which hold none)
    the CLIP tokenizer at the text encoder's length: token ids only set the sizes the step traces."""
    spec = params.get(name)
    if spec is None and params.get("pretrained") and (Path(params["pretrained"]) / name).is_dir():
        spec = part_spec(name, None, params["pretrained"])
    spec = spec or {"config": {"vocab": "clip", "model_max_length": text_config["max_position_embeddings"]}}
    return build_part(name, spec, f"model.params.{name}")


def _build(cls: type, config: dict, dtype: torch.dtype) -> torch.nn.Module:
    """Build a part with its parameters created in `dtype` (fake modules cannot be cast afterwards)."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        return module_from_config(cls, config)
    finally:
        torch.set_default_dtype(previous)


def plan_training_step(
    cfg: Any, batch_size: int | None = None, resolution: int | None = None, fake: bool = True
) -> MemoryPlan:
    """Trace one training step of the model in `cfg` (a loaded config) on fake tensors.

    `fake=False` runs the same step on real tensors, to check the fake trace on a small model.
    """
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.mem_tracker import MemTracker

    params = to_plain(cfg.model.params)
    data = to_plain(cfg.data.params) if "params" in cfg.data else {}
    trainer = to_plain((cfg.get("lightning") or {}).get("trainer") or {})
    batch_size = batch_size or int(data.get("batch_size", 1))
    resolution = resolution or int(data.get("size", 512))
    precision = str(trainer.get("precision", "32-true"))
    trainable = tuple(params.get("trainable", ("unet",)))
    frozen_dtype = DTYPES[params["frozen_dtype"]] if params.get("frozen_dtype") else torch.float32
    autocast = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}.get(precision)
    if precision not in ("32-true", "32", "bf16-mixed", "16-mixed"):
        raise ConfigError(
            f"lightning.trainer.precision: the planner knows 32-true, bf16-mixed, 16-mixed; got {precision}"
        )
    configs = {name: _part_config(params, name) for name in _network_names(params)}
    tokenizers = {"tokenizer": _tokenizer(params, configs["text_encoder"][1])}
    if "text_encoder_2" in configs:
        tokenizers["tokenizer_2"] = _tokenizer(params, configs["text_encoder_2"][1], "tokenizer_2")
    scheduler_spec = part_spec("scheduler", params.get("scheduler"), params.get("pretrained"))
    scheduler = build_part("scheduler", scheduler_spec, "model.params.scheduler")

    tracker = MemTracker()
    # Real tensors that meet fake ones (the noise schedule, token ids) become fake on the way.
    with FakeTensorMode(allow_non_fake_inputs=True) if fake else contextlib.nullcontext(), tracker:
        modules = {
            name: _build(cls, config, torch.float32 if name in trainable else frozen_dtype)
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
        )
        # MemTracker hooks every parameter's gradient, so frozen parts keep requires_grad; the system
        # runs them under no_grad, so they still get no gradients, and the optimizer never sees them.
        for module in modules.values():
            module.requires_grad_(True)
        optimizer = torch.optim.AdamW(system.trained_parameters(), lr=1e-4, foreach=False)
        system.train()
        channels = modules["vae"].config.in_channels
        batch = {
            "pixel_values": torch.zeros(batch_size, channels, resolution, resolution),
            "caption": [""] * batch_size,
        }
        with torch.autocast("cpu", dtype=autocast or torch.float32, enabled=autocast is not None):
            loss = system.loss(batch)  # what training_step computes, before its NaN guard and logging
        loss.backward()
        backward_peak = _by_category(tracker)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    totals = _by_category(tracker)
    parts = []
    for name, module in modules.items():
        n = sum(p.numel() for p in module.parameters())
        weight_bytes = sum(p.numel() * p.element_size() for p in module.parameters())
        is_trained = name in trainable
        parts.append(
            PartMemory(name, n, is_trained, weight_bytes, 4 * n if is_trained else 0, 8 * n if is_trained else 0)
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


@dataclass
class Placement:
    """Where a strategy keeps each kind of state: (part, state, device, bytes) rows, totals per device."""

    strategy: str
    rows: list[tuple[str, str, str, int]]

    def total(self, device: str) -> int:
        return sum(b for _, _, d, b in self.rows if d == device)

    def table(self, gpu_gib: float | None = None) -> str:
        lines = [f"placement under {self.strategy}", f"{'part':<14}{'state':<32}{'device':<8}{'GiB':>8}"]
        lines += [f"{part:<14}{state:<32}{device:<8}{b / GIB:>8.2f}" for part, state, device, b in self.rows if b]
        totals = ", ".join(f"{d} {self.total(d) / GIB:.2f} GiB" for d in ("gpu", "cpu", "nvme") if self.total(d))
        lines.append(f"totals: {totals}")
        if gpu_gib is not None:
            verdict = "fits" if self.total("gpu") <= gpu_gib * GIB else "does NOT fit"
            lines.append(f"{verdict} a {gpu_gib:g} GiB GPU (CUDA context and allocator slack not counted)")
        return "\n".join(lines)


def place(plan: MemoryPlan, cfg: Any) -> Placement | None:
    """Split the traced step's memory over GPU, CPU and NVMe as the configured ColossalAIStrategy would.

    `cfg` is a checked config (`ldm.training.checks.check_config`), its strategy settings in their groups.

    Arithmetic on the traced sizes: half-precision working weights (2 B/param), fp32 master weights
    (4 B), Adam moments (8 B). Gemini reuses its fp16 chunks for gradients unless accumulating; ZeRO
    keeps gradients beside the weights, or fp32 ones on the CPU with cpu_offload. Activations and
    temporaries are the traced ones at the forward/backward peak. None for other strategies.
    """
    trainer = to_plain((cfg.get("lightning") or {}).get("trainer") or {})
    strategy = trainer.get("strategy")
    if not isinstance(strategy, dict) or strategy.get("target") != COLOSSAL_TARGET:
        return None
    sp = strategy.get("params") or {}
    optimizer = (to_plain(cfg.model.params).get("optimizer") or {}).get("params") or {}
    nvme = float(optimizer.get("nvme_offload_fraction") or 0.0)
    accumulate = int(trainer.get("accumulate_grad_batches", 1)) > 1
    plugin = sp.get("plugin", "gemini")
    gemini, zero = resolved("gemini", sp.get("gemini")), resolved("zero", sp.get("zero"))
    rows: list[tuple[str, str, str, int]] = []

    def split(part: str, state: str, nbytes: float, gpu_share: float) -> None:
        rows.append((part, state, "gpu", int(nbytes * gpu_share)))
        rows.append((part, state, "cpu", int(nbytes * (1 - gpu_share))))

    for p in plan.parts:
        n = p.parameters
        if not p.trainable:
            rows.append((p.name, "weights (frozen, half)", "gpu", 2 * n))
        elif plugin == "gemini":
            weights_gpu = 1.0 - float(gemini["offload_param_frac"])
            optim_gpu = 1.0 - float(gemini["offload_optim_frac"])
            split(p.name, "weights (fp16 chunks)", 2 * n, weights_gpu)
            if accumulate:
                split(p.name, "gradients (fp16, accumulated)", 2 * n, weights_gpu)
            split(p.name, "master weights (fp32)", 4 * n, optim_gpu)
            rows.append((p.name, "Adam moments (fp32)", "gpu", int(8 * n * optim_gpu)))
            rows.append((p.name, "Adam moments (fp32)", "cpu", int(8 * n * (1 - optim_gpu) * (1 - nvme))))
            rows.append((p.name, "Adam moments (fp32)", "nvme", int(8 * n * (1 - optim_gpu) * nvme)))
        else:
            offload = bool(zero["cpu_offload"])
            width = 4 if str(trainer.get("precision", "16-mixed")).startswith("32") else 2
            device = "cpu" if offload else "gpu"
            rows.append((p.name, "weights (working)", "gpu", width * n))
            if offload:
                rows.append((p.name, "gradient bucket", "gpu", 2 * 2**20 * int(zero["reduce_bucket_size_m"])))
                rows.append((p.name, "gradients (fp32)", "cpu", 4 * n))
            else:
                rows.append((p.name, "gradients", "gpu", width * n))
            if width == 2:
                rows.append((p.name, "master weights (fp32)", device, 4 * n))
            rows.append((p.name, "Adam moments (fp32)", device, int(8 * n * (1 - nvme))))
            rows.append((p.name, "Adam moments (fp32)", "nvme", int(8 * n * nvme)))
    rows.append(("step", "activations + temporaries", "gpu", plan.activations))
    return Placement(f"ColossalAIStrategy ({plugin})", rows)
