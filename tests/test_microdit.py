"""MicroDiT: its published sizes, deferred masking, the expert-choice dispatch, and the diffusers round trip."""

import math

import pytest
import torch
import torch.nn.functional as F

from ldm.backbones import as_denoiser
from ldm.backbones.microdit import MICRODIT_DIGITS, MICRODIT_TINY_2, MICRODIT_XL_2, MicroDiT
from ldm.backbones.microdit_layers import ExpertChoiceFeedForward
from ldm.diffusion import random_keep


def digits(**changes) -> MicroDiT:
    torch.manual_seed(0)
    return MicroDiT(**{**MICRODIT_DIGITS, **changes})


def perturbed(model: MicroDiT) -> MicroDiT:
    """The model with every weight moved off its initialisation (zero gates and output layer open up)."""
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=generator))
    return model


def inputs(batch: int = 2, size: int = 8, tokens: int = 7, seed: int = 2):
    generator = torch.Generator().manual_seed(seed)
    noisy = torch.randn(batch, 4, size, size, generator=generator)
    t = torch.randn(batch, generator=generator)  # EDM's c_noise = log(sigma) / 4
    return noisy, t, {"encoder_hidden_states": torch.randn(batch, tokens, 32, generator=generator)}


def test_xl_has_the_published_parameter_counts():
    """MicroDiT_XL_2 of SonyResearch/micro_diffusion: 1,165.4 M in all, 184.1 M in the patch mixer's blocks,
    604.1 M in the expert-choice feed-forwards."""
    with torch.device("meta"):
        model = MicroDiT(**MICRODIT_XL_2)
    total = sum(p.numel() for p in model.parameters())
    mixer = sum(p.numel() for p in model.patch_mixer.parameters())
    moe = sum(p.numel() for m in model.modules() if isinstance(m, ExpertChoiceFeedForward) for p in m.parameters())
    for got, want in ((total, 1165.4e6), (mixer, 184.1e6), (moe, 604.1e6)):
        assert abs(got - want) / want < 0.01, (got, want)
    assert sum(isinstance(b.ffn, ExpertChoiceFeedForward) for b in model.blocks) == 13  # every second, not the last
    assert [isinstance(b.ffn, ExpertChoiceFeedForward) for b in model.patch_mixer] == [False, True] * 3
    widths = [b.attn.to_out.in_features for b in model.blocks]
    assert widths[0] == 512 and widths[-1] == 1024 and widths == sorted(widths)  # attention 0.5 -> 1.0
    with torch.device("meta"):
        tiny = MicroDiT(**MICRODIT_TINY_2)
    assert len(tiny.blocks) == 16 and isinstance(tiny.mixer_in, torch.nn.Identity)  # mixer at the backbone's width


def test_the_output_is_zero_at_initialisation_and_full_size_with_masking():
    model = digits()
    noisy, t, cond = inputs()
    out = model(noisy, t, cond)
    assert out.shape == noisy.shape and not out.any()
    keep = random_keep(2, model.num_patches(8, 8), 0.75, torch.Generator().manual_seed(0))
    assert keep.shape == (2, 16)
    assert model(noisy, t, cond, keep=keep).shape == noisy.shape
    assert as_denoiser(model) is model


def test_masking_keeps_predictions_only_at_the_kept_patches():
    model = perturbed(digits())
    noisy, t, cond = inputs()
    full = model(noisy, t, cond)
    keep = random_keep(2, 64, 0.5, torch.Generator().manual_seed(0))
    masked = model(noisy, t, cond, keep=keep)
    dropped = torch.ones(2, 64, dtype=torch.bool).scatter(1, keep, False)
    assert not masked.flatten(2).transpose(1, 2)[dropped].any()  # dropped positions are zero
    kept = masked.flatten(2).transpose(1, 2)[~dropped]
    assert kept.abs().min() > 0
    assert not torch.allclose(kept, full.flatten(2).transpose(1, 2)[~dropped], atol=1e-3)  # fewer tokens attend
    everything = torch.arange(64).expand(2, -1)
    torch.testing.assert_close(model(noisy, t, cond, keep=everything), full)


def test_the_order_of_the_kept_indices_does_not_matter():
    model = perturbed(digits())
    noisy, t, cond = inputs()
    keep = random_keep(2, 64, 0.5, torch.Generator().manual_seed(0))
    shuffled = keep[:, torch.randperm(keep.shape[1], generator=torch.Generator().manual_seed(3))]
    torch.testing.assert_close(model(noisy, t, cond, keep=shuffled), model(noisy, t, cond, keep=keep))


def test_dropped_patches_reach_kept_predictions_only_through_the_patch_mixer():
    """Deferred masking: the mixer sees every patch before masking; without a mixer, it is plain masking."""
    noisy, t, cond = inputs()
    keep = random_keep(2, 64, 0.5, torch.Generator().manual_seed(0))
    dropped = torch.ones(2, 64, dtype=torch.bool).scatter(1, keep, False).view(2, 1, 8, 8)
    changed = torch.where(dropped, torch.randn_like(noisy), noisy)
    for mixer_depth in (0, 1):
        model = perturbed(digits(patch_mixer_depth=mixer_depth))
        a, b = model(noisy, t, cond, keep=keep), model(changed, t, cond, keep=keep)
        if mixer_depth:
            assert not torch.allclose(a, b, atol=1e-4)
        else:
            assert not any(p.numel() for p in model.patch_mixer.parameters())
            torch.testing.assert_close(a, b)


def test_one_backward_reaches_every_parameter():
    model = perturbed(digits())
    noisy, t, cond = inputs()
    keep = random_keep(2, 64, 0.5, torch.Generator().manual_seed(0))
    model(noisy, t, cond, keep=keep).square().mean().backward()
    silent = [name for name, p in model.named_parameters() if p.grad is None or not p.grad.any()]
    assert not silent, silent


