"""The loader of precomputed shards (`ldm.data.shards`), resumable to the sample.

Its checkpointed position is the streaming library's global sample offset within the epoch, not a count of
this process's batches, so a run resumes on the samples an unbroken run saw, on any number of processes at the
same global batch. It records what fixes the order, so a resume can tell whether it continues the same one.
"""

from __future__ import annotations

import logging
from typing import Any

from ldm.config import ConfigError
from ldm.data import ResumableDataLoader

log = logging.getLogger(__name__)


class ShardLoader(ResumableDataLoader):
    """A loader whose checkpointed position is the library's global sample offset within the epoch, with what
    fixes the order (`order`: seed, sources, global batch, canonical nodes, epoch size), so a resume can tell
    whether it continues the same order; `inexact_resume` says what to do when it cannot (warn | refuse)."""

    def __init__(self, *args: Any, world_size: int, order: dict, inexact_resume: str, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.world_size, self.order, self.inexact_resume = world_size, order, inexact_resume
        self._resumed_at: dict[str, int] | None = None  # where an inexact resume started: positions count from it

    def _samples_done(self, position: dict[str, int]) -> int:
        global_batch = self.batch_size * self.world_size
        samples = position["batches_done"] * global_batch
        resumed = self._resumed_at
        if resumed is not None and resumed["epoch"] == position["epoch"]:  # batches counted at another batch size
            samples += resumed["samples"] - resumed["batches_done"] * global_batch
        return samples

    def state_dict(self) -> dict[str, Any]:
        position = self.position()
        streaming = self.dataset.state_dict(self._samples_done(position), from_beginning=True)
        return {**position, "streaming": {**streaming, "epoch": position["epoch"]}, "order": self.order}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        streaming = dict(state["streaming"])
        changed = _order_changes(state.get("order"), self.order)
        if changed:
            where = f"sample {streaming['sample_in_epoch']} of epoch {state['epoch']}"
            if self.inexact_resume == "refuse":
                raise ConfigError(
                    f"-r: cannot resume the checkpoint's sample order exactly: {changed}. Resume with its settings, "
                    f"or set data.params.inexact_resume: warn to go on from {where} in the new order"
                )
            log.warning("resume is not exact: %s; going on from %s in the new order", changed, where)
            # the library would take the seed and canonical nodes from the checkpoint: keep the config's
            streaming.update(shuffle_seed=self.order["seed"], num_canonical_nodes=self.order["num_canonical_nodes"])
            self._resumed_at = {"epoch": state["epoch"], "samples": streaming["sample_in_epoch"],
                                "batches_done": state["batches_done"]}  # fmt: skip
        if state["batches_done"] >= len(self):  # saved at the end of an epoch: the next one starts from its beginning
            streaming.update(epoch=state["epoch"] + 1, sample_in_epoch=0)
        self.dataset.load_state_dict(streaming)


def _order_changes(saved: dict | None, current: dict) -> str:
    """What differs between the order a checkpoint was saved in and this run's, in words ('' when the same)."""
    if saved is None:  # a checkpoint from before the order was recorded: trust it
        return ""
    changes = [f"{key} {saved.get(key)} -> {value}" for key, value in current.items() if saved.get(key) != value]
    return ", ".join(changes)
