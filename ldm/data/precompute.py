"""Encode a dataset once into precomputed shards (`ldm.data.shards`): in chunks, resumably, over several processes.

The distinct examples (a kohya folder's repeats once each) are split in chunks of `chunk_size`. Chunk k is the
MDS folder `OUT/chunk-{k:05d}/`, written by process k % world_size, so the output does not depend on how many
processes wrote it. A chunk is finished when its `index.json` exists (the writer writes it last): a restart
skips finished chunks and redoes the others. Once every chunk is written, the first process merges their
indexes into `OUT/index.json` and writes the manifest, the empty caption's conditioning and `bad_samples.tsv`.
Undecodable images are skipped, not replaced, and listed there (`path<TAB>reason`).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors.torch import save_file
from streaming.base.util import merge_index
from torch.utils.data import DataLoader, Dataset, Subset

from ldm.components import Parts
from ldm.components.describe import describe_parts
from ldm.data import _once_each
from ldm.data.chunks import CHUNK, CHUNK_NAME, CHUNK_STATS, INDEX, ChunkWriter, shard_bytes
from ldm.data.folder import BAD_SAMPLES, FolderDataset
from ldm.data.images import BadImage
from ldm.data.shard_format import FORMAT_VERSION, MANIFEST, UNCONDITIONAL, columns, to_row

log = logging.getLogger(__name__)

# Config entries that say where and by which library version a part was loaded, not what it computes.
PROVENANCE = ("transformers_version", "torch_dtype")


class PrecomputeError(ValueError):
    """What is wrong with the arguments or the output folder, in one line that says what to do."""


@dataclass
class Cost:
    """What one precompute run did: examples encoded, bad files skipped, shard bytes written, wall seconds."""

    examples: int
    skipped: int
    bytes: int
    seconds: float

    @property
    def images_per_second(self) -> float:
        return self.examples / self.seconds if self.seconds else 0.0

    def __str__(self) -> str:
        return (
            f"precompute: {self.examples} examples encoded, {self.skipped} skipped, "
            f"{self.images_per_second:.1f} images/s, {self.bytes / 1e9:.3g} GB written, {self.seconds:.1f} s"
        )


def precompute(
    model: Any,
    dataset: Dataset,
    out: Path,
    source: str,
    chunk_size: int = 4096,
    batch_size: int = 32,
    num_workers: int = 0,
    rank: int = 0,
    world_size: int = 1,
    shard_bytes: int = 1 << 26,
    min_bucket: int = 1,
) -> Cost:
    """Encode each distinct example of `dataset` with `model`'s VAE and text encoder into MDS shards in `out`.

    `model` is a `LatentDiffusion` on its device. Its `sample_latents` is switched on: the shards keep the
    posterior's deviation for models that draw from it and models that train on the mean alike (the manifest
    records the config's choice). A dataset's random crop and flip are switched off: the shards hold the
    centre crop. With `world_size` > 1, every process calls this with its `rank`, in a `torch.distributed`
    process group (for the barrier before the merge). Returns this run's cost; a finished `out` is re-merged.

    A dataset with aspect-ratio buckets (`data.params.buckets`) is written one bucket per subfolder,
    `out/HxW/`, each a shard folder of its own, latents at the bucket's shape; buckets of fewer than
    `min_bucket` images join their neighbour. `out`'s manifest lists them (`buckets`), and training deals
    batches of one bucket each (`ldm.data.shards`)."""
    if chunk_size < 1 or batch_size < 1:
        raise PrecomputeError(f"--chunk-size and --batch-size: must be at least 1; got {chunk_size}, {batch_size}")
    _centre_crop(dataset, rank)
    settings = (chunk_size, batch_size, num_workers, rank, world_size, shard_bytes)
    if getattr(dataset, "shapes", None) is None:
        return _precompute(model, dataset, _distinct_indices(dataset), Path(out), source, *settings)
    bucket_of = dataset.assign_buckets(min_bucket)
    members: dict[int, list[int]] = {}
    for index in _distinct_indices(dataset):
        members.setdefault(bucket_of[index], []).append(index)
    folders, costs = {}, []
    for bucket in sorted(members):
        height, width = dataset.shapes[bucket]
        folders[f"{height}x{width}"] = [height, width]
        costs.append(_precompute(model, dataset, members[bucket], Path(out) / f"{height}x{width}", source, *settings))
    if rank == 0:
        _finish_buckets(Path(out), folders)
    return Cost(*(sum(getattr(c, field) for c in costs) for field in ("examples", "skipped", "bytes", "seconds")))


def _precompute(
    model: Any,
    dataset: Dataset,
    indices: list[int],
    out: Path,
    source: str,
    chunk_size: int,
    batch_size: int,
    num_workers: int,
    rank: int,
    world_size: int,
    shard_bytes: int,
) -> Cost:
    """`precompute` of the dataset's examples `indices` into the shard folder `out`."""
    started = time.monotonic()
    chunks = [indices[i : i + chunk_size] for i in range(0, len(indices), chunk_size)]
    finished = _check_out(out, source, chunk_size, len(indices))
    if world_size > 1:
        dist.barrier()  # every process has seen the same finished chunks before any writes
    if finished and rank == 0:
        log.info("precompute: %d of %d chunks already written in %s", len(finished), len(chunks), out)
    pending = [k for k in range(len(chunks)) if k % world_size == rank and k not in finished]
    for k in pending:
        shutil.rmtree(out / CHUNK.format(k), ignore_errors=True)  # an unfinished chunk, redone from its start
    record = {"source": source, "chunk_size": chunk_size, "dataset_size": len(indices)}
    sample_latents = model.sample_latents
    model.eval()
    model.sample_latents = True
    unconditional = {name: value[0].float().cpu() for name, value in _encode_text(model, [""]).items()}
    if pending:
        items = [(k, index) for k in pending for index in chunks[k]]
        writer = ChunkWriter(out, columns(list(unconditional)), shard_bytes, record, len(chunks))
        loader = DataLoader(_Loading(dataset, items), batch_size=batch_size, num_workers=num_workers,
                            collate_fn=_collate, generator=torch.Generator())  # fmt: skip
        with writer:
            waited = time.monotonic()
            for batch in loader:
                _write_batch(model, batch, writer, source)
                now = time.monotonic()
                writer.charge(now - waited)  # loading, encoding and writing the batch
                waited = now
    if world_size > 1:
        dist.barrier()  # every chunk is written
    fresh = [k for k in range(len(chunks)) if k not in finished]
    cost = _cost(out, fresh, time.monotonic() - started)
    if rank == 0:
        _finish(model, out, source, len(chunks), unconditional, sample_latents)
    return cost


