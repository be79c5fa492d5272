"""The quickstart's data: scikit-learn's 1,797 handwritten 8x8 digits, rendered at 32x32."""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.data import Dataset

CAPTION = "a handwritten digit {}"


def digit_prompts() -> list[str]:
    """The ten captions of the digits task, in digit order."""
    return [CAPTION.format(d) for d in range(10)]


def render_digits(size: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """All 1,797 digits as (N, 1, size, size) floats in [-1, 1], and their labels (N,)."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    images = torch.from_numpy(digits.images.astype(np.float32) / 16.0).unsqueeze(1)
    images = F.interpolate(images, size=(size, size), mode="bilinear", align_corners=False)
    return images.clamp(0, 1) * 2 - 1, torch.from_numpy(digits.target.astype(np.int64))


class DigitsDataset(Dataset):
    """Digits as `{"pixel_values", "caption"}` examples; `split` holds out every 10th image."""

    def __init__(self, size: int = 32, split: str = "all") -> None:
        if split not in ("all", "train", "test"):
            raise ValueError(f"split must be 'all', 'train' or 'test', got {split!r}")
        images, labels = render_digits(size)
        index = torch.arange(len(labels))
        keep = {"all": index >= 0, "train": index % 10 != 0, "test": index % 10 == 0}[split]
        self.images, self.labels = images[keep], labels[keep]

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> dict:
        return {"pixel_values": self.images[i], "caption": CAPTION.format(int(self.labels[i]))}
