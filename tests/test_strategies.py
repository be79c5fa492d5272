"""Strategy config that needs no Colossal-AI: old configs' strategy blocks, and the error without it."""

import importlib.util

import pytest

from ldm.config import ConfigError, load_config
from ldm.training.checks import check_config
from ldm.training.strategies import TARGET
from ldm.training.strategies.legacy import translate_legacy_strategy
from tests.helpers import SD_FOLDER


def test_old_placement_policies_become_gemini_static_offload():
    old = {"target": "pytorch_lightning.strategies.ColossalAIStrategy", "params": {"placement_policy": "cuda"}}
    assert translate_legacy_strategy(old) == {
        "target": TARGET,
        "params": {
            "plugin": "gemini",
            "gemini": {"placement_policy": "static", "offload_optim_frac": 0.0, "offload_param_frac": 0.0},
        },
    }
    auto = translate_legacy_strategy(
        {"target": "x", "params": {"placement_policy": "auto", "chunk_search_range": 2**26}}
    )
    assert auto["params"] == {"plugin": "gemini", "gemini": {"placement_policy": "auto", "search_range_m": 64}}
    kept = translate_legacy_strategy({"target": "x", "params": {"initial_scale": 1024, "hysteresis": 3}})
    assert kept["params"] == {"plugin": "gemini", "loss_scale": {"initial_scale": 1024, "hysteresis": 3}}


def test_use_chunk_false_trains_the_same_under_gemini():
    """The Colossal-AI example's train_pokemon.yaml says use_chunk: False; it only decided the memory layout."""
    translated = translate_legacy_strategy({"target": "x", "params": {"use_chunk": False, "initial_scale": 65536}})
    assert translated["params"] == {"plugin": "gemini", "loss_scale": {"initial_scale": 65536}}


@pytest.mark.parametrize(
    ("params", "message"),
    [
        ({"placement_policy": "gpu"}, r"params\.placement_policy: got 'gpu'; valid: 'cuda', 'cpu', 'auto'"),
        ({"chunk_search_n_grids": 4}, r"params\.chunk_search_n_grids: Colossal-AI no longer has this setting"),
        ({"stage": 3}, r"params\.stage: not a parameter of the old ColossalAIStrategy"),
    ],
)
def test_old_settings_without_an_equivalent_say_what_to_write(params, message):
    with pytest.raises(ConfigError, match=r"^lightning\.trainer\.strategy\." + message):
        translate_legacy_strategy({"target": "lightning.pytorch.strategies.ColossalAIStrategy", "params": params})


@pytest.mark.skipif(importlib.util.find_spec("colossalai") is not None, reason="Colossal-AI is installed here")
def test_the_strategy_without_colossalai_says_how_to_install_it(tmp_path):
    cfg, sources = load_config(
        [SD_FOLDER],
        [
            f"model.params.pretrained={tmp_path}",
            f"data.params.root={tmp_path}",
            "lightning.trainer.strategy={target: ldm.training.strategies.ColossalAIStrategy, params: {plugin: zero}}",
        ],
    )
    with pytest.raises(
        ConfigError, match=r"^lightning\.trainer\.strategy\.target \(command line\): cannot import"
    ) as err:
        check_config(cfg, sources)
    assert "pip install -e .[colossalai]" in str(err.value) and "torch<=2.5.1" in str(err.value)


def test_settings_written_before_the_groups_are_regrouped(caplog):
    """`params: {plugin: zero, stage: 2, ...}` (the layout before the groups) still loads, with a notice each."""
    import logging

    from ldm.training.strategies.options import group_flat_settings

    flat = {"plugin": "zero", "stage": 1, "cpu_offload": True, "initial_scale": 128, "checkpoint_shard_mb": 64}
    with caplog.at_level(logging.INFO, logger="ldm.training.strategies.options"):
        grouped = group_flat_settings(flat)
    assert grouped == {
        "plugin": "zero",
        "zero": {"stage": 1, "cpu_offload": True},
        "loss_scale": {"initial_scale": 128},
        "checkpoint_shard_mb": 64,
    }
    assert "lightning.trainer.strategy.params.stage is now lightning.trainer.strategy.params.zero.stage" in caplog.text
    with pytest.raises(
        ConfigError, match=r"params\.stage: also given as lightning\.trainer\.strategy\.params\.zero\.stage"
    ):
        group_flat_settings({"stage": 1, "zero": {"stage": 2}})
