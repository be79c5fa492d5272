"""The quickstart's evaluator: a small digit classifier that judges generated 32x32 samples, for accuracy (is
each sample the digit its prompt asked for?) and for diversity (the Fréchet distance of the classifier's
features of the samples against those of the real digits, as FID does with Inception's: samples that are
right but all alike score a large distance)."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from examples.digits.data import DigitsDataset, digit_prompts

JUDGE_CACHE = "LDM_JUDGE_CACHE"  # a folder of trained judges, shared by the processes that set it (the tests do)


def _make_classifier() -> nn.Module:
    """Build the untrained CNN: three conv stages (32 -> 16 -> 8 -> 4) and a linear head."""
    layers: list[nn.Module] = []
    for cin, cout in [(1, 12), (12, 24), (24, 48)]:
        layers += [
            nn.Conv2d(cin, cout, 3, padding=1),
            nn.BatchNorm2d(cout),
            nn.ReLU(),
            nn.MaxPool2d(2),
        ]
    return nn.Sequential(*layers, nn.Flatten(), nn.Linear(48 * 4 * 4, 10))


def _init_(model: nn.Module, gen: torch.Generator) -> nn.Module:
    """Initialise `model` in place like PyTorch's defaults, but from `gen` (not the global RNG)."""
    for m in model.modules():
        if isinstance(m, (nn.Conv2d, nn.Linear)):
            nn.init.kaiming_uniform_(m.weight, a=5**0.5, generator=gen)
            bound = m.weight[0].numel() ** -0.5
            nn.init.uniform_(m.bias, -bound, bound, generator=gen)
        elif isinstance(m, nn.BatchNorm2d):
            m.reset_parameters()
    return model


def _augment(x: Tensor, gen: torch.Generator) -> Tensor:
    """Randomly shift, scale, rotate, blur and noise a batch of [-1, 1] images."""
    n = x.shape[0]

    def u(*shape: int) -> Tensor:  # uniform in [-1, 1]
        return torch.rand(*shape, generator=gen) * 2 - 1

    scale, angle, shift = 1 + 0.15 * u(n), 0.15 * u(n), 0.2 * u(n, 2)
    cos, sin = torch.cos(angle) / scale, torch.sin(angle) / scale
    theta = torch.stack([torch.stack([cos, -sin, shift[:, 0]], 1), torch.stack([sin, cos, shift[:, 1]], 1)], 1)
    grid = F.affine_grid(theta, list(x.shape), align_corners=False)
    x = F.grid_sample(x + 1, grid, align_corners=False, padding_mode="zeros") - 1  # pad with -1
    blur = torch.rand(n, 1, 1, 1, generator=gen) < 0.3
    x = torch.where(blur, F.avg_pool2d(x, 3, stride=1, padding=1, count_include_pad=False), x)
    noise = torch.randn(x.shape, generator=gen) * 0.15 * torch.rand(n, 1, 1, 1, generator=gen)
    return (x + noise).clamp(-1, 1)


def train_digit_classifier(seed: int = 0, epochs: int = 10, batch_size: int = 64) -> nn.Module:
    """Train the digit CNN on the `train` split with light augmentation; return it in eval mode.

    Where the environment names a folder in `LDM_JUDGE_CACHE`, a judge this code trained there before with the
    same settings and torch version is read back instead, and a new one is saved there (atomically)."""
    folder = os.environ.get(JUDGE_CACHE)
    if not folder:
        return _train_classifier(seed, epochs, batch_size)
    code = b"".join(Path(__file__).with_name(name).read_bytes() for name in ("judge.py", "data.py"))
    key = hashlib.sha256(code + f"{seed} {epochs} {batch_size} {torch.__version__}".encode()).hexdigest()[:16]
    path = Path(folder) / f"digit-judge-{key}.pt"
    if path.is_file():
        model = _make_classifier()
        model.load_state_dict(torch.load(path, map_location="cpu", weights_only=True))
        return model.eval()
    model = _train_classifier(seed, epochs, batch_size)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f"{path.name}.{os.getpid()}.partial")
    torch.save(model.state_dict(), partial)
    os.replace(partial, path)  # another process saving the same judge at once writes the same bytes
    return model


