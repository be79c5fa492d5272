"""Tests for the offline SD 1.x CLIP tokenizer writer in ldm.components.tokenizers."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import transformers

from ldm.components import tokenizers
from ldm.components.tokenizers import clip_bpe_path, write_clip_tokenizer

CAT_IDS = [49406, 320, 1125, 539, 320, 2368, 49407]
BOS_ID, EOS_ID = 49406, 49407
LONG_CAPTION = " ".join(["a photo of a very fluffy orange cat sitting on a red sofa"] * 12)
EXPECTED_FILES = [
    "vocab.json",
    "merges.txt",
    "special_tokens_map.json",
    "tokenizer_config.json",
    "tokenizer.json",
]
LOADERS = [transformers.CLIPTokenizer, transformers.CLIPTokenizerFast, transformers.AutoTokenizer]


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Write the CLIP tokenizer files once for the whole module."""
    out = tmp_path_factory.mktemp("clip_tokenizer")
    write_clip_tokenizer(out)
    return out


def test_clip_bpe_path_points_to_gz() -> None:
    path = clip_bpe_path()
    assert path.name == "bpe_simple_vocab_16e6.txt.gz"
    assert path.is_file()


def test_clip_bpe_path_missing_open_clip(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tokenizers.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps open_clip_torch"):
        clip_bpe_path()


def test_files_written(tok_dir: Path) -> None:
    assert sorted(p.name for p in tok_dir.iterdir()) == sorted(EXPECTED_FILES)

    merges = (tok_dir / "merges.txt").read_text(encoding="utf-8").splitlines()
    assert merges[0] == "#version: 0.2"
    assert len(merges) == 1 + 48894
    assert merges[1] == "i n"

    vocab = json.loads((tok_dir / "vocab.json").read_text(encoding="utf-8"))
    assert len(vocab) == 49408
    assert sorted(vocab.values()) == list(range(49408))
    assert vocab["!"] == 0
    assert vocab["a</w>"] == 320
    assert vocab["cat</w>"] == 2368
    assert vocab["<|startoftext|>"] == BOS_ID
    assert vocab["<|endoftext|>"] == EOS_ID

    config = json.loads((tok_dir / "tokenizer_config.json").read_text(encoding="utf-8"))
    assert config["tokenizer_class"] == "CLIPTokenizer"
    assert config["model_max_length"] == 77
    assert config["do_lower_case"] is True
    assert config["errors"] == "replace"
    special = {
        "bos_token": "<|startoftext|>",
        "eos_token": "<|endoftext|>",
        "unk_token": "<|endoftext|>",
        "pad_token": "<|endoftext|>",
    }
    assert {k: config[k] for k in special} == special
    assert json.loads((tok_dir / "special_tokens_map.json").read_text()) == special

    fast = json.loads((tok_dir / "tokenizer.json").read_text(encoding="utf-8"))
    assert fast["model"]["type"] == "BPE"
    assert fast["model"]["vocab"] == vocab
    assert len(fast["model"]["merges"]) == 48894


@pytest.mark.parametrize("loader", LOADERS, ids=lambda c: c.__name__)
def test_tokenize_cat(tok_dir: Path, loader: type) -> None:
    tok = loader.from_pretrained(tok_dir)
    assert tok("a photo of a cat").input_ids == CAT_IDS
    assert tok("A  Photo of a CAT").input_ids == CAT_IDS
    assert len(tok) == 49408
    assert tok.model_max_length == 77
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (BOS_ID, EOS_ID, EOS_ID)
    assert tok.decode(CAT_IDS, skip_special_tokens=True) == "a photo of a cat"


@pytest.mark.parametrize("loader", LOADERS, ids=lambda c: c.__name__)
def test_padding_and_truncation(tok_dir: Path, loader: type) -> None:
    tok = loader.from_pretrained(tok_dir)
    padded = tok("a photo of a cat", padding="max_length", max_length=tok.model_max_length)
    assert padded.input_ids == CAT_IDS + [EOS_ID] * (77 - len(CAT_IDS))
    assert padded.attention_mask == [1] * len(CAT_IDS) + [0] * (77 - len(CAT_IDS))

    full = tok(LONG_CAPTION).input_ids
    assert len(full) > 77
    cut = tok(LONG_CAPTION, padding="max_length", max_length=tok.model_max_length, truncation=True).input_ids
    assert len(cut) == 77
    assert cut == full[:76] + [EOS_ID]


def test_fast_file_alone_and_slow_files_alone(tok_dir: Path, tmp_path: Path) -> None:
    configs = ["tokenizer_config.json", "special_tokens_map.json"]
    for name, files in {
        "fast_only": ["tokenizer.json", *configs],
        "slow_only": ["vocab.json", "merges.txt", *configs],
    }.items():
        sub = tmp_path / name
        sub.mkdir()
        for file in files:
            shutil.copy(tok_dir / file, sub / file)
        tok = transformers.AutoTokenizer.from_pretrained(sub)
        assert tok("a photo of a cat").input_ids == CAT_IDS, name
        assert len(tok) == 49408, name
