"""The candidate guard: do this rank's shards still hold the candidate the last build built from?

Paper Proposition 1 assumes the candidate stays fixed until the commit. Every build records,
per owned shard, what it built from (`candidate.Candidate`: its changed indices and their
new stored bits against the tracker; in mode F, without trackers, a 20-byte SHA-1 of the
whole shard). `CandidateGuard.verify` scans the shards again and compares (the changed
indices, then their bits) and raises `CandidateChanged` naming the moved parameters, so a
version the trainer no longer holds is never committed and a retry never re-emits a
different candidate. Who calls: the hook's ``commit`` (unless ``verify=False``) and its
overwrite retry, and the coordinator before its compare-and-set (the owner service's
``verify``, every rank).

Outcomes of ``verify(ledger, version, scan=)``, in this order:
1. guard off (``candidate_guard=False``): nothing is checked.
2. the candidate of `version` was built again while its attempt was open (`OwnerState`
   REBUILT): `CandidateChanged` ("built again"); the ledger moves to STALE.
3. no candidate of `version` with guard records: `ProtocolError` naming the last build.
4. ``scan=False`` (the caller held the training thread from the build until now): counted
   in `held`, no shard is read.
5. scan (counted in `scans`): any owned shard that moved raises `CandidateChanged` and the
   ledger moves to STALE; otherwise nothing changes.

Limitations:
1. A scan costs one detection pass over the owned shards (detection.py: in place on the host,
   or against the baseline streamed to the device).
2. The fingerprint of mode F detects accidental change, not an attacker (SHA-1).
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch

from megatron_dcr_hooks.candidate import Candidate, OwnerLedger
from megatron_dcr_hooks.detection import DeviceScan, shard_state
from megatron_dcr_hooks.tasks import Task
from shared_codec.errors import CandidateChanged, ProtocolError


class CandidateGuard:
    """The guard of one rank's owned shards (module docstring). `trackers` is the hook's own
    mapping (read, never written here)."""

    def __init__(
        self,
        owned: list[Task],
        trackers: Mapping[int, torch.Tensor],
        *,
        enabled: bool,
        rank: int,
        device_scan: DeviceScan | None = None,
    ) -> None:
        self.owned = owned
        self.device_scan = device_scan  # the hook's streamed scan, for shards on a device
        self.trackers = trackers
        self.enabled = enabled
        self.rank = rank
        self.scans = 0  # verifies that scanned the shards
        self.held = 0  # verifies answered without a scan (``scan=False``)

    def unmoved(self, t: Task, candidate: Candidate) -> bool:
        """Does owned shard `t` still hold what `candidate` recorded for it?"""
        state, change = shard_state(
            t.param, self.trackers.get(t.index), guard=self.enabled, scan=self.device_scan
        )
        if change is None:
            return state == candidate.checks[t.index]
        built = candidate.delta.get(t.index)
        if built is None:  # unchanged at the build
            return not change[0].size
        return np.array_equal(change[0], built[0]) and np.array_equal(change[1], built[1])

    def verify(self, ledger: OwnerLedger, version: int, *, scan: bool = True) -> None:
        """Raise unless this rank's shards still hold the candidate of `version` (module
        docstring: outcomes, in order)."""
        if not self.enabled:
            return
        if ledger.rebuilt(version):
            ledger.refused()
            raise CandidateChanged(
                f"rank {self.rank}: version {version} was built again (another optimizer step) "
                "before it was committed or aborted; the engines may hold either build. Nothing "
                "committed: build the version again from the current weights"
            )
        if not ledger.holds(version):
            raise ProtocolError(
                f"rank {self.rank}: no build of version {version} to verify "
                f"(last build: {ledger.last_built()})"
            )
        if not scan:
            self.held += 1
            return
        self.scans += 1
        candidate = ledger.candidate
        assert candidate is not None
        moved = [
            t.name
            for t in self.owned
            if t.index in candidate.checks and not self.unmoved(t, candidate)
        ]
        if moved:
            # the record is stale: a later retry builds from the current weights (the
            # coordinator restores the engines to the committed version first)
            ledger.refused()
            shown = ", ".join(moved[:5]) + (f" and {len(moved) - 5} more" if len(moved) > 5 else "")
            raise CandidateChanged(
                f"rank {self.rank}: parameters changed after version {version} was built "
                f"({shown}); an optimizer step between build and commit? Nothing committed: "
                "build the version again from the current weights"
            )
