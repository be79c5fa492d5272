"""CompVis / Colossal-AI configs run as they are: tiny models in the shape of the Colossal-AI example's
`train_colossalai.yaml` and `train_pokemon.yaml` (fixture configs of our own) fine-tune through main.py on a
CPU and export; the original inference YAMLs translate to exactly the shipped architectures."""

from __future__ import annotations

import importlib.util
import json
import logging
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from ldm.config import ConfigError, Sources, load_config
from ldm.training.checks import check_config
from ldm.training.compvis import translate_compvis
from ldm.training.lr_schedules import LambdaLinear
from tests.conftest import REPO, write_images
from tests.fixtures.compvis import tiny_parts, write_part_files
from tests.helpers import SD_FOLDER, run_script, train_once

CONFIGS = Path(__file__).resolve().parent / "fixtures" / "configs"
ON_CPU = ["lightning.trainer.accelerator=cpu", "lightning.trainer.devices=1", "lightning.trainer.precision=32",
          "lightning.trainer.strategy=null", "lightning.trainer.max_steps=2", "lightning.trainer.max_epochs=null",
          "lightning.trainer.log_every_n_steps=1"]  # fmt: skip


@pytest.fixture(scope="module")
def images(tmp_path_factory) -> Path:
    return write_images(tmp_path_factory.mktemp("compvis-images"), n=4, size=(16, 16))


@pytest.fixture(scope="module")
def v_ckpt(tmp_path_factory) -> Path:
    """An original-layout single file (OpenCLIP text layout, v-prediction) of the colossalai-shape architecture."""
    from ldm.weights.single_file import save_single_file

    return save_single_file(tiny_parts("v_prediction"), tmp_path_factory.mktemp("ckpt") / "tiny-v.ckpt",
                            text_layout="open_clip")  # fmt: skip


@pytest.fixture(scope="module")
def part_files(tmp_path_factory) -> dict[str, Path]:
    return write_part_files(tiny_parts(linear=False), tmp_path_factory.mktemp("pokemon-weights"))


def pokemon_overrides(part_files, images) -> list[str]:
    return [
        f"model.params.unet_config.params.from_pretrained={part_files['unet']}",
        f"model.params.first_stage_config.params.from_pretrained={part_files['vae']}",
        f"model.params.cond_stage_config.params.version={part_files['text_encoder']}",
        f"data.params.train.params.root={images}",
    ]


@pytest.mark.parametrize(
    "name, data_key",
    [("colossalai-shape.yaml", "data.params"), ("colossalai-flat-shape.yaml", "data")],
    ids=["under-params", "held-directly"],
)
def test_colossalai_example_shapes_fine_tune_and_export(name, data_key, v_ckpt, images, tmp_path, caplog):
    """Both forms the example has shipped: every sub-config under `params:`, or holding its keys directly."""
    logdir = tmp_path / "logs"
    argv = ["-t", "-b", str(CONFIGS / name), "-l", str(logdir),
            f"model.params.ckpt={v_ckpt}", f"{data_key}.train.params.root={images}", *ON_CPU]  # fmt: skip
    with caplog.at_level(logging.INFO, logger="ldm"):
        run_dir = train_once(argv, logdir)
    saved = OmegaConf.load(run_dir / "configs" / "project.yaml")
    params = saved.model.params
    assert params.pretrained == str(v_ckpt) and params.prediction_type == "v_prediction"
    assert params.learning_rate == pytest.approx(1e-4 * 2)  # base x accumulate 1 x 1 device x batch 2
    assert params.gradient_checkpointing is True  # unet_config.params.use_checkpoint
    assert saved.data.target == "ldm.data.compvis.DataModuleFromConfig" and saved.data.params.caption_key == "txt"
    ignored = [r.getMessage() for r in caplog.records if r.getMessage().startswith("ignored")]
    assert len(ignored) == 1, "every ignored key in one line"
    for key in (
        "model.params.monitor",
        "lightning.logger_config",
        "lightning.trainer.log_gpu_memory",
        f"{data_key}.wrap",
    ):
        assert key in ignored[0]
    # the LambdaLinear warm-up (f_start 1e-6 -> f_max 1 over 2 steps) drove the logged learning rate
    rows = (next((run_dir / "csv").iterdir()) / "metrics.csv").read_text().splitlines()
    header = rows[0].split(",")
    lrs = [float(r.split(",")[header.index("lr-AdamW")]) for r in rows[1:] if r.split(",")[header.index("lr-AdamW")]]
    assert lrs[0] == pytest.approx(2e-4 * 1e-6) and lrs[1] == pytest.approx(2e-4 * (1e-6 + (1 - 1e-6) / 2))
    out = tmp_path / "exported"
    run_script("export_diffusers.py", "--ckpt", run_dir / "checkpoints" / "last.ckpt", "--out", out)
    from diffusers import StableDiffusionPipeline

    pipe = StableDiffusionPipeline.from_pretrained(out, local_files_only=True)
    assert pipe.scheduler.config.prediction_type == "v_prediction"
    assert pipe.unet.config.block_out_channels == (32, 64) or list(pipe.unet.config.block_out_channels) == [32, 64]


