"""Train from precomputed shards (`scripts/precompute.py`), streamed and mixed from several sources.

`ShardDataModule` reads the MDS shards of `ldm.data.shard_format` with mosaicml-streaming's `StreamingDataset`
(the `streaming-community` package): local folders, or object stores (`s3://`, `gs://`, ...) through the
library's own downloaders, credentials from the environment. Sources are mixed by `proportion`, `repeat` or
`choose`, as the library's `Stream`s weigh them.

The order is a function of the seed alone. The library shuffles the samples over `num_canonical_nodes`
canonical nodes, fixed by the config whatever the real node count, and its `random` batching method deals that
one global order out to the ranks, sample by sample: at global batch B, step N trains on samples N*B to
(N+1)*B - 1 of the order, however many processes share them (1 at batch 16 and 2 at batch 8 train on the same
16). Caption dropout is drawn from (seed, epoch, sample), and each sample carries its `sample_id`, from which
the model keys its noise (`LatentDiffusion.draws`): not from a rank's random state. Checkpoints hold the
position in that order as a global sample offset: a resumed run continues with the samples an unbroken run saw,
on any number of processes at the same global batch.

A source precomputed with aspect-ratio buckets (`OUT/HxW/` shard folders, listed in its manifest) is read as
one stream per bucket, weighted by its share of the source, with the library's `per_stream` batching: every
global batch comes from one bucket, in an order that is again a function of the seed alone.

The examples hold the latents and the text conditioning, so the VAE encoder and the text encoder do not run
in training; the model still loads them, frozen: sample grids and exports use them.

The library keeps a run's shared state in blocks under /dev/shm and lock files in the temporary folder. A run
whose processes are all killed at once (a node lost, a job cancelled) cannot remove them: the blocks hold
memory, and the library refuses to start again on a remote source's cache they name. The next run frees the
ones of its own sources that no process maps any more (`ldm.data.leftovers`).
"""

from __future__ import annotations

import logging
import os
import tempfile
from pathlib import Path
from typing import Any, TypedDict

import lightning.pytorch as pl
import numpy as np

try:
    from streaming import Stream, StreamingDataset
    from streaming.base.storage import CloudDownloader
except ImportError as err:  # not installed, or its torchvision does not match torch
    raise ImportError(
        f"{err}; training from shards needs the pretrain extra: pip install -e '.[pretrain]' (streaming-community, "
        "which imports torchvision: install the torchvision release that matches your torch)"
    ) from err

from ldm.config import ConfigError
from ldm.data import trainer_position
from ldm.data.leftovers import SHARED_MEMORY, free_stale_shared_memory
from ldm.data.shard_format import MANIFEST, UNCONDITIONAL, read_manifest, read_unconditional, to_example
from ldm.data.shard_loader import ShardLoader

log = logging.getLogger(__name__)

# Manifest entries that must agree between sources: shards of other encoders cannot be trained together.
MUST_AGREE = ("conditioning", "cond_shapes", "scaling_factor", "shift_factor", "encoders")
UNRECORDED = {"shift_factor": 0.0}  # what a manifest from before an entry was recorded meant


class Source(TypedDict, total=False):
    """`data.params.sources[i]`: one folder of shards and its weight in the mix."""

    path: str  # a local folder, or a remote URI (s3://, gs://, oci://, ...)
    name: str  # default: the folder's name
    proportion: float  # the share of each epoch drawn from this source
    repeat: float  # or: how many times each of its samples is seen per epoch
    choose: int  # or: how many of its samples per epoch
    cache: str  # where a remote source's shards are kept (default: data.params.cache_dir/NAME); with a local
    # path, the path is read as a remote and copied here


