"""`main.DataModuleFromConfig` of CompVis configs: the user's own dataset of CompVis-style examples.

CompVis datasets return `{"image": HWC array in [-1, 1], "txt": str}` (the keys are the model's
`first_stage_key` and `cond_stage_key`); they are served here as our `{pixel_values, caption}` examples,
through `DataModule`'s resumable sampler.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset, IterableDataset

from ldm.config import ConfigError, TargetSpec
from ldm.data import DataModule


class CompVisExamples(Dataset):
    """A CompVis-style dataset's examples as `{pixel_values: CHW tensor, caption}`."""

    def __init__(self, dataset: Dataset, image_key: str, caption_key: str) -> None:
        self.dataset, self.image_key, self.caption_key = dataset, image_key, caption_key

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> dict[str, Any]:
        example = self.dataset[index]
        where = f"data.params.train: example {index}"
        for k in (self.image_key, self.caption_key):
            if k not in example:
                raise ConfigError(
                    f"{where} has no {k!r} (keys: {', '.join(map(str, example))}); the keys come from "
                    "model.params.first_stage_key / cond_stage_key (or data.params.image_key / caption_key)"
                )
        image = torch.as_tensor(np.asarray(example[self.image_key]), dtype=torch.float32)
        if image.dim() != 3 or image.shape[-1] not in (1, 3, 4):
            raise ConfigError(f"{where}: {self.image_key!r} has shape {list(image.shape)}; expected H x W x C")
        if image.min() < -1.01 or image.max() > 1.01:
            raise ConfigError(
                f"{where}: {self.image_key!r} has values in [{image.min():.3g}, {image.max():.3g}]; "
                "CompVis datasets give images in [-1, 1]"
            )
        return {"pixel_values": image.permute(2, 0, 1).contiguous(), "caption": str(example[self.caption_key])}


class DataModuleFromConfig(DataModule):
    """CompVis' `main.DataModuleFromConfig`: `train` is the user's dataset (`{target, params}`)."""

    dataset_key = "data.params.train"

    def __init__(
        self,
        batch_size: int,
        train: TargetSpec | Dataset,
        num_workers: int | None = None,
        image_key: str = "image",
        caption_key: str = "caption",
        shuffle: bool = True,
        seed: int = 0,
        caption_dropout: float = 0.0,
        cache_latents: bool = False,
        cache_text: bool = False,
        drop_last: bool = False,
    ) -> None:
        workers = min(2 * batch_size, torch.get_num_threads()) if num_workers is None else num_workers
        super().__init__(
            train, batch_size, workers, shuffle, seed, caption_dropout, cache_latents, cache_text, drop_last
        )
        self.image_key, self.caption_key = image_key, caption_key

    def build_dataset(self) -> Dataset:
        dataset = super().build_dataset()
        if isinstance(dataset, IterableDataset) or not hasattr(dataset, "__getitem__"):
            raise ConfigError(
                f"{self.dataset_key}: {type(dataset).__name__} is an iterable dataset; runs here resume mid-epoch "
                "from a position, so give a map-style Dataset (__len__ and __getitem__)"
            )
        return CompVisExamples(dataset, self.image_key, self.caption_key)
