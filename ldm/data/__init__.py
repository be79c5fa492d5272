"""Training data: any map-style `Dataset` of `{pixel_values, caption}` examples, resumable mid-epoch.

`DataModule` wraps a dataset given by `target` (the user's own, or one of ours), shuffles it
with a seeded sampler whose position is saved in every checkpoint, applies caption dropout for
classifier-free guidance, and can encode every image once with the model's VAE (`cache_latents`).
A dataset that serves some examples more than once an epoch (a kohya folder's repeats) says which with
`example_index` (index i serves distinct example `example_index[i]`), and the caches encode each once.
"""

from __future__ import annotations

import logging
from typing import Any

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, Dataset, Sampler, Subset

from ldm.config import ConfigError, TargetSpec, instantiate
from ldm.data.buckets import BucketBatchSampler
from ldm.utils import stacked_pairs

log = logging.getLogger(__name__)
SIZE_KEYS = {"original_size", "crop_top_left"}  # what an image's size conditioning is made of, kept by caches


class ResumableSampler(Sampler):
    """Seeded per-epoch shuffle, sharded by rank, that can start mid-epoch.

    Yields `(index, drop_caption, augment_seed)`: everything random about an example is drawn
    here from (seed, epoch), so a resumed run sees exactly the examples an unbroken run would.
    """

    def __init__(
        self, size: int, batch_size: int, shuffle: bool, seed: int, caption_dropout: float, rank: int, world_size: int
    ) -> None:
        self.size, self.batch_size, self.shuffle, self.seed = size, batch_size, shuffle, seed
        self.caption_dropout, self.rank, self.world_size = caption_dropout, rank, world_size
        self.epoch, self.resume_epoch, self.resume_batches = 0, -1, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def resume(self, epoch: int, batches_done: int) -> None:
        """Skip the first `batches_done` batches the next time `epoch` is iterated."""
        self.resume_epoch, self.resume_batches = epoch, batches_done

    def __len__(self) -> int:
        return self.size // self.world_size

    def draws(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """This epoch's order of all examples, whether each one's caption is dropped, and its augmentation seed:
        functions of (seed, epoch) alone."""
        g = torch.Generator().manual_seed(self.seed * 100_003 + self.epoch)
        order = torch.randperm(self.size, generator=g) if self.shuffle else torch.arange(self.size)
        drop = torch.rand(self.size, generator=g) < self.caption_dropout
        augment_seeds = torch.randint(0, 2**31 - 1, (self.size,), generator=g)
        return order, drop, augment_seeds

    def take_resume(self) -> int:
        """How many batches of this epoch to skip: those a resumed checkpoint had done (once; then 0)."""
        if self.epoch != self.resume_epoch:
            return 0
        self.resume_epoch = -1
        return self.resume_batches

    def __iter__(self):
        order, drop, augment_seeds = self.draws()
        mine = order[: len(self) * self.world_size][self.rank :: self.world_size]
        for i in mine[self.take_resume() * self.batch_size :].tolist():
            yield i, bool(drop[i]), int(augment_seeds[i])


class _Indexed(Dataset):
    """Index with the sampler's tuples: the example (seeded if the dataset has `get(index, seed)`),
    its caption emptied when asked, with its caption's conditioning (`cond`) when captions were encoded once,
    and its `sample_id`: its index in the dataset (unless the dataset gives its own), from which the model draws
    the sample's noise and timestep, so they do not depend on the process or the batch it is trained in."""

    def __init__(self, dataset: Dataset, text_cache: _TextCache | None = None) -> None:
        self.dataset, self.text_cache = dataset, text_cache

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, item: tuple[int, bool, int]) -> dict:
        index, drop, seed = item
        get = getattr(self.dataset, "get", None)
        example = dict(get(index, seed) if callable(get) else self.dataset[index])
        example.setdefault("sample_id", index)
        if drop:
            example["caption"] = ""
        if self.text_cache is not None:
            example["cond"] = self.text_cache.embedding(index, drop)
        return example