class _LatentShards(StreamingDataset):
    """The shards' samples as training examples, the caption dropped by a draw from (seed, epoch, sample)."""

    def __init__(self, *, unconditional: dict, caption_dropout: float, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.unconditional, self.caption_dropout = unconditional, caption_dropout

    def get_item(self, sample_id: int, retry: int = 7) -> dict:
        sample = super().get_item(sample_id, retry)
        dropped = False
        if self.caption_dropout:
            epoch = self.next_epoch - 1  # the epoch being iterated (the library advances it as iteration starts)
            dropped = np.random.default_rng((self.shuffle_seed, epoch, sample_id)).random() < self.caption_dropout
        # the id keys the sample's noise in training (`LatentDiffusion.draws`): the same at any world size
        return {**to_example(sample, self.unconditional if dropped else None), "sample_id": sample_id}

    def lock_files(self) -> list[Path]:
        """The lock files the library made for this dataset in the temporary folder (it never removes them)."""
        return [Path(self._shared_barrier.filelock_path), Path(self._cache_filelock_path)]


def _check_proportions(sources: list[dict]) -> None:
    """Proportions are shares of an epoch: every source has one or none does, and they add up to 1."""
    given = [i for i, source in enumerate(sources) if source.get("proportion") is not None]
    if not given:
        return
    if len(given) != len(sources):
        missing = ", ".join(f"sources[{i}]" for i in range(len(sources)) if i not in given)
        raise ConfigError(
            f"data.params.{missing}: no proportion, where other sources have one; give every source a proportion "
            "(shares of an epoch, adding up to 1), or weigh them all by repeat / choose"
        )
    shares = [float(sources[i]["proportion"]) for i in given]
    if any(share < 0 for share in shares) or abs(sum(shares) - 1.0) > 1e-6:
        listed = " + ".join(f"{share:g}" for share in shares)
        raise ConfigError(
            f"data.params.sources: the proportions add up to {sum(shares):g} ({listed}), not 1; they are each "
            "source's share of an epoch"
        )


class ShardDataModule(pl.LightningDataModule):
    """Serve precomputed shards from `sources` to `LatentDiffusion`, mixed, in an order set by `seed` alone.

    `batch_size` is per process, as everywhere in Lightning: the global batch is `batch_size` x processes.
    `num_canonical_nodes` fixes the library's partition of the sample order: keep it the same across runs
    that should see the same order (resumes on other node counts included). `epoch_size` (samples per epoch)
    defaults to the weighted size of the sources.

    A resume on any number of processes at the same global batch continues the order exactly. One that cannot
    (another seed, sources, global batch, canonical nodes or epoch size) says so in one line and goes on from
    the same sample offset in the new order (`inexact_resume: warn`), or is refused (`refuse`).

    Before the library starts, each node's first process frees what killed runs left of these sources in shared
    memory (`free_stale_shared_memory`), while the others wait."""

    def __init__(
        self,
        sources: list[Source],
        batch_size: int = 1,
        num_workers: int = 0,
        shuffle: bool = True,
        seed: int = 0,
        caption_dropout: float = 0.0,
        cache_dir: str = "~/.cache/ldm/shards",
        num_canonical_nodes: int = 1,
        epoch_size: int | None = None,
        predownload: int | None = None,
        cache_limit: str | None = None,
        download_timeout: float = 60.0,
        inexact_resume: str = "warn",
        free_stale_shared_memory: bool = True,
    ) -> None:
        super().__init__()
        if inexact_resume not in ("warn", "refuse"):
            raise ConfigError(f"data.params.inexact_resume: got {inexact_resume!r}; valid: warn, refuse")
        if not sources:
            raise ConfigError("data.params.sources: empty; list at least one {path: FOLDER_OR_URI}")
        if not 0.0 <= caption_dropout <= 1.0:
            raise ConfigError(f"data.params.caption_dropout: got {caption_dropout}; must be in [0, 1]")
        for key, value, least in (("batch_size", batch_size, 1), ("num_canonical_nodes", num_canonical_nodes, 1)):
            if value < least:
                raise ConfigError(f"data.params.{key}: got {value}; must be at least {least}")
        if seed < 0:
            raise ConfigError(f"data.params.seed: got {seed}; must be 0 or more")
        self.sources = [self._check_source(i, dict(source)) for i, source in enumerate(sources)]
        names = [source["name"] for source in self.sources]
        if len(set(names)) != len(names):
            raise ConfigError(f"data.params.sources: two sources have the same name ({', '.join(names)}); name them")
        _check_proportions(self.sources)
        self.batch_size, self.num_workers, self.shuffle, self.seed = batch_size, num_workers, shuffle, seed
        self.caption_dropout, self.cache_dir = caption_dropout, Path(cache_dir).expanduser()
        self.num_canonical_nodes, self.epoch_size = num_canonical_nodes, epoch_size
        self.predownload, self.cache_limit, self.download_timeout = predownload, cache_limit, download_timeout
        self.inexact_resume, self.free_stale_shared_memory = inexact_resume, free_stale_shared_memory
        self.dataset: _LatentShards | None = None
        self.manifests: list[dict] = []

    @staticmethod
    def _check_source(i: int, source: dict) -> dict:
        key = f"data.params.sources[{i}]"
        if not source.get("path"):
            raise ConfigError(f"{key}.path: missing; a folder written by scripts/precompute.py, or its remote URI")
        weights = [k for k in ("proportion", "repeat", "choose") if source.get(k) is not None]
        if len(weights) > 1:
            raise ConfigError(f"{key}: give one of proportion, repeat, choose; got {', '.join(weights)}")
        remote = "://" in source["path"]
        if not remote and not Path(source["path"]).expanduser().is_dir():
            raise ConfigError(f"{key}.path: {source['path']} is not a folder")
        source.setdefault("name", Path(source["path"].rstrip("/")).name)
        return source

    def _stream(self, source: dict, bucket: dict | None = None, count: int = 0) -> Stream:
        """The library's stream of a source, or of one `bucket` of a bucketed source of `count` samples (its
        share of the source's weight): a local folder read in place, or a remote copied to its cache."""
        weights = {k: source[k] for k in ("proportion", "repeat", "choose") if source.get(k) is not None}
        sub = ""
        if bucket is not None:
            sub = bucket["folder"]
            share = bucket["count"] / count
            weights = {k: v if k == "repeat" else (v * share if k == "proportion" else round(v * share))
                       for k, v in weights.items()}  # fmt: skip
        if "://" in source["path"] or source.get("cache"):
            cache = Path(source.get("cache") or self.cache_dir / source["name"]).expanduser() / sub
            remote = source["path"].rstrip("/") + (f"/{sub}" if sub else "")
            return Stream(remote=remote, local=str(cache), download_timeout=self.download_timeout, **weights)
        return Stream(local=str(Path(source["path"]).expanduser() / sub), **weights)

    def _manifest(self, i: int, stream: Stream) -> dict:
        """A source's manifest and empty-caption conditioning, fetched into its cache first if it is remote."""
        local = Path(stream.local)
        if stream.remote is not None:
            local.mkdir(parents=True, exist_ok=True)
            for name in (MANIFEST, UNCONDITIONAL):
                if not (local / name).exists():
                    remote = os.path.join(stream.remote, name)  # as the library joins remote paths
                    try:
                        CloudDownloader.direct_download(remote, str(local / name), self.download_timeout)
                    except Exception as err:  # each store's client raises its own errors
                        raise ConfigError(
                            f"data.params.sources[{i}].path: cannot fetch {remote} ({type(err).__name__}: {err}); "
                            "is it a folder written by scripts/precompute.py, and are the store's credentials "
                            "in the environment?"
                        ) from None
        try:
            return {**read_manifest(local, f"data.params.sources[{i}].path"), "folder": local}
        except (FileNotFoundError, ValueError) as err:
            raise ConfigError(str(err)) from None

    def setup(self, stage: str) -> None:
        if self.dataset is not None:
            return
        self._tell_library_the_world()
        streams = [self._stream(source) for source in self.sources]
        self.manifests = [self._manifest(i, stream) for i, stream in enumerate(streams)]
        first = self.manifests[0]
        for i, manifest in enumerate(self.manifests[1:], start=1):
            for entry in MUST_AGREE:
                if manifest.get(entry, UNRECORDED.get(entry)) != first.get(entry, UNRECORDED.get(entry)):
                    raise ConfigError(
                        f"data.params.sources[{i}]: its shards were precomputed with another {entry} than "
                        f"sources[0]'s ({self.sources[i]['path']} vs {self.sources[0]['path']}); precompute both "
                        "with the same model config"
                    )
        bucketed = [i for i, manifest in enumerate(self.manifests) if manifest.get("buckets")]
        if bucketed:  # one stream per bucket; the library's per_stream batching keeps each batch to one
            streams = [
                stream
                for i, (source, manifest) in enumerate(zip(self.sources, self.manifests))
                for stream in (
                    [self._stream(source, bucket, manifest["count"]) for bucket in manifest["buckets"]]
                    if i in bucketed
                    else [streams[i]]
                )
            ]
        if self.free_stale_shared_memory:
            self._free_leftovers(streams)
        try:
            self.dataset = _LatentShards(
                streams=streams,
                batch_size=self.batch_size,
                shuffle=self.shuffle,
                shuffle_seed=self.seed,
                num_canonical_nodes=self.num_canonical_nodes,
                # one global order dealt to the ranks (the library's default, stated), or batches of one bucket
                batching_method="per_stream" if bucketed else "random",
                epoch_size=self.epoch_size,
                predownload=self.predownload or 8 * self.batch_size,  # the library's default, stated
                shuffle_block_size=max(4_000_000 // self.num_canonical_nodes, 1 << 18),  # likewise
                cache_limit=self.cache_limit,
                unconditional=read_unconditional(first["folder"]),
                caption_dropout=self.caption_dropout,
            )
        except ValueError as err:  # e.g. proportions given for some sources only
            raise ConfigError(f"data.params.sources: {err}") from None
        counts = ", ".join(f"{s['name']} {m['count']}" for s, m in zip(self.sources, self.manifests))
        log.info(
            "data: %d samples per epoch from %d source(s) (%s); the shards hold the latents and text states, so the "
            "VAE encoder and the text encoder do not run in training",
            self.dataset.epoch_size,
            len(streams),
            counts,
        )

    def teardown(self, stage: str) -> None:
        """Remove the library's lock files, which it leaves in the temporary folder after every run."""
        if self.dataset is not None:
            for path in self.dataset.lock_files():
                path.unlink(missing_ok=True)

    def _free_leftovers(self, streams: list[Stream]) -> None:
        """Each node's first process frees what killed runs of these sources left; every process then waits at a
        barrier: the library's processes each pick the first free prefix on their own, before its own barrier, so
        one that looked before the freeing would pick another than its node's first process, and wait for it."""
        trainer = self.trainer
        if trainer is None or trainer.local_rank == 0:
            freed = free_stale_shared_memory(streams)
            if freed:
                log.info(
                    "data: freed what %d killed run(s) left in %s and %s (the library's prefixes %s)",
                    len(freed),
                    SHARED_MEMORY,
                    tempfile.gettempdir(),
                    ", ".join(map(str, freed)),
                )
        if trainer is not None and trainer.world_size > 1:
            trainer.strategy.barrier("free_stale_shared_memory")

    def _tell_library_the_world(self) -> None:
        """The library learns its rank and world from environment variables alone (torchrun's); Lightning's own
        launcher and SLURM do not set them all, and every rank would read rank 0's samples. Set them from the
        trainer, which knows."""
        trainer = self.trainer
        if trainer is None or trainer.world_size == 1:  # the library's default: one process
            return
        world = {
            "RANK": trainer.global_rank,
            "WORLD_SIZE": trainer.world_size,
            "LOCAL_RANK": trainer.local_rank,
            "LOCAL_WORLD_SIZE": trainer.num_devices,
        }
        os.environ.update({name: str(value) for name, value in world.items()})

    def train_dataloader(self) -> ShardLoader:
        trainer = self.trainer
        if trainer is not None:  # the model is built by now
            self._check_fits(trainer.lightning_module)
        world_size = trainer.world_size if trainer else 1
        weights = ("name", "proportion", "repeat", "choose")  # not the path: a moved folder is the same source
        sources = [
            {**{k: source[k] for k in weights if source.get(k) is not None}, "samples": manifest["count"]}
            for source, manifest in zip(self.sources, self.manifests)
        ]
        order = {
            "seed": self.seed,
            "sources": sources,
            "global batch": self.batch_size * world_size,
            "num_canonical_nodes": self.num_canonical_nodes,
            "epoch_size": self.dataset.epoch_size,
        }
        self._log_buckets(self.batch_size * world_size)
        return ShardLoader(
            self.dataset,
            batch_size=self.batch_size,
            drop_last=True,  # a short last batch would differ between world sizes
            num_workers=self.num_workers,
            persistent_workers=self.num_workers > 0,
            position=lambda: trainer_position(trainer),
            world_size=world_size,
            order=order,
            inexact_resume=self.inexact_resume,
        )

    def _log_buckets(self, global_batch: int) -> None:
        """Say what each bucketed source holds, and which of its buckets cannot fill a global batch (the library
        leaves their samples out)."""
        for i, (source, manifest) in enumerate(zip(self.sources, self.manifests)):
            buckets = manifest.get("buckets") or []
            if not buckets:
                continue
            log.info(
                "buckets: source %s: %s", source["name"], ", ".join(f"{b['folder']}: {b['count']}" for b in buckets)
            )
            for bucket in buckets:
                if bucket["count"] < global_batch:
                    log.warning(
                        "buckets: data.params.sources[%d] (%s) bucket %s holds %d samples, fewer than a global batch "
                        "of %d: they are not trained on; precompute with --min-bucket %d to merge it into its "
                        "neighbour",
                        i, source["name"], bucket["folder"], bucket["count"], global_batch, global_batch,
                    )  # fmt: skip

    def _check_fits(self, model: pl.LightningModule) -> None:
        """Refuse shards whose latents or text states the model's denoiser cannot take (another model family)."""
        config = getattr(model, model.denoiser_name).config
        manifest, where = self.manifests[0], f"data.params.sources[0].path ({self.sources[0]['path']})"
        channels = manifest["latent_shape"][0] if manifest.get("latent_shape") else None
        expected = config.get("in_channels")
        if channels is not None and expected is not None and channels != expected:
            raise ConfigError(
                f"{where}: the shards hold {channels}-channel latents, but model.params' {model.denoiser_name} takes "
                f"{expected}; they were precomputed for another model family: precompute them with this model's VAE"
            )
        width = manifest["cond_shapes"].get("encoder_hidden_states", [None])[-1]
        expected = config.get("cross_attention_dim")
        if width is not None and expected is not None and width != expected:
            raise ConfigError(
                f"{where}: the shards hold text states {width} wide, but model.params' {model.denoiser_name} attends "
                f"to {expected}; they were precomputed for another model family: precompute them with this model's "
                "text encoder"
            )
