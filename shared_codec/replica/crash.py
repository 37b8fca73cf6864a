"""Crash points of the replica store: the places where a test-only hook may fire.

tests/integration/shared_codec/test_replica_kill.py installs a hook (`_hook`) that SIGKILLs
the writer at one point, then recovers and checks; docs/replica.md, "Crash points", says what
each point leaves on disk. Product code never installs a hook: fault injection is not part of
any signature (CONVENTIONS.md, 12); the kill tests' program arms it from its environment.
"""

from __future__ import annotations

from collections.abc import Callable

#: where the test-only crash hook may fire, in the order a stage / commit / abort reaches them
#: ("<x>_tmp": a STATE.json or record temporary is written and fsynced, not yet renamed)
CRASH_POINTS = (
    "bootstrap_slot0",  # bootstrap: slot0 copied, slot1 not, no STATE.json
    "bootstrapped_tmp", "bootstrapped",  # bootstrap: STATE.json being written / written
    "log_tmp", "log",  # stage: the record being written / durable
    "dirty_tmp", "dirty",  # STATE.json: shadow marked dirty
    "undo_partial",  # an overwrite retry: part of the previous attempt undone
    "catchup_partial",  # a lagging shadow: part of the committed record replayed
    "apply_partial",  # part of the attempt's new bits written
    "slot_written",  # the shadow written (not synced: the log redoes it), STATE.json dirty
    "staged_tmp", "staged",  # STATE.json: shadow staged
    "committed_tmp", "committed",  # commit: STATE.json flipped (old records not yet removed)
    "synced_tmp", "synced",  # the committed slot fsynced, STATE.json: it is durable
    "redo_partial",  # recovery: part of a staged or committed attempt written again from the log
    "repair_partial",  # abort or recovery: part of the undo written
    "clean_tmp", "clean",  # STATE.json: shadow clean again
)  # fmt: skip

#: test-only: called with each crash point's name (tests install a hook that SIGKILLs the
#: process there); never set by product code, not part of any signature
_hook: Callable[[str], None] | None = None


def at(point: str) -> None:
    """Call the test hook, when one is installed, with the crash point's name."""
    if _hook is not None:
        _hook(point)
