"""Measure training speed: optimizer steps/s and images/s, in all and per process, and the model FLOPs
utilisation (MFU), logged and summarised at the end.

The FLOPs of one training batch (forward, backward and the optimizer step, on one process) are counted once,
on the first batch of a new run, with `torch.utils.flop_counter.FlopCounterMode`; that batch is a warm-up batch,
not timed. The count is kept in checkpoints: a resumed run does not count again, because a step run under the
counter can round differently in the last bit (its ops go through the counter's dispatch), and a resume must
repeat the unbroken run's losses exactly.
MFU is those FLOPs per image times the images each process trains per second, over the device's dense peak at
the run's precision (Lightning's table, `get_available_flops`); where no peak is known (a CPU, an unlisted
GPU) the achieved TFLOP/s are logged without it. Under Colossal-AI the count is not made (its Gemini hooks on a
GPU have not been checked under the counter), and only images/s are logged.
"""

from __future__ import annotations

import logging
import time

import lightning.pytorch as pl
import torch

log = logging.getLogger("ldm")

PRECISION_DTYPES = {"bf16": torch.bfloat16, "16": torch.float16, "transformer-engine": torch.bfloat16}


def compute_dtype(precision: str) -> torch.dtype:
    """The dtype matmuls run in at a Trainer precision ("bf16-mixed", "16-true", "32-true", ...)."""
    return PRECISION_DTYPES.get(str(precision).split("-")[0], torch.float32)


def dense_peak_flops(device: torch.device, dtype: torch.dtype) -> float | None:
    """The device's dense peak FLOP/s at `dtype`, from Lightning's table; None where it has none (CPUs)."""
    if device.type != "cuda":
        return None
    from lightning.fabric.utilities.throughput import get_available_flops

    peak = get_available_flops(device, dtype)
    return float(peak) if peak else None


class Throughput(pl.Callback):
    """Log `perf/steps_per_s`, `perf/images_per_s`, `perf/images_per_s_per_process`, on a GPU
    `perf/max_memory_gib` (the peak allocated so far), and, once one batch's FLOPs are counted,
    `perf/tflops_per_s_per_process` and `perf/mfu` (where the device's peak is known); the first
    `warmup_steps` are not counted. `count_flops: false` skips the count (it runs the first batch under
    PyTorch's FLOP counter, which some strategies' hooks may not take)."""

    def __init__(self, warmup_steps: int = 1, count_flops: bool = True) -> None:
        self.warmup_steps, self.count_flops = warmup_steps, count_flops
        self._start: float | None = None
        self._start_step = 0
        self._images = 0
        self._counter = None
        self.flops_per_image: float | None = None  # one process's FLOPs per image it trains on
        self.peak: float | None = None

    # -- the FLOP count, on the first batch ---------------------------------------------------------

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch, batch_idx) -> None:
        if not self.count_flops or self.flops_per_image is not None or self._counter is not None:
            return
        if trainer.global_step > 0:  # resumed: counted by the run that started it (see the module docstring)
            return
        if hasattr(trainer.strategy, "booster"):  # Colossal-AI: its GPU hooks are not checked under the counter
            self.count_flops = False
            return
        from torch.utils.flop_counter import FlopCounterMode

        self._counter = FlopCounterMode(display=False)
        self._counter.__enter__()

    def _stop_counting(self) -> float | None:
        counter, self._counter = self._counter, None
        if counter is None:
            return None
        counter.__exit__(None, None, None)
        return float(counter.get_total_flops())

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._stop_counting()

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs, batch, batch_idx) -> None:
        batch_size = len(batch["caption"])
        if self._counter is not None:
            flops = self._stop_counting()
            self.flops_per_image = flops / batch_size if flops else None
        step = trainer.global_step
        if self._start is None:
            if step >= self._start_step + self.warmup_steps or step >= trainer.max_steps > 0:
                self._start, self._start_step, self._images = time.perf_counter(), step, 0
            return
        self._images += batch_size * trainer.world_size
        elapsed = time.perf_counter() - self._start
        if elapsed > 0 and step > self._start_step:
            rates = self._rates(trainer, step - self._start_step, elapsed)
            if pl_module.device.type == "cuda":
                rates["perf/max_memory_gib"] = torch.cuda.max_memory_allocated(pl_module.device) / 2**30
            pl_module.log_dict(rates, batch_size=1)

    def _rates(self, trainer: pl.Trainer, steps: int, elapsed: float) -> dict[str, float]:
        per_process = self._images / elapsed / trainer.world_size
        rates = {
            "perf/steps_per_s": steps / elapsed,
            "perf/images_per_s": self._images / elapsed,
            "perf/images_per_s_per_process": per_process,
        }
        if self.flops_per_image:
            achieved = self.flops_per_image * per_process
            rates["perf/tflops_per_s_per_process"] = achieved / 1e12
            if self.peak:
                rates["perf/mfu"] = achieved / self.peak
        return rates

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._start, self._start_step = None, trainer.global_step  # after a resume: the restored step
        self.peak = dense_peak_flops(pl_module.device, compute_dtype(trainer.precision))

    def state_dict(self) -> dict[str, float | None]:
        return {"flops_per_image": self.flops_per_image}

    def load_state_dict(self, state_dict: dict[str, float | None]) -> None:
        self.flops_per_image = state_dict.get("flops_per_image")

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._stop_counting()
        if self._start is None or trainer.global_step <= self._start_step:
            return
        elapsed = time.perf_counter() - self._start
        steps = trainer.global_step - self._start_step
        rates = self._rates(trainer, steps, elapsed)
        line = (
            f"throughput: {steps} steps in {elapsed:.1f} s after warm-up: {rates['perf/steps_per_s']:.2f} steps/s, "
            f"{rates['perf/images_per_s']:.1f} images/s ({rates['perf/images_per_s_per_process']:.1f} per process)"
        )
        if "perf/tflops_per_s_per_process" in rates:
            line += f"; {rates['perf/tflops_per_s_per_process']:.4g} TFLOP/s per process"
            dtype = str(compute_dtype(trainer.precision)).removeprefix("torch.")
            if "perf/mfu" in rates:
                peak = f"{self.peak / 1e12:.0f} TFLOP/s"
                line += f", MFU {100 * rates['perf/mfu']:.1f} % of the {dtype} dense peak {peak}"
            else:
                line += f" (no dense {dtype} peak known for {pl_module.device.type}: no MFU)"
            line += f"; {self.flops_per_image:.4g} FLOPs per image (counted once)"
        log.info(line)
