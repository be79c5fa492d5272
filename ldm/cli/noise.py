"""Other libraries' messages that tell a user of ldm nothing, hidden by the command-line tools unless `-v`.

Each entry names where the message comes from (a logger, or a Python warning), matches it by its text, and
says why it is noise here; anything not listed is shown. The library never imports this module: only the
tools decide what their output looks like.
"""

from __future__ import annotations

import logging
import re
import warnings

from diffusers.utils import logging as diffusers_logging
from transformers.utils import logging as transformers_logging

# (logger, message pattern, why it is hidden)
LOGGED = (
    ("lightning.pytorch.utilities.rank_zero", r"(GPU|TPU|HPU) available", "the device is the config's"),
    ("lightning.pytorch.utilities.rank_zero", r"💡 Tip: .*litlogger", "an advertisement for a cloud logger"),
    ("lightning.pytorch.utilities.rank_zero", r"`Trainer.fit` stopped: `max_steps=\d+` reached", "the run ends "
     "with its checkpoint's path"),
    ("lightning.fabric.utilities.seed", r"Seed set to", "the seed is in the run's config and checkpoints"),
    ("httpx", r"^HTTP Request: ", "the web app's own requests to itself (Gradio's start-up checks)"),
    ("diffusers.models.modeling_utils", r"There are modules in \w+ that should be kept in float32: \[\]",
     "there are none (an empty list); the dtype casts are the config's"),
)  # fmt: skip
# (warning message pattern, matched from its start, why it is hidden). Hidden from this module's import on:
# some are raised while a tool imports its libraries, before it calls `quiet`, so the tools import ldm.cli first.
WARNED = (
    (r"`isinstance\(treespec, LeafSpec\)` is deprecated", "Lightning's use of a torch API, not ours to fix"),
    (r"`Transformer2DModelOutput` is deprecated and will be removed in version 1\.0\.0\. Importing",
     "diffusers 0.29 (the Colossal-AI stack) warns as it imports its own module"),
)  # fmt: skip


class _Hide(logging.Filter):
    def __init__(self, pattern: str) -> None:
        super().__init__()
        self.pattern = re.compile(pattern)

    def filter(self, record: logging.LogRecord) -> bool:
        return not self.pattern.search(record.getMessage())  # Lightning may prefix "[rank: 0] "


_installed: list[tuple[logging.Logger, _Hide]] = []


def _hide_warnings() -> None:
    for pattern, _ in WARNED:
        warnings.filterwarnings("ignore", message=pattern)


_hide_warnings()


def quiet(verbose: bool = False) -> None:
    """Hide the listed messages and the loaders' progress bars (diffusers, transformers); `verbose` shows all."""
    for logger, hide in _installed:
        logger.removeFilter(hide)
    _installed.clear()
    if verbose:
        warnings.simplefilter("default")  # every warning, once per place: the listed ones too
        diffusers_logging.enable_progress_bar()
        transformers_logging.enable_progress_bar()
        return
    for name, pattern, _ in LOGGED:
        logger, hide = logging.getLogger(name), _Hide(pattern)
        logger.addFilter(hide)
        _installed.append((logger, hide))
    _hide_warnings()
    diffusers_logging.disable_progress_bar()
    transformers_logging.disable_progress_bar()
