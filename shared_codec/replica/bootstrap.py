"""Bootstrap: copy the rollout cluster's initial checkpoint into both slots of a new root.

Each slot is copied through a temporary directory (every file and directory fsynced, then
renamed into place); ``STATE.json`` is written last, by the store. A crash before that leaves
no ``STATE.json``: the root is not bootstrapped, and the next bootstrap removes the debris.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from shared_codec.errors import ReplicaError
from shared_codec.replica import durable
from shared_codec.replica.crash import at
from shared_codec.replica.leases import LEASE_DIR
from shared_codec.replica.state import Bootstrap, ReplicaState, SlotState, SlotStatus, slot_dir

LOG_DIR = "log"


def copy_initial(root: Path, src: Path, version: int, identity: str) -> ReplicaState:
    """Copy checkpoint `src` into ``slot0`` and ``slot1`` of `root` durably, create ``log/``;
    the state to commit (both slots clean at `version`). `ReplicaError` (nothing written) when
    the root holds anything but the store's own (debris of a crashed bootstrap)."""
    ours = {"slot0", "slot1", LOG_DIR, LEASE_DIR}
    other = sorted(
        p.name
        for p in root.iterdir()
        if p.name not in ours and not p.name.startswith(durable.TMP_PREFIX)
    )
    if other:
        raise ReplicaError(f"bootstrap: {root} is not empty (holds {other}); refused")
    for name in ("slot0", "slot1", LOG_DIR):  # debris of a bootstrap that crashed
        if (root / name).exists():
            shutil.rmtree(root / name)
    durable.remove_temporaries(root)
    durable.copy_tree(src, slot_dir(root, 0))
    at("bootstrap_slot0")
    durable.copy_tree(src, slot_dir(root, 1))
    (root / LOG_DIR).mkdir()
    durable.fsync_dir(root)
    clean = SlotState(status=SlotStatus.CLEAN, version=version)
    return ReplicaState(
        committed=version,
        committed_slot=0,
        committed_attempt=None,
        bootstrap=Bootstrap(version=version, source=str(src), identity=identity),
        slots=(clean, clean),
    )
