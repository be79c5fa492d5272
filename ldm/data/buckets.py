"""Aspect-ratio buckets: batches of one image shape each, so photos keep their composition instead of being
cropped to a square (NovelAI's aspect-ratio bucketing, as kohya-ss/sd-scripts and most fine-tuning tools offer it).

`bucket_shapes` lists the shapes at a target area: sides that are multiples of `step` (64 px: a UNet's latent
grid halves three times), aspects from 1:`max_aspect` to `max_aspect`:1. Each image goes to the shape nearest its
own aspect (`nearest_shape`); a bucket with fewer images than a global batch is merged into its neighbour in
aspect (`assign_buckets`). `BucketBatchSampler` deals batches of one bucket each, in an order that is a function
of the seed and the epoch alone, and starts mid-epoch on resume.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterator, Sequence
from typing import TypedDict

import torch
from torch.utils.data import Sampler

from ldm.config import ConfigError

log = logging.getLogger(__name__)

Shape = tuple[int, int]  # (height, width) in pixels


class Buckets(TypedDict, total=False):
    """`data.params.buckets`: the shapes images are bucketed into, as a rule or listed."""

    area: int  # pixels per image; default: data.params.size squared
    step: int  # sides are multiples of this (default 64)
    max_aspect: float  # the longest side at most this many times the shortest (default 4)
    shapes: list[list[int]]  # or the [height, width] shapes themselves


def bucket_shapes(area: int, step: int = 64, max_aspect: float = 4.0) -> list[Shape]:
    """Every (height, width) with sides multiples of `step`, at most `area` pixels and as close to it as the
    step allows (for each width, the tallest height that fits), with an aspect within 1:max_aspect..max_aspect:1;
    sorted from tallest to widest."""
    shapes = set()
    for width in range(step, area // step + 1, step):
        height = area // width // step * step
        if height >= step and max(width / height, height / width) <= max_aspect:
            shapes.update({(height, width), (width, height)})
    return sorted(shapes, key=lambda shape: shape[1] / shape[0])


def shapes_from(buckets: Buckets, size: int, key: str = "data.params.buckets") -> list[Shape]:
    """The shapes `data.params.buckets` asks for (`size`: the square side, whose area is the default)."""
    unknown = set(buckets) - set(Buckets.__annotations__)
    if unknown:
        raise ConfigError(f"{key}.{sorted(unknown)[0]}: unknown; valid: {', '.join(Buckets.__annotations__)}")
    if buckets.get("shapes"):
        listed = [tuple(int(side) for side in shape) for shape in buckets["shapes"]]
        bad = [shape for shape in listed if len(shape) != 2 or min(shape) < 8 or any(side % 8 for side in shape)]
        if bad:
            raise ConfigError(f"{key}.shapes: {list(bad[0])} is not a [height, width] of multiples of 8 pixels")
        return sorted(set(listed), key=lambda shape: shape[1] / shape[0])
    area, step = int(buckets.get("area") or size * size), int(buckets.get("step", 64))
    max_aspect = float(buckets.get("max_aspect", 4.0))
    if step < 8 or step % 8:
        raise ConfigError(f"{key}.step: got {step}; must be a multiple of 8 (the VAE's downsampling)")
    if max_aspect < 1:
        raise ConfigError(f"{key}.max_aspect: got {max_aspect}; must be at least 1 (1: square only)")
    shapes = bucket_shapes(area, step, max_aspect)
    if not shapes:
        raise ConfigError(f"{key}: no shape of sides multiple of {step} fits in an area of {area} pixels")
    return shapes


def nearest_shape(height: int, width: int, shapes: Sequence[Shape]) -> int:
    """The index of the shape in `shapes` whose aspect is nearest the image's (in log ratio; the larger on a
    tie)."""
    aspect = math.log(width / height)
    return min(range(len(shapes)), key=lambda i: (abs(math.log(shapes[i][1] / shapes[i][0]) - aspect),
                                                  -shapes[i][0] * shapes[i][1]))  # fmt: skip


def assign_buckets(sizes: Sequence[Shape], shapes: Sequence[Shape], min_count: int) -> list[int]:
    """For each image of (height, width) `sizes`, the index in `shapes` of its bucket: the nearest aspect, then
    every bucket holding fewer than `min_count` images (one global batch) merged into its nearest neighbour in
    aspect, the smallest first, each merge logged. Fewer than `min_count` images in all end in one bucket."""
    bucket = [nearest_shape(h, w, shapes) for h, w in sizes]
    aspect = [math.log(w / h) for h, w in shapes]
    while True:
        counts = {b: bucket.count(b) for b in set(bucket)}
        small = [b for b, n in counts.items() if n < min_count]
        if not small or len(counts) == 1:
            return bucket
        merged = min(small, key=lambda b: (counts[b], b))
        into = min((b for b in counts if b != merged), key=lambda b: (abs(aspect[b] - aspect[merged]), -counts[b]))
        log.info(
            "buckets: %d image(s) of %s merged into %s (%d): fewer than a global batch of %d",
            counts[merged],
            "x".join(map(str, shapes[merged])),
            "x".join(map(str, shapes[into])),
            counts[into],
            min_count,
        )
        bucket = [into if b == merged else b for b in bucket]


class BucketBatchSampler(Sampler[list]):
    """Batches of one bucket each, for `rank` of `world_size` processes, resumable mid-epoch.

    Each epoch, from (seed, epoch) alone: every bucket's indices are shuffled and cut into global batches
    (`batch_size` x `world_size`; a bucket's remainder waits for another epoch), the global batches are
    shuffled, and each process takes its `batch_size` slice of each. Yields lists of `(index, drop_caption,
    augment_seed)`, as `ResumableSampler` yields them one by one; `sampler` holds the epoch and the resume
    position (Lightning calls its `set_epoch`)."""

    def __init__(self, sampler, buckets: Sequence[int], batch_size: int) -> None:
        self.sampler, self.buckets, self.batch_size = sampler, torch.as_tensor(list(buckets)), batch_size
        if len(self.buckets) != sampler.size:
            raise ValueError(f"buckets: {len(self.buckets)} bucket ids for {sampler.size} examples")
        self.global_batch = batch_size * sampler.world_size
        counts = torch.bincount(self.buckets)
        self.batches = int((counts // self.global_batch).sum())
        if self.batches == 0:
            raise ConfigError(
                f"data.params.batch_size: no bucket holds a global batch of {self.global_batch} images "
                f"({sampler.size} in all); lower data.params.batch_size"
            )

    def __len__(self) -> int:
        return self.batches

    def __iter__(self) -> Iterator[list[tuple[int, bool, int]]]:
        s = self.sampler
        order, drop, augment_seeds = s.draws()
        g = torch.Generator().manual_seed(s.seed * 100_003 + s.epoch + 1)  # not the sampler's stream: it is used
        global_batches = []
        for bucket in torch.unique(self.buckets).tolist():
            members = order[self.buckets[order] == bucket]  # in the epoch's shuffled order
            whole = len(members) // self.global_batch * self.global_batch
            global_batches += list(members[:whole].split(self.global_batch))
        if s.shuffle:
            global_batches = [global_batches[i] for i in torch.randperm(len(global_batches), generator=g).tolist()]
        start = s.take_resume()
        for batch in global_batches[start:]:
            mine = batch[s.rank * self.batch_size : (s.rank + 1) * self.batch_size].tolist()
            yield [(i, bool(drop[i]), int(augment_seeds[i])) for i in mine]