@torch.enable_grad()
def _train_classifier(seed: int, epochs: int, batch_size: int) -> nn.Module:
    gen = torch.Generator().manual_seed(seed)
    data = DigitsDataset(split="train")
    images, labels = data.images, data.labels
    with torch.device("meta"):  # build without drawing from the global RNG, then seed the init
        model = _init_(_make_classifier().to_empty(device="cpu"), gen)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=1e-4)
    steps = epochs * ((len(labels) + batch_size - 1) // batch_size)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=3e-3, total_steps=steps)
    model.train()
    for _ in range(epochs):
        for idx in torch.randperm(len(labels), generator=gen).split(batch_size):
            loss = F.cross_entropy(model(_augment(images[idx], gen)), labels[idx])
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
    return model.eval()


def _prepare(images: Tensor) -> Tensor:
    """Bring images to (N, 1, 32, 32) floats in [-1, 1] by averaging channels and resizing."""
    images = images.float()
    if images.dim() == 3:
        images = images.unsqueeze(1)
    if images.shape[1] != 1:
        images = images.mean(dim=1, keepdim=True)
    if images.shape[-2:] != (32, 32):
        images = F.interpolate(images, size=(32, 32), mode="bilinear", antialias=True)
    return images.clamp(-1, 1)


@torch.no_grad()
def predict(model: nn.Module, images: Tensor, batch_size: int = 256) -> Tensor:
    """Predict the digit (N,) shown in each of `images`, in [-1, 1]."""
    x = _prepare(images)
    if len(x) == 0:
        return torch.zeros(0, dtype=torch.long)
    return torch.cat([model(b).argmax(dim=1) for b in x.split(batch_size)])


def classifier_accuracy(model: nn.Module, images: Tensor, labels: Tensor) -> float:
    """Return the fraction of `images` that `model` classifies as their `labels`."""
    return float((predict(model, images) == labels.cpu().long()).float().mean())


@torch.no_grad()
def judge_features(model: nn.Module, images: Tensor, batch_size: int = 256) -> Tensor:
    """(N, 48) features of `images` in [-1, 1]: the classifier's last convolution stage, averaged over positions
    (what Inception's pool layer is to FID)."""
    x = _prepare(images)
    trunk = model[:-2]  # the three conv stages, without Flatten and the linear head
    return torch.cat([trunk(b).mean(dim=(2, 3)) for b in x.split(batch_size)]).double()


def frechet_distance(a: Tensor, b: Tensor) -> float:
    """The Fréchet distance between Gaussians fitted to feature sets `a` and `b` (N, D):
    |mu_a - mu_b|^2 + tr(S_a + S_b - 2 (S_a S_b)^(1/2)) (Heusel et al. 2017)."""
    from scipy import linalg

    mu_a, mu_b = a.mean(0).numpy(), b.mean(0).numpy()
    cov_a, cov_b = torch.cov(a.T).numpy(), torch.cov(b.T).numpy()
    root = linalg.sqrtm(cov_a @ cov_b).real
    return float(((mu_a - mu_b) ** 2).sum() + np.trace(cov_a + cov_b - 2 * root))


def real_digit_features(model: nn.Module) -> Tensor:
    """The judge's features of all 1,797 real digits: the reference of `frechet_distance`."""
    return judge_features(model, DigitsDataset().images)


def score_samples(model: nn.Module, images: Tensor, labels: Tensor) -> dict[str, Any]:
    """Score samples against their intended digits: accuracy, per-digit accuracy, confusion."""
    labels = labels.cpu().long()
    preds = predict(model, images.cpu())
    confusion = torch.zeros(10, 10, dtype=torch.long)
    confusion.index_put_((labels, preds), torch.ones_like(labels), accumulate=True)
    counts = confusion.sum(dim=1).clamp(min=1)
    return {
        "accuracy": float((preds == labels).float().mean()) if len(labels) else 0.0,
        "per_digit": (confusion.diag() / counts).tolist(),  # rows = asked-for digit
        "confusion": confusion.tolist(),
    }


@torch.no_grad()
def evaluate_pipeline(
    pipe: Any,
    samples_per_digit: int = 10,
    num_inference_steps: int = 25,
    guidance_scale: float = 5.0,
    seed: int = 0,
    classifier: nn.Module | None = None,
) -> dict[str, Any]:
    """Generate `samples_per_digit` images per digit prompt and score them with the classifier."""
    classifier = classifier if classifier is not None else train_digit_classifier()
    samples = []
    for digit, prompt in enumerate(digit_prompts()):
        out = pipe(
            prompt,
            num_images_per_prompt=samples_per_digit,
            num_inference_steps=num_inference_steps,
            guidance_scale=guidance_scale,
            generator=torch.Generator().manual_seed(seed + digit),
            output_type="pt",
            height=32,
            width=32,
        ).images
        samples.append(_prepare(out.float().cpu() * 2 - 1))
    images = torch.cat(samples)
    labels = torch.arange(10).repeat_interleave(samples_per_digit)
    distance = frechet_distance(judge_features(classifier, images), real_digit_features(classifier))
    return {**score_samples(classifier, images, labels), "frechet_distance": distance, "samples": images}