def test_both_forms_of_the_example_translate_alike(v_ckpt, images):
    """The strategy block too: `{params: {...}}` without a target, or its settings held directly."""
    translated = []
    for name, data_key in (("colossalai-shape.yaml", "data.params"), ("colossalai-flat-shape.yaml", "data")):
        cfg, sources = load_config(
            [CONFIGS / name], [f"model.params.ckpt={v_ckpt}", f"{data_key}.train.params.root={images}"]
        )
        translate_compvis(cfg, sources)
        translated.append(OmegaConf.to_container(cfg))
    assert translated[0] == translated[1]
    strategy = translated[1]["lightning"]["trainer"]["strategy"]
    assert strategy["target"] == "strategies.ColossalAIStrategy" and strategy["params"]["placement_policy"] == "cuda"
    assert translated[1]["model"]["params"]["lr_lambda"]["params"]["warm_up_steps"] == [2]
    mixed = [
        f"model.params.ckpt={v_ckpt}",
        "data.train.params.root=.",
        "model.params.unet_config.params.context_dim=64",
    ]
    cfg, _ = load_config([CONFIGS / "colossalai-flat-shape.yaml"], mixed)
    with pytest.raises(ConfigError, match=r"^model.params.unet_config: holds settings both under params and directly"):
        translate_compvis(cfg, Sources())


def test_a_datasets_unknown_parameter_is_one_line_naming_it(v_ckpt, images, tmp_path, capsys):
    from main import main

    argv = ["-t", "-b", str(CONFIGS / "colossalai-shape.yaml"), "-l", str(tmp_path / "logs"),
            f"model.params.ckpt={v_ckpt}", f"data.params.train.params.root={images}",
            "data.params.train.params.file_path=/data/laion", *ON_CPU]  # fmt: skip
    assert main(argv) == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if not line.startswith("INFO")]
    assert lines == [
        "data.params.train.params.file_path (command line): unknown parameter; valid: root, size, caption_key"
    ]
    assert not (tmp_path / "logs").exists(), "nothing was built"


@pytest.mark.parametrize("trainable", ["unet", "unet+text_encoder"])
def test_trained_parts_are_in_train_mode_while_they_train(trainable, part_files, images, tmp_path):
    """Every module of a trained part is in train mode at every step (dropout reads it); frozen parts stay in
    eval mode. Weights read by from_pretrained and from the part files arrive in eval mode."""
    record = tmp_path / "modes.jsonl"
    argv = ["-t", "-b", str(CONFIGS / "pokemon-shape.yaml"), "-l", str(tmp_path / "logs"),
            *pokemon_overrides(part_files, images), *ON_CPU,
            f"model.params.cond_stage_trainable={trainable == 'unet+text_encoder'}",
            "lightning.callbacks.modes.target=tests.fixtures.compvis.RecordModes",
            f"lightning.callbacks.modes.params.path={record}"]  # fmt: skip
    train_once(argv, tmp_path / "logs")
    steps = [json.loads(line) for line in record.read_text().splitlines()]
    assert len(steps) == 2
    for step in steps:
        assert step["trainable"] == trainable.split("+")
        for name, modes in step["modes"].items():
            assert all(modes) if name in step["trainable"] else not any(modes), (name, modes)


