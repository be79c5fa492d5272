"""The rules of a training config: its sections, the Lightning keys, and what each part asks of the others.

`ldm.config` checks any `{target, params}` node against its target's signature; this module knows
what a training config holds (`model`, `data`, `lightning`), translates targets that moved and the
strategy blocks of older Colossal-AI configs, and runs the whole-config checks that strategies and
optimizers declare (`check_run_config`), so that a combination they cannot train fails at load time.
"""

from __future__ import annotations

import copy
import inspect
import logging
import re
from collections.abc import Mapping

import torch
from lightning.pytorch import LightningDataModule, Trainer
from omegaconf import DictConfig, ListConfig, OmegaConf

from ldm.config import (
    ConfigError,
    Problems,
    Sources,
    check_params,
    check_target_node,
    fail,
    import_target,
    signature,
    to_plain,
)
from ldm.training.callbacks.checkpoints import Checkpoints
from ldm.training.compvis import translate_compvis
from ldm.training.strategies import TARGET as COLOSSAL_TARGET
from ldm.training.strategies.legacy import LEGACY_TARGETS, translate_legacy_strategy
from ldm.training.strategies.options import group_flat_settings

log = logging.getLogger(__name__)

TOP_LEVEL_KEYS = ("model", "data", "lightning")
LIGHTNING_KEYS = ("trainer", "callbacks", "modelcheckpoint")
# Targets that moved when the package was laid out in floors (issue 14): old configs keep working, with a notice.
MOVED_TARGETS = {
    "ldm.strategies.ColossalAIStrategy": "ldm.training.strategies.ColossalAIStrategy",
    "ldm.strategies.HybridAdam": "ldm.training.strategies.HybridAdam",
    "ldm.strategies.CPUAdam": "ldm.training.strategies.CPUAdam",
    "ldm.callbacks.ema.EMA": "ldm.training.callbacks.ema.EMA",
    "ldm.callbacks.image_logger.ImageLogger": "ldm.training.callbacks.image_logger.ImageLogger",
    "ldm.callbacks.throughput.Throughput": "ldm.training.callbacks.throughput.Throughput",
    "ldm.optim.LowMemoryAdamW": "ldm.training.optim.LowMemoryAdamW",
    "ldm.models.autoencoder.AutoencoderTraining": "ldm.systems.autoencoder.AutoencoderTraining",
    "ldm.data.digits.DigitsDataset": "examples.digits.data.DigitsDataset",
}


def translate_moved_targets(node: DictConfig | ListConfig, key: str = "") -> None:
    """Rewrite, in place, every `target` that names a moved class by its new path, saying so once each."""
    items = node.items() if isinstance(node, DictConfig) else enumerate(node) if isinstance(node, ListConfig) else ()
    for name, value in list(items):
        where = f"{key}.{name}" if key and isinstance(name, str) else f"{key}[{name}]" if key else str(name)
        if name == "target" and isinstance(value, str) and value in MOVED_TARGETS:
            node[name] = MOVED_TARGETS[value]
            log.info("%s: %s moved to %s; translated (write the new path to silence this)", where, value, node[name])
        elif isinstance(value, (DictConfig, ListConfig)):
            translate_moved_targets(value, where)


