"""The layers of MicroDiT (Sehwag et al. 2024, "Stretching Each Dollar: Diffusion Training from Scratch on a
Micro-Budget"): attention with QK-LayerNorm, SwiGLU and expert-choice feed-forwards, the adaLN DiT block.

Each layer has the same parameters, with the same shapes, as its counterpart in SonyResearch/micro_diffusion,
so the two layouts map one to one; the names are ours. `init_weights(std)` gives a layer the initialisation
theirs has (their `custom_init`); `MicroDiT` calls it with each block's depth-dependent `std`.

Attention is our own small module, not diffusers' `Attention`: MicroDiT normalises the queries and keys with one
LayerNorm over all heads together and without affine parameters, whereas diffusers' `qk_norm="layer_norm"`
normalises each head on its own, and its `"layer_norm_across_heads"` carries weights and biases and, under the
default processor, is applied after the heads are split (a shape mismatch). Both compute something else.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def modulate(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """adaLN: `x * (1 + scale) + shift`, one shift and scale per sample (Peebles & Xie 2023, DiT)."""
    return x * (1 + scale[:, None]) + shift[:, None]


def round_up(value: int, multiple: int) -> int:
    """The smallest multiple of `multiple` that is at least `value`."""
    return multiple * -(-value // multiple)


def attention_width(dim: int, ratio: float, head_dim: int) -> int:
    """The query/key/value width of a block scaled by `ratio`, rounded up to an even number of heads
    (`dim` itself when the ratio is 1), as MicroDiT's layer-wise scaling sizes it."""
    return dim if ratio == 1 else round_up(int(dim * ratio), 2 * head_dim)


def layer_norm(dim: int, eps: float) -> nn.LayerNorm:
    """A LayerNorm with a learned scale and no bias, MicroDiT's norm everywhere outside attention."""
    return nn.LayerNorm(dim, eps=eps, bias=False)


class ProjectionMlp(nn.Module):
    """Linear -> GELU(tanh) -> LayerNorm -> Linear; MicroDiT projects the caption tokens and processes the
    pooled caption with it."""

    def __init__(self, in_dim: int, dim: int, eps: float) -> None:
        super().__init__()
        self.fc1 = nn.Linear(in_dim, dim)
        self.act = nn.GELU(approximate="tanh")
        self.norm = layer_norm(dim, eps)
        self.fc2 = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.norm(self.act(self.fc1(x))))

    def init_weights(self, std: float = 0.02) -> None:
        for linear in (self.fc1, self.fc2):
            nn.init.normal_(linear.weight, std=std)


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, head_dim: int, eps: float) -> torch.Tensor:
    """Scaled dot-product attention after a LayerNorm of `q` and `k` over all heads at once (no affine)."""
    q = F.layer_norm(q, q.shape[-1:], eps=eps)
    k = F.layer_norm(k, k.shape[-1:], eps=eps)
    batch, length, width = q.shape
    q, k, v = (y.unflatten(-1, (-1, head_dim)).transpose(1, 2) for y in (q, k, v))
    return F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(batch, length, width)


