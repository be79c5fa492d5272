"""Strategy blocks of older Colossal-AI Stable Diffusion configs, written for Lightning 1.x's
`ColossalAIStrategy`, translated onto `ldm.training.strategies.ColossalAIStrategy`."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from ldm.config import ConfigError
from ldm.training.strategies import TARGET
from ldm.training.strategies.options import group_flat_settings

log = logging.getLogger(__name__)

LEGACY_TARGETS = (
    "pytorch_lightning.strategies.ColossalAIStrategy",
    "lightning.pytorch.strategies.ColossalAIStrategy",
    "lightning_colossalai.ColossalAIStrategy",
    "strategies.ColossalAIStrategy",
)
# Lightning 1.x ColossalAIStrategy parameters that keep their meaning under Gemini today.
_SAME_NAME = (
    "force_outputs_fp32",
    "gpu_margin_mem_ratio",
    "initial_scale",
    "min_scale",
    "growth_factor",
    "backoff_factor",
    "growth_interval",
    "hysteresis",
    "max_scale",
)
# Old placement policies as Gemini's static placement: how much of the optimizer / parameters to offload.
_PLACEMENTS = {
    "cuda": {"placement_policy": "static", "offload_optim_frac": 0.0, "offload_param_frac": 0.0},
    "cpu": {"placement_policy": "static", "offload_optim_frac": 1.0, "offload_param_frac": 1.0},
    "auto": {"placement_policy": "auto"},
}


def translate_legacy_strategy(node: Mapping, key: str = "lightning.trainer.strategy") -> dict:
    """The strategy node of an old Colossal-AI config, rewritten for `ldm.training.strategies.ColossalAIStrategy`.

    Parameters with a Gemini equivalent are translated; the rest are a `ConfigError` that says
    what to write instead.
    """
    old = dict(node.get("params") or {})
    params: dict[str, Any] = {"plugin": "gemini"}
    for name, value in old.items():
        where = f"{key}.params.{name}"
        if name in _SAME_NAME:
            params[name] = value
        elif name == "placement_policy":
            if value not in _PLACEMENTS:
                raise ConfigError(f"{where}: got {value!r}; valid: {', '.join(map(repr, _PLACEMENTS))}")
            params.update(_PLACEMENTS[value])
        elif name == "use_chunk":
            if not value:  # the layout of parameters in memory only: training is the same
                log.info("%s: false has no equivalent; Gemini always manages parameters in chunks", where)
        elif name == "enable_distributed_storage":
            params["shard_param_frac"] = 1.0 if value else 0.0
        elif name == "min_chunk_size":
            params["min_chunk_size_m"] = value
        elif name == "chunk_search_range":
            params["search_range_m"] = max(1, round(value / 2**20))
        elif name == "chunk_search_n_grids":
            raise ConfigError(f"{where}: Colossal-AI no longer has this setting; remove it (search_range_m remains)")
        else:
            raise ConfigError(
                f"{where}: not a parameter of the old ColossalAIStrategy that {TARGET} can honour; "
                f"write the block as {{target: {TARGET}, params: {{plugin: gemini, ...}}}} (see docs/colossalai.md)"
            )
    params = group_flat_settings(params)
    log.info("%s: %s is now %s with params %s", key, node["target"], TARGET, params)
    return {"target": TARGET, "params": params}
