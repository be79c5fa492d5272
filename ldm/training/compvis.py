"""CompVis / Colossal-AI Stable Diffusion configs, translated onto ours before they are checked.

The configs of CompVis `ldm`, Stability's SD 2 and the Colossal-AI example (`train_colossalai.yaml`,
`train_pokemon.yaml`, `v1-inference.yaml`, ...) describe the model by its original classes
(`unet_config`, `first_stage_config`, `cond_stage_config`), the noise schedule by `linear_start` /
`linear_end` / `timesteps`, and Lightning 1.x trainer keys. Each key is either translated onto
`ldm.models.diffusion.ddpm.LatentDiffusion`'s own keys, or listed once, in one log line, as ignored with
the reason; a key that would change training and has no equivalent is an error. Architectures are
read with diffusers' own converters (`create_unet_diffusers_config_from_ldm`, `..._vae_...`).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

from ldm.config import ConfigError, Problems, Sources, fail, to_plain
from ldm.training.compvis_parts import node_params, translate_parts
from ldm.training.strategies import TARGET as COLOSSAL_TARGET
from ldm.training.strategies.legacy import LEGACY_TARGETS

log = logging.getLogger(__name__)

MODEL_TARGET = "ldm.models.diffusion.ddpm.LatentDiffusion"
DATA_TARGET = "ldm.data.compvis.DataModuleFromConfig"
DATAMODULES = ("main.DataModuleFromConfig", DATA_TARGET)
LR_SCHEDULERS = {"ldm.lr_scheduler.LambdaLinearScheduler": "ldm.training.lr_schedules.LambdaLinear"}
PARAMETERIZATIONS = {"eps": "epsilon", "v": "v_prediction"}
BETA_SCHEDULES = {"linear": "scaled_linear", "cosine": "squaredcos_cap_v2"}  # CompVis "linear" is linear in sqrt(beta)

# CompVis LatentDiffusion keys with nothing to do here, and why.
IGNORED = {
    "monitor": "runs here do not validate; checkpoints are saved by step",
    "log_every_t": "no intermediate denoising steps are logged",
    "image_size": "the latent size follows the images",
    "channels": "the latent channels come from the VAE",
    "use_fp16": "precision is lightning.trainer.precision",
    "check_nan_inf": "non-finite losses are always caught (model.params.nonfinite_loss)",
    "first_stage_key": "read by the data module as the image key",
    "cond_stage_key": "read by the data module as the caption key",
    "ignore_keys": "nothing is left out of a checkpoint read",
    "load_only_unet": "every part is read",
    "scale_by_std": "the scaling factor comes from the VAE",
}
# Keys that are fine at Stable Diffusion's value only; another value would train something else.
FIXED = {
    "num_timesteps_cond": 1,
    "conditioning_key": "crossattn",
    "loss_type": "l2",
    "l_simple_weight": 1.0,
    "original_elbo_weight": 0.0,
    "learn_logvar": False,
    "logvar_init": 0.0,
    "cond_stage_forward": None,
    "concat_mode": True,
    "use_positional_encodings": False,
    "v_posterior": 0.0,
    "clip_denoised": True,
    "cosine_s": 8e-3,
}
COMPVIS_KEYS = {
    *IGNORED,
    *FIXED,
    *("linear_start", "linear_end", "timesteps", "beta_schedule", "parameterization", "scale_factor"),
    *("cond_stage_trainable", "use_ema", "ckpt", "ckpt_path", "scheduler_config"),
    *("unet_config", "first_stage_config", "cond_stage_config"),
}
TRAINER_IGNORED = {
    "log_gpu_memory": "Lightning 2 removed it; the throughput line in train.log reports memory",
    "auto_select_gpus": "Lightning 2 removed it; set lightning.trainer.devices",
    "logger": "runs always log to TensorBoard and CSV in the run folder",
    "default_root_dir": "the run folder is LOGDIR/<time>_<name> (-l, -n)",
    "weights_summary": "Lightning 2 removed it",
    "progress_bar_refresh_rate": "Lightning 2 removed it",
    "replace_sampler_ddp": "the data module shards data itself",
    "checkpoint_callback": "checkpoints are lightning.modelcheckpoint",
}
PRECISIONS = {16: "16-mixed", "16": "16-mixed", 32: "32-true", "32": "32-true", "bf16": "bf16-mixed", 64: "64-true"}


def is_compvis_model(model: Any) -> bool:
    """Whether a `model` section is in the CompVis shape (no target, `base_learning_rate`, or CompVis keys)."""
    if not isinstance(model, Mapping) or model.get("target") not in (None, MODEL_TARGET):
        return False
    params = model.get("params") or {}
    return "target" not in model or "base_learning_rate" in model or any(k in COMPVIS_KEYS for k in params)


def translate_compvis(cfg: DictConfig, sources: Sources, scale_lr: bool = True) -> None:
    """Rewrite, in place, the CompVis-shaped parts of a config as ours; log what was ignored, and why."""
    problems, ignored = Problems(), []
    model = cfg.get("model")
    compvis_model = is_compvis_model(model)
    params = to_plain(model.get("params") or {}) if compvis_model else {}
    with problems.check():  # before the model: the learning rate rule reads the batch size
        _translate_data(cfg, {k: params.get(k) for k in ("first_stage_key", "cond_stage_key")}, ignored)
    if compvis_model:
        with problems.check():
            ours = _model_params(params, cfg, ignored)
            for k in model:
                if k not in ("target", "params", "base_learning_rate"):
                    fail(sources, f"model.{k}", "unknown key; valid: target, params, base_learning_rate")
            cfg.model = OmegaConf.create({"target": MODEL_TARGET, "params": ours})
            if "base_learning_rate" in model:
                cfg.model.params.learning_rate = _learning_rate(cfg, float(model.base_learning_rate), scale_lr)
    with problems.check():
        _translate_lightning(cfg, ignored)
    strategy = ((cfg.get("lightning") or {}).get("trainer") or {}).get("strategy")
    colossal = isinstance(strategy, Mapping) and strategy.get("target") in (*LEGACY_TARGETS, COLOSSAL_TARGET)
    if compvis_model and colossal and "optimizer" not in (cfg.model.params or {}):  # as the Colossal-AI example
        cfg.model.params.optimizer = {"target": "ldm.training.strategies.HybridAdam"}
        log.info("model.params.optimizer: ldm.training.strategies.HybridAdam, as the Colossal-AI example trains")
    problems.raise_any()
    if ignored:
        log.info("ignored (nothing here reads them): %s", "; ".join(ignored))


def _model_params(params: dict, cfg: DictConfig, ignored: list[str]) -> dict:
    """CompVis `model.params` as our factory's params (our own keys pass through unchanged)."""
    key = "model.params"
    problems = Problems()
    ours = {k: v for k, v in params.items() if k not in COMPVIS_KEYS}
    for k, reason in IGNORED.items():
        if k in params:
            ignored.append(f"{key}.{k} ({reason})")
    for k, value in FIXED.items():
        if k in params and params[k] != value:
            with problems.check():
                raise ConfigError(f"{key}.{k}: got {params[k]!r}; only Stable Diffusion's {value!r} trains here")
        elif k in params:
            ignored.append(f"{key}.{k} (Stable Diffusion's value)")
    ckpt = [params[k] for k in ("ckpt", "ckpt_path") if params.get(k)]
    if len(set(ckpt)) > 1:
        problems.errors.append(ConfigError(f"{key}.ckpt and {key}.ckpt_path name different files; keep one"))
    if ckpt and "pretrained" in ours:
        problems.errors.append(ConfigError(f"{key}.ckpt and {key}.pretrained both name weights; keep one"))
    if ckpt:
        ours["pretrained"] = ckpt[0]
    from_weights = "pretrained" in ours
    with problems.check():
        _schedule(params, ours, from_weights, key)
    if params.get("cond_stage_trainable"):
        ours.setdefault("trainable", ["unet", "text_encoder"])
    with problems.check():
        _ema(params.get("use_ema"), cfg, key)
    if params.get("scheduler_config") is not None:
        with problems.check():
            ours["lr_lambda"] = _lr_lambda(params["scheduler_config"], f"{key}.scheduler_config")
    with problems.check():
        translate_parts(params, ours, from_weights, ignored)
    problems.raise_any()
    return ours