class SelfAttention(nn.Module):
    """Multi-head self-attention at width `inner` with QK-LayerNorm across heads, through SDPA."""

    def __init__(self, dim: int, inner: int, head_dim: int, bias: bool, eps: float) -> None:
        super().__init__()
        self.head_dim, self.eps = head_dim, eps
        self.to_qkv = nn.Linear(dim, 3 * inner, bias=bias)
        self.to_out = nn.Linear(inner, dim, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.to_out(_attend(*self.to_qkv(x).chunk(3, dim=-1), self.head_dim, self.eps))

    def init_weights(self, std: float) -> None:
        nn.init.trunc_normal_(self.to_qkv.weight, std=0.02)
        nn.init.trunc_normal_(self.to_out.weight, std=std)


class CrossAttention(nn.Module):
    """Multi-head attention from the image tokens to the caption tokens, QK-LayerNorm across heads, SDPA."""

    def __init__(self, dim: int, inner: int, head_dim: int, bias: bool, eps: float) -> None:
        super().__init__()
        self.head_dim, self.eps = head_dim, eps
        self.to_q = nn.Linear(dim, inner, bias=bias)
        self.to_kv = nn.Linear(dim, 2 * inner, bias=bias)
        self.to_out = nn.Linear(inner, dim, bias=bias)

    def forward(self, x: torch.Tensor, context: torch.Tensor) -> torch.Tensor:
        return self.to_out(_attend(self.to_q(x), *self.to_kv(context).chunk(2, dim=-1), self.head_dim, self.eps))

    def init_weights(self, std: float) -> None:
        for linear in (self.to_q, self.to_kv):
            nn.init.trunc_normal_(linear.weight, std=0.02)
        nn.init.trunc_normal_(self.to_out.weight, std=std)


class SwiGLU(nn.Module):
    """SwiGLU feed-forward (Shazeer 2020): `down(silu(gate(x)) * up(x))`, its hidden width 2/3 of `hidden`
    rounded up to a multiple of `multiple_of`, as in LLaMA."""

    def __init__(self, dim: int, hidden: int, multiple_of: int, bias: bool) -> None:
        super().__init__()
        hidden = round_up(int(2 * hidden / 3), multiple_of)
        self.gate = nn.Linear(dim, hidden, bias=bias)
        self.up = nn.Linear(dim, hidden, bias=bias)
        self.down = nn.Linear(hidden, dim, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.silu(self.gate(x)) * self.up(x))

    def init_weights(self, std: float) -> None:
        nn.init.trunc_normal_(self.gate.weight, std=0.02)
        for linear in (self.up, self.down):
            nn.init.trunc_normal_(linear.weight, std=std)


class ExpertChoiceFeedForward(nn.Module):
    """Expert-choice mixture of GELU experts (Zhou et al. 2022, "Mixture-of-Experts with Expert Choice
    Routing"): each expert takes the `capacity * T / num_experts` tokens of a sequence that give it the highest
    softmax gate probability, and adds its output, weighted by that probability, back at their positions.

    A token may be taken by several experts or by none (then it only passes the residual). Tokens are
    dispatched with `torch.gather` and combined with `index_add_`, so memory grows with the tokens taken,
    not with `T` squared as a one-hot dispatch would. At least one token per expert, so every expert and
    the gate always take part in the loss (an expert with none would leave its weights without gradient).
    """

    lr_group = "experts"  # its parameters train at model.params.expert_lr_multiplier times the LR

    def __init__(self, dim: int, hidden: int, num_experts: int, capacity: float) -> None:
        super().__init__()
        self.num_experts, self.capacity = num_experts, capacity
        self.gate = nn.Linear(dim, num_experts, bias=False)
        self.w_in = nn.Parameter(torch.empty(num_experts, dim, hidden))
        self.w_out = nn.Parameter(torch.empty(num_experts, hidden, dim))
        self.act = nn.GELU()

    def tokens_per_expert(self, length: int) -> int:
        """How many of a sequence's `length` tokens each expert takes."""
        return max(1, min(length, int(self.capacity * length / self.num_experts)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, dim = x.shape
        experts, k = self.num_experts, self.tokens_per_expert(length)
        probs = self.gate(x).softmax(dim=-1)  # (B, T, E): each token's distribution over the experts
        weight, index = probs.transpose(1, 2).topk(k, dim=-1)  # (B, E, k): each expert's choice of tokens
        taken = torch.gather(x, 1, index.reshape(batch, experts * k, 1).expand(-1, -1, dim))
        taken = taken.view(batch, experts, k, dim).transpose(0, 1).reshape(experts, batch * k, dim)
        hidden = self.act(torch.bmm(taken, self.w_in))
        out = torch.bmm(hidden, self.w_out).view(experts, batch, k, dim).transpose(0, 1)
        out = out * weight[..., None]  # (B, E, k, D)
        rows = (index + length * torch.arange(batch, device=x.device)[:, None, None]).reshape(-1)
        combined = out.new_zeros(batch * length, dim).index_add_(0, rows, out.reshape(-1, dim))
        return combined.view(batch, length, dim)

    def init_weights(self, std: float) -> None:
        nn.init.trunc_normal_(self.gate.weight, std=0.02)
        nn.init.trunc_normal_(self.w_in, std=0.02)
        nn.init.trunc_normal_(self.w_out, std=std)


class PromptBlock(nn.Module):
    """A pre-norm transformer block over the caption tokens alone (self-attention, SwiGLU), MicroDiT's
    refinement of the text encoder's tokens before the image blocks read them."""

    def __init__(self, dim: int, head_dim: int, multiple_of: int, bias: bool, eps: float) -> None:
        super().__init__()
        self.norm1 = layer_norm(dim, eps)
        self.attn = SelfAttention(dim, dim, head_dim, bias, eps)
        self.norm2 = layer_norm(dim, eps)
        self.ffn = SwiGLU(dim, 4 * dim, multiple_of, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.ffn(self.norm2(x))

    def init_weights(self) -> None:
        """Both residual branches start at zero: the block is the identity at initialisation."""
        self.attn.init_weights(0.02)
        self.ffn.init_weights(0.02)
        nn.init.zeros_(self.attn.to_out.weight)
        nn.init.zeros_(self.ffn.down.weight)


class MicroDiTBlock(nn.Module):
    """A DiT block with adaLN-modulated self-attention and feed-forward (shift, scale, gate from the
    conditioning vector), an unmodulated cross-attention to the caption tokens in between, QK-LayerNorm,
    and a SwiGLU or an expert-choice feed-forward (Sehwag et al. 2024, MicroDiT).

    `experts` is `(num_experts, capacity)` for an expert-choice feed-forward, None for SwiGLU.
    """

    def __init__(
        self,
        dim: int,
        cond_dim: int,
        head_dim: int,
        qkv_ratio: float,
        ffn_ratio: float,
        multiple_of: int,
        bias: bool,
        eps: float,
        experts: tuple[int, float] | None,
    ) -> None:
        super().__init__()
        inner = attention_width(dim, qkv_ratio, head_dim)
        self.norm1 = layer_norm(dim, eps)
        self.attn = SelfAttention(dim, inner, head_dim, bias, eps)
        self.norm2 = layer_norm(dim, eps)
        self.cross_attn = CrossAttention(dim, dim, head_dim, bias, eps)
        self.norm3 = layer_norm(dim, eps)
        hidden = int(dim * ffn_ratio)
        if experts is None:
            self.ffn: nn.Module = SwiGLU(dim, hidden, multiple_of, bias)
        else:
            self.ffn = ExpertChoiceFeedForward(dim, round_up(hidden, multiple_of), *experts)
        self.modulation = nn.Sequential(nn.GELU(approximate="tanh"), nn.Linear(cond_dim, 6 * dim))

    def forward(self, x: torch.Tensor, caption: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        shift_attn, scale_attn, gate_attn, shift_ffn, scale_ffn, gate_ffn = self.modulation(c).chunk(6, dim=-1)
        x = x + gate_attn[:, None] * self.attn(modulate(self.norm1(x), shift_attn, scale_attn))
        x = x + self.cross_attn(self.norm2(x), caption)
        return x + gate_ffn[:, None] * self.ffn(modulate(self.norm3(x), shift_ffn, scale_ffn))

    def init_weights(self, std: float) -> None:
        """Inputs at std 0.02, residual outputs at `std`, the modulation at zero (gates closed)."""
        self.attn.init_weights(std)
        self.cross_attn.init_weights(std)
        self.ffn.init_weights(std)
        nn.init.zeros_(self.modulation[-1].weight)


class FinalLayer(nn.Module):
    """adaLN-modulated LayerNorm and a Linear to each patch's `patch_size**2 * out_channels` values."""

    def __init__(self, dim: int, cond_dim: int, out_dim: int, eps: float) -> None:
        super().__init__()
        self.norm = layer_norm(dim, eps)
        self.modulation = nn.Sequential(nn.GELU(approximate="tanh"), nn.Linear(cond_dim, 2 * dim))
        self.linear = nn.Linear(dim, out_dim)

    def forward(self, x: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        shift, scale = self.modulation(c).chunk(2, dim=-1)
        return self.linear(modulate(self.norm(x), shift, scale))

    def init_weights(self) -> None:
        """Zero: the network predicts zeros at initialisation."""
        nn.init.zeros_(self.modulation[-1].weight)
        nn.init.zeros_(self.linear.weight)
