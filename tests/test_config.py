"""Config mistakes fail before anything is built, in one line naming the key path and the file."""

from pathlib import Path

import pytest

from ldm.config import ConfigError, load_config
from ldm.training.checks import check_config
from main import main

REPO = Path(__file__).resolve().parents[1]
SD_FOLDER = REPO / "configs" / "finetune" / "sd-folder.yaml"


def check(files, overrides=()):
    cfg, sources = load_config(files, overrides)
    check_config(cfg, sources)
    return cfg


@pytest.fixture
def valid(tiny_sd, image_folder):
    return [f"model.params.pretrained={tiny_sd}", f"data.params.root={image_folder}"]


def test_shipped_config_is_valid_with_the_documented_overrides(valid):
    cfg = check(
        [SD_FOLDER], valid + ["data.params.size=64", "data.params.batch_size=3", "lightning.trainer.max_steps=7"]
    )
    assert cfg.data.params.size == 64 and cfg.data.params.batch_size == 3 and cfg.lightning.trainer.max_steps == 7


def test_later_files_and_overrides_win(tmp_path, valid):
    extra = tmp_path / "extra.yaml"
    extra.write_text("model:\n  params:\n    learning_rate: 0.5\ndata:\n  params:\n    size: 32\n")
    cfg = check([SD_FOLDER, extra], valid + ["data.params.size=48"])
    assert cfg.model.params.learning_rate == 0.5 and cfg.data.params.size == 48


@pytest.mark.parametrize(
    ("override", "message"),
    [
        (
            "model.params.learnin_rate=1",
            r"^model\.params\.learnin_rate \(command line\): unknown parameter; valid: .*learning_rate",
        ),
        (
            "model.params.learning_rate=fast",
            r"^model\.params\.learning_rate \(command line\): expected float, got str 'fast'",
        ),
        (
            "model.params.lr_schedule=cosin",
            r"^model\.params\.lr_schedule \(command line\): got str 'cosin'; valid: 'constant', 'linear', 'cosine'",
        ),
        ("model.params.trainable=[unet,vae]", r"^model\.params\.trainable\[1\] \(command line\): got str 'vae'"),
        (
            "model.params.pretrained=/no/such/sd",
            r"^model\.params\.pretrained \(command line\): no such file or folder: /no/such/sd",
        ),
        ("data.params.root=/no/such/images", r"^data\.params\.root \(command line\): no such file or folder"),
        ("data.params.batch_size=2.5", r"^data\.params\.batch_size \(command line\): expected int, got float 2\.5"),
        (
            "model.target=ldm.models.nothing.Here",
            r"^model\.target \(command line\): cannot import 'ldm\.models\.nothing\.Here'",
        ),
        (
            "model.params.optimizer.target=torch.optim.Adamm",
            r"optimizer\.target \(command line\): cannot import.*no 'Adamm'",
        ),
        ("model.params.optimizer.params.lr=0.1", r"optimizer\.params\.lr \(command line\): is set by the code"),
        (
            "model.params.unet.confg={}",
            r"^model\.params\.unet\.confg \(command line\): unknown key; valid: target, pretrained",
        ),
        ("lightning.trainer.max_step=3", r"^lightning\.trainer\.max_step \(command line\): unknown parameter"),
        ("lightning.trainer.max_steps=ten", r"^lightning\.trainer\.max_steps \(command line\): expected int"),
        (
            "lightning.callbacks.ema.params.decai=0.9",
            r"^lightning\.callbacks\.ema\.params\.decai \(command line\): unknown",
        ),
        ("lightning.modelcheckpoint.params.every_n_train_step=3", r"every_n_train_step \(command line\): unknown"),
        ("trainer.max_steps=3", r"^trainer \(command line\): unknown section; valid sections: model, data, lightning"),
    ],
)
def test_mistakes_name_key_and_source(valid, override, message):
    with pytest.raises(ConfigError, match=message):
        check([SD_FOLDER], valid + [override])


def test_mistake_in_a_file_names_the_file(tmp_path, valid):
    bad = tmp_path / "bad.yaml"
    bad.write_text("model:\n  params:\n    snr_gama: 5\n")
    with pytest.raises(ConfigError, match=rf"^model\.params\.snr_gama \({bad}\): unknown parameter"):
        check([SD_FOLDER, bad], valid)


def test_unset_required_value(image_folder):
    with pytest.raises(ConfigError, match=r"^model\.params\.pretrained \(.*sd-folder\.yaml\): required value"):
        check([SD_FOLDER], [f"data.params.root={image_folder}"])


def test_unset_values_and_a_typo_are_reported_in_one_pass(capsys, tmp_path):
    code = main(["-t", "-b", str(SD_FOLDER), "-l", str(tmp_path), "model.params.learnin_rate=1"])
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith(("model.", "data."))]
    assert code == 2
    assert err == [
        f"data.params.root ({SD_FOLDER}): required value (???) not set; pass it as data.params.root=VALUE",
        f"model.params.pretrained ({SD_FOLDER}): required value (???) not set; "
        "pass it as model.params.pretrained=VALUE",
        "model.params.learnin_rate (command line): unknown parameter; valid: " + err[2].split("valid: ")[1],
    ]
    assert "learning_rate" in err[2], "the valid names are listed"


