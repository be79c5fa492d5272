"""Colossal-AI's ZeRO and Gemini under Lightning 2.x; the only module in ldm that imports `colossalai`.

Lightning 2 removed its `ColossalAIStrategy`. This one is built on Colossal-AI's supported API,
`Booster` with `GeminiPlugin` (chunked parameters, static or auto CPU offload) or
`LowLevelZeroPlugin` (ZeRO stage 1/2, optional CPU offload), and follows the shape of
Lightning's DeepSpeed strategy: the plugin owns precision, loss scaling, gradient clipping and
the optimizer step; checkpoints are folders written through the booster
(`ldm.training.strategies.colossal_checkpoint`).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Generator, Mapping
from datetime import timedelta
from typing import Any, Literal

import lightning.pytorch as pl
import torch
from colossalai.booster import Booster
from colossalai.booster.plugin import GeminiPlugin, LowLevelZeroPlugin
from colossalai.nn.optimizer import CPUAdam, FusedAdam, HybridAdam
from lightning.pytorch.core.optimizer import _init_optimizers_and_lr_schedulers
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.trainer.states import TrainerFn
from torch.optim import Optimizer

from ldm.config import ConfigError, Sources, fail, import_target
from ldm.training.strategies.colossal_checkpoint import BoosterCheckpoints, unwrap
from ldm.training.strategies.options import GeminiOptions, LossScaleOptions, ZeroOptions, resolved

__all__ = ["ColossalAIStrategy", "ColossalAIPrecision", "HybridAdam", "CPUAdam"]

log = logging.getLogger(__name__)

GEMINI_OPTIMIZERS = (HybridAdam, CPUAdam, FusedAdam)
NVME_OPTIMIZERS = (HybridAdam, CPUAdam)
# Callbacks that read the trained weights between steps; Gemini keeps them in chunks it may move or free.
READS_WEIGHTS = ("ldm.training.callbacks.ema.EMA", "ldm.training.callbacks.image_logger.ImageLogger")


def _plugin_precision(flag: str) -> str:
    """Lightning's precision flag as the plugin's: '16-mixed' -> 'fp16', 'bf16-mixed' -> 'bf16', '32-true' -> 'fp32'."""
    flag = str(flag)
    if flag.startswith("bf16"):
        return "bf16"
    if flag.startswith("16"):
        return "fp16"
    if flag.startswith("32"):
        return "fp32"
    raise ConfigError(f"lightning.trainer.precision: {flag!r} is not usable with ColossalAIStrategy; use 16-mixed")


class ColossalAIPrecision(Precision):
    """Precision handled by the Colossal-AI plugin: it casts the model, scales the loss, clips and steps."""

    def __init__(self, precision: str) -> None:
        self.precision = precision  # Lightning's flag, e.g. "16-mixed"
        self.plugin_precision = _plugin_precision(precision)

    def backward(self, tensor: torch.Tensor, model: pl.LightningModule, optimizer: Any, *args, **kwargs) -> None:
        unwrap(optimizer).backward(tensor)  # loss scaling and gradient reduction into ZeRO / Gemini buffers

    def optimizer_step(self, optimizer: Any, model: Any, closure: Callable[[], Any], **kwargs: Any) -> Any:
        closure_result = closure()
        self._after_closure(model, optimizer)
        if closure_result is None and isinstance(model, pl.LightningModule) and model.automatic_optimization:
            return None  # training_step skipped this batch (the non-finite loss guard): no update
        unwrap(optimizer).step()  # skips the update (and lowers the loss scale) on fp16 overflow
        return closure_result

    def clip_gradients(self, *args: Any, **kwargs: Any) -> None:
        """Clipping happens inside the optimizer wrapper (`max_norm`, from `trainer.gradient_clip_val`)."""


def _unsupported(
    plugin: str, clip_algorithm: Any, precision: Any, optimizer_cls: type | None, optimizer_name: str
) -> tuple[str, str] | None:
    """(key, why) of the first setting this strategy cannot train with, or None."""
    if clip_algorithm not in (None, "norm"):
        return "lightning.trainer.gradient_clip_algorithm", "ColossalAIStrategy clips by norm only"
    if plugin == "gemini" and precision is not None and _plugin_precision(precision) == "fp32":
        return "lightning.trainer.precision", "Gemini trains in fp16 or bf16; use 16-mixed or bf16-mixed"
    if plugin == "gemini" and optimizer_cls is not None and optimizer_cls not in GEMINI_OPTIMIZERS:
        return (
            "model.params.optimizer.target",
            f"{optimizer_name} cannot be driven by Gemini; use ldm.training.strategies.HybridAdam (or CPUAdam)",
        )
    return None


class ColossalAIStrategy(BoosterCheckpoints, DDPStrategy):
    """Train with Colossal-AI's Gemini (`plugin: gemini`) or ZeRO stage 1/2 (`plugin: zero`).

    Precision comes from `trainer.precision` (16-mixed -> fp16, bf16-mixed -> bf16; ZeRO also takes
    32-true), gradient clipping from `trainer.gradient_clip_val` (by norm). With Gemini the model's
    optimizer must be `ldm.training.strategies.HybridAdam` or `CPUAdam`; those also offload optimizer states
    to NVMe (`nvme_offload_fraction`, `nvme_offload_dir` in `model.params.optimizer.params`; needs
    the `tensornvme` package). The settings of each plugin are a group of their own
    (`ldm.training.strategies.options`), documented in Colossal-AI's `GeminiPlugin` and `LowLevelZeroPlugin`.
    """

    strategy_name = "colossalai"

    def __init__(
        self,
        plugin: Literal["gemini", "zero"] = "gemini",
        gemini: GeminiOptions | None = None,
        zero: ZeroOptions | None = None,
        loss_scale: LossScaleOptions | None = None,
        checkpoint_shard_mb: int = 1024,
        process_group_backend: str | None = None,
        timeout_minutes: float = 30,
    ) -> None:
        super().__init__(process_group_backend=process_group_backend, timeout=timedelta(minutes=timeout_minutes))
        self.plugin_name = plugin
        self.gemini_options = resolved("gemini", gemini)
        zero_options = resolved("zero", zero)
        zero_options["reduce_bucket_size_in_m"] = zero_options.pop("reduce_bucket_size_m")  # the plugin's name
        self.zero_options = zero_options
        self.scaler_options = resolved("loss_scale", loss_scale)
        self.checkpoint_shard_mb = checkpoint_shard_mb
        self.booster: Booster | None = None

    # -- configuration checks, run by ldm.training.checks.check_config before anything is built ------------

    @staticmethod
    def check_run_config(cfg: Mapping, sources: Sources | None = None) -> None:
        """Reject combinations this strategy cannot train, naming the key and what to write instead."""
        strategy = cfg["lightning"]["trainer"]["strategy"]
        params = strategy.get("params") or {}
        plugin = params.get("plugin", "gemini")
        other = "zero" if plugin == "gemini" else "gemini"
        if params.get(other):
            fail(sources, f"lightning.trainer.strategy.params.{other}", f"applies to plugin {other} only")
        if (cfg["model"].get("params") or {}).get("lora"):
            fail(
                sources,
                "model.params.lora",
                "not supported with ColossalAIStrategy; LoRA needs no offload on 8 GB: "
                "use configs/finetune/sd15-lora.yaml (Lightning's default strategy)",
            )
        trainer = cfg["lightning"]["trainer"]
        precision = trainer.get("precision")
        if precision is not None:
            try:
                _plugin_precision(precision)
            except ConfigError as err:
                fail(sources, "lightning.trainer.precision", str(err).split(": ", 1)[1])
        spec = (cfg["model"].get("params") or {}).get("optimizer") or {"target": "torch.optim.AdamW"}
        optimizer_cls = import_target(spec["target"], "model.params.optimizer.target", sources)
        problem = _unsupported(plugin, trainer.get("gradient_clip_algorithm"), precision, optimizer_cls, spec["target"])
        if problem is not None:
            fail(sources, *problem)
        nvme = ((spec.get("params") or {}).get("nvme_offload_fraction")) or 0
        if nvme:
            if optimizer_cls not in NVME_OPTIMIZERS:
                fail(sources, "model.params.optimizer.params.nvme_offload_fraction", "needs HybridAdam or CPUAdam")
            if not _has_tensornvme():
                fail(
                    sources,
                    "model.params.optimizer.params.nvme_offload_fraction",
                    "NVMe offload needs the tensornvme package (pip install tensornvme; it builds liburing)",
                )
        if plugin == "gemini":
            for name, node in (cfg["lightning"].get("callbacks") or {}).items():
                if isinstance(node, Mapping) and node.get("target") in READS_WEIGHTS:
                    fail(
                        sources,
                        f"lightning.callbacks.{name}",
                        f"{node['target']} reads the weights between steps, which Gemini keeps in moving chunks; "
                        "use plugin: zero for EMA and sample grids",
                    )

    # -- Lightning integration ---------------------------------------------------------------------

    @property
    def precision_plugin(self) -> Precision:
        return self._precision_plugin if self._precision_plugin is not None else ColossalAIPrecision("16-mixed")

    @precision_plugin.setter
    def precision_plugin(self, plugin: Precision | None) -> None:
        if plugin is not None and not isinstance(plugin, ColossalAIPrecision):
            plugin = ColossalAIPrecision(getattr(plugin, "precision", "32-true"))
        self._precision_plugin = plugin

    @contextlib.contextmanager
    def tensor_init_context(self, empty_init: bool | None = None) -> Generator[None, None, None]:
        """Build the model on the CPU; the plugin moves (or offloads) each part where it belongs."""
        yield

    def model_to_device(self) -> None:
        """The booster places the model."""

    def setup_optimizers(self, trainer: pl.Trainer) -> None:
        """Optimizers are built in `setup`, then wrapped by the booster with the model."""
        self.optimizers, self.lr_scheduler_configs = [], []

    def setup(self, trainer: pl.Trainer) -> None:
        assert self.accelerator is not None and self.model is not None
        self.accelerator.setup(trainer)
        optimizer, scheduler_configs = None, []
        if trainer.state.fn == TrainerFn.FITTING:
            optimizers, scheduler_configs = _init_optimizers_and_lr_schedulers(self.lightning_module)
            if len(optimizers) != 1:
                raise ValueError(
                    f"ColossalAIStrategy trains with one optimizer; configure_optimizers gave {len(optimizers)}"
                )
            optimizer = optimizers[0]
        # The config was checked at load; a strategy built in code gets the same rules here.
        problem = _unsupported(
            self.plugin_name,
            trainer.gradient_clip_algorithm,
            self.precision_plugin.precision,
            type(optimizer) if optimizer is not None else None,
            type(optimizer).__name__,
        )
        if problem is not None:
            raise ConfigError(": ".join(problem))
        self.booster = Booster(plugin=self._make_plugin(trainer))
        self.model, optimizer, *_ = self.booster.boost(self.model, optimizer)
        self.model, optimizers, self.lr_scheduler_configs = self.precision_plugin.connect(
            self.model, [optimizer] if optimizer is not None else [], scheduler_configs
        )
        self.optimizers = optimizers  # Lightning wraps each optimizer in a LightningOptimizer here
        for wrapper in self._lightning_optimizers:
            # The wrapper subclasses the ZeRO optimizer and shares its hook handles; the ZeRO optimizer's
            # __del__ removes its gradient hooks, so a discarded wrapper would silently stop training.
            type(wrapper).__del__ = _leave_hooks
        log.info("ColossalAIStrategy: %s plugin, %s", self.plugin_name, self.precision_plugin.plugin_precision)

    def _make_plugin(self, trainer: pl.Trainer) -> GeminiPlugin | LowLevelZeroPlugin:
        precision = self.precision_plugin.plugin_precision
        max_norm = float(trainer.gradient_clip_val or 0.0)
        if self.plugin_name == "gemini":
            return GeminiPlugin(
                **self.gemini_options,
                **self.scaler_options,
                precision=precision,
                max_norm=max_norm,
                enable_gradient_accumulation=trainer.accumulate_grad_batches > 1,
            )
        return LowLevelZeroPlugin(**self.zero_options, **self.scaler_options, precision=precision, max_norm=max_norm)

    @property
    def handles_gradient_accumulation(self) -> bool:
        return False  # Lightning skips the step; the plugin keeps gradients between backward passes

    @property
    def restore_checkpoint_after_setup(self) -> bool:
        return True  # the booster must have wrapped model and optimizer before states load into them

    @property
    def lightning_restore_optimizer(self) -> bool:
        return False  # loaded in load_checkpoint, shard by shard

    def lightning_module_state_dict(self) -> dict[str, Any]:
        return {}  # the weights are written by the booster in save_checkpoint

    def optimizer_state(self, optimizer: Optimizer) -> dict[str, torch.Tensor]:
        return {}  # likewise

    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        """Weights were loaded by the booster in `load_checkpoint`."""

    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        """Optimizer states were loaded by the booster in `load_checkpoint`."""

    def teardown(self) -> None:
        """Release the plugin's process groups; the wrapped model stays where the plugin put it."""
        assert self.accelerator is not None
        self.precision_plugin.teardown()
        self.accelerator.teardown()
        self.checkpoint_io.teardown()
        self.booster = None


def _leave_hooks(self: Any) -> None:
    """Finalizer for LightningOptimizer wrappers: the wrapped optimizer owns the hooks."""


def _has_tensornvme() -> bool:
    try:
        import tensornvme  # noqa: F401
    except ImportError:
        return False
    return True