def _centre_crop(dataset: Dataset, rank: int) -> None:
    """Switch a dataset's random crop and flip off (stated policy: the shards hold the centre crop, unflipped)."""
    if getattr(dataset, "random_crop", False) or getattr(dataset, "flip", False):
        if rank == 0:
            log.info(
                "precompute: the data's random_crop / flip do not apply; the shards hold the centre crop, unflipped"
            )
        dataset.random_crop = dataset.flip = False


def _distinct_indices(dataset: Dataset) -> list[int]:
    """The index of each distinct example once (a kohya folder serves some several times an epoch)."""
    once, _ = _once_each(dataset)
    indices = list(once.indices) if isinstance(once, Subset) else list(range(len(dataset)))
    if not indices:
        raise PrecomputeError("data: the dataset is empty; check data.params (root, files, captions)")
    return indices


def _check_out(out: Path, source: str, chunk_size: int, dataset_size: int) -> set[int]:
    """The finished chunks of `out`, after checking that it is new, empty or a precompute of the same data."""
    if out.exists() and not out.is_dir():
        raise PrecomputeError(f"--out: {out} is a file; pass a folder for the shards")
    if not out.is_dir() or not any(out.iterdir()):
        return set()
    chunk_folders = [p for p in out.iterdir() if p.is_dir() and CHUNK_NAME.fullmatch(p.name)]
    if not (out / MANIFEST).is_file() and not chunk_folders:
        raise PrecomputeError(
            f"--out: {out} is not empty and holds no precompute output ({MANIFEST}, chunk-NNNNN/); "
            "refusing to write into it: pass a new or empty folder"
        )
    written = [json.loads((out / MANIFEST).read_text())] if (out / MANIFEST).is_file() else []
    written += [json.loads((f / CHUNK_STATS).read_text()) for f in sorted(chunk_folders) if (f / INDEX).is_file()]
    for stats in written:
        if stats["source"] != source:
            raise PrecomputeError(
                f"--out: {out} holds shards of another source {stats['source']!r}; pass --source "
                f"{stats['source']} to continue it, or a new --out folder for source {source!r}"
            )
        if stats["chunk_size"] != chunk_size:
            raise PrecomputeError(
                f"--chunk-size: {out} is written in chunks of {stats['chunk_size']} examples, not {chunk_size}; "
                f"pass --chunk-size {stats['chunk_size']} to continue it"
            )
        if stats["dataset_size"] != dataset_size:
            raise PrecomputeError(
                f"--out: {out} holds shards of {stats['dataset_size']} distinct examples, but the data has "
                f"{dataset_size} now; precompute the changed data into a new --out folder"
            )
    return {int(f.name.split("-")[1]) for f in chunk_folders if (f / INDEX).is_file()}