def check_config(cfg: DictConfig, sources: Sources | None = None, scale_lr: bool = True) -> None:
    """Check the whole config before anything is built; raise every mistake found, one line each.

    A config in the CompVis / Colossal-AI shape is first translated onto ours (`ldm.training.compvis`),
    with `scale_lr` deciding whether `model.base_learning_rate` is scaled by the batch size."""
    sources = sources or Sources()
    problems = Problems()
    for key in sources.missing:
        with problems.check():
            fail(sources, key, f"required value (???) not set; pass it as {key}=VALUE")
    if sources.missing:  # the rest is checked on a copy without them, so each mistake is reported once
        cfg = _without(cfg, sources.missing)
    translate_moved_targets(cfg)
    with problems.check():
        translate_compvis(cfg, sources, scale_lr)
    with problems.check():
        half_precision_on_a_cpu(cfg)
    for key in cfg:
        if key not in TOP_LEVEL_KEYS:
            with problems.check():
                fail(sources, str(key), f"unknown section; valid sections: {', '.join(TOP_LEVEL_KEYS)}")
    for section in ("model", "data"):
        with problems.check():
            if section not in cfg:
                raise ConfigError(f"{section}: missing section; every config needs `{section}: {{target, params}}`")
            if section == "data" and isinstance(cfg.data, Mapping) and "target" in cfg.data:
                _check_datamodule(cfg.data.target, sources)
            check_target_node(cfg[section], section, sources)
    lightning = cfg.get("lightning") or {}
    if not isinstance(lightning, Mapping):
        fail(sources, "lightning", "must be a mapping")
    for key in lightning:
        if key not in LIGHTNING_KEYS:
            with problems.check():
                fail(sources, f"lightning.{key}", f"unknown key; valid keys: {', '.join(LIGHTNING_KEYS)}")
    trainer = lightning.get("trainer") or {}
    with problems.check():
        check_params(trainer, _trainer_signature(), "lightning.trainer", sources, skip=("strategy",))
    with problems.check():
        _check_strategy(cfg, trainer.get("strategy"), sources)
    with problems.check():
        _check_frozen_device(cfg, trainer, sources)
    callbacks = lightning.get("callbacks") or {}
    with problems.check():
        if not isinstance(callbacks, Mapping):
            fail(sources, "lightning.callbacks", "must be a mapping of name: {target, params}")
        for name, node in callbacks.items():
            if node is not None:  # `lightning.callbacks.NAME=null` switches off a callback a base config adds
                with problems.check():
                    check_target_node(node, f"lightning.callbacks.{name}", sources)
    checkpoint = lightning.get("modelcheckpoint") or {}
    for k in checkpoint:
        if k != "params":
            with problems.check():
                fail(
                    sources, f"lightning.modelcheckpoint.{k}", "unknown key; valid: params (every_n_train_steps, keep)"
                )
    with problems.check():
        check_params(
            checkpoint.get("params") or {},
            signature(Checkpoints),
            "lightning.modelcheckpoint.params",
            sources,
            skip=("dirpath",),
            supplied=("dirpath",),
        )
    optimizer = ((cfg.get("model") or {}).get("params") or {}).get("optimizer")
    if isinstance(optimizer, Mapping) and not problems.errors:
        check_whole = getattr(
            import_target(optimizer["target"], "model.params.optimizer.target", sources), "check_run_config", None
        )
        if check_whole is not None:  # training settings an optimizer cannot honour, e.g. clipping with a fused step
            check_whole(cfg, sources)
    problems.errors = _one_line_per_missing_package(problems.errors)
    problems.raise_any()


NEEDS = re.compile(
    r"^(?P<key>\S+)(?P<where> \([^)]*\))?: cannot import '(?P<target>[\w.]+)': (?P=target) needs (?P<what>.+)$"
)


class MissingPackage(ConfigError):
    """A target of the config needs a package this environment lacks (the config itself may be right)."""


def _one_line_per_missing_package(errors: list[ConfigError]) -> list[ConfigError]:
    """Targets that cannot be imported for want of the same package, as one line: a Colossal-AI preset on an
    environment without it names the strategy and the optimizer, and the user has one thing to install."""
    groups: dict[str, list[re.Match]] = {}
    merged: list[ConfigError | list[re.Match]] = []
    for err in errors:
        found = NEEDS.match(str(err))
        if found is None:
            merged.append(err)
        elif found["what"] in groups:
            groups[found["what"]].append(found)
        else:
            merged.append(groups.setdefault(found["what"], [found]))
    return [item if isinstance(item, ConfigError) else _needs(item) for item in merged]


def _needs(found: list[re.Match]) -> MissingPackage:
    if len(found) == 1:
        return MissingPackage(found[0].string)
    keys, names = ", ".join(m["key"] for m in found), " and ".join(m["target"].rpartition(".")[2] for m in found)
    return MissingPackage(f"{keys}{found[0]['where'] or ''}: {names} need {found[0]['what']}")


HALF_TO_BF16 = {"16-mixed": "bf16-mixed", "16": "bf16-mixed", "16-true": "bf16-true", "float16": "bfloat16"}


