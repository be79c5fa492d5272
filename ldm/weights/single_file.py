"""Original Stable Diffusion single files (the CompVis / Stability key layout), to and from our parts.

A1111, ComfyUI and the original `ldm` code read one `.safetensors` / `.ckpt` holding the UNet under
`model.diffusion_model.`, the VAE under `first_stage_model.` and the text encoders where the family's
`FileLayout` says (`ldm.families`).

The model family decides the architecture configs, the tokenizer and the prediction type: a file is never
paired with a prediction type guessed in a config. The key maps are in `ldm.weights.keymaps`. What a file holds
beyond the parts (schedule buffers, EMA copy, OpenCLIP's last layer, ...) is read with them and written back
(`ldm.weights.extras`).

A written file says what it is the way other tools read it: the Stability AI model spec keys
(`modelspec.*`) in a `.safetensors` header, the family's markers, and for a family whose weights look like
another's with a different prediction type, the original inference YAML as `<stem>.yaml` beside it, which
AUTOMATIC1111 reads before guessing.
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

from ldm.components import Parts, vae_downscale
from ldm.components.describe import describe_parts, family_description, parts_from_description
from ldm.families import (
    CONFIGS,
    FAMILIES,
    LAYOUTS,
    Family,
    FileLayout,
    architecture_of,
    detect_family,
    family_of,
    layout_of_keys,
    scheduler_prediction,
)
from ldm.families.base import SWAPPED, swapped_halves
from ldm.utils.atomic import atomic_path
from ldm.weights.checkpoint import load_pickle
from ldm.weights.extras import Extras, attach, extras_of, extras_read_with, fingerprint, writable
from ldm.weights.formats import PICKLE_SUFFIXES, is_our_checkpoint
from ldm.weights.keymaps import (
    TRANSPOSED,
    UNET,
    SingleFileError,
    ema_name,
    is_vae_attention_weight,
    original_names,
    tied_name,
)
from ldm.weights.tensors import Joined, Renamed, TensorFile

log = logging.getLogger(__name__)

METADATA_KEY = "ldm"  # safetensors metadata / pickle entry: JSON with family, layout and part configs
# The Stability AI model spec (github.com/Stability-AI/ModelSpec): each family's architecture id, and the
# implementation string sd-scripts writes for files in this key layout.
MODELSPEC_ARCHITECTURES = {f.name: f.modelspec for f in FAMILIES.values()}
MODELSPEC_IMPLEMENTATION = "https://github.com/Stability-AI/generative-models"


def file_layout(name: str) -> FileLayout:
    """The `FileLayout` called `name` (as files and extras record it)."""
    if name not in LAYOUTS:
        raise SingleFileError(f"text layout {name!r} is not one of {', '.join(LAYOUTS)}")
    return LAYOUTS[name]


def to_original(parts: Parts, text_layout: str, half: bool = False) -> dict[str, torch.Tensor]:
    """The parts' weights as one original-layout state dict (fp16 with `half`, else as they are)."""
    state = {f"{part}.{k}": v for part, module in parts.networks.items() for k, v in module.state_dict().items()}
    out: dict[str, torch.Tensor] = {}
    fused: dict[str, list] = {}
    layout = file_layout(text_layout)
    for ours, implied in layout.implied.items():
        if ours in state and not torch.equal(state[ours].detach().cpu().float(), implied(state[ours].shape)):
            raise SingleFileError(
                f"{ours} has been changed, and a {layout.name} single file has no place for it (readers take it "
                "as it was); export a diffusers folder instead"
            )
    for ours, (original, slot) in original_names(parts, layout).items():
        tensor = state[ours].detach()
        if is_vae_attention_weight(original) and tensor.dim() == 2:
            tensor = tensor[:, :, None, None]
        if slot is None or slot in (TRANSPOSED, SWAPPED):
            out[original] = tensor if slot is None else tensor.T if slot == TRANSPOSED else swapped_halves(tensor)
        else:
            fused.setdefault(original, [None] * 3)[slot] = tensor
    out.update({k: torch.cat(chunks) for k, chunks in fused.items()})
    if layout.placeholders is not None:  # `save_single_file` writes the real ones where the source file gave them
        out.update(layout.placeholders(parts, out))
    dtype = torch.float16 if half else None
    return {k: v.to(dtype=dtype or v.dtype).contiguous() for k, v in out.items()}