class _Loading(Dataset):
    """`(chunk, dataset index)` items loaded for encoding, with their keys; a bad image comes back as
    example None, with its `path<TAB>reason` line for the listing."""

    def __init__(self, dataset: Dataset, items: list[tuple[int, int]]) -> None:
        self.dataset, self.items = dataset, items

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, item: int) -> dict[str, Any]:
        chunk, index = self.items[item]
        key, path = str(index), None
        if isinstance(self.dataset, FolderDataset):
            path = self.dataset.examples[self.dataset.example_index[index]][0]
            key = Path(os.path.relpath(path, self.dataset.root)).as_posix()
        load = getattr(self.dataset, "load", None)
        try:
            example = load(index, seed=index) if callable(load) else self.dataset[index]
        except BadImage as err:
            return {"chunk": chunk, "key": key, "example": None, "bad": f"{path or key}\t{err}"}
        return {"chunk": chunk, "key": key, "example": example, "bad": None}


def _collate(items: list[dict[str, Any]]) -> dict[str, Any]:
    """The batch's good examples' pixels stacked; every item (bad ones included) kept in order."""
    good = [item["example"] for item in items if item["example"] is not None]
    pixels = torch.stack([example["pixel_values"] for example in good]) if good else None
    return {"items": items, "pixel_values": pixels}


def _encode_text(model: Any, captions: list[str]) -> dict[str, torch.Tensor]:
    with torch.no_grad():
        return model.encode_text(captions)


@torch.no_grad()
def _write_batch(model: Any, batch: dict[str, Any], writer: ChunkWriter, source: str) -> None:
    """Encode a batch's good examples and write every item, in order, to its chunk (bad ones to its listing)."""
    good = [item for item in batch["items"] if item["example"] is not None]
    if good:
        pixels = batch["pixel_values"]
        mean, std = (t.to("cpu", torch.float16) for t in model.encode_posterior(pixels))
        cond = _encode_text(model, [item["example"]["caption"] for item in good])
        cond = {name: value.to("cpu", torch.float16) for name, value in cond.items()}
        writer.shapes = {"latent_shape": list(mean.shape[1:]), "image_size": list(pixels.shape[-2:])}
    rows = iter(range(len(good)))
    for item in batch["items"]:
        if item["example"] is None:
            writer.skip(item["chunk"], item["bad"])
            continue
        i, example = next(rows), item["example"]
        size = tuple(example.get("original_size", pixels.shape[-2:]))  # a dataset without it serves images unresized
        crop = tuple(example.get("crop_top_left", (0, 0)))
        cond_i = {name: value[i] for name, value in cond.items()}
        writer.write(
            item["chunk"], to_row(mean[i], std[i], cond_i, example["caption"], size, crop, source, item["key"])
        )


def _cost(out: Path, chunks: list[int], seconds: float) -> Cost:
    """This run's cost: what the chunks it wrote hold, and how long it took."""
    folders = [out / CHUNK.format(k) for k in chunks]
    stats = [json.loads((folder / CHUNK_STATS).read_text()) for folder in folders]
    written = sum(shard_bytes(json.loads((folder / INDEX).read_text())) for folder in folders)
    return Cost(sum(s["examples"] for s in stats), sum(s["skipped"] for s in stats), written, seconds)