def test_invalid_yaml_and_missing_file(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: [unclosed\n")
    with pytest.raises(ConfigError, match=rf"^{bad}: not valid YAML"):
        load_config([bad])
    with pytest.raises(ConfigError, match="config file not found: /no/such.yaml"):
        load_config(["/no/such.yaml"])
    with pytest.raises(ConfigError, match="must look like key.path=value"):
        load_config([SD_FOLDER], ["model.params.pretrained"])


def test_data_target_must_be_a_datamodule(valid):
    with pytest.raises(
        ConfigError, match=r"^data\.target \(command line\): examples.digits.data.DigitsDataset is not a Lightning"
    ):
        check([SD_FOLDER], valid + ["data.target=examples.digits.data.DigitsDataset"])


def test_main_prints_one_line_and_exits_2(capsys, valid, tmp_path):
    code = main(["-t", "-b", str(SD_FOLDER), "-l", str(tmp_path), *valid, "model.params.snr_gamma=high"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert err == ["model.params.snr_gamma (command line): expected float or null, got str 'high'"]
    assert not list(tmp_path.iterdir()), "nothing is written when the config is invalid"


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("data.params.batch_size=0", "data.params.batch_size: got 0; must be at least 1"),
        ("data.params.num_workers=-1", "data.params.num_workers: got -1; must be 0"),
        ("data.params.caption_dropout=2", "data.params.caption_dropout: got 2; must be in [0, 1]"),
        ("data.params.root=EMPTY", "data.params.root: no images (.png, .jpg"),
        ("model.params.learning_rate=-1", "model.params.learning_rate: got -1; must be positive"),
        ("model.params.pretrained=NOTES", "model.params.pretrained: NOTES: expected a .safetensors or .ckpt file"),
        (
            "model.params.optimizer.params.betas=[5,0.9]",
            "model.params.optimizer.params: torch.optim.AdamW rejects them: Invalid beta parameter at index 0: 5",
        ),
        (
            "lightning.trainer.strategy=fsdpp",
            "lightning.trainer: You selected an invalid strategy name: `strategy='fsdpp'`",
        ),
        ("lightning.callbacks.ema.params.decay=2", "lightning.callbacks.ema.params.decay: got 2; must be in (0, 1)"),
        ("lightning.modelcheckpoint.params.keep=0", "lightning.modelcheckpoint.params.keep: got 0; must be at least 1"),
        (
            "lightning.modelcheckpoint.params.save_top_k=3",
            "lightning.modelcheckpoint.params.save_top_k (command line): unknown parameter; "
            "valid: every_n_train_steps, keep",
        ),
        (
            "lightning.callbacks.env.target=os.environ",
            "lightning.callbacks.env.target (command line): os.environ is not a class or function to call",
        ),
        (
            "lightning.callbacks.evil.target=/tmp/evil.py",
            "lightning.callbacks.evil.target (command line): cannot import '/tmp/evil.py'",
        ),
    ],
)
def test_bad_values_anywhere_are_one_line_naming_the_key(override, message, capsys, valid, tmp_path):
    """Values only the code they configure can judge (Lightning's, torch's, ours) still fail in one line."""
    (tmp_path / "empty").mkdir()
    (tmp_path / "notes.txt").write_text("not weights")
    override = override.replace("EMPTY", str(tmp_path / "empty"))
    message = message.replace("NOTES", str(tmp_path / "notes.txt"))
    override = override.replace("NOTES", str(tmp_path / "notes.txt"))
    argv = ["-t", "-b", str(SD_FOLDER), "-l", str(tmp_path / "logs"), *valid, "data.params.size=16",
            "lightning.trainer.max_steps=1", "lightning.callbacks.image_logger=null", override]  # fmt: skip
    code = main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert err[-1].startswith(message), err[-1]
    assert not list((tmp_path / "logs").glob("*/checkpoints/*")), "no checkpoint"


def test_an_error_names_the_key_its_value_came_from(capsys, tiny_sd, tmp_path):
    """A FolderDataset nested under a DataModule reports its own key path, not the flat FolderDataModule's."""
    (tmp_path / "empty").mkdir()
    config = tmp_path / "nested.yaml"
    config.write_text(
        f"model: {{target: ldm.models.diffusion.ddpm.LatentDiffusion, params: {{pretrained: {tiny_sd}}}}}\n"
        "data:\n  target: ldm.data.DataModule\n  params:\n    dataset:\n"
        f"      target: ldm.data.folder.FolderDataset\n      params: {{root: {tmp_path / 'empty'}, size: 16}}\n"
        "lightning: {trainer: {max_steps: 1}}\n"
    )
    assert main(["-t", "-b", str(config), "-l", str(tmp_path / "logs")]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("data.params.dataset.params.root: no images (.png"), err


def test_targets_that_moved_still_load_with_a_notice(valid, caplog):
    """Configs written before the package was laid out in floors keep working; the log names the new path."""
    import logging

    from ldm.config import import_target
    from ldm.training.checks import MOVED_TARGETS

    old = ["lightning.callbacks.ema.target=ldm.callbacks.ema.EMA", "lightning.callbacks.image_logger=null"]
    cfg, sources = load_config([SD_FOLDER], [*valid, *old])
    with caplog.at_level(logging.INFO, logger="ldm.training.checks"):
        check_config(cfg, sources)
    assert cfg.lightning.callbacks.ema.target == "ldm.training.callbacks.ema.EMA"
    notice = "lightning.callbacks.ema.target: ldm.callbacks.ema.EMA moved to ldm.training.callbacks.ema.EMA"
    assert notice in caplog.text

    for new in MOVED_TARGETS.values():
        if "strategies" not in new:  # those need Colossal-AI
            assert callable(import_target(new)), new