def _schedule(params: dict, ours: dict, from_weights: bool, key: str) -> None:
    schedule = {}
    names = {"linear_start": "beta_start", "linear_end": "beta_end", "timesteps": "num_train_timesteps"}
    for theirs, mine in names.items():
        if theirs in params:
            schedule[mine] = params[theirs]
    beta_schedule = params.get("beta_schedule", "linear")
    if beta_schedule not in BETA_SCHEDULES:
        raise ConfigError(f"{key}.beta_schedule: got {beta_schedule!r}; valid: {', '.join(map(repr, BETA_SCHEDULES))}")
    schedule["beta_schedule"] = BETA_SCHEDULES[beta_schedule]
    if "parameterization" in params:
        value = params["parameterization"]
        if value not in PARAMETERIZATIONS:
            raise ConfigError(f"{key}.parameterization: got {value!r}; valid: 'eps', 'v'")
        ours.setdefault("prediction_type", PARAMETERIZATIONS[value])
    if "scale_factor" in params and from_weights:
        ours.setdefault("scaling_factor", float(params["scale_factor"]))
    if from_weights:
        ours.setdefault("noise_schedule", schedule)
    else:  # trained from a config: the schedule is the scheduler's whole config
        config = {"beta_start": 0.0001, "beta_end": 0.02, "num_train_timesteps": 1000, **schedule}
        config |= {"clip_sample": False, "steps_offset": 1, "prediction_type": ours.pop("prediction_type", "epsilon")}
        ours.setdefault("scheduler", {"config": config})


