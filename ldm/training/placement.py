"""Where a traced step's memory lives: GPU, CPU or NVMe, as a Colossal-AI strategy places it, or as one device
does with frozen networks or optimizer state kept in CPU memory. Arithmetic on `ldm.training.memory`'s plan."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ldm.config import to_plain
from ldm.training.memory import GIB, MemoryPlan
from ldm.training.strategies import TARGET as COLOSSAL_TARGET
from ldm.training.strategies.options import resolved


@dataclass
class Placement:
    """Where a strategy keeps each kind of state: (part, state, device, bytes) rows, totals per device."""

    strategy: str
    rows: list[tuple[str, str, str, int]]

    def total(self, device: str) -> int:
        return sum(b for _, _, d, b in self.rows if d == device)

    def table(self, gpu_gib: float | None = None) -> str:
        lines = [f"placement under {self.strategy}", f"{'part':<14}{'state':<32}{'device':<8}{'GiB':>8}"]
        lines += [f"{part:<14}{state:<32}{device:<8}{b / GIB:>8.2f}" for part, state, device, b in self.rows if b]
        totals = ", ".join(f"{d} {self.total(d) / GIB:.2f} GiB" for d in ("gpu", "cpu", "nvme") if self.total(d))
        lines.append(f"totals: {totals}")
        if gpu_gib is not None:
            verdict = "fits" if self.total("gpu") <= gpu_gib * GIB else "does NOT fit"
            lines.append(f"{verdict} a {gpu_gib:g} GiB GPU (CUDA context and allocator slack not counted)")
        return "\n".join(lines)


def place(plan: MemoryPlan, cfg: Any) -> Placement | None:
    """Split the traced step's memory over GPU, CPU and NVMe as the configured ColossalAIStrategy would, or as
    one device does with frozen networks or `LowMemoryAdamW`'s state kept on the CPU (`_place_on_one_device`).

    `cfg` is a checked config (`ldm.training.checks.check_config`), its strategy settings in their groups.

    Arithmetic on the traced sizes: half-precision working weights (2 B/param), fp32 master weights
    (4 B), Adam moments (8 B). Gemini reuses its fp16 chunks for gradients unless accumulating; ZeRO
    keeps gradients beside the weights, or fp32 ones on the CPU with cpu_offload. Activations and
    temporaries are the traced ones at the forward/backward peak. None for other strategies.
    """
    trainer = to_plain((cfg.get("lightning") or {}).get("trainer") or {})
    strategy = trainer.get("strategy")
    if not isinstance(strategy, dict) or strategy.get("target") != COLOSSAL_TARGET:
        return _place_on_one_device(plan, to_plain(cfg.model.params))
    sp = strategy.get("params") or {}
    optimizer = (to_plain(cfg.model.params).get("optimizer") or {}).get("params") or {}
    nvme = float(optimizer.get("nvme_offload_fraction") or 0.0)
    accumulate = int(trainer.get("accumulate_grad_batches", 1)) > 1
    plugin = sp.get("plugin", "gemini")
    gemini, zero = resolved("gemini", sp.get("gemini")), resolved("zero", sp.get("zero"))
    rows: list[tuple[str, str, str, int]] = []

    def split(part: str, state: str, nbytes: float, gpu_share: float) -> None:
        rows.append((part, state, "gpu", int(nbytes * gpu_share)))
        rows.append((part, state, "cpu", int(nbytes * (1 - gpu_share))))

    for p in plan.parts:
        n = p.parameters
        if not p.trainable:
            rows.append((p.name, "weights (frozen, half)", "gpu", 2 * n))
        elif plugin == "gemini":
            weights_gpu = 1.0 - float(gemini["offload_param_frac"])
            optim_gpu = 1.0 - float(gemini["offload_optim_frac"])
            split(p.name, "weights (fp16 chunks)", 2 * n, weights_gpu)
            if accumulate:
                split(p.name, "gradients (fp16, accumulated)", 2 * n, weights_gpu)
            split(p.name, "master weights (fp32)", 4 * n, optim_gpu)
            rows.append((p.name, "Adam moments (fp32)", "gpu", int(8 * n * optim_gpu)))
            rows.append((p.name, "Adam moments (fp32)", "cpu", int(8 * n * (1 - optim_gpu) * (1 - nvme))))
            rows.append((p.name, "Adam moments (fp32)", "nvme", int(8 * n * (1 - optim_gpu) * nvme)))
        else:
            offload = bool(zero["cpu_offload"])
            width = 4 if str(trainer.get("precision", "16-mixed")).startswith("32") else 2
            device = "cpu" if offload else "gpu"
            rows.append((p.name, "weights (working)", "gpu", width * n))
            if offload:
                rows.append((p.name, "gradient bucket", "gpu", 2 * 2**20 * int(zero["reduce_bucket_size_m"])))
                rows.append((p.name, "gradients (fp32)", "cpu", 4 * n))
            else:
                rows.append((p.name, "gradients", "gpu", width * n))
            if width == 2:
                rows.append((p.name, "master weights (fp32)", device, 4 * n))
            rows.append((p.name, "Adam moments (fp32)", device, int(8 * n * (1 - nvme))))
            rows.append((p.name, "Adam moments (fp32)", "nvme", int(8 * n * nvme)))
    rows.append(("step", "activations + temporaries", "gpu", plan.activations))
    return Placement(f"ColossalAIStrategy ({plugin})", rows)


def _place_on_one_device(plan: MemoryPlan, params: dict) -> Placement | None:
    """The traced step on one device, less what stays in CPU memory: the frozen networks with `frozen_device: cpu`,
    the optimizer state with `optimizer.params.offload`. The traced peak holds every weight and state (the
    optimizer's was created before the step), so the GPU's share is the peak less those; what remains beyond
    the weights, gradients and states is the step's activations and temporaries. None when nothing is offloaded.
    """
    frozen_on_cpu = params.get("frozen_device") == "cpu"
    state_on_cpu = bool(((params.get("optimizer") or {}).get("params") or {}).get("offload"))
    if not (frozen_on_cpu or state_on_cpu):
        return None
    rows: list[tuple[str, str, str, int]] = []
    for p in plan.parts:
        frozen = not p.trainable
        rows.append((p.name, "weights (frozen)" if frozen else "weights", "cpu" if frozen and frozen_on_cpu else "gpu",
                     p.weights))  # fmt: skip
        rows.append((p.name, "gradients", "gpu", p.gradients))
        rows.append((p.name, "optimizer state", "cpu" if state_on_cpu else "gpu", p.optimizer_states))
    static = sum(p.weights + p.gradients + p.optimizer_states for p in plan.parts)
    rows.append(("step", "activations + temporaries", "gpu", max(plan.peak - static, 0)))
    return Placement("one device, " + " and ".join(
        what for what, on in (("frozen networks", frozen_on_cpu), ("optimizer state", state_on_cpu)) if on
    ) + " in CPU memory", rows)  # fmt: skip