def test_pokemon_shape_fine_tunes_from_per_part_files_and_exports(part_files, images, tmp_path):
    logdir = tmp_path / "logs"
    argv = ["-t", "-b", str(CONFIGS / "pokemon-shape.yaml"), "-l", str(logdir),
            *pokemon_overrides(part_files, images), *ON_CPU]  # fmt: skip
    run_dir = train_once(argv, logdir)
    ckpt = torch.load(run_dir / "checkpoints" / "last.ckpt", weights_only=True)
    start = torch.load(part_files["vae"], weights_only=True)
    vae = {k.removeprefix("vae."): v for k, v in ckpt["state_dict"].items() if k.startswith("vae.")}
    assert all(torch.equal(vae[k], v) for k, v in start.items()), "the frozen VAE is the from_pretrained file's"
    unet = {k.removeprefix("unet."): v for k, v in ckpt["state_dict"].items() if k.startswith("unet.")}
    trained = torch.load(part_files["unet"], weights_only=True)
    assert unet.keys() == trained.keys() and any(not torch.equal(unet[k], trained[k]) for k in trained)
    out = tmp_path / "exported"
    run_script("export_diffusers.py", "--ckpt", run_dir / "checkpoints" / "last.ckpt", "--out", out)
    assert json.loads((out / "unet" / "config.json").read_text())["attention_head_dim"] == 1


def test_lambda_linear_is_the_compvis_schedule():
    schedule = LambdaLinear(warm_up_steps=[10], f_min=[0.1], f_max=[1.0], f_start=[0.0], cycle_lengths=[100])
    assert schedule(0) == 0.0 and schedule(5) == pytest.approx(0.5)
    assert schedule(10) == pytest.approx(0.1 + 0.9 * 90 / 100) and schedule(100) == pytest.approx(0.1)
    two = LambdaLinear(warm_up_steps=[0, 5], f_min=[0.0, 0.0], f_max=[1.0, 2.0], f_start=[0.0, 0.0],
                       cycle_lengths=[10, 10])  # fmt: skip
    assert two(10) == pytest.approx(0.0)  # the last step of the first cycle (CompVis counts it in)
    assert two(13) == pytest.approx(2.0 * 3 / 5)  # three steps into the second cycle's five-step warm-up


def test_scale_lr_rule_and_switch(part_files, images):
    def lr(*extra, scale_lr=True):
        cfg, sources = load_config(
            [CONFIGS / "pokemon-shape.yaml"],
            [*pokemon_overrides(part_files, images), "lightning.trainer.strategy=null", *extra],
        )
        check_config(cfg, sources, scale_lr)
        return cfg.model.params.learning_rate

    assert lr("lightning.trainer.accelerator=cpu", "lightning.trainer.devices=1") == pytest.approx(2e-4)
    # CompVis' rule: base x accumulation x devices x batch size (devices: 4 as the config says)
    assert lr("lightning.trainer.accumulate_grad_batches=3", "data.params.batch_size=5") == pytest.approx(
        1e-4 * 3 * 4 * 5
    )
    assert lr(scale_lr=False) == pytest.approx(1e-4)
    with pytest.raises(ConfigError, match="base_learning_rate and model.params.learning_rate"):
        lr("model.params.learning_rate=1e-3")


@pytest.mark.parametrize(
    "original, family, prediction",
    [("v1-inference.yaml", "sd15", "epsilon"), ("v2-inference.yaml", "sd2-base", "epsilon"),
     ("v2-inference-v.yaml", "sd2-768-v", "v_prediction")],
)  # fmt: skip
def test_original_inference_yamls_declare_the_shipped_architectures(original, family, prediction, images, tmp_path):
    """`-b v1-inference.yaml model.params.ckpt=FILE`: the parts come from the file, and the YAML's
    architecture (read by diffusers' converters) is checked against it: here, against the shipped configs."""
    ckpt = tmp_path / "model.safetensors"
    ckpt.write_bytes(b"")
    data = tmp_path / "data.yaml"
    OmegaConf.save({"data": {"target": "main.DataModuleFromConfig", "params": {"batch_size": 1, "train": {
        "target": "tests.fixtures.compvis.CaptionedImages", "params": {"root": str(images)}}}}}, data)  # fmt: skip
    cfg, sources = load_config(
        [REPO / "configs" / "models" / "original" / original, data], [f"model.params.ckpt={ckpt}"]
    )
    check_config(cfg, sources)
    params = cfg.model.params
    assert params.pretrained == str(ckpt) and "unet" not in params and "text_encoder" not in params
    assert params.get("prediction_type", "epsilon") == prediction
    for part in ("unet", "vae"):
        shipped = json.loads((REPO / "configs" / "models" / family / part / "config.json").read_text())
        declared = params.architecture[part].config
        assert declared, part
        for k, v in declared.items():
            assert list(v) == list(shipped[k]) if isinstance(v, list) else v == shipped.get(k, v), (part, k)