def _ema(use_ema: Any, cfg: DictConfig, key: str) -> None:
    callbacks = ((cfg.get("lightning") or {}).get("callbacks")) or {}
    has_ema = any(isinstance(n, Mapping) and str(n.get("target", "")).endswith(".EMA") for n in callbacks.values())
    if use_ema and not has_ema:
        OmegaConf.update(cfg, "lightning.callbacks.ema", {"target": "ldm.training.callbacks.ema.EMA"}, merge=True)
    elif use_ema is False and has_ema:
        raise ConfigError(f"{key}.use_ema: false, but lightning.callbacks lists an EMA callback; keep one")


def _lr_lambda(node: Any, key: str) -> dict:
    target, params, _ = node_params(node, key)
    target = target or "ldm.lr_scheduler.LambdaLinearScheduler"  # the one CompVis configs use
    if target not in LR_SCHEDULERS:
        raise ConfigError(f"{key}.target: {target} has no equivalent here; valid: {', '.join(LR_SCHEDULERS)}")
    return {"target": LR_SCHEDULERS[target], "params": params}


def _learning_rate(cfg: DictConfig, base: float, scale_lr: bool) -> float:
    """CompVis' rule: the base learning rate times accumulation, devices and batch size (unless --scale_lr false)."""
    if (cfg.model.params or {}).get("learning_rate") is not None:
        raise ConfigError("model.base_learning_rate and model.params.learning_rate: both set; keep one")
    if not scale_lr:
        log.info("learning rate: %.2e (model.base_learning_rate; --scale_lr false)", base)
        return base
    trainer = (cfg.get("lightning") or {}).get("trainer") or {}
    accumulate = int(trainer.get("accumulate_grad_batches") or 1)
    devices, nodes = _device_count(trainer), int(trainer.get("num_nodes") or 1)
    batch = int(((cfg.get("data") or {}).get("params") or {}).get("batch_size") or 1)
    lr = base * accumulate * devices * nodes * batch
    log.info(
        "learning rate: %.2e = %.2e (model.base_learning_rate) x %d (accumulate_grad_batches) x %d (devices) "
        "x %d (nodes) x %d (batch size); --scale_lr false keeps the base",
        lr, base, accumulate, devices, nodes, batch,
    )  # fmt: skip
    return lr


