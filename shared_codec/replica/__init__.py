"""The rollout cluster's canonical replica: the committed checkpoint on local disk, kept
current by applying the refit payloads in canonical coordinates (no vLLM, no Megatron), so
restores and late joins load from it instead of a trainer export (issue 31; docs/replica.md).

Modules, one concept each:
- `store.py`: `ReplicaStore` (bootstrap, stage, abort, commit, checkpoint_for, lease, digest)
  and the discipline (what is durable when);
- `recovery.py`: its recovery and slot repair (undo, catch-up, sync of an unsynced commit,
  redo from the log after a restart);
- `transition.py`: an attempt's payloads -> validated changes (indices and new bits per
  tensor), and what a record read back from the log touches;
- `log.py`: the write-ahead log record (the attempt's payloads, checksummed, written before any
  slot write);
- `bootstrap.py`: the initial copy into both slots;
- `crash.py`: the named crash points (a test-only hook kills a writer there);
- `state.py`: ``STATE.json`` (committed version and slot, what each slot holds), replaced
  atomically;
- `layout.py`: where each tensor lies in the safetensors files; in-place reads and writes
  through memory maps;
- `leases.py`: reader leases and the store's slot write locks (flock);
- `durable.py`: atomic replace, directory fsync, durable copies;
- `digests.py`: per-tensor digests of the committed and staged versions, hashed on demand;
- `receiver.py`: `ReplicaReceiver`, the replica as a required receiver of every transition;
- `service.py` / `client.py`: its HTTP service (``dcr replica serve``: receiver calls, the
  committed checkpoints with range reads under a lease) and `HttpReplica`, `download`;
- `fanout.py`: the cluster's one reader of the object store, forwarding down its relay tree.

Limitations: docs/replica.md, "Limitations".
"""

from shared_codec.replica.crash import CRASH_POINTS
from shared_codec.replica.leases import lease
from shared_codec.replica.state import ReplicaStatus, read_status
from shared_codec.replica.store import ReplicaStore, StageResult

__all__ = ["CRASH_POINTS", "ReplicaStatus", "ReplicaStore", "StageResult", "lease", "read_status"]