def half_precision_on_a_cpu(cfg: DictConfig) -> None:
    """On a machine that trains on the CPU, fp16 settings become bf16 (one log line says which).

    A CPU has no fp16 autocast: Lightning runs `16-mixed` there as bf16 autocast, under which fp16 weights
    (`frozen_dtype: float16`, made for a GPU) fail in their first normalisation layer. bf16 keeps the
    presets' memory saving. Colossal-AI runs its own mixed precision and is left as configured."""
    trainer = (cfg.get("lightning") or {}).get("trainer") or {}
    strategy = trainer.get("strategy")
    accelerator = str(trainer.get("accelerator") or "auto")
    on_cpu = accelerator == "cpu" or accelerator == "auto" and not torch.cuda.is_available()
    if not on_cpu or isinstance(strategy, Mapping) and strategy.get("target") in (COLOSSAL_TARGET, *LEGACY_TARGETS):
        return
    changed = []
    params = (cfg.get("model") or {}).get("params") or {}
    for node, key, where in ((trainer, "precision", "lightning.trainer"), (params, "frozen_dtype", "model.params")):
        value = str(node.get(key))
        if value in HALF_TO_BF16:
            node[key] = HALF_TO_BF16[value]
            changed.append(f"{where}.{key}: {value} -> {node[key]}")
    if changed:
        log.info("training on the CPU, which has no fp16: %s (bf16 saves the same memory)", ", ".join(changed))


def _without(cfg: DictConfig, keys: list[str]) -> DictConfig:
    """A copy of `cfg` with `keys` removed (a list item is set to null instead)."""
    cfg = copy.deepcopy(cfg)
    for key in keys:
        item = re.fullmatch(r"(.*)\[(\d+)\]", key)
        if item:
            OmegaConf.select(cfg, item[1])[int(item[2])] = None
        else:
            parent, _, name = key.rpartition(".")
            del (OmegaConf.select(cfg, parent) if parent else cfg)[name]
    return cfg


def _check_strategy(cfg: DictConfig, strategy: object, sources: Sources) -> None:
    if not isinstance(strategy, Mapping):
        return
    if strategy.get("target") in LEGACY_TARGETS:  # configs written for Lightning 1.x's ColossalAIStrategy
        cfg.lightning.trainer.strategy = translate_legacy_strategy(strategy)
        strategy = cfg.lightning.trainer.strategy
    elif strategy.get("target") == COLOSSAL_TARGET and isinstance(strategy.get("params"), Mapping):
        try:  # its settings, written directly under params before they were grouped
            cfg.lightning.trainer.strategy.params = group_flat_settings(to_plain(strategy.params))
        except ConfigError as err:
            fail(sources, *str(err).split(": ", 1))
        strategy = cfg.lightning.trainer.strategy
    check_target_node(strategy, "lightning.trainer.strategy", sources)
    check_whole = getattr(import_target(strategy["target"]), "check_run_config", None)
    if check_whole is not None:  # combinations a strategy cannot train, e.g. an optimizer it cannot drive
        check_whole(cfg, sources)


def _check_frozen_device(cfg: DictConfig, trainer: Mapping, sources: Sources) -> None:
    """`model.params.frozen_device` keeps networks outside what a strategy places: one process, no wrapper."""
    params = (cfg.get("model") or {}).get("params") or {}
    if not isinstance(params, Mapping) or params.get("frozen_device") is None:
        return
    strategy, devices = trainer.get("strategy", "auto"), trainer.get("devices", "auto")
    if strategy not in ("auto", "single_device") or devices not in ("auto", 1, "1", [0]):
        fail(
            sources,
            "model.params.frozen_device",
            f"keeps the frozen networks on the CPU, which one process with Lightning's default strategy allows; "
            f"this run has lightning.trainer.strategy {to_plain(strategy)!r} and devices {to_plain(devices)!r}: "
            "remove frozen_device, or train on one device without a strategy",
        )


def _check_datamodule(target: str, sources: Sources) -> None:
    cls = import_target(target, "data.target", sources)
    if not (isinstance(cls, type) and issubclass(cls, LightningDataModule)):
        fail(
            sources,
            "data.target",
            f"{target} is not a LightningDataModule; put a Dataset under "
            "data.params.dataset and set data.target: ldm.data.DataModule",
        )


def _trainer_signature() -> inspect.Signature:
    return inspect.signature(Trainer.__init__)