def save_single_file(parts: Parts, path: str | Path, half: bool = False, text_layout: str | None = None) -> Path:
    """Write `parts` as an original Stable Diffusion single file: `.safetensors` (default) or `.ckpt`.

    The file carries our part configs as metadata, so it reads back exactly, architecture and all; the
    tensors of the file the parts were read from that no part holds come back too (`ldm.weights.extras`).
    The text encoder's layout is `text_layout`, else the family's, else that of the file the parts were read from.
    Where a family needs it, the original YAML goes beside it first (`config_beside`), so a published file has it.
    """
    family, extras = family_of(parts), extras_of(parts)
    architecture = architecture_of(parts)
    if not architecture.layouts:
        raise SingleFileError(f"ldm writes no {architecture.title} single file yet; export a diffusers folder")
    own = architecture.layouts[0].name
    layout = text_layout or (family.text_layout if family else extras.text_layout if extras else own)
    state, written = to_original(parts, layout, half), file_layout(layout)
    state.update({k: v for k, v in writable(parts, half).items() if k not in state or k in written.placeholder_keys})
    schedule = parts.scheduler.config
    state.update({k: torch.tensor([]) for k, (key, value) in written.markers.items() if schedule.get(key) == value})
    meta = {
        "family": family.name if family else "custom",
        "text_layout": layout,
        "prediction_type": scheduler_prediction(parts.scheduler),
        "parts": describe_parts(parts),
    }
    path = Path(path)
    if path.suffix != ".safetensors" and path.suffix not in PICKLE_SUFFIXES:
        raise SingleFileError(f"{path}: a single file ends in .safetensors (recommended) or .ckpt")
    yaml = config_beside(path, family)
    if yaml is not None:
        with atomic_path(yaml) as partial:
            partial.write_bytes((CONFIGS / "original" / family.original_config).read_bytes())
        log.info(
            "%s: the original config beside it, for tools that cannot tell %s from the weights", yaml, family.title
        )
    with atomic_path(path) as partial:
        if path.suffix == ".safetensors":
            from safetensors.torch import save_file

            header = {"format": "pt", METADATA_KEY: json.dumps(meta), **modelspec(parts, family, path.stem)}
            save_file(state, str(partial), metadata=header)
        else:
            torch.save({"state_dict": state, METADATA_KEY: meta}, partial)
    return path


def config_beside(path: str | Path, family: Family | None) -> Path | None:
    """Where the original YAML of a single file of `family` goes (`<stem>.yaml`, where AUTOMATIC1111 looks
    first), or None where no tool needs it.

    It is needed where another family has the same architecture and a different prediction type: A1111 then
    guesses the type by running the UNet on a test input, and ComfyUI by the spread of one bias. A family alone
    in its layout needs none, nor does a custom architecture, which has no original YAML."""
    if family is None or family.original_config is None:
        return None
    twins = [f for f in FAMILIES.values() if f.text_layout == family.text_layout and f.name != family.name]
    if not any(f.prediction_type != family.prediction_type for f in twins):
        return None
    return Path(path).with_suffix(".yaml")


def modelspec(parts: Parts, family: Family | None, title: str) -> dict[str, str]:
    """The Stability AI model spec keys (`modelspec.*`) of a single file of `family`: its required keys,
    resolution and prediction type; none for a custom architecture, which has no architecture id."""
    if family is None:
        return {}
    size = parts.unet.config.sample_size * vae_downscale(parts.vae.config)
    spec = {
        "modelspec.sai_model_spec": "1.0.0",
        "modelspec.architecture": family.modelspec,
        "modelspec.implementation": MODELSPEC_IMPLEMENTATION,
        "modelspec.title": title,
        "modelspec.resolution": f"{size}x{size}",
    }
    if family.prediction_type != "flow":  # the spec has no name for flow matching's velocity
        spec["modelspec.prediction_type"] = "v" if family.prediction_type == "v_prediction" else "epsilon"
    return spec


# ---------------------------------------------------------------------------------------------- reading


