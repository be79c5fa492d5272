"""Publish files and folders atomically: write beside the target, sync, checksum, rename.

A reader (or a crash, a full disk, `kill -9`) at any moment sees either the old file or the new
one, never a half-written file under the final name. Checksums are in the format of `sha256sum`
(one `digest  name` line per file), so `sha256sum -c NAME.sha256` checks them by hand.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

CHECKSUM_SUFFIX = ".sha256"
PARTIAL_SUFFIX = ".partial"


def remove_path(path: Path) -> None:
    """Delete a file, a link or a folder, if there."""
    path = Path(path)
    if path.is_symlink() or path.is_file():
        path.unlink()
    elif path.is_dir():
        shutil.rmtree(path, ignore_errors=True)


def files_of(path: Path) -> list[Path]:
    """The files of a folder (recursively, sorted), or the path itself."""
    return sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            digest.update(chunk)
    return digest.hexdigest()


def fsync_path(path: Path) -> None:
    """Flush a file's (or a folder's entries') data to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def honour_umask(path: str | Path) -> None:
    """Give a written file, or a folder and everything in it, the modes the umask gives new files and folders,
    as a plain `open(path, "w")` and `mkdir` would.

    Libraries that write through temporary files leave them 0600 (safetensors' `save_file`, so diffusers'
    and transformers' `save_pretrained`; `tempfile.mkdtemp` folders are 0700): a folder copied to a shared
    model directory or a container would then be readable by its owner only."""
    path = Path(path)
    umask = os.umask(0)
    os.umask(umask)
    inside = [p for p in path.rglob("*") if not p.is_symlink()] if path.is_dir() else []
    for written in [path, *inside]:
        os.chmod(written, (0o777 if written.is_dir() else 0o666) & ~umask)


def replace_path(new: Path, final: Path) -> None:
    """Rename `new` (a file or folder) to `final`, replacing whatever is there, folder or not."""
    if final.is_dir() and not final.is_symlink():  # os.replace cannot replace a folder: move it aside first
        old = final.with_name(final.name + ".old")
        remove_path(old)
        final.rename(old)
        os.replace(new, final)
        remove_path(old)
    else:
        if new.is_dir() and final.exists():  # a file where the folder goes
            final.unlink()
        os.replace(new, final)
    fsync_path(final.parent)


def publish(partial: Path, final: Path, checksum: bool = True) -> None:
    """Sync a finished `partial` (a file or a folder), write `final`'s checksum file (with `checksum`),
    then rename `partial` to `final`. The checksum file comes first, so a published `final` always
    has one."""
    partial, final = Path(partial), Path(final)
    lines = []
    for file in files_of(partial):
        fsync_path(file)
        if checksum:
            name = final.name if file == partial else f"{final.name}/{file.relative_to(partial).as_posix()}"
            lines.append(f"{sha256(file)}  {name}\n")
    if checksum:
        sums = final.with_name(final.name + CHECKSUM_SUFFIX)
        temporary = sums.with_name(sums.name + PARTIAL_SUFFIX)
        with open(temporary, "w") as f:
            f.writelines(lines)
            f.flush()
            os.fsync(f.fileno())
        os.replace(temporary, sums)
    replace_path(partial, final)


@contextlib.contextmanager
def atomic_path(final: str | Path, checksum: bool = False) -> Iterator[Path]:
    """A temporary path beside `final` to write into; published to `final` when the block succeeds,
    removed when it fails. The result has the mode the umask gives new files."""
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    partial = final.with_name(final.name + PARTIAL_SUFFIX)
    remove_path(partial)
    try:
        yield partial
        honour_umask(partial)
        publish(partial, final, checksum)
    finally:
        remove_path(partial)


def verify(path: Path) -> str | None:
    """Why the file or folder at `path` (or the one a link there points to) does not match its checksum
    file, or None if it does. Without a checksum file beside it there is nothing to check: None."""
    path = Path(path)
    target = path.resolve()
    if not target.exists():
        return "missing" + (f" (the link points to {target.name})" if path.is_symlink() else "")
    sums = target.with_name(target.name + CHECKSUM_SUFFIX)
    if not sums.is_file():
        return None
    lines = [line.split("  ", 1) for line in sums.read_text().splitlines() if line.strip()]
    if not lines or any(len(line) != 2 for line in lines):
        return f"its checksum file {sums.name} is unreadable"
    for digest, name in lines:
        file = target.parent / target.name / name.partition("/")[2] if "/" in name else target
        if not file.is_file():
            return f"{file.relative_to(target.parent)} is missing"
        if sha256(file) != digest:
            return (
                f"{file.relative_to(target.parent)} does not match its checksum in {sums.name} "
                f"(truncated or corrupted; {file.stat().st_size} bytes on disk)"
            )
    return None