class _TextCache:
    """Each distinct caption's conditioning (a mapping of tensors), computed once; `embedding(index, dropped)`
    looks one up."""

    def __init__(self, embeddings: dict, caption_ids: torch.Tensor, empty: dict) -> None:
        self.embeddings, self.caption_ids, self.empty = embeddings, caption_ids, empty

    def embedding(self, index: int, dropped: bool) -> dict[str, torch.Tensor]:
        if dropped:
            return self.empty
        row = self.caption_ids[index]
        return {k: v[row] for k, v in self.embeddings.items()}


def _once_each(dataset: Dataset) -> tuple[Dataset, torch.Tensor | None]:
    """`dataset` with each distinct example once, and for each index of `dataset` the row of that one it serves.

    A dataset without `example_index` serves each example once already: it comes back as it is, with None."""
    example_index = getattr(dataset, "example_index", None)
    if example_index is None:
        return dataset, None
    first: dict[int, int] = {}
    for index, example in enumerate(example_index):
        first.setdefault(example, index)
    row = {example: i for i, example in enumerate(first)}
    return Subset(dataset, list(first.values())), torch.tensor([row[example] for example in example_index])


class _LatentCache(Dataset):
    """Examples whose images were encoded once: the VAE posterior's mean and, when the model draws
    from the posterior each step, its standard deviation, with each image's size and crop where the data
    records them (`SIZE_KEYS`); index i serves row `rows[i]` (i if None)."""

    def __init__(
        self,
        latents: torch.Tensor,
        stds: torch.Tensor | None,
        captions: list[str],
        rows: torch.Tensor | None,
        sizes: dict[str, torch.Tensor] | None = None,
    ) -> None:
        self.latents, self.stds, self.captions, self.rows = latents, stds, captions, rows
        self.sizes = sizes or {}

    def __len__(self) -> int:
        return len(self.captions) if self.rows is None else len(self.rows)

    def __getitem__(self, index: int) -> dict:
        row = index if self.rows is None else int(self.rows[index])
        example = {"latents": self.latents[row], "caption": self.captions[row]}
        if self.stds is not None:
            example["latent_std"] = self.stds[row]
        example.update({key: values[row] for key, values in self.sizes.items()})
        return example


def trainer_position(trainer: pl.Trainer) -> dict[str, int]:
    """The epoch and how many of its batches the trainer has consumed (prefetched batches not counted)."""
    loop = trainer.fit_loop
    return {
        "epoch": loop.epoch_progress.current.completed,
        "batches_done": loop.epoch_loop.batch_progress.current.processed,
    }