def _device_count(trainer: Mapping) -> int:
    devices = trainer.get("devices", "auto")
    if isinstance(devices, int) and devices > 0:
        return devices
    if isinstance(devices, (list, tuple)) or OmegaConf.is_list(devices):
        return len(devices)
    if isinstance(devices, str) and devices not in ("auto", "-1"):
        return len([d for d in devices.split(",") if d.strip()]) if "," in devices else max(1, int(devices))
    on_cpu = trainer.get("accelerator") == "cpu" or not torch.cuda.is_available()
    return 1 if on_cpu else torch.cuda.device_count()


def _translate_data(cfg: DictConfig, keys: dict, ignored: list[str]) -> None:
    data = cfg.get("data")
    if not isinstance(data, Mapping) or data.get("target") not in (*DATAMODULES, None):
        return
    _, params, where = node_params(to_plain(data), "data")  # under data.params, or held directly by data
    if data.get("target") is None and "train" not in params:
        return
    for k, reason in {
        "wrap": "any dataset with __len__ and __getitem__ is served as is",
        "validation": "runs here do not validate",
        "test": "runs here do not test",
        "predict": "runs here do not predict",
        "use_worker_init_fn": "workers are seeded by the data module",
        "shuffle_test_loader": "runs here do not test",
        "shuffle_val_dataloader": "runs here do not validate",
    }.items():
        if k in params:
            params.pop(k)
            ignored.append(f"{where}.{k} ({reason})")
    if keys.get("first_stage_key"):
        params.setdefault("image_key", keys["first_stage_key"])
    if keys.get("cond_stage_key"):
        params.setdefault("caption_key", keys["cond_stage_key"])
    if data.get("target") != DATA_TARGET:
        log.info("data: %s is %s here", data.get("target") or "a data section without a target", DATA_TARGET)
    cfg.data = OmegaConf.create({"target": DATA_TARGET, "params": params})


def _translate_lightning(cfg: DictConfig, ignored: list[str]) -> None:
    lightning = cfg.get("lightning")
    if not isinstance(lightning, Mapping):
        return
    for k in ("logger", "logger_config"):
        if k in lightning:
            ignored.append(f"lightning.{k} (runs always log to TensorBoard and CSV in the run folder)")
            del lightning[k]
    trainer = lightning.get("trainer")
    if not isinstance(trainer, Mapping):
        return
    for k, reason in TRAINER_IGNORED.items():
        if k in trainer:
            ignored.append(f"lightning.trainer.{k} ({reason})")
            del trainer[k]
    if "gpus" in trainer:
        gpus = trainer.pop("gpus")
        if "devices" in trainer:
            raise ConfigError("lightning.trainer.gpus and lightning.trainer.devices: both set; keep devices")
        if gpus not in (None, 0, "0", ""):
            trainer.accelerator = trainer.get("accelerator") or "gpu"
            trainer.devices = gpus.strip(",") if isinstance(gpus, str) else gpus
    if trainer.get("precision") in PRECISIONS:
        trainer.precision = PRECISIONS[trainer.precision]
    if "resume_from_checkpoint" in trainer:
        raise ConfigError("lightning.trainer.resume_from_checkpoint: resume with -r PATH (or -r auto -n NAME)")
    strategy = trainer.get("strategy")
    if isinstance(strategy, Mapping) and not strategy.get("target"):  # the Colossal-AI example's block
        _, settings, _ = node_params(to_plain(strategy), "lightning.trainer.strategy")
        trainer.strategy = {"target": "strategies.ColossalAIStrategy", "params": settings}