def _finish(
    model: Any, out: Path, source: str, chunks: int, unconditional: dict[str, torch.Tensor], sample_latents: bool
) -> None:
    """Merge the chunks' indexes and write the manifest, the empty caption's conditioning and the bad files."""
    (out / INDEX).unlink(missing_ok=True)  # merge_index will not replace one
    logging.disable(logging.WARNING)  # merge_index warns that `out` is not empty, and where its temporary files go
    try:
        merge_index(str(out), keep_local=True)
    finally:
        logging.disable(logging.NOTSET)
    folders = [out / CHUNK.format(k) for k in range(chunks)]
    stats = [json.loads((folder / CHUNK_STATS).read_text()) for folder in folders]
    bad = "".join((f / BAD_SAMPLES).read_text(encoding="utf-8") for f in folders if (f / BAD_SAMPLES).is_file())
    if bad:
        (out / BAD_SAMPLES).write_text(bad, encoding="utf-8")
    save_file({name: value.contiguous() for name, value in unconditional.items()}, str(out / UNCONDITIONAL))
    first = next((s for s in stats if "latent_shape" in s), {})
    seconds = sum(s["seconds"] for s in stats)
    count = sum(s["examples"] for s in stats)
    manifest = {
        "format": FORMAT_VERSION,
        "source": source,
        "count": count,
        "skipped": sum(s["skipped"] for s in stats),
        "conditioning": model.conditioning,
        "cond_shapes": {name: list(value.shape) for name, value in unconditional.items()},
        "latent_shape": first.get("latent_shape"),
        "scaling_factor": model.latent_scale,
        "shift_factor": model.latent_shift,
        "sample_latents": sample_latents,
        "resolution": first.get("image_size"),
        "encoders": _describe_encoders(model),
        "chunk_size": stats[0]["chunk_size"],
        "dataset_size": stats[0]["dataset_size"],
        "chunks": chunks,
        "bytes": shard_bytes(json.loads((out / INDEX).read_text())),
        "seconds": seconds,  # loading + encoding time summed over the chunks (and so over processes)
        "images_per_second": count / seconds if seconds else 0.0,  # per process
    }
    (out / MANIFEST).write_text(json.dumps(manifest, indent=1))


def _finish_buckets(out: Path, folders: dict[str, list[int]]) -> None:
    """`out`'s manifest for bucket subfolders: what they share (encoders, conditioning, ...) and each bucket's
    folder, image shape, latent shape and count; the empty caption's conditioning beside it."""
    manifests = {folder: json.loads((out / folder / MANIFEST).read_text()) for folder in folders}
    first = next(iter(manifests.values()))
    buckets = [{"folder": folder, "shape": shape, "latent_shape": manifests[folder]["latent_shape"],
                "count": manifests[folder]["count"]} for folder, shape in folders.items()]  # fmt: skip
    shared = {k: v for k, v in first.items() if k not in ("latent_shape", "resolution", "chunks", "bytes")}
    totals = {key: sum(m[key] for m in manifests.values()) for key in ("count", "skipped", "dataset_size")}
    manifest = {**shared, **totals, "latent_shape": first["latent_shape"], "buckets": buckets}
    shutil.copyfile(out / next(iter(folders)) / UNCONDITIONAL, out / UNCONDITIONAL)
    (out / MANIFEST).write_text(json.dumps(manifest, indent=1))
    log.info("precompute: %d buckets (%s)", len(buckets), ", ".join(f"{b['folder']}: {b['count']}" for b in buckets))


def _describe_encoders(model: Any) -> dict:
    """The VAE's and text encoders' classes and configs (`describe_parts`), without where they were loaded from."""
    names = ("vae", *model.text_parts)
    described = describe_parts(Parts((name, part) for name, part in model.parts.networks.items() if name in names))
    for entry in described.values():
        entry["config"] = {k: v for k, v in entry["config"].items() if not k.startswith("_") and k not in PROVENANCE}
    return described
