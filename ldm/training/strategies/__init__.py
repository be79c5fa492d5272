"""Training strategies Lightning does not ship: `ColossalAIStrategy` (ZeRO / Gemini offload).

`ldm.training.strategies.ColossalAIStrategy`, `HybridAdam` and `CPUAdam` import Colossal-AI on first
use (`pip install -e .[colossalai]`); `ldm.training.strategies.colossal` is the only module that
imports it. `legacy` maps the strategy block of Lightning 1.x-era Colossal-AI configs onto ours.
"""

from __future__ import annotations

import importlib
from typing import Any

TARGET = "ldm.training.strategies.ColossalAIStrategy"
_LAZY = ("ColossalAIStrategy", "ColossalAIPrecision", "HybridAdam", "CPUAdam")


def __getattr__(name: str) -> Any:
    """The Colossal-AI classes, imported when first asked for: Colossal-AI is an optional dependency."""
    if name in _LAZY:
        try:
            colossal = importlib.import_module("ldm.training.strategies.colossal")
        except ImportError as err:
            raise ImportError(
                f"ldm.training.strategies.{name} needs Colossal-AI ({err}); install it with "
                "`pip install -e .[colossalai]` into an environment with torch<=2.5.1 (see docs/colossalai.md)"
            ) from err
        return getattr(colossal, name)
    raise AttributeError(f"module 'ldm.training.strategies' has no attribute {name!r}")
