"""MicroDiT (Sehwag et al. 2024, "Stretching Each Dollar: Diffusion Training from Scratch on a Micro-Budget"),
a text-conditioned diffusion transformer trained with deferred masking, as a denoiser of `ldm.backbones`.

`MicroDiT.forward(noisy, t, cond, keep=None)` is the denoiser call with one more argument: `keep`, the
indices of the patches each sample keeps. The patch mixer sees every patch; only the kept ones then go through
the backbone blocks, and the dropped positions of the output are zero (the paper's deferred masking; the loss
counts the kept patches only). The caller draws `keep` (`ldm.diffusion.random_keep`); the network draws
nothing random. The architecture is that of SonyResearch/micro_diffusion (`models/dit.py`), with the same
parameter shapes and initialisation; `MICRODIT_XL_2` and `MICRODIT_TINY_2` are its two published sizes.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import numpy as np
import torch
from diffusers import ConfigMixin, ModelMixin
from diffusers.configuration_utils import register_to_config
from diffusers.models.embeddings import TimestepEmbedding, Timesteps
from torch import nn

from ldm.backbones.microdit_layers import FinalLayer, MicroDiTBlock, ProjectionMlp, PromptBlock, layer_norm

# Their `MicroDiT_XL_2` (1.16 B parameters, of which 604 M in expert feed-forwards) for 32x32 latents.
MICRODIT_XL_2 = dict(
    sample_size=32,
    patch_size=2,
    in_channels=4,
    width=1024,
    depth=28,
    head_dim=64,
    multiple_of=256,
    caption_channels=1024,
    qkv_ratio=(0.5, 1.0),
    ffn_ratio=(0.5, 4.0),
    patch_mixer_depth=6,
    patch_mixer_dim=768,
    patch_mixer_qkv_ratio=1.0,
    patch_mixer_ffn_ratio=4.0,
    use_bias=False,
    num_experts=8,
    expert_capacity=2.0,
    experts_every_n=2,
)
# Their `MicroDiT_Tiny_2`: the same recipe at width 512, 16 blocks, a 4-block mixer at the backbone's width.
MICRODIT_TINY_2 = {
    **MICRODIT_XL_2,
    **dict(width=512, depth=16, head_dim=32, patch_mixer_depth=4, patch_mixer_dim=512),
}
# CPU-sized, for 4x8x8 latents and 32-channel caption tokens: a forward takes milliseconds.
MICRODIT_DIGITS = dict(
    sample_size=8,
    patch_size=1,
    in_channels=4,
    width=64,
    depth=4,
    head_dim=16,
    multiple_of=16,
    caption_channels=32,
    timestep_channels=64,
    qkv_ratio=(0.5, 1.0),
    ffn_ratio=(0.5, 4.0),
    patch_mixer_depth=1,
    patch_mixer_dim=32,
    patch_mixer_qkv_ratio=1.0,
    patch_mixer_ffn_ratio=2.0,
    use_bias=False,
    num_experts=4,
    expert_capacity=2.0,
    experts_every_n=2,
)


def sincos_positions(width: int, rows: int, columns: int, base: int, scale: float = 1.0) -> torch.Tensor:
    """Fixed 2D sin-cos position embeddings (rows * columns, width), patches row by row, as MAE / DiT make them
    (the values of diffusers' `get_2d_sincos_pos_embed`): the first half of the channels encodes the column,
    the second the row, each as sines then cosines of 10000^(-i / (width / 4)); coordinates are scaled so
    that any grid spans a `base` x `base` one, then divided by `scale`.

    Ours, not diffusers': its function in 0.29 returns numpy only and lays a non-square grid out wrongly."""
    quarter = width // 4
    frequencies = 1.0 / 10000 ** (torch.arange(quarter, dtype=torch.float64) / quarter)

    def encode(coordinates: torch.Tensor) -> torch.Tensor:
        angles = coordinates.reshape(-1, 1) * frequencies
        return torch.cat([angles.sin(), angles.cos()], dim=1)

    row = torch.arange(rows, dtype=torch.float64) / (rows / base) / scale
    column = torch.arange(columns, dtype=torch.float64) / (columns / base) / scale
    grid_row, grid_column = torch.meshgrid(row, column, indexing="ij")
    return torch.cat([encode(grid_column), encode(grid_row)], dim=1).float()


def _check_config(config: Mapping) -> None:
    """Refuse a MicroDiT configuration that cannot build, naming the offending values."""

    def refuse(message: str) -> None:
        raise ValueError(f"MicroDiT config: {message}")

    width, head_dim = config["width"], config["head_dim"]
    if width % head_dim or width % 4:
        refuse(f"width={width} must be a multiple of head_dim={head_dim} and of 4 (2D sin-cos position embedding)")
    mixer_depth, mixer_dim = config["patch_mixer_depth"], config["patch_mixer_dim"]
    if mixer_depth < 0 or (mixer_depth > 0 and mixer_dim % head_dim):
        refuse(
            f"patch_mixer_depth={mixer_depth} must be >= 0 (0: no mixer), and with a mixer "
            f"patch_mixer_dim={mixer_dim} a multiple of head_dim={head_dim}"
        )
    if config["sample_size"] % config["patch_size"]:
        refuse(f"sample_size={config['sample_size']} is not a multiple of patch_size={config['patch_size']}")
    for key in ("qkv_ratio", "ffn_ratio"):
        if len(config[key]) != 2 or min(config[key]) <= 0:
            refuse(f"{key}={list(config[key])} must be two positive ratios, (first block, last block)")
    if config["experts_every_n"] < 0:
        refuse(f"experts_every_n={config['experts_every_n']} must be >= 0 (0: no expert feed-forwards)")
    if config["experts_every_n"] and not 0 < config["expert_capacity"] <= config["num_experts"]:
        refuse(
            f"expert_capacity={config['expert_capacity']} must be in (0, num_experts={config['num_experts']}]: "
            "each expert takes capacity * tokens / num_experts tokens"
        )


class MicroDiT(ModelMixin, ConfigMixin):
    """The MicroDiT denoiser (Sehwag et al. 2024): a patch mixer over all patches, then DiT blocks with
    layer-wise scaling and expert-choice feed-forwards over the kept patches, conditioned on the timestep
    and the pooled caption (adaLN) and on the caption tokens (cross-attention).

    Sizes: `qkv_ratio` and `ffn_ratio` are the (first, last) block's attention and feed-forward width ratios,
    linear in between; every `experts_every_n`-th block (not the last backbone block) has an expert-choice
    feed-forward (`experts_every_n=0`: none); `patch_mixer_depth=0` builds no mixer. Positions are 2D sin-cos
    embeddings of the input's patch grid, scaled so that any grid spans the positions of the
    `sample_size // patch_size` grid, divided by `pos_interp_scale`.
    """

    _no_split_modules = ["MicroDiTBlock", "PromptBlock"]  # the units FSDP shards on their own

    @register_to_config
    def __init__(
        self,
        sample_size: int = 32,
        patch_size: int = 2,
        in_channels: int = 4,
        out_channels: int | None = None,
        width: int = 1024,
        depth: int = 28,
        head_dim: int = 64,
        multiple_of: int = 256,
        caption_channels: int = 1024,
        timestep_channels: int = 512,
        pos_interp_scale: float = 1.0,
        norm_eps: float = 1e-6,
        depth_init: bool = True,
        qkv_ratio: Sequence[float] = (0.5, 1.0),
        ffn_ratio: Sequence[float] = (0.5, 4.0),
        patch_mixer_depth: int = 6,
        patch_mixer_dim: int = 768,
        patch_mixer_qkv_ratio: float = 1.0,
        patch_mixer_ffn_ratio: float = 4.0,
        use_bias: bool = False,
        num_experts: int = 8,
        expert_capacity: float = 2.0,
        experts_every_n: int = 2,
    ) -> None:
        super().__init__()
        _check_config(self.config)
        self.out_channels = out_channels or in_channels
        eps = norm_eps
        self.patch_embed = nn.Conv2d(in_channels, width, patch_size, stride=patch_size)
        # cos before sin, frequencies exp(-ln(1e4) * i / half), as their TimestepEmbedder; GELU(tanh) as theirs.
        self.time_proj = Timesteps(timestep_channels, flip_sin_to_cos=True, downscale_freq_shift=0)
        self.time_embedding = TimestepEmbedding(timestep_channels, width)
        self.time_embedding.act = nn.GELU(approximate="tanh")
        self.caption_projection = ProjectionMlp(caption_channels, width, eps)
        self.caption_block = PromptBlock(width, head_dim, multiple_of, use_bias, eps)
        self.pooled_caption = ProjectionMlp(width, width, eps)

        every = experts_every_n
        experts = (num_experts, expert_capacity)
        self.patch_mixer = nn.ModuleList(
            MicroDiTBlock(
                patch_mixer_dim,
                width,
                head_dim,
                patch_mixer_qkv_ratio,
                patch_mixer_ffn_ratio,
                multiple_of,
                use_bias,
                eps,
                experts if every and i >= 1 and (i + 1) % every == 0 else None,
            )
            for i in range(patch_mixer_depth)
        )
        mixer_widths = (width, patch_mixer_dim)
        projections = patch_mixer_depth > 0 and patch_mixer_dim != width
        self.mixer_in = self._projection(*mixer_widths) if projections else nn.Identity()
        self.mixer_caption = self._projection(*mixer_widths) if projections else nn.Identity()
        self.mixer_out = self._projection(*reversed(mixer_widths)) if projections else nn.Identity()

        qkv_ratios = np.linspace(*qkv_ratio, num=depth).tolist()
        ffn_ratios = np.linspace(*ffn_ratio, num=depth).tolist()
        self.blocks = nn.ModuleList(
            MicroDiTBlock(
                width,
                width,
                head_dim,
                qkv_ratios[i],
                ffn_ratios[i],
                multiple_of,
                use_bias,
                eps,
                experts if every and i < depth - 1 and (i + 1) % every == 0 else None,
            )
            for i in range(depth)
        )
        self.final_layer = FinalLayer(width, width, patch_size**2 * self.out_channels, eps)
        self._init_weights()

    def _projection(self, in_dim: int, out_dim: int) -> nn.Sequential:
        """LayerNorm and Linear between the backbone's and the mixer's widths."""
        return nn.Sequential(layer_norm(in_dim, self.config.norm_eps), nn.Linear(in_dim, out_dim, self.config.use_bias))

    def _init_weights(self) -> None:
        """MicroDiT's initialisation: Xavier-uniform Linears with zero biases, std-0.02 embeddings, residual
        outputs at 0.02 / sqrt(2 (i + 1)) in block i (0.02 / sqrt(2 depth) without `depth_init`, and in the
        mixer), adaLN modulations and the final layer at zero."""
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.xavier_uniform_(module.weight)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
        nn.init.xavier_uniform_(self.patch_embed.weight.view(self.config.width, -1))
        for linear in (self.time_embedding.linear_1, self.time_embedding.linear_2):
            nn.init.normal_(linear.weight, std=0.02)
        self.caption_projection.init_weights()
        self.pooled_caption.init_weights()
        depth = self.config.depth
        for i, block in enumerate(self.blocks):
            block.init_weights(0.02 / math.sqrt(2 * (i + 1 if self.config.depth_init else depth)))
        for block in self.patch_mixer:
            block.init_weights(0.02 / math.sqrt(2 * depth))
        self.caption_block.init_weights()
        self.final_layer.init_weights()

    def grid(self, height: int, width: int) -> tuple[int, int]:
        """The patch grid (rows, columns) of a (height, width) latent."""
        p = self.config.patch_size
        if height % p or width % p:
            raise ValueError(f"MicroDiT: a {height}x{width} latent does not split into {p}x{p} patches")
        return height // p, width // p

    def num_patches(self, height: int, width: int) -> int:
        """How many patches a (height, width) latent has: the `num_patches` of `ldm.diffusion.random_keep`."""
        rows, columns = self.grid(height, width)
        return rows * columns

    def position_embedding(self, rows: int, columns: int, device: torch.device | None = None) -> torch.Tensor:
        """2D sin-cos position embeddings (rows * columns, width) of a patch grid, interpolated to span the
        positions of the `sample_size // patch_size` grid (divided by `pos_interp_scale`)."""
        base, scale = self.config.sample_size // self.config.patch_size, self.config.pos_interp_scale
        return sincos_positions(self.config.width, rows, columns, base, scale).to(device)

    def forward(
        self,
        noisy: torch.Tensor,
        t: torch.Tensor,
        cond: Mapping[str, torch.Tensor],
        keep: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The prediction (B, out_channels, H, W) for `noisy` (B, in_channels, H, W) at timesteps or noise
        levels `t` (B,) or (), given `cond["encoder_hidden_states"]` (B, L, caption_channels).

        With `keep` (B, K), the patch indices each sample keeps, only those patches pass the backbone blocks
        and the other positions of the prediction are zero (deferred masking, Sehwag et al. 2024)."""
        batch = noisy.shape[0]
        rows, columns = self.grid(*noisy.shape[-2:])
        x = self.patch_embed(noisy).flatten(2).transpose(1, 2)  # (B, N, width), patches row by row
        x = x + self.position_embedding(rows, columns, x.device).to(x.dtype)

        caption = self.caption_block(self.caption_projection(cond["encoder_hidden_states"]))
        t = torch.as_tensor(t, device=x.device).reshape(-1).expand(batch)
        c = self.time_embedding(self.time_proj(t).to(x.dtype)) + self.pooled_caption(caption.mean(dim=1))

        if self.patch_mixer:
            x = self.mixer_in(x)
            mixer_caption = self.mixer_caption(caption)
            for block in self.patch_mixer:
                x = block(x, mixer_caption, c)
        if keep is not None:
            keep = self._checked_keep(keep, batch, rows * columns)
            x = torch.gather(x, 1, keep[..., None].expand(-1, -1, x.shape[-1]))
        x = self.mixer_out(x)
        for block in self.blocks:
            x = block(x, caption, c)
        x = self.final_layer(x, c)  # (B, N or K, p * p * out_channels)
        if keep is not None:
            full = x.new_zeros(batch, rows * columns, x.shape[-1])
            x = full.scatter(1, keep[..., None].expand(-1, -1, x.shape[-1]), x)
        return self.unpatchify(x, rows, columns)

    @staticmethod
    def _checked_keep(keep: torch.Tensor, batch: int, patches: int) -> torch.Tensor:
        if keep.dtype != torch.long or keep.ndim != 2 or keep.shape[0] != batch or not 0 < keep.shape[1] <= patches:
            raise ValueError(
                f"MicroDiT: keep must be a LongTensor (batch={batch}, K) with 0 < K <= {patches} patches; "
                f"got {keep.dtype} of shape {tuple(keep.shape)}. Draw it with ldm.diffusion.random_keep."
            )
        return keep

    def unpatchify(self, x: torch.Tensor, rows: int, columns: int) -> torch.Tensor:
        """Per-patch values (B, rows * columns, p * p * C) as an image (B, C, rows * p, columns * p)."""
        p, channels = self.config.patch_size, self.out_channels
        x = x.reshape(x.shape[0], rows, columns, p, p, channels)
        return x.permute(0, 5, 1, 3, 2, 4).reshape(x.shape[0], channels, rows * p, columns * p)
