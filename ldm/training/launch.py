"""One run folder for every rank of a run: the first rank names it, the others receive the name.

Three ways ranks start, and how each learns the folder:

- Lightning's own launcher (`lightning.trainer.devices=N` on one machine): the ranks it starts inherit
  `LDM_RUN_DIR`, which the first rank sets before training;
- torchrun and SLURM (`srun`) start every rank at once, before any process group exists: rank 0
  publishes the name in a `torch.distributed.TCPStore` at the job's main address, one port above the
  one the process group will use, and the others read it there;
- `LDM_RUN_DIR` set by hand overrides both.

Ranks and addresses come from Lightning's cluster environments (`TorchElasticEnvironment`,
`SLURMEnvironment`), as the Trainer itself will read them.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist
from lightning.fabric.plugins.environments import ClusterEnvironment, SLURMEnvironment, TorchElasticEnvironment

from ldm.utils.run_folder import RUN_DIR_ENV

log = logging.getLogger(__name__)

STORE_KEY = "ldm_run_dir"
TIMEOUT = timedelta(minutes=10)


def cluster_environment() -> ClusterEnvironment | None:
    """The launcher this process was started by, if it started several ranks at once."""
    for env_cls in (TorchElasticEnvironment, SLURMEnvironment):
        if env_cls.detect():
            env = env_cls()
            if env.world_size() > 1:
                return env
    return None


def agree_on_run_dir(propose: Callable[[], Path], env: ClusterEnvironment | None = None) -> Path:
    """The run folder every rank uses: `LDM_RUN_DIR` if set, else `propose()` on the first rank, shared.

    `propose` runs on rank 0 only. Ranks other than 0 wait for it (at most ten minutes)."""
    if os.environ.get(RUN_DIR_ENV):
        return Path(os.environ[RUN_DIR_ENV])
    env = env or cluster_environment()
    if env is None:
        return propose()
    rank, world = env.global_rank(), env.world_size()
    store = dist.TCPStore(
        env.main_address, env.main_port + 1, world, is_master=rank == 0, timeout=TIMEOUT, wait_for_workers=False
    )
    if rank == 0:
        run_dir = propose()
        store.set(STORE_KEY, str(run_dir))
        _wait_for_readers(store, world - 1)
        log.info("run folder %s shared with %d other ranks", run_dir, world - 1)
        return run_dir
    run_dir = Path(store.get(STORE_KEY).decode())
    store.add("ldm_readers", 1)
    return run_dir


def _wait_for_readers(store: dist.TCPStore, readers: int) -> None:
    """Keep the store (hosted by rank 0) up until every other rank has read the name."""
    deadline = time.monotonic() + TIMEOUT.total_seconds()
    while store.add("ldm_readers", 0) < readers:
        if time.monotonic() > deadline:
            raise TimeoutError(f"only {store.add('ldm_readers', 0)} of {readers} ranks read the run folder in time")
        time.sleep(0.05)
