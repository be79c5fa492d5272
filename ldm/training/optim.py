"""`LowMemoryAdamW`: AdamW that trains bf16 weights in a fifth of AdamW's memory, without losing small updates.

Plain fp32 AdamW holds 16 bytes per trained weight: the weight, its gradient and two moments, 4 bytes
each. Here each weight tensor's update is AdamW's math (Loshchilov & Hutter 2019, algorithm 2) done in
fp32, a few million values at a time, from compact state:

- the weight itself in bf16 (2 bytes), which the forward and backward passes use directly. bf16 keeps
  8 significant bits, so an update smaller than 1/256 of a weight would round away; instead the new
  value is rounded up or down at random in proportion to the remainder (stochastic rounding), so each
  weight is right on average (0 bytes), or with `rounding: kahan` the rounding error is kept in a
  bf16 buffer and added back at the next step (Kahan summation) (2 bytes); both from Zamirai et al.
  2020, "Revisiting BFloat16 Training", sec. 3-4;
- the first moment in 8 bits, one fp32 scale per block of 256 values (block-wise quantization,
  Dettmers et al. 2022, "8-bit Optimizers via Block-wise Quantization"), on a square-root scale so
  small values keep precision (1.02 bytes), or `momentum: float32` (4 bytes);
- the second moment of a matrix (a conv kernel counts as out x in*kh*kw) factored into its row and
  column means, as Adafactor does (Shazeer & Stern 2018, "Adafactor", sec. 3 and algorithm 4):
  rows + columns floats instead of rows x columns (`factored: false`: 4 bytes per weight);
- with `fused`, no gradients kept: each weight is updated as soon as backward has finished its
  gradient (`Tensor.register_post_accumulate_grad_hook`, as in the PyTorch tutorial "How to save
  memory by fusing the optimizer step into the backward pass"), which is then freed, so the full set
  of gradients never exists;
- with `offload`, the state that grows with the weight (first moment, unfactored second moment, Kahan
  buffer) in CPU memory instead (pinned, when there is CUDA), as ZeRO-Offload keeps optimizer state (Ren
  et al. 2021, "ZeRO-Offload"), though the update still runs on the weight's device: each step copies the
  state there a chunk at a time and back, about 2 x 1 byte per weight over PCIe with the defaults; the
  factored second moment stays on the device.

With fp32 weights, `momentum: float32` and `factored: false` the update is torch's AdamW. Under
Lightning's automatic optimization, `step(closure)` runs the closure (training step and backward)
and the weights are updated inside it; a training step that returns None (the non-finite loss guard)
runs no backward, so nothing changes. Gradient clipping by global norm, gradient accumulation and
averaging across processes need every gradient first, which the fused step never keeps:
`check_run_config` refuses them, naming the key.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any, Literal

import torch

from ldm.config import ConfigError, Sources, fail
from ldm.training.strategies import TARGET

PER_VALUE = ("exp_avg", "exp_avg_scale", "exp_avg_sq", "compensation")  # state that grows with the weight
BLOCK = 256  # first-moment values per fp32 scale
CHUNK = 1 << 22  # values updated at once (a multiple of BLOCK): bounds the fp32 temporaries to a few 16 MB
KEY = "model.params.optimizer.params"


class LowMemoryAdamW(torch.optim.Optimizer):
    """AdamW for bf16 (or fp32) weights with an 8-bit first moment, a factored second moment and the
    step fused into backward.

    Memory per trained bf16 weight with the defaults: 2 (the weight) + 1.02 (8-bit first moment)
    bytes, plus rows + columns fp32 values per matrix; plain AdamW in fp32 holds 16 bytes.
    `rounding: kahan` adds 2 bytes; `fused: false` keeps a gradient (2 bytes) until `step()`. `offload`
    moves the state's per-weight bytes (1.02 with the defaults) to CPU memory, leaving the device 2 bytes per
    weight plus the factored second moment, for two copies of them over PCIe per step; the values, and so
    the training, are the same bit for bit.
    `seed` seeds stochastic rounding, whose random bits depend only on (seed, weight, step).
    """

    low_precision_weights = True  # keeps bf16 weights' small updates; LatentDiffusion checks this for trainable_dtype

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict],
        lr: float = 1e-4,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        momentum: Literal["int8", "float32"] = "int8",
        factored: bool = True,
        rounding: Literal["stochastic", "kahan"] = "stochastic",
        fused: bool = True,
        offload: bool = False,
        seed: int = 0,
    ) -> None:
        betas = tuple(betas)
        if lr < 0:
            raise ValueError(f"lr: got {lr}; must be at least 0")
        if len(betas) != 2 or not all(0.0 <= b < 1.0 for b in betas):
            raise ValueError(f"betas: got {list(betas)}; must be two numbers in [0, 1)")
        if eps <= 0 or weight_decay < 0:
            raise ValueError(f"eps must be positive and weight_decay at least 0; got {eps}, {weight_decay}")
        if momentum not in ("int8", "float32"):
            raise ValueError(f"momentum: got {momentum!r}; valid: 'int8', 'float32'")
        if rounding not in ("kahan", "stochastic"):
            raise ValueError(f"rounding: got {rounding!r}; valid: 'stochastic', 'kahan'")
        self.momentum, self.factored, self.rounding, self.fused, self.seed = momentum, factored, rounding, fused, seed
        self.offload = offload
        self._group_of: dict[torch.Tensor, tuple[dict, int]] = {}  # weight -> (its group, its index)
        self._in_step, self._updated = False, set()
        super().__init__(params, {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay})

    def add_param_group(self, param_group: dict) -> None:
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        for p in group["params"]:
            if p.dtype not in (torch.float32, torch.bfloat16):
                raise ValueError(f"trains float32 or bfloat16 weights; got a {p.dtype} weight of shape {list(p.shape)}")
            self._group_of[p] = (group, len(self._group_of))
            if self.fused and p.requires_grad:
                p.register_post_accumulate_grad_hook(self._on_gradient)

    # -- the step ---------------------------------------------------------------------------------

    def step(self, closure: Any = None) -> Any:
        """Run `closure` (forward and backward; with `fused`, the weights are updated inside it), then
        update every weight that still holds a gradient (all of them when not fused)."""
        loss = None
        if closure is not None:
            if self.fused:
                _check_single_process()
            self._in_step, self._updated = self.fused, set()
            try:
                with torch.enable_grad():
                    loss = closure()
            finally:
                self._in_step = False
        with torch.no_grad():
            for group in self.param_groups:
                for p in group["params"]:
                    if p.grad is not None:
                        self._update(p, p.grad)
        return loss

    def init_state(self) -> None:
        """Create the state of every trained weight that has none yet (zeros, step 0), as its first update
        would, and put every state tensor where it lives: allocates the pinned memory of `offload` now (a
        machine short of RAM fails at the start), moves back what Lightning moved to the GPU when it set up or
        restored the run, and gives a memory planner a steady-state step."""
        for p in (p for p in self._group_of if p.requires_grad):
            state = self.state[p] = self.state[p] or self._new_state(p)
            for k, v in state.items():
                if torch.is_tensor(v) and v.device != self._home(p, k):
                    state[k] = self._allocate(p, k, v.shape, v.dtype).copy_(v)

    def _new_state(self, p: torch.Tensor) -> dict[str, Any]:
        """The state of `p` before its first update: zeros in `_layout`, each where `_allocate` puts it."""
        state = {k: self._allocate(p, k, shape, dtype).zero_() for k, (shape, dtype) in self._layout(p).items()}
        return state | {"step": 0}

    def _allocate(self, p: torch.Tensor, key: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """Memory for state `key` of weight `p` where it lives: CPU memory (pinned, for fast copies to
        CUDA) when `offload` moves it there, else `p`'s device."""
        pinned = torch.cuda.is_available() and p.device.type != "cpu" and self._home(p, key).type == "cpu"
        return torch.empty(shape, dtype=dtype, device=self._home(p, key), pin_memory=pinned)

    def _home(self, p: torch.Tensor, key: str) -> torch.device:
        return torch.device("cpu") if self.offload and key in PER_VALUE else p.device

    def _on_gradient(self, p: torch.Tensor) -> None:
        """Backward has finished `p`'s gradient: update `p` now and free the gradient (fused step only)."""
        if not self._in_step:  # a backward outside step(closure): the gradient waits for step()
            return
        if p in self._updated:
            raise RuntimeError(
                "LowMemoryAdamW: a weight got its gradient twice in one step (reentrant checkpointing or a "
                f"weight shared between calls?); set {KEY}.fused: false"
            )
        self._updated.add(p)
        with torch.no_grad():
            self._update(p, p.grad)
        p.grad = None

    def _update(self, p: torch.Tensor, grad: torch.Tensor) -> None:
        """One AdamW step of weight `p` (Loshchilov & Hutter 2019, algorithm 2) in fp32, `CHUNK` values at a
        time, so the fp32 temporaries stay small whatever the weight's size."""
        (group, index), state = self._group_of[p], self.state[p]
        if not state:
            state.update(self._new_state(p))
        state["step"] += 1
        step, (beta1, beta2), lr = state["step"], group["betas"], group["lr"]
        order = _memory_order(p)
        weights, grads = p.permute(order).view(-1), grad.permute(order).reshape(-1)
        if "exp_avg_sq_row" in state:
            _update_factors(state, grads, beta2)
            rows, cols = state["exp_avg_sq_row"], state["exp_avg_sq_col"]
            rows_mean = rows.mean().clamp_min(1e-30)
        generator = None
        if p.dtype == torch.bfloat16 and self.rounding == "stochastic":  # random bits that depend on the weight and
            generator = torch.Generator(p.device).manual_seed(hash((self.seed, index, step)) % 2**63)  # step only
        for start in range(0, p.numel(), CHUNK):
            end = min(start + CHUNK, p.numel())
            with self._chunk(state, start, end, p.device) as chunk:
                g = grads[start:end].float()
                if "exp_avg_sq" in state:
                    v = chunk["exp_avg_sq"].mul_(beta2).addcmul_(g, g, value=1 - beta2).clone()
                else:  # Adafactor's rank-1 estimate r c^T / mean(r) (Shazeer & Stern 2018, algorithm 4)
                    width, first = cols.numel(), start // cols.numel()
                    v = torch.outer(rows[first : (end - 1) // width + 1] / rows_mean, cols).view(-1)
                    v = v[start - first * width : end - first * width]
                update = v.div_(1 - beta2**step).sqrt_().add_(group["eps"])
                update = self._first_moment(chunk, g, beta1).div_(1 - beta1**step).div_(update)
                del v, g
                weight = weights[start:end].float()
                update.add_(weight, alpha=group["weight_decay"]).mul_(-lr)  # decoupled weight decay
                if p.dtype == torch.float32:
                    weight.add_(update)
                elif generator is not None:
                    weights[start:end] = _round_stochastically(weight.add_(update), generator)
                else:  # Kahan: add back what earlier roundings lost; keep what this one loses
                    compensation = chunk["compensation"]
                    update.add_(compensation)
                    rounded = (weight + update).to(p.dtype)
                    compensation.copy_(update.sub_(rounded.float().sub_(weight)))
                    weights[start:end] = rounded

    @contextmanager
    def _chunk(self, state: dict, start: int, end: int, device: torch.device) -> Iterator[dict[str, torch.Tensor]]:
        """The per-value state of values start:end (8-bit moment: its whole blocks) on `device`: views, or
        copies (`offload`) that are written back afterwards. Copying back waits for the device, so the CPU
        tensors are current whenever anything (the next step, a checkpoint) reads them."""
        blocks, values = slice(start // BLOCK, math.ceil(end / BLOCK)), slice(start, end)
        homes = {k: state[k][blocks if state[k].dim() == 2 else values] for k in PER_VALUE if k in state}
        chunk = {k: v.to(device, copy=self.offload, non_blocking=True) for k, v in homes.items()}
        yield chunk
        for k, home in homes.items():
            if chunk[k] is not home:
                home.copy_(chunk[k])

    def _layout(self, p: torch.Tensor) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """The state tensors of weight `p`, name -> (shape, dtype); values in `p`'s memory order."""
        n = p.numel()
        if self.momentum == "int8":
            layout = {"exp_avg": ((math.ceil(n / BLOCK), BLOCK), torch.int8)}
            layout["exp_avg_scale"] = ((math.ceil(n / BLOCK), 1), torch.float32)
        else:
            layout = {"exp_avg": ((n,), torch.float32)}
        if self.factored and p.dim() >= 2:
            rows = p.shape[_memory_order(p)[0]]
            layout.update(exp_avg_sq_row=((rows,), torch.float32), exp_avg_sq_col=((n // rows,), torch.float32))
        else:
            layout["exp_avg_sq"] = ((n,), torch.float32)
        if p.dtype == torch.bfloat16 and self.rounding == "kahan":
            layout["compensation"] = ((n,), p.dtype)
        return layout

    def _first_moment(self, chunk: dict, g: torch.Tensor, beta1: float) -> torch.Tensor:
        """The moving average of g over a `_chunk`, in fp32, stored back (8-bit: whole blocks)."""
        if self.momentum == "float32":
            return chunk["exp_avg"].lerp_(g, 1 - beta1).clone()
        codes, scales = chunk["exp_avg"], chunk["exp_avg_scale"]
        m = _dequantize(codes, scales, g.numel()).lerp_(g, 1 - beta1)
        _quantize(m, codes, scales)
        return m

    # -- checkpoints ------------------------------------------------------------------------------

    def load_state_dict(self, state_dict: Mapping) -> None:
        """Load a `state_dict()`, keeping each state tensor's own dtype (torch would cast an 8-bit moment
        to the weight's dtype) and checking it was saved with the same settings; each tensor goes where
        `offload` says, whether or not the saving optimizer offloaded it."""
        groups, saved_groups = self.param_groups, state_dict["param_groups"]
        if len(groups) != len(saved_groups) or any(
            len(a["params"]) != len(b["params"]) for a, b in zip(groups, saved_groups)
        ):
            raise ValueError("the saved optimizer state has different parameter groups than this optimizer")
        by_index = {i: p for a, b in zip(groups, saved_groups) for i, p in zip(b["params"], a["params"])}
        state = defaultdict(dict)
        for index, saved in state_dict["state"].items():
            p = by_index[int(index)]
            expected = {k: (torch.Size(shape), dtype) for k, (shape, dtype) in self._layout(p).items()}
            found = {k: (v.shape, v.dtype) for k, v in saved.items() if torch.is_tensor(v)}
            if found != expected:
                raise ValueError(
                    f"the saved state of a weight of shape {list(p.shape)} holds {_describe(found)}; these settings "
                    f"({self._settings()}) need {_describe(expected)}; resume with the settings it was saved with"
                )
            state[p] = {
                k: self._allocate(p, k, v.shape, v.dtype).copy_(v) if torch.is_tensor(v) else v
                for k, v in saved.items()
            }
        self.state = state
        for group, saved in zip(groups, saved_groups):
            group.update({k: v for k, v in saved.items() if k != "params"})

    def _settings(self) -> str:
        """The settings that decide the state's layout; not `offload`, which decides only where it lives."""
        return f"momentum {self.momentum}, factored {self.factored}, rounding {self.rounding}"

    # -- what this optimizer cannot do ------------------------------------------------------------

    @staticmethod
    def check_run_config(cfg: Mapping, sources: Sources | None = None) -> None:
        """Refuse training settings this optimizer cannot honour, naming the key (called by `check_config`)."""
        params = cfg["model"]["params"]["optimizer"].get("params") or {}
        trainer = (cfg.get("lightning") or {}).get("trainer") or {}
        strategy = trainer.get("strategy")
        if isinstance(strategy, Mapping) and strategy.get("target") == TARGET:
            fail(
                sources,
                "lightning.trainer.strategy",
                "ColossalAIStrategy keeps its own fp32 master weights and cannot drive "
                "ldm.training.optim.LowMemoryAdamW; use it with torch.optim.AdamW or "
                "ldm.training.strategies.HybridAdam, or remove the strategy",
            )
        if not params.get("fused", True):
            return
        why = f"with {KEY}.fused: true every weight is updated as soon as its gradient is complete, so"
        if trainer.get("gradient_clip_val"):
            fail(
                sources,
                "lightning.trainer.gradient_clip_val",
                f"{why} there is no global gradient norm to clip by; set it to null, or set {KEY}.fused: false",
            )
        if trainer.get("accumulate_grad_batches", 1) != 1:
            fail(
                sources,
                "lightning.trainer.accumulate_grad_batches",
                f"{why} no gradients are kept between batches; set it to 1 (a larger data.params.batch_size "
                f"instead), or set {KEY}.fused: false",
            )
        if str(trainer.get("precision", "")).startswith("16"):
            fail(
                sources,
                "lightning.trainer.precision",
                f"{why} fp16 loss scaling cannot check all gradients first; use bf16-mixed or 32-true",
            )
        if isinstance(strategy, str) and strategy not in ("auto", "single_device"):
            fail(
                sources,
                "lightning.trainer.strategy",
                f"{why} no strategy can average gradients across processes first; use one process, or set "
                f"{KEY}.fused: false",
            )


def _check_single_process() -> None:
    """The fused step updates weights before DDP / FSDP could average their gradients: one process only."""
    if (
        torch.distributed.is_available()
        and torch.distributed.is_initialized()
        and torch.distributed.get_world_size() > 1
    ):
        raise ConfigError(
            f"{KEY}.fused: true updates each weight before its gradient is averaged across the "
            f"{torch.distributed.get_world_size()} processes; set it to false to train on several devices"
        )


def _memory_order(t: torch.Tensor) -> list[int]:
    """`t`'s dimensions from outermost to innermost in memory (channels-last weights keep rows outermost)."""
    return sorted(range(t.dim()), key=lambda d: -t.stride(d))


def _update_factors(state: dict, grads: torch.Tensor, beta2: float) -> None:
    """Move the row and column means of g^2 (rows: the outermost dimension) towards this step's."""
    rows, cols = state["exp_avg_sq_row"], state["exp_avg_sq_col"]
    matrix = grads.view(rows.numel(), cols.numel())
    row_means, col_sums = torch.empty_like(rows), torch.zeros_like(cols)
    step = max(1, CHUNK // cols.numel())
    for first in range(0, rows.numel(), step):
        rows_of_g = matrix[first : first + step].float()
        squares = rows_of_g * rows_of_g
        row_means[first : first + step] = squares.mean(1)
        col_sums += squares.sum(0)
    rows.lerp_(row_means, 1 - beta2)
    cols.lerp_(col_sums.div_(rows.numel()), 1 - beta2)


def _describe(layout: dict) -> str:
    return ", ".join(
        f"{k} {str(dtype).removeprefix('torch.')}{list(shape)}" for k, (shape, dtype) in sorted(layout.items())
    )


def _quantize(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor) -> None:
    """Store `x` as 8-bit codes, one absmax scale per block (Dettmers et al. 2022), on a square-root
    scale: code = round(127 * sign(x) * sqrt(|x| / absmax))."""
    if x.numel() < codes.numel():  # the last block of a weight, padded with zeros
        x = torch.cat([x.flatten(), x.new_zeros(codes.numel() - x.numel())])
    blocks = x.view(codes.shape)
    magnitudes = blocks.abs()
    torch.amax(magnitudes, dim=1, keepdim=True, out=scales)
    codes.copy_(magnitudes.div_(scales.clamp_min(1e-30)).sqrt_().copysign_(blocks).mul_(127).round_())


def _dequantize(codes: torch.Tensor, scales: torch.Tensor, numel: int) -> torch.Tensor:
    """The fp32 values of `_quantize`'s codes: sign(c) * (c / 127)^2 * absmax."""
    x = codes.float().div_(127)
    return x.mul_(x.abs()).mul_(scales).flatten()[:numel]


def _round_stochastically(x: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """Round fp32 `x` to bf16, up or down at random in proportion to the remainder (unbiased): add a
    random 16-bit number to the bits bf16 drops, then drop them."""
    bits = x.view(torch.int32).view(-1)
    noise = torch.empty((bits.numel() + 1) // 2, dtype=torch.int32, device=x.device)
    noise.random_(-(1 << 31), 1 << 31, generator=generator)  # 32 random bits: two 16-bit draws
    bits.add_(noise.view(torch.int16)[: bits.numel()]).add_(1 << 15)  # each in [0, 2^16)
    bits.bitwise_and_(-(1 << 16))
    return x.to(torch.bfloat16)
