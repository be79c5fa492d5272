"""The chunk folders of a precompute (`ldm.data.precompute`): their names, and the writer that fills them.

Chunk k is the MDS folder `OUT/chunk-{k:05d}/`; it is finished when its `index.json` exists, which the writer
writes last, after the listing of the files it skipped and its stats.
"""

from __future__ import annotations

import json
import logging
import re
import shutil
from pathlib import Path
from typing import Any

from streaming import MDSWriter
from streaming.base.util import get_index_basename

from ldm.data.folder import BAD_SAMPLES

log = logging.getLogger(__name__)

INDEX = get_index_basename()  # index.json: a chunk's, and the merged one at the top
CHUNK = "chunk-{:05d}"
CHUNK_NAME = re.compile(r"chunk-[0-9]{5}")
# What a finished chunk was written from, as JSON; not named *.json, which merge_index would read as an index.
CHUNK_STATS = "chunk_stats.txt"


class ChunkWriter:
    """Writes items chunk after chunk: opens a chunk's MDS writer at its first item, finishes it (bad files'
    listing and stats first, `index.json` last) when the next chunk starts. Leaving the `with` block by an
    error deletes the unfinished chunk, which the library's writer would otherwise mark finished."""

    def __init__(self, out: Path, columns: dict[str, str], shard_bytes: int, record: dict, chunks: int) -> None:
        self.out, self.columns, self.shard_bytes, self.record, self.chunks = out, columns, shard_bytes, record, chunks
        self.chunk: int | None = None
        self.writer: MDSWriter | None = None
        self.examples, self.bad, self.seconds = 0, [], 0.0  # of the chunk being written
        self.shapes: dict[str, list[int]] = {}  # of the last batch's latents and images, recorded in each chunk

    def __enter__(self) -> ChunkWriter:
        return self

    def __exit__(self, error_type: type | None, *_: Any) -> None:
        if error_type is None:
            self._close()
        elif self.writer is not None:
            self.writer.cancel_future_jobs()
            shutil.rmtree(self.out / CHUNK.format(self.chunk), ignore_errors=True)

    def write(self, chunk: int, row: dict[str, Any]) -> None:
        self._switch(chunk)
        self.writer.write(row)
        self.examples += 1

    def skip(self, chunk: int, line: str) -> None:
        self._switch(chunk)
        self.bad.append(line)

    def charge(self, seconds: float) -> None:
        """Count `seconds` of loading and encoding to the chunk being written (a batch's, once it is written)."""
        self.seconds += seconds

    def _switch(self, chunk: int) -> None:
        if chunk == self.chunk:
            return
        self._close()
        self.chunk, self.examples, self.bad, self.seconds = chunk, 0, [], 0.0
        self.writer = MDSWriter(out=str(self.out / CHUNK.format(chunk)), columns=self.columns,
                                size_limit=self.shard_bytes)  # fmt: skip

    def _close(self) -> None:
        if self.writer is None:
            return
        folder, seconds = self.out / CHUNK.format(self.chunk), self.seconds
        if self.bad:
            (folder / BAD_SAMPLES).write_text("".join(f"{line}\n" for line in self.bad), encoding="utf-8")
        stats = {**self.record, "examples": self.examples, "skipped": len(self.bad), "seconds": seconds}
        (folder / CHUNK_STATS).write_text(json.dumps({**stats, **(self.shapes if self.examples else {})}))
        self.writer.finish()
        self.writer = None
        rate = f", {self.examples / seconds:.1f} images/s" if seconds else ""  # a batch's time goes to its last chunk
        log.info(
            "precompute: chunk %d of %d written (%d examples, %d skipped%s)",
            self.chunk + 1, self.chunks, self.examples, len(self.bad), rate,
        )  # fmt: skip


def shard_bytes(index: dict) -> int:
    return sum(
        shard[kind]["bytes"] for shard in index["shards"] for kind in ("raw_data", "zip_data") if shard.get(kind)
    )