class ResumableDataLoader(DataLoader):
    """A DataLoader whose position Lightning stores in checkpoints and restores on resume.

    Lightning saves `state_dict()` of loaders that have one and calls `load_state_dict` on the
    new loader before iterating it. `position` reports the epoch and how many of its batches the
    trainer has consumed (prefetched batches are not counted).
    """

    def __init__(self, *args: Any, position: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.position = position

    def state_dict(self) -> dict[str, int]:
        return self.position()

    def load_state_dict(self, state: dict[str, int]) -> None:
        if state["batches_done"] < len(self):  # our samplers: a batch sampler's `sampler` holds the position
            self.batch_sampler.sampler.resume(state["epoch"], state["batches_done"])


class DataModule(pl.LightningDataModule):
    """Serve a dataset of `{pixel_values, caption}` examples to `LatentDiffusion`, resumably."""

    dataset_key = "data.params.dataset"  # where the dataset's `{target, params}` node is, for errors

    def __init__(
        self,
        dataset: TargetSpec | Dataset,
        batch_size: int = 1,
        num_workers: int = 0,
        shuffle: bool = True,
        seed: int = 0,
        caption_dropout: float = 0.0,
        cache_latents: bool = False,
        cache_text: bool = False,
        drop_last: bool = False,
    ) -> None:
        super().__init__()
        if not 0.0 <= caption_dropout <= 1.0:
            raise ConfigError(f"data.params.caption_dropout: got {caption_dropout}; must be in [0, 1]")
        if batch_size < 1:
            raise ConfigError(f"data.params.batch_size: got {batch_size}; must be at least 1")
        if num_workers < 0:
            raise ConfigError(
                f"data.params.num_workers: got {num_workers}; must be 0 (load in the main process) or more"
            )
        self.dataset_spec = dataset
        self.batch_size, self.num_workers, self.shuffle, self.seed = batch_size, num_workers, shuffle, seed
        self.caption_dropout, self.cache_latents, self.cache_text = caption_dropout, cache_latents, cache_text
        self.drop_last = drop_last
        self.dataset: Dataset | None = None
        self.text_cache: _TextCache | None = None
        self.buckets: list[int] | None = None  # per index, when the dataset has aspect-ratio buckets

    def build_dataset(self) -> Dataset:
        """The configured dataset, not cached or encoded; `ConfigError` if it says it holds no examples."""
        spec = self.dataset_spec
        dataset = instantiate(spec, self.dataset_key) if isinstance(spec, dict) else spec
        if hasattr(dataset, "__len__") and len(dataset) == 0:
            raise ConfigError("data.params.dataset: the dataset is empty; check data.params (root, files, captions)")
        return dataset

    def setup(self, stage: str) -> None:
        if self.dataset is not None:
            return
        dataset = self.build_dataset()
        if getattr(dataset, "shapes", None) is not None:
            self._assign_buckets(dataset)
        if self.cache_latents:
            dataset = self._encode_all(dataset)
        if self.cache_text:
            self.text_cache = self._encode_captions(dataset)
        self.dataset = dataset

    def _assign_buckets(self, dataset: Dataset) -> None:
        """Bucket the examples by aspect (buckets of less than a global batch merged) and log the buckets."""
        if self.cache_latents:
            raise ConfigError(
                "data.params.cache_latents: not with data.params.buckets (latents of many shapes); precompute "
                "the folder into bucketed shards instead (scripts/precompute.py), or drop one of the two"
            )
        world_size = self.trainer.world_size if self.trainer is not None else 1
        global_batch = self.batch_size * world_size
        self.buckets = dataset.assign_buckets(global_batch)
        counts = torch.bincount(torch.tensor(self.buckets), minlength=len(dataset.shapes))
        used = [(dataset.shapes[b], int(n)) for b, n in enumerate(counts) if n]
        spare = sum(int(n) % global_batch for _, n in used)
        log.info(
            "buckets: %d examples in %d bucket(s) (%s); each epoch, %d wait for a later one (a bucket's remainder "
            "after whole global batches of %d)",
            len(dataset),
            len(used),
            ", ".join(f"{h}x{w}: {n}" for (h, w), n in used),
            spare,
            global_batch,
        )

    @property
    def _device(self) -> torch.device:
        """Where caches are encoded: the device training will run on (the model is still on the CPU in `setup`)."""
        return self.trainer.strategy.root_device

    def _one_pass(self, dataset: Dataset) -> DataLoader:
        """A loader for encoding the data once. Its own generator: drawing its worker seeds from the global
        one would shift every random number training draws, so a cached run would not match an uncached one."""
        batch_size = max(self.batch_size, 32) if self._device.type == "cpu" else self.batch_size  # GPU memory
        return DataLoader(dataset, batch_size=batch_size, num_workers=self.num_workers,
                          generator=torch.Generator())  # fmt: skip

    @torch.no_grad()
    def _encode_all(self, dataset: Dataset) -> Dataset:
        model = self.trainer.lightning_module
        means, stds, captions, sizes = [], [], [], {}
        once, rows = _once_each(dataset)
        for batch in self._one_pass(once):
            with model.networks_on(self._device, ["vae"]):  # std is None unless model.sample_latents
                mean, std = model.encode_posterior(batch["pixel_values"].to(self._device))
            means.append(mean.cpu())
            if std is not None:
                stds.append(std.cpu())
            captions.extend(batch["caption"])
            for key in SIZE_KEYS & batch.keys():
                sizes.setdefault(key, []).append(stacked_pairs(batch[key]))
        kept = "posterior mean and deviation; a latent is drawn from them each step" if stds else "mean"
        log.info("cache_latents: encoded %d images once with the model's VAE (%s)", len(captions), kept)
        sizes = {key: torch.cat(values) for key, values in sizes.items()}
        return _LatentCache(torch.cat(means), torch.cat(stds) if stds else None, captions, rows, sizes)

    @torch.no_grad()
    def _encode_captions(self, dataset: Dataset) -> _TextCache:
        """Encode every distinct caption once with the model's frozen text encoder."""
        model = self.trainer.lightning_module
        training = [name for name in model.text_parts if name in model.trainable]
        if training:
            raise ConfigError(
                f"data.params.cache_text: the text encoder trains (model.params.trainable includes {training[0]}), "
                "so its embeddings change every step; set cache_text: false or train the UNet only"
            )
        if isinstance(dataset, _LatentCache):
            captions, rows = dataset.captions, dataset.rows
        else:  # one pass over the data, images included: datasets need not expose their captions
            once, rows = _once_each(dataset)
            captions = [caption for batch in self._one_pass(once) for caption in batch["caption"]]
        distinct = list(dict.fromkeys(captions))
        position = {caption: i for i, caption in enumerate(distinct)}
        was_training = model.training
        model.eval()
        try:
            with model.networks_on(self._device, model.text_parts):
                chunks = [model.encode_text(distinct[i : i + 64]) for i in range(0, len(distinct), 64)]
                empty = {k: v[0].cpu() for k, v in model.encode_text([""]).items()}
        finally:
            model.train(was_training)
        log.info("cache_text: encoded %d distinct captions once with the model's text encoder", len(distinct))
        embeddings = {k: torch.cat([chunk[k].cpu() for chunk in chunks]) for k in chunks[0]}
        caption_ids = torch.tensor([position[c] for c in captions])
        return _TextCache(embeddings, caption_ids if rows is None else caption_ids[rows], empty)

    def train_dataloader(self) -> DataLoader:
        trainer = self.trainer
        sampler = ResumableSampler(
            len(self.dataset),
            self.batch_size,
            self.shuffle,
            self.seed,
            self.caption_dropout,
            trainer.global_rank if trainer else 0,
            trainer.world_size if trainer else 1,
        )
        if self.buckets is not None:  # batches of one bucket each; a bucket's remainder waits for another epoch
            return ResumableDataLoader(
                _Indexed(self.dataset, self.text_cache),
                batch_sampler=BucketBatchSampler(sampler, self.buckets, self.batch_size),
                num_workers=self.num_workers,
                persistent_workers=self.num_workers > 0,
                position=lambda: trainer_position(self.trainer),
                generator=torch.Generator().manual_seed(self.seed),
            )
        if self.drop_last and len(sampler) < self.batch_size:
            raise ConfigError(
                f"data.params.drop_last: each process gets {len(sampler)} examples, fewer than one batch of "
                f"{self.batch_size}, so every batch would be dropped; lower data.params.batch_size or set "
                "drop_last: false"
            )
        return ResumableDataLoader(
            _Indexed(self.dataset, self.text_cache),
            batch_size=self.batch_size,
            sampler=sampler,
            drop_last=self.drop_last,
            num_workers=self.num_workers,
            persistent_workers=self.num_workers > 0,
            position=lambda: trainer_position(self.trainer),
            # Worker seeds come from here, not the global generator, so starting an epoch's iterator
            # draws nothing from the random state a resumed run restores.
            generator=torch.Generator().manual_seed(self.seed),
        )