def read_single_file(path: str | Path, trust_pickle: bool = False) -> tuple[Mapping[str, torch.Tensor], dict, Any]:
    """(state dict, our metadata or {}, global_step or None) of a single file, without running code from it.

    A `.safetensors` file's state is a `TensorFile`: each tensor is read when it is looked up."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no such file: {path}")
    if path.suffix == ".safetensors":
        from safetensors import SafetensorError

        try:
            state = TensorFile(path)
        except (SafetensorError, OSError) as err:
            raise SingleFileError(f"{path}: not a readable safetensors file ({err})") from None
        return state, json.loads(state.metadata.get(METADATA_KEY, "{}")), None
    if path.suffix not in PICKLE_SUFFIXES:
        raise SingleFileError(f"{path}: expected a .safetensors or .ckpt file")
    try:
        return split_pickle(load_pickle(path, trust_pickle), path)
    except ValueError as err:
        raise SingleFileError(str(err)) from None


def split_pickle(obj: Any, path: Path) -> tuple[dict[str, torch.Tensor], dict, Any]:
    """(state dict, our metadata or {}, global_step or None) of a loaded pickle checkpoint."""
    if not isinstance(obj, dict):
        raise SingleFileError(f"{path}: holds a {type(obj).__name__}, not a state dict")
    state = obj.get("state_dict", obj)
    return state, obj.get(METADATA_KEY) or {}, obj.get("global_step")


def load_single_file(
    path: str | Path,
    ema: bool = False,
    family: str | None = None,
    trust_pickle: bool = False,
    loaded: tuple = (),
    dtypes: Mapping[str, torch.dtype] | None = None,
    keep_extras: bool = True,
    part_files: Mapping[str, str | Path] | None = None,
) -> tuple[Parts, str]:
    """Parts from an original single file, and a line saying which family was detected and how.

    Each network is read straight into its dtype in `dtypes` (by part name; float32 where not given), tensor by
    tensor. `loaded` is the file's `(state, metadata, global_step)` where the caller has read it already. The
    tensors no part holds are kept with the parts (`ldm.weights.extras`) unless `keep_extras` is False (a
    training run, which reads them again from the file when it exports). `part_files` are files of one text
    encoder's weights each (transformers' names; ComfyUI's `clip_l.safetensors`, say), read in place of the
    file's copy, or where its layout lets a file lack that encoder."""
    path = Path(path)
    state, metadata, global_step = loaded or read_single_file(path, trust_pickle)
    detected, how = detect_family(state, metadata, global_step, family, where=str(path))
    parts = parts_from_description(metadata["parts"] if metadata.get("parts") else family_description(detected))
    layout = metadata.get("text_layout") or detected.text_layout
    weights = _with_part_files(state, parts, file_layout(layout), dict(part_files or {}), path)
    _load_original(parts, _with_ema(weights, path) if ema else weights, layout, path, dtypes or {})
    extras = {}
    if keep_extras:
        extras = {k: v for k in extra_keys(state, parts, layout, ema) if isinstance(v := state[k], torch.Tensor)}
    attach(parts, extras_read_with(parts, extras, str(path), layout))
    title = detected.title if detected else "a custom architecture"
    prediction = scheduler_prediction(parts.scheduler)
    kept = f"; {len(extras)} tensors no part holds kept beside them" if extras else ""
    return parts, f"{path}: {title} ({prediction}), {how}{kept}"


def extra_keys(keys: Iterable[str], parts: Parts, layout: str, ema: bool = False) -> list[str]:
    """The keys of an original state dict that `parts` do not take: the extras, written back on export.

    With `ema`, the UNet takes the EMA copy; the raw weights it replaces are not kept, since they could
    come back only by displacing the weights the user chose (readers load `model.diffusion_model.*`)."""
    used = {original for original, _ in original_names(parts, file_layout(layout)).values()}
    if ema:
        used |= {ema_name(k) for k in used if k.startswith(UNET)}
    return [k for k in keys if k not in used]


def extras_from_file(path: str | Path, parts: Parts, ema: bool = False) -> Extras | None:
    """The extras of the single file `path` for `parts` made from it (a fine-tune, say), read again; None when
    `path` is one of our checkpoints or not the architecture of `parts`. Reads only the tensors it needs from
    a `.safetensors` file."""
    path = Path(path)
    with _tensors_of(path) as (keys, get):
        if keys is None:
            return None
        layout = layout_of_keys(keys)
        names = original_names(parts, file_layout(layout))
        present = set(keys)
        if any(original not in present for original, _ in names.values()):
            return None
        extras = Extras({k: get(k) for k in extra_keys(keys, parts, layout, ema)}, str(path), layout)
        if extras.ema:
            unet = sorted((k.removeprefix("unet."), o) for k, (o, _) in names.items() if k.startswith("unet."))
            extras.unet_fingerprint = fingerprint((k, get(ema_name(o) if ema else o)) for k, o in unet)
    return extras


@contextlib.contextmanager
def _tensors_of(path: Path) -> Iterator[tuple[list[str] | None, Callable[[str], torch.Tensor]]]:
    """(keys, key -> tensor) of a single file: lazily from safetensors; (None, ...) for one of our checkpoints."""
    if path.suffix == ".safetensors":
        tensors = TensorFile(path)
        yield list(tensors), tensors.__getitem__
        tensors.close()
        return
    obj = load_pickle(path)
    if is_our_checkpoint(obj):
        yield None, dict.__getitem__
        return
    state = split_pickle(obj, path)[0]
    yield [k for k, v in state.items() if isinstance(v, torch.Tensor)], state.__getitem__


