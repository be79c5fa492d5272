"""What the streaming library leaves behind when a run is killed whole, and how the next run frees it.

The library keeps a run's shared state in blocks under /dev/shm (named `PREFIX_what`, PREFIX a six-digit
number the run picks as the first free one) and lock files in the temporary folder. Python's resource tracker
frees the blocks of a process killed alone, but not when it dies too (a job cancelled, a node lost): then the
blocks hold memory, and the library refuses to start on a remote source's cache that a leftover names
unless that prefix's lock files are still there.
"""

from __future__ import annotations

import os
import re
import tempfile
from pathlib import Path

import numpy as np
from streaming import Stream
from streaming.base.constant import BARRIER_FILELOCK, CACHE_FILELOCK, LOCALS, SHM_TO_CLEAN

SHARED_MEMORY = Path("/dev/shm")
_BLOCK = re.compile(rf"^(\d{{6}})_({'|'.join(SHM_TO_CLEAN)})$")
_LOCK = re.compile(rf"^(\d{{6}})_({BARRIER_FILELOCK}|{CACHE_FILELOCK})$")


def _mapped_shared_memory() -> set[str]:
    """The names under /dev/shm that a process this one can see has mapped."""
    names = set()
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            maps = (proc / "maps").read_text()
        except OSError:  # gone, or another user's (who cannot map our blocks: they are 0600)
            continue
        for line in maps.splitlines():
            at = line.find(f"{SHARED_MEMORY}/")
            if at >= 0:
                names.add(line[at + len(str(SHARED_MEMORY)) + 1 :].removesuffix(" (deleted)"))
    return names


def registered_folders(block: Path) -> set[str]:
    """The local folders a run registered in its `locals` block: int32 size, then the folders and the prefix
    number, NUL-separated."""
    try:
        data = block.read_bytes()
        size = int(np.frombuffer(data[:4], np.int32)[0])
        return set(data[4:size].decode().split("\0")[:-1])
    except (OSError, ValueError, UnicodeDecodeError, IndexError):
        return set()


def free_stale_shared_memory(streams: list[Stream]) -> list[int]:
    """Free the library's blocks and lock files left by runs that read any of `streams`' local folders and that
    no process maps any more; also lock files whose blocks are gone. Returns the prefix numbers freed.

    Only this user's files, and only on Linux, where a block in use shows in some process's /proc/PID/maps: a
    live run maps its blocks until it exits. A run in another PID namespace sharing /dev/shm (containers
    started with --ipc=host) is not visible from here; turn this off there (`free_stale_shared_memory: false`)
    if two of them read the same folders at once."""
    if not SHARED_MEMORY.is_dir() or not Path("/proc/self/maps").is_file():
        return []
    uid, ours = os.getuid(), {os.path.abspath(os.path.join(s.local, s.split or "")) for s in streams}
    blocks: dict[int, list[Path]] = {}
    for path in SHARED_MEMORY.iterdir():
        if (match := _BLOCK.match(path.name)) and path.stat().st_uid == uid:
            blocks.setdefault(int(match[1]), []).append(path)
    locks: dict[int, list[Path]] = {}
    for path in Path(tempfile.gettempdir()).iterdir():
        if (match := _LOCK.match(path.name)) and path.stat().st_uid == uid:
            locks.setdefault(int(match[1]), []).append(path)
    candidates = {n for n, paths in blocks.items() if registered_folders(SHARED_MEMORY / f"{n:06}_{LOCALS}") & ours}
    if candidates:
        mapped = _mapped_shared_memory()
        candidates = {n for n in candidates if not any(path.name in mapped for path in blocks[n])}
    freed = sorted(candidates | (set(locks) - set(blocks)))
    for n in freed:
        for path in blocks.get(n, []) + locks.get(n, []):
            path.unlink(missing_ok=True)
    return freed
