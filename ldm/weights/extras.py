"""The tensors of an original single file that no part holds, kept so that a round trip gives each one back.

A UNet family's single file holds more than the UNet, VAE and text encoder weights: the noise schedule as
buffers (`betas`, `alphas_cumprod`, ..., `posterior_*`), the UNet's EMA copy (`model_ema.*`) beside
the raw weights, OpenCLIP's last layer (a family conditioning on the penultimate one builds its CLIPTextModel
a layer short), its `logit_scale` and `text_projection`, and whatever else a tool put there.
Reading a file keeps them with the parts (`attach`); a diffusers folder carries them in
`EXTRAS_FILE` at its root, which diffusers never reads; a single file written from those parts gets
them back as they were (`writable`).

The EMA copy is an average of the UNet it was saved beside, so it comes back only while the parts'
UNet is still that one (a fingerprint taken when it was read says so). After fine-tuning or merging
a LoRA it would be a stale average of the old weights, which a reader of EMA weights would take for
the model: it is left out, and the log says so.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch

from ldm.components import Parts
from ldm.utils.atomic import atomic_path
from ldm.weights.keymaps import EMA

log = logging.getLogger(__name__)

EXTRAS_FILE = "single_file_extras.safetensors"  # at a diffusers folder's root, beside model_index.json
METADATA_KEY = "ldm_extras"
_ATTRIBUTE = "single_file_extras"  # kept in the Parts object's __dict__: its items are parts, and are iterated


@dataclass
class Extras:
    """Tensors of a single file that the parts do not hold, by their original names."""

    tensors: dict[str, torch.Tensor]
    source: str  # where they were read from, for messages
    text_layout: str  # the `FileLayout` of the file they come from (`ldm.families.LAYOUTS`): their names are in it
    unet_fingerprint: str | None = None  # of the UNet the EMA copies average (`unet_fingerprint`); None without them

    @property
    def ema(self) -> list[str]:
        """The keys that belong to the UNet's EMA copy (its weights, decay and update count)."""
        return [k for k in self.tensors if k.startswith(EMA)]


def fingerprint(named: Iterable[tuple[str, torch.Tensor]]) -> str:
    """A sha256 of names and float32 values, in the order given: the same for the same values in any float dtype."""
    digest = hashlib.sha256()
    for name, tensor in named:
        digest.update(name.encode())
        digest.update(tensor.detach().to("cpu", torch.float32).contiguous().numpy())
    return digest.hexdigest()


def unet_fingerprint(unet: torch.nn.Module) -> str:
    """The fingerprint of a UNet's weights, by our (diffusers) names in sorted order."""
    state = unet.state_dict()
    return fingerprint((k, state[k]) for k in sorted(state))


def attach(parts: Parts, extras: Extras | None) -> Parts:
    """Keep `extras` with `parts`, beside its items (code that iterates the parts never sees them)."""
    if extras is not None and extras.tensors:
        vars(parts)[_ATTRIBUTE] = extras
    else:
        vars(parts).pop(_ATTRIBUTE, None)
    return parts


def extras_of(parts: Parts) -> Extras | None:
    """The extras kept with `parts`, or None (parts built from a config, or read from our checkpoints)."""
    return vars(parts).get(_ATTRIBUTE)


def extras_read_with(parts: Parts, tensors: dict[str, torch.Tensor], source: str, text_layout: str) -> Extras:
    """Extras just read beside `parts`; fingerprints the UNet when they hold its EMA copy."""
    extras = Extras(tensors, source, text_layout)
    if extras.ema:
        extras.unet_fingerprint = unet_fingerprint(parts.unet)
    return extras


def writable(parts: Parts, half: bool = False) -> dict[str, torch.Tensor]:
    """The extras to write with `parts`: all of them, less the EMA copy when the UNet is not the one it averages.

    With `half`, weights (floating tensors of a module, with at least one dimension) become fp16; the
    schedule buffers (top-level names) and scalars keep their dtype, as the tools that read them expect."""
    extras = extras_of(parts)
    if extras is None:
        return {}
    tensors = dict(extras.tensors)
    if extras.ema and unet_fingerprint(parts.unet) != extras.unet_fingerprint:
        log.info(
            "%s: left out its %d EMA tensors (%s*): the UNet is no longer the one they average (trained or merged "
            "since), so they would be a stale copy of the old model",
            extras.source,
            len(extras.ema),
            EMA,
        )
        for key in extras.ema:
            del tensors[key]
    return {k: _half(k, v) if half else v for k, v in tensors.items()}


def _half(key: str, tensor: torch.Tensor) -> torch.Tensor:
    if tensor.is_floating_point() and tensor.dim() > 0 and "." in key:
        return tensor.half()
    return tensor


def write_extras(folder: str | Path, parts: Parts, tensors: dict[str, torch.Tensor]) -> Path | None:
    """Write `tensors` (from `writable`) to `EXTRAS_FILE` in a diffusers folder, against the parts as written."""
    if not tensors:
        return None
    from safetensors.torch import save_file

    extras = extras_of(parts)
    meta = {"source": extras.source, "text_layout": extras.text_layout}
    if any(k.startswith(EMA) for k in tensors):
        meta["unet_fingerprint"] = unet_fingerprint(parts.unet)
    path = Path(folder) / EXTRAS_FILE
    with atomic_path(path) as partial:
        state = {k: v.contiguous() for k, v in tensors.items()}
        save_file(state, str(partial), metadata={"format": "pt", METADATA_KEY: json.dumps(meta)})
    return path


def read_extras(folder: str | Path) -> Extras | None:
    """The extras a diffusers folder carries in `EXTRAS_FILE`, or None if it has none."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file, safe_open

    path = Path(folder) / EXTRAS_FILE
    if not path.is_file():
        return None
    try:
        with safe_open(str(path), "pt") as handle:
            meta = json.loads((handle.metadata() or {}).get(METADATA_KEY, "{}"))
        tensors = load_file(str(path))
    except (SafetensorError, OSError, ValueError) as err:
        raise ValueError(
            f"{path}: not a readable safetensors file ({err}); it holds the tensors of the original single file "
            "that the parts do not (schedule buffers, EMA copy, ...): restore it, or delete it to go on without them"
        ) from None
    source = f"{path} (from {meta['source']})" if meta.get("source") else str(path)
    return Extras(tensors, source, meta.get("text_layout", "clip"), meta.get("unet_fingerprint"))
