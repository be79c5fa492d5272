"""Offline construction of the CLIP tokenizer files.

OpenAI CLIP's text encoders use the openai/clip-vit-large-patch14 tokenizer. Its BPE merges ship
inside the ``open_clip_torch`` package, so the Hugging Face tokenizer folder can be rebuilt
without any access to a model hub.
"""

from __future__ import annotations

import gzip
import importlib.util
import json
import tempfile
from collections.abc import Callable
from pathlib import Path

BPE_FILENAME = "bpe_simple_vocab_16e6.txt.gz"
BOS_TOKEN = "<|startoftext|>"
EOS_TOKEN = "<|endoftext|>"
# Number of merges CLIP keeps: 49152 BPE entries minus the 256 byte tokens and 2 specials.
NUM_MERGES = 49152 - 256 - 2
VOCAB_SIZE = 2 * 256 + NUM_MERGES + 2  # 49,408


def clip_bpe_path() -> Path:
    """Return the path of CLIP's BPE merges file inside the installed open_clip package.

    open_clip is located without importing it (its import needs torchvision).
    """
    spec = importlib.util.find_spec("open_clip")
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for location in locations:
        path = Path(location) / BPE_FILENAME
        if path.is_file():
            return path
    raise FileNotFoundError(
        f"{BPE_FILENAME} not found: open_clip_torch is not installed. "
        "Install it with `pip install --no-deps open_clip_torch`."
    )


def _byte_unicode_chars() -> list[str]:
    """List the 256 printable unicode chars standing for bytes 0..255, in CLIP vocab order.

    Printable Latin-1 bytes map to themselves and come first; every other byte is mapped to
    chr(256 + k) for the k-th such byte, appended after them (the GPT-2/CLIP byte-level scheme).
    """
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    others = [b for b in range(256) if b not in set(printable)]
    return [chr(b) for b in printable] + [chr(256 + k) for k in range(len(others))]


def _read_merges(bpe_path: Path) -> list[str]:
    """Read the merges CLIP uses (lines 1..NUM_MERGES of the gzip file) as "a b" strings."""
    with gzip.open(bpe_path, "rt", encoding="utf-8") as handle:
        lines = handle.read().split("\n")
    merges = lines[1 : NUM_MERGES + 1]
    if len(merges) != NUM_MERGES:
        raise ValueError(f"{bpe_path} holds {len(merges)} merges, expected {NUM_MERGES}")
    return merges


def _build_vocab(merges: list[str]) -> dict[str, int]:
    """Build CLIP's 49,408-token vocabulary from the byte chars, word-end forms and merges."""
    chars = _byte_unicode_chars()
    tokens = chars + [c + "</w>" for c in chars]
    tokens += ["".join(merge.split()) for merge in merges]
    tokens += [BOS_TOKEN, EOS_TOKEN]
    vocab = {token: index for index, token in enumerate(tokens)}
    if len(vocab) != VOCAB_SIZE:
        raise ValueError(f"built {len(vocab)} unique tokens, expected {VOCAB_SIZE}")
    return vocab


def _write_json(path: Path, data: object) -> None:
    """Write data as UTF-8 JSON with a trailing newline."""
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def write_clip_tokenizer(out_dir: str | Path, model_max_length: int = 77, pad_token: str = EOS_TOKEN) -> None:
    """Write the CLIPTokenizer files (slow vocab/merges and fast tokenizer.json) offline.

    Files written into out_dir: vocab.json, merges.txt, special_tokens_map.json,
    tokenizer_config.json and tokenizer.json, matching openai/clip-vit-large-patch14. OpenCLIP's
    encoders use the same vocabulary and pad with "!" (`pad_token="!"`).
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    merges = _read_merges(clip_bpe_path())

    _write_json(out / "vocab.json", _build_vocab(merges))
    (out / "merges.txt").write_text("#version: 0.2\n" + "\n".join(merges) + "\n", encoding="utf-8")
    special_tokens = {
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "unk_token": EOS_TOKEN,
        "pad_token": pad_token,
    }
    _write_json(out / "special_tokens_map.json", special_tokens)
    _write_json(
        out / "tokenizer_config.json",
        {
            "tokenizer_class": "CLIPTokenizer",
            "model_max_length": model_max_length,
            "do_lower_case": True,
            "errors": "replace",
            "add_prefix_space": False,
            **special_tokens,
        },
    )

    # Build the fast tokenizer from the slow files just written and keep its tokenizer.json.
    from transformers import CLIPTokenizerFast

    # A stale tokenizer.json would take precedence over the slow files, so drop it first.
    (out / "tokenizer.json").unlink(missing_ok=True)
    fast = CLIPTokenizerFast.from_pretrained(str(out))
    fast.backend_tokenizer.save(str(out / "tokenizer.json"))


def tokenizer_files(write: Callable[[str], object]) -> dict[str, str]:
    """The text files `write(folder)` puts in a fresh folder (a tokenizer's `save_pretrained`, or
    `write_clip_tokenizer`), by name: how checkpoints and single files carry a tokenizer."""
    with tempfile.TemporaryDirectory() as tmp:
        write(tmp)
        return {p.name: p.read_text() for p in Path(tmp).iterdir() if p.is_file()}


def write_both_tokenizer_forms(folder: str | Path) -> None:
    """A CLIP tokenizer folder with both the slow files (`vocab.json`, `merges.txt`) and `tokenizer.json`.

    transformers >= 5.6 saves only `tokenizer.json` and transformers 4.x's slow `CLIPTokenizer` needs
    the other two; a folder saved by 4.x has no `tokenizer.json`. Each form is made from the other."""
    folder = Path(folder)
    write_slow_tokenizer_files(folder)
    if (folder / "vocab.json").is_file() and not (folder / "tokenizer.json").is_file():
        from transformers import CLIPTokenizerFast

        CLIPTokenizerFast.from_pretrained(str(folder)).backend_tokenizer.save(str(folder / "tokenizer.json"))


def write_slow_tokenizer_files(folder: str | Path) -> None:
    """Write `vocab.json` and `merges.txt` from a BPE `tokenizer.json` where they are missing.

    transformers >= 5.6 saves only `tokenizer.json`; the slow `CLIPTokenizer` of transformers 4.x
    needs the two files."""
    folder = Path(folder)
    fast = folder / "tokenizer.json"
    if not fast.is_file() or (folder / "vocab.json").is_file():
        return
    model = json.loads(fast.read_text(encoding="utf-8"))["model"]
    if model.get("type") != "BPE":
        return
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    _write_json(folder / "vocab.json", model["vocab"])
    (folder / "merges.txt").write_text("#version: 0.2\n" + "\n".join(merges) + "\n", encoding="utf-8")
