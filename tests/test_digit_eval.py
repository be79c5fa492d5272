"""Tests for the digit classifier that scores generated digit samples."""

from __future__ import annotations

import json

import pytest
import torch

from examples.digits.data import DigitsDataset
from examples.digits.judge import (
    classifier_accuracy,
    evaluate_pipeline,
    frechet_distance,
    judge_features,
    real_digit_features,
    score_samples,
    train_digit_classifier,
)


@pytest.fixture(scope="module")
def classifier() -> torch.nn.Module:
    return train_digit_classifier(seed=0)


@pytest.fixture(scope="module")
def test_split() -> DigitsDataset:
    return DigitsDataset(split="test")


def test_classifier_accuracy(classifier, test_split):
    assert not classifier.training
    assert classifier_accuracy(classifier, test_split.images, test_split.labels) >= 0.95


def test_score_samples_matches_accuracy(classifier, test_split):
    images, labels = test_split.images, test_split.labels
    scores = score_samples(classifier, images, labels)
    assert scores["accuracy"] == pytest.approx(classifier_accuracy(classifier, images, labels))
    assert len(scores["per_digit"]) == 10
    confusion = torch.tensor(scores["confusion"])
    assert confusion.shape == (10, 10) and confusion.sum() == len(labels)
    # RGB in [-1, 1] at another size scores the same images.
    rgb = torch.nn.functional.interpolate(images, size=64, mode="bilinear").repeat(1, 3, 1, 1)
    assert score_samples(classifier, rgb, labels)["accuracy"] >= 0.9


def test_score_samples_wrong_labels(classifier, test_split):
    shifted = (test_split.labels + 1) % 10
    assert score_samples(classifier, test_split.images, shifted)["accuracy"] < 0.2


def _tiny_pipeline(tmp_path):
    from diffusers import (
        AutoencoderKL,
        DDIMScheduler,
        StableDiffusionPipeline,
        UNet2DConditionModel,
    )
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTokenizer

    # GPT-2/CLIP byte-to-unicode table: printable bytes map to themselves, the rest to 256+.
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    others = [b for b in range(256) if b not in printable]
    chars = [chr(b) for b in printable] + [chr(256 + i) for i in range(len(others))]
    tokens = chars + [c + "</w>" for c in chars] + ["<|startoftext|>", "<|endoftext|>"]
    (tmp_path / "vocab.json").write_text(json.dumps({t: i for i, t in enumerate(tokens)}))
    (tmp_path / "merges.txt").write_text("#version: 0.2\n")
    tokenizer = CLIPTokenizer(str(tmp_path / "vocab.json"), str(tmp_path / "merges.txt"), model_max_length=77)

    torch.manual_seed(0)
    vae = AutoencoderKL(
        in_channels=1,
        out_channels=1,
        latent_channels=4,
        block_out_channels=(8, 16),
        down_block_types=("DownEncoderBlock2D",) * 2,
        up_block_types=("UpDecoderBlock2D",) * 2,
        norm_num_groups=4,
        sample_size=32,
    )
    unet = UNet2DConditionModel(
        sample_size=16,
        in_channels=4,
        out_channels=4,
        block_out_channels=(8, 16),
        layers_per_block=1,
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
        cross_attention_dim=16,
        attention_head_dim=2,
        norm_num_groups=4,
    )
    text_encoder = CLIPTextModel(
        CLIPTextConfig(
            vocab_size=len(tokens),
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            max_position_embeddings=77,
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )
    )
    pipe = StableDiffusionPipeline(
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        unet=unet,
        scheduler=DDIMScheduler(clip_sample=False, steps_offset=1),
        safety_checker=None,
        feature_extractor=None,
        requires_safety_checker=False,
    )
    pipe.set_progress_bar_config(disable=True)
    return pipe


def test_evaluate_pipeline(classifier, tmp_path):
    pipe = _tiny_pipeline(tmp_path)
    result = evaluate_pipeline(pipe, samples_per_digit=2, num_inference_steps=2, classifier=classifier)
    assert set(result) == {"accuracy", "per_digit", "confusion", "frechet_distance", "samples"}
    assert result["frechet_distance"] > 0
    assert result["samples"].shape == (20, 1, 32, 32)
    assert result["samples"].min() >= -1 and result["samples"].max() <= 1
    assert 0.0 <= result["accuracy"] <= 1.0
    assert len(result["per_digit"]) == 10
    assert torch.tensor(result["confusion"]).sum() == 20


def test_frechet_distance_is_its_formula_and_punishes_alike_samples(classifier, test_split):
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(400, 3, generator=g, dtype=torch.float64), torch.randn(400, 3, generator=g, dtype=torch.float64)
    b = b * 2 + 1  # N(1, 4 I) against N(0, I): |mu|^2 = 3, tr(I + 4I - 2 * 2I) = 3
    assert frechet_distance(a, b) == pytest.approx(6.0, rel=0.15)
    assert frechet_distance(a, a) == pytest.approx(0.0, abs=1e-6)
    real = real_digit_features(classifier)
    assert real.shape == (1797, 48)
    varied = judge_features(classifier, test_split.images[:100])
    alike = judge_features(classifier, test_split.images[:10].repeat(10, 1, 1, 1))  # right digits, ten drawings
    assert frechet_distance(varied, real) < frechet_distance(alike, real) / 2


def test_a_judge_is_trained_once_per_cache_folder_and_read_back_exactly(tmp_path, monkeypatch):
    import examples.digits.judge as judge

    monkeypatch.setenv(judge.JUDGE_CACHE, str(tmp_path))
    trained = judge.train_digit_classifier(seed=1, epochs=1)
    (saved,) = tmp_path.iterdir()
    monkeypatch.setattr(judge, "_train_classifier", lambda *args: pytest.fail("trained again"))
    again = judge.train_digit_classifier(seed=1, epochs=1)
    assert not again.training
    for name, value in trained.state_dict().items():
        assert torch.equal(again.state_dict()[name], value), name
    monkeypatch.setattr(judge, "_train_classifier", lambda *args: trained)
    judge.train_digit_classifier(seed=2, epochs=1)
    assert len(list(tmp_path.iterdir())) == 2 and saved.exists(), "another seed is another judge"
    assert not list(tmp_path.glob("*.partial"))