def _with_part_files(
    state: Mapping[str, torch.Tensor], parts: Parts, layout: FileLayout, files: dict[str, str | Path], path: Path
) -> Mapping[str, torch.Tensor]:
    """`state` with each text encoder in `files` read from its own file, under the layout's names; a text encoder
    the layout lets a file lack and that neither has is an error saying how to give it."""
    joined: dict[str, tuple[Mapping, str]] = {}
    names: dict[str, tuple[str, int | None]] = {}  # the layout's names, made once a part file needs them
    for part, prefix, kind in layout.text:
        if part not in files:
            if part in layout.optional and not any(k.startswith(prefix) for k in state):
                raise SingleFileError(
                    f"{path} holds no {part} ({prefix}*): give its weights in a file of their own, "
                    f"model.params.part_weights.{part}=FILE in training, --part {part}=FILE to convert "
                    "(ComfyUI keeps them in models/text_encoders/)"
                )
            continue
        if kind != "hf":
            raise SingleFileError(f"the {layout.name} layout reads no {part} from a file of its own")
        source, _, _ = read_single_file(files[part])
        own = set(parts[part].state_dict())
        for key in source:  # transformers >= 5.6 writes a CLIPTextModel's names without `text_model.`
            name = key if key in own or "text_model." + key not in own else "text_model." + key
            joined[prefix + tied_name(name)] = (source, key)
        names = names or original_names(parts, layout)
        for ours, (original, _) in names.items():
            if ours.startswith(part + ".") and original not in joined:
                raise SingleFileError(
                    f"{part}'s own file {files[part]} has no {original.removeprefix(prefix)}; "
                    f"is it the weights of the {part}, in transformers' names?"
                )
    return Joined(state, joined) if joined else state


def _with_ema(state: Mapping[str, torch.Tensor], path: Path) -> Mapping[str, torch.Tensor]:
    """`state` whose UNet weights read the EMA weights stored beside them (`model_ema.<key without dots>`)."""
    ema = {}
    for key in state:
        if key.startswith(UNET):
            flat = ema_name(key)
            if flat not in state:
                raise SingleFileError(
                    f"{path}: has no EMA weights ({flat} missing); its UNet weights may be the EMA ones already "
                    "(as in *-emaonly files): drop the EMA setting"
                )
            ema[key] = flat
    return Renamed(state, ema)


def _load_original(parts: Parts, state: Mapping, layout: str, path: Path, dtypes: Mapping[str, torch.dtype]) -> None:
    """Load an original-layout state dict into `parts` (built on the meta device), each part's floating-point
    weights in its dtype in `dtypes` (float32 where not given). Each weight is read, reshaped and cast on its
    own, into memory of its own: no part is ever held in another dtype, nor the file's tensors beside it."""
    by_part: dict[str, dict] = {name: {} for name in parts.networks}
    shapes = {part: {k: v.shape for k, v in getattr(parts, part).state_dict().items()} for part in by_part}
    last: tuple[str, torch.Tensor] | None = None  # the fused q/k/v weight just read, for its next two slots
    written = file_layout(layout)
    for ours, implied in written.implied.items():
        part, _, key = ours.partition(".")
        if part in by_part:
            by_part[part][key] = implied(shapes[part][key]).to(dtypes.get(part, torch.float32))
    for ours, (original, slot) in original_names(parts, written).items():
        if original not in state:
            raise SingleFileError(f"{path}: missing weight {original} (for {ours}); is it a complete checkpoint?")
        tensor = last[1] if last is not None and last[0] == original else state[original]
        last = (original, tensor) if slot is not None and slot not in (TRANSPOSED, SWAPPED) else None
        if slot == TRANSPOSED:
            tensor = tensor.T
        elif slot == SWAPPED:
            tensor = swapped_halves(tensor)
        elif slot is not None:
            tensor = tensor.chunk(3)[slot]
        part, _, key = ours.partition(".")
        expected = shapes[part][key]
        if is_vae_attention_weight(original) and tensor.dim() == 4:
            tensor = tensor[:, :, 0, 0]
        if tensor.shape != expected:
            raise SingleFileError(
                f"{path}: {original} has shape {tuple(tensor.shape)}, but the detected architecture expects "
                f"{tuple(expected)}; the file is not the family it looks like"
            )
        dtype = dtypes.get(part, torch.float32) if tensor.is_floating_point() else tensor.dtype
        # A copy, always: its own contiguous storage (savers refuse tensors that share one), not the file's map
        by_part[part][key] = tensor.to(dtype, memory_format=torch.contiguous_format, copy=True)
    del last
    for part, part_state in by_part.items():
        module = getattr(parts, part)
        module.load_state_dict(part_state, assign=True)
        module.eval()
