"""The settings of ColossalAIStrategy, in the groups they belong to: one per plugin, and fp16 loss scaling.

    strategy:
      target: ldm.training.strategies.ColossalAIStrategy
      params:
        plugin: gemini                  # gemini | zero
        gemini: {placement_policy: static, offload_optim_frac: 1.0, ...}   # GeminiPlugin's settings
        zero: {stage: 2, cpu_offload: true, ...}                           # LowLevelZeroPlugin's
        loss_scale: {initial_scale: 65536, ...}                            # fp16 dynamic loss scaling

Configs written before the groups (every setting directly under `params`) are regrouped on load, with
one log line per setting. No Colossal-AI import here: config checks and the memory planner read these.
"""

from __future__ import annotations

import logging
from typing import Literal, TypedDict

from ldm.config import ConfigError

log = logging.getLogger(__name__)


class GeminiOptions(TypedDict, total=False):
    """Colossal-AI `GeminiPlugin` settings (chunked parameters, static or auto CPU offload)."""

    placement_policy: Literal["static", "auto"]
    shard_param_frac: float  # ZeRO-3-like sharding of the fp16 weights across GPUs
    offload_optim_frac: float  # share of fp32 master weights and Adam moments on the CPU
    offload_param_frac: float  # share of fp16 weights on the CPU
    warmup_non_model_data_ratio: float
    steady_cuda_cap_ratio: float
    gpu_margin_mem_ratio: float
    search_range_m: int
    hidden_dim: int | None
    min_chunk_size_m: float
    pin_memory: bool
    force_outputs_fp32: bool


class ZeroOptions(TypedDict, total=False):
    """Colossal-AI `LowLevelZeroPlugin` settings (ZeRO stage 1 / 2)."""

    stage: Literal[1, 2]
    cpu_offload: bool
    reduce_bucket_size_m: int
    overlap_communication: bool


class LossScaleOptions(TypedDict, total=False):
    """Dynamic loss scaling for fp16 (both plugins)."""

    initial_scale: float
    min_scale: float
    growth_factor: float
    backoff_factor: float
    growth_interval: int
    hysteresis: int
    max_scale: float


DEFAULTS = {
    "gemini": {
        "placement_policy": "static",
        "shard_param_frac": 1.0,
        "offload_optim_frac": 0.0,
        "offload_param_frac": 0.0,
        "warmup_non_model_data_ratio": 0.8,
        "steady_cuda_cap_ratio": 0.9,
        "gpu_margin_mem_ratio": 0.0,
        "search_range_m": 32,
        "hidden_dim": None,
        "min_chunk_size_m": 32,
        "pin_memory": False,
        "force_outputs_fp32": False,
    },
    "zero": {"stage": 2, "cpu_offload": False, "reduce_bucket_size_m": 12, "overlap_communication": True},
    "loss_scale": {
        "initial_scale": 2**16,
        "min_scale": 1.0,
        "growth_factor": 2.0,
        "backoff_factor": 0.5,
        "growth_interval": 1000,
        "hysteresis": 2,
        "max_scale": 2**32,
    },
}
FRACTIONS = ("shard_param_frac", "offload_optim_frac", "offload_param_frac")
KEY = "lightning.trainer.strategy.params"


def resolved(group: str, given: dict | None) -> dict:
    """A group's settings with its defaults filled in; an unknown name is a `ConfigError`."""
    given = dict(given or {})
    unknown = sorted(set(given) - set(DEFAULTS[group]))
    if unknown:
        raise ConfigError(f"{KEY}.{group}.{unknown[0]}: unknown setting; valid: {', '.join(DEFAULTS[group])}")
    for name in FRACTIONS:
        if name in given and not 0.0 <= given[name] <= 1.0:
            raise ConfigError(f"{KEY}.{group}.{name}: must be within [0, 1], got {given[name]}")
    return {**DEFAULTS[group], **given}


def group_flat_settings(params: dict) -> dict:
    """`params` with every setting written directly under it (the layout before the groups) moved into its
    group, saying so once per setting; a setting given both ways is an error."""
    grouped = {k: (dict(v) if k in DEFAULTS and isinstance(v, dict) else v) for k, v in params.items()}
    for name in list(params):
        group = next((g for g, names in DEFAULTS.items() if name in names), None)
        if group is None:
            continue
        if name in (grouped.get(group) or {}):
            raise ConfigError(f"{KEY}.{name}: also given as {KEY}.{group}.{name}; keep one")
        grouped.setdefault(group, {})
        grouped[group][name] = grouped.pop(name)
        log.info("%s.%s is now %s.%s.%s; translated (write it there to silence this)", KEY, name, KEY, group, name)
    return grouped
