"""The tensors of a `.safetensors` file, read one at a time when asked for, so that loading a model never holds
the whole file in memory beside the weights it keeps.

safetensors reads through memory maps of the file, and a page read stays resident (and counts in the process's
RSS) while a map holding it is open: the tensors it returns are backed by the file, and its handle keeps what
it read. `TensorFile` reopens the file after each `REOPEN_BYTES` it read, and a reader copies what it keeps
(`tensor.to(dtype, copy=True)`): a 6.9 GB single file read into bf16 then peaks at the weights kept plus about
`REOPEN_BYTES`, instead of the file's size on top (measured by `benchmarks/load_memory.py`).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from pathlib import Path

import torch

REOPEN_BYTES = 256 * 2**20


class TensorFile(Mapping[str, torch.Tensor]):
    """A `.safetensors` file as a read-only mapping of names to tensors, each read when it is looked up, in the
    file's dtype and backed by the file (copy what you keep). `metadata` is the header's string map. Raises
    safetensors' errors for a file that is not one."""

    def __init__(self, path: str | Path) -> None:
        from safetensors import safe_open

        self.path = str(path)
        with safe_open(self.path, "pt") as handle:
            self.metadata: dict[str, str] = handle.metadata() or {}
            self._keys = list(handle.keys())
        self._names = set(self._keys)
        self._handle = None
        self._read = 0

    def __getitem__(self, key: str) -> torch.Tensor:
        if key not in self._names:
            raise KeyError(key)
        if self._handle is None or self._read >= REOPEN_BYTES:
            from safetensors import safe_open

            self._handle = None  # the old map goes, and the pages it holds with it
            self._handle = safe_open(self.path, "pt")
            self._read = 0
        tensor = self._handle.get_tensor(key)
        self._read += tensor.nbytes
        return tensor

    def __contains__(self, key: object) -> bool:
        return key in self._names

    def __iter__(self) -> Iterator[str]:
        return iter(self._keys)

    def __len__(self) -> int:
        return len(self._keys)

    def close(self) -> None:
        """Let go of the file's map now (it also goes when the object does)."""
        self._handle = None


class Renamed(Mapping[str, torch.Tensor]):
    """`state` where the names in `renames` read another entry (`renames[name]`), nothing read until looked up."""

    def __init__(self, state: Mapping[str, torch.Tensor], renames: dict[str, str]) -> None:
        self.state, self.renames = state, renames

    def __getitem__(self, key: str) -> torch.Tensor:
        return self.state[self.renames.get(key, key)]

    def __contains__(self, key: object) -> bool:
        return key in self.state

    def __iter__(self) -> Iterator[str]:
        return iter(self.state)

    def __len__(self) -> int:
        return len(self.state)


class Joined(Mapping[str, torch.Tensor]):
    """A single file's tensors and, under the keys `joined` names, those of the text encoders' own files."""

    def __init__(self, state: Mapping[str, torch.Tensor], joined: dict[str, tuple[Mapping, str]]) -> None:
        self.state, self.joined = state, joined

    def __getitem__(self, key: str) -> torch.Tensor:
        if key in self.joined:
            source, name = self.joined[key]
            return source[name]
        return self.state[key]

    def __contains__(self, key: object) -> bool:
        return key in self.joined or key in self.state

    def __iter__(self) -> Iterator[str]:
        return iter({**dict.fromkeys(self.state), **dict.fromkeys(self.joined)})

    def __len__(self) -> int:
        return len(set(self.state) | set(self.joined))