def test_save_pretrained_and_from_pretrained_give_the_same_outputs(tmp_path):
    model = perturbed(digits()).eval()
    model.save_pretrained(tmp_path / "microdit")
    again = MicroDiT.from_pretrained(tmp_path / "microdit").eval()
    assert again.config.qkv_ratio == list(MICRODIT_DIGITS["qkv_ratio"])
    noisy, t, cond = inputs()
    keep = random_keep(2, 64, 0.5, torch.Generator().manual_seed(0))
    assert torch.equal(again(noisy, t, cond), model(noisy, t, cond))
    assert torch.equal(again(noisy, t, cond, keep=keep), model(noisy, t, cond, keep=keep))


def test_a_larger_grid_gets_interpolated_positions():
    model = perturbed(digits())
    noisy, t, cond = inputs(size=16)
    assert model(noisy, t, cond).shape == (2, 4, 16, 16)
    base, twice = model.position_embedding(8, 8), model.position_embedding(16, 16)
    torch.testing.assert_close(twice.view(16, 16, -1)[::2, ::2], base.view(8, 8, -1))  # same span, finer steps
    assert model(noisy, t, cond, keep=random_keep(2, 256, 0.75)).shape == (2, 4, 16, 16)
    wide = noisy[:, :, :8]  # 8 x 16: rows and columns differ
    assert model(wide, t, cond, keep=random_keep(2, model.num_patches(8, 16), 0.5)).shape == (2, 4, 8, 16)


def test_the_timestep_embedding_is_theirs():
    """cos then sin of t * exp(-ln(10000) i / 256), i < 256, as micro_diffusion's TimestepEmbedder."""
    model = MicroDiT(**{**MICRODIT_DIGITS, "timestep_channels": 512})
    t = torch.tensor([-1.3, 0.0, 0.7])
    freqs = torch.exp(-math.log(10000) * torch.arange(256) / 256)
    angles = t[:, None] * freqs
    torch.testing.assert_close(model.time_proj(t), torch.cat([angles.cos(), angles.sin()], dim=1))


def test_expert_choice_dispatch_equals_a_loop_over_experts():
    torch.manual_seed(0)
    moe = ExpertChoiceFeedForward(dim=8, hidden=16, num_experts=4, capacity=2.0).double()
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.5)
    x = torch.randn(3, 10, 8, dtype=torch.float64)
    k = int(2.0 * 10 / 4)
    expected = torch.zeros_like(x)
    for b in range(3):
        probs = F.softmax(x[b] @ moe.gate.weight.T, dim=-1)  # (T, E)
        for e in range(4):
            for token in probs[:, e].argsort(descending=True)[:k].tolist():
                hidden = F.gelu(x[b, token] @ moe.w_in[e])
                expected[b, token] += probs[token, e] * (hidden @ moe.w_out[e])
    torch.testing.assert_close(moe(x), expected)


def test_random_keep_draws_sorted_unique_subsets_reproducibly():
    keep = random_keep(5, 64, 0.7, torch.Generator().manual_seed(4))
    assert keep.shape == (5, round(0.3 * 64)) and keep.dtype == torch.long
    for row in keep:
        assert torch.equal(row, row.unique())  # unique and sorted
        assert 0 <= row.min() and row.max() < 64
    assert torch.equal(keep, random_keep(5, 64, 0.7, torch.Generator().manual_seed(4)))
    assert not torch.equal(keep[0], keep[1])
    assert random_keep(2, 10, 0.0).tolist() == [list(range(10))] * 2
    with pytest.raises(ValueError, match="mask_ratio=1"):
        random_keep(2, 10, 1.0)


def test_bad_configs_and_calls_are_refused_naming_the_values():
    with pytest.raises(ValueError, match="width=60 must be a multiple of head_dim=16"):
        MicroDiT(**{**MICRODIT_DIGITS, "width": 60})
    with pytest.raises(ValueError, match=r"expert_capacity=9 must be in \(0, num_experts=4\]"):
        MicroDiT(**{**MICRODIT_DIGITS, "expert_capacity": 9})
    dense = MicroDiT(**{**MICRODIT_DIGITS, "experts_every_n": 0})
    assert not any(isinstance(m, ExpertChoiceFeedForward) for m in dense.modules())
    model = digits()
    noisy, t, cond = inputs()
    with pytest.raises(ValueError, match="keep must be a LongTensor"):
        model(noisy, t, cond, keep=torch.zeros(3, 4, dtype=torch.long))
    with pytest.raises(ValueError, match="does not split into"):
        MicroDiT(**{**MICRODIT_DIGITS, "patch_size": 2, "sample_size": 8})(torch.randn(1, 4, 7, 8), t[:1], cond)


def test_positions_are_diffusers_sincos_embeddings_on_square_grids_and_laid_out_by_row_on_others():
    import numpy as np
    from diffusers.models.embeddings import get_2d_sincos_pos_embed

    from ldm.backbones.microdit import sincos_positions

    theirs = torch.as_tensor(np.asarray(get_2d_sincos_pos_embed(64, 8, base_size=4, interpolation_scale=2.0)))
    torch.testing.assert_close(sincos_positions(64, 8, 8, base=4, scale=2.0), theirs.float())
    wide = sincos_positions(64, 2, 3, base=2).view(2, 3, 64)
    square = sincos_positions(64, 3, 3, base=2).view(3, 3, 64)
    torch.testing.assert_close(wide[:, :, :32], square[:2, :, :32])  # the columns' half: same columns
    assert torch.equal(wide[0, :, 32:], wide[0, :1, 32:].expand(3, -1)), "the rows' half is constant along a row"