def test_contradictions_name_both_sides(v_ckpt, part_files, images, tmp_path):
    from ldm.training.run import train

    colossal = [f"model.params.ckpt={v_ckpt}", f"data.params.train.params.root={images}", *ON_CPU]
    with pytest.raises(
        ConfigError, match=r"'epsilon' contradicts the pretrained weights' prediction type 'v_prediction'"
    ):
        train([CONFIGS / "colossalai-shape.yaml"], [*colossal, "model.params.parameterization=eps"], tmp_path)
    with pytest.raises(
        ConfigError, match=r"^model.params.unet_config: declares cross_attention_dim = 64, but the unet"
    ):
        train(
            [CONFIGS / "colossalai-shape.yaml"], [*colossal, "model.params.unet_config.params.context_dim=64"], tmp_path
        )
    pokemon = [*pokemon_overrides(part_files, images), *ON_CPU, "model.params.unet_config.params.model_channels=64"]
    with pytest.raises(ConfigError, match=r"^model.params.part_weights.unet: .* does not fit the part's config: .* is"):
        train([CONFIGS / "pokemon-shape.yaml"], pokemon, tmp_path)
    with pytest.raises(ConfigError, match=r"from_pretrained and model.params.ckpt both give the unet's weights"):
        train(
            [CONFIGS / "pokemon-shape.yaml"],
            [*pokemon_overrides(part_files, images), f"model.params.ckpt={v_ckpt}"],
            tmp_path,
        )


def test_a_config_with_three_mistakes_prints_three_lines(tiny_sd, tmp_path, capsys):
    from main import main

    missing = tmp_path / "missing"
    argv = ["-t", "-b", str(SD_FOLDER), "-l", str(tmp_path / "logs"), "model.params.snr_gamma=high",
            f"model.params.pretrained={missing / 'weights'}", f"data.params.root={missing / 'images'}"]  # fmt: skip
    assert main(argv) == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if not line.startswith("INFO")]
    assert len(lines) == 3, lines
    assert lines[0].startswith("model.params.pretrained (command line): no such file or folder")
    assert lines[1].startswith("model.params.snr_gamma (command line): expected float or null, got str 'high'")
    assert lines[2].startswith("data.params.root (command line): no such file or folder")
    assert not (tmp_path / "logs").exists(), "nothing was built"


@pytest.mark.skipif(importlib.util.find_spec("colossalai") is None, reason="needs Colossal-AI (make test-compat)")
@pytest.mark.parametrize("name", ["colossalai-shape.yaml", "colossalai-flat-shape.yaml", "pokemon-shape.yaml"])
def test_their_strategy_blocks_become_gemini(name, v_ckpt, part_files, images):
    """The example's strategy block, with its target (pokemon) or without (colossalai: under params, or its
    settings held directly), as written."""
    data_key = "data" if "flat" in name else "data.params"
    overrides = [f"model.params.ckpt={v_ckpt}", f"{data_key}.train.params.root={images}"]
    if name.startswith("pokemon"):
        overrides = pokemon_overrides(part_files, images)
    cfg, sources = load_config([CONFIGS / name], overrides)
    check_config(cfg, sources)
    strategy = cfg.lightning.trainer.strategy
    assert strategy.target == "ldm.training.strategies.ColossalAIStrategy" and strategy.params.plugin == "gemini"
    assert strategy.params.gemini.placement_policy == "static" and cfg.lightning.trainer.precision == "16-mixed"
