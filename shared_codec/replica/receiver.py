"""`ReplicaReceiver`: the canonical replica as a required receiver of every transition (the
coordinator's `Engine` protocol over a `ReplicaStore` in this process; service.py serves it
over HTTP to a coordinator elsewhere, client.py is that coordinator's handle).

Per transition, in the coordinator's order (docs/protocol.md, "The replica"):
1. ``apply(v, a, timeout_s)``: stream the attempt's payloads from the rollout cluster's
   payload source as they arrive (the same transport spec the engines fetch from, until the
   seal: a pipelined coordinator calls it while the owners still build), decoding and
   validating each one on arrival (`ReplicaStore.decoder`), then ``store.stage(v, a,
   payloads, decoded=...)``: logged, written to the shadow slot and durable before the ACK.
   An overwrite retry stages a new attempt, which undoes the previous one.
2. ``commit(v)``: the staged version becomes the committed one (idempotent); then, in the
   background, the other slot catches up to `v` (`ReplicaStore.catch_up`), so the next stage
   writes only its own attempt.
3. ``abort(a)``: fence attempt `a` of the version being staged (a later apply of it is refused,
   also one that is still fetching) and undo it if it is staged.

`restore(v)` (the coordinator's repair after a failed or unreachable attempt) reopens the store,
which recovers whatever a crash left, and commits `v` when it is staged (the coordinator died
between its compare-and-set and telling the replica), then catches up like a commit; a replica
whose committed version is not `v` afterwards is refused: nothing but a bootstrap or later
transitions may move it.

With `fanout` (the rollout cluster's relay tree root), the replica is also the cluster's one
fetcher in object-storage mode: it streams each attempt from the store once and forwards every
payload down the tree as it arrives, whose nodes spool it for their engines (fanout.py); after
each commit it tells the tree to forget what engines no longer need (`keep_versions`).

`checkpoint_for(v)` is a lease on `v`'s slot: ``with replica.checkpoint_for(v) as path:`` (a
restore or join of an engine on this host dense-loads `path`); the digest of a version is the
store's (`checkpoint.combined_digest` of the canonical tensors).

Limitations:
1. Calls are serialized by one lock (the store is not thread-safe); a fetch waits outside it.
2. Fences live in memory: a restarted replica is fenced again by the coordinator's restore.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

from shared_codec.coordination.protocol import EngineAck, RankAck
from shared_codec.errors import PayloadError, ProtocolError, ReplicaError
from shared_codec.replica.fanout import relay_attempt
from shared_codec.replica.state import ReplicaStatus
from shared_codec.replica.store import ReplicaStore
from shared_codec.replica.transition import AttemptDecoder
from shared_codec.transport.spec import Role, TransportSpec

log = logging.getLogger("dcr.replica")


class ReplicaReceiver:
    """The replica's receiver side (module docstring). `root`: the bootstrapped replica root;
    `source`: the payload source spec the replica reads attempts from (``dir``, ``s3``, or a
    relay node's ``spool``); `key`: the payload secret; `lease_timeout_s`: how long a stage
    waits for readers of the slot it must write."""

    #: a required receiver: the coordinator never removes it from a transition
    required = True

    def __init__(
        self,
        root: str | os.PathLike[str],
        source: TransportSpec | Mapping[str, Any] | str,
        *,
        name: str = "replica",
        key: bytes | None = None,
        lease_timeout_s: float = 30.0,
        fanout: TransportSpec | Mapping[str, Any] | str | None = None,
        keep_versions: int = 2,
    ) -> None:
        self.name = name
        self.root = Path(root).resolve()
        self.source = TransportSpec.parse(source, role=Role.SOURCE, what="replica source")
        self.fanout = None
        if fanout is not None:
            self.fanout = TransportSpec.parse(fanout, role=Role.SINK, what="replica fanout")
            if self.fanout.kind != "relay":
                raise ValueError(
                    f"replica fanout must be the cluster's relay tree (kind 'relay'), got "
                    f"{self.fanout.kind!r}"
                )
        self.keep_versions = keep_versions
        #: bytes read from the payload source (the cluster boundary in object-storage mode)
        self.bytes_in = 0
        self.key = key
        self.lease_timeout_s = lease_timeout_s
        self._lock = threading.Lock()
        self._store: ReplicaStore | None = self._open()
        self._fenced: set[int] = set()  # attempts of the version after the committed one
        self.last: EngineAck | None = None

    def _open(self) -> ReplicaStore:
        store = ReplicaStore(self.root, key=self.key, lease_timeout_s=self.lease_timeout_s)
        try:
            store.status()  # the constructor recovered it; refused when never bootstrapped
        except ProtocolError:
            store.close()
            raise ReplicaError(
                f"{self.root}: not bootstrapped (dcr replica bootstrap ROOT CHECKPOINT first)"
            ) from None
        return store

    @property
    def store(self) -> ReplicaStore:
        if self._store is None:
            raise ReplicaError(f"replica {self.name}: closed")
        return self._store

    def close(self) -> None:
        with self._lock:
            if self._store is not None:
                self._store.close()
                self._store = None

    def status(self) -> ReplicaStatus:
        with self._lock:
            return self.store.status()

    def committed_version(self) -> int:
        return self.status().committed

    # -- the coordinator's Engine protocol ----------------------------------------------------
    def apply(self, version: int, attempt: int, timeout_s: float) -> EngineAck:
        """Fetch the attempt's sealed payloads and stage them durably (module docstring, 1).
        A refused or unreadable attempt is a failed ACK naming why; nothing is staged."""
        t0 = time.perf_counter()
        committed = self.committed_version()
        if version != committed + 1:  # stale (or not yet possible): fetch nothing
            return self._failed(
                version, attempt,
                f"version {version} is not the next one after the replica's committed version "
                f"{committed}",
            )  # fmt: skip
        if attempt in self._fenced:
            return self._failed(version, attempt, f"attempt {attempt} is fenced (aborted)")
        with self._lock:
            decoder = self.store.decoder(version, attempt)
        with decoder:
            return self._stream_and_stage(decoder, version, attempt, timeout_s, t0)

    def _stream_and_stage(
        self, decoder: AttemptDecoder, version: int, attempt: int, timeout_s: float, t0: float
    ) -> EngineAck:
        fenced = lambda: attempt in self._fenced  # noqa: E731 - polled by the stream
        try:
            source = self.source.open_source(key=self.key)
            if self.fanout is not None:  # the cluster's one fetcher: forward as it reads
                relay_attempt(source, self.fanout, version, attempt, timeout_s, each=decoder.add)
            else:
                for data in source.stream(version, attempt, timeout_s, cancelled=fenced):
                    decoder.add(data)  # decoded and validated as it arrives
        except PayloadError as e:
            return self._failed(version, attempt, f"stage: {type(e).__name__}: {e}")
        except Exception as e:  # transport: missing, abandoned, timed out
            return self._failed(version, attempt, f"fetch: {type(e).__name__}: {e}")
        payloads = decoder.payloads
        self.bytes_in += sum(len(p) for p in payloads)
        fetched = time.perf_counter()
        with self._lock:
            if fenced():  # fenced while it fetched: a late attempt
                return self._failed(version, attempt, f"attempt {attempt} is fenced (aborted)")
            try:
                res = self.store.stage(version, attempt, payloads, decoded=decoder)
            except Exception as e:
                return self._failed(version, attempt, f"stage: {type(e).__name__}: {e}")
        done = time.perf_counter()
        rank = RankAck(
            ok=True,
            attempt=attempt,
            rank=0,
            target_version=version,
            payloads=res.payloads,
            items=res.tensors,
            elements_written=res.elements,
            bytes=sum(len(p) for p in payloads),
        )
        self.last = EngineAck.merge(
            [rank], fetch_s=fetched - t0, apply_s=done - fetched,
            fetched_bytes=rank.bytes, payloads=len(payloads),
        )  # fmt: skip
        return self.last

    def _failed(self, version: int, attempt: int, why: str) -> EngineAck:
        rank = RankAck(ok=False, attempt=attempt, rank=0, target_version=version, error=why)
        self.last = EngineAck.merge([rank])
        return self.last

    def commit(self, version: int) -> None:
        with self._lock:
            if not self.store.commit(version, sync=False):  # synced by the catch-up below
                return
            self._fenced.clear()  # attempt ids start again for the next version
        self._start_catch_up()
        if self.fanout is not None and self.keep_versions > 0:
            before = version - self.keep_versions + 1  # the tree keeps what engines may need
            threading.Thread(
                target=self._forget, args=(before,), name="dcr-replica-forget", daemon=True
            ).start()

    def _start_catch_up(self) -> None:
        """In the background, off the refit's critical path: make the committed slot durable
        (`sync_committed`) and bring the lagging slot to the committed version (`catch_up`),
        both of which the next stage would otherwise do first (a stage that comes first does
        them itself, under the lock)."""
        threading.Thread(target=self._catch_up, name="dcr-replica-catch-up", daemon=True).start()

    def _catch_up(self) -> None:
        with self._lock:
            if self._store is None:  # closed meanwhile
                return
            try:
                self._store.catch_up(lease_timeout_s=0.0)
            except Exception as e:  # a lease on the lagging version: the next stage waits
                log.info("replica %s: catch-up after commit deferred: %s", self.name, e)

    def _forget(self, before_version: int) -> None:
        assert self.fanout is not None
        try:
            self.fanout.forget(before_version)
        except Exception as e:  # best effort: the next commit's pass catches up
            log.warning("replica %s: relay retention before v%d: %s", self.name, before_version, e)

    def abort(self, attempt: int) -> None:
        with self._lock:
            self._fenced.add(attempt)
            target = self.store.status().shadow.target
            if target is not None:
                self.store.abort(target, attempt)

    def digest(self) -> str:
        """The digest of the staged version when one is staged (what the commit record binds,
        as an engine's digest is of its applied weights), else of the committed one."""
        with self._lock:
            return self.store.digest(self.store.status().staged)

    def restore(self, version: int) -> None:
        """Reopen (recover) the store and bring it to committed `version` when that is staged
        (module docstring); `ReplicaError` when the replica does not hold `version`."""
        with self._lock:
            if self._store is not None:
                self._store.close()
                self._store = None
            self._store = self._open()
            self._fenced.clear()
            st = self.store.status()
            if st.staged == version:
                self.store.commit(version)
                st = self.store.status()
            if st.committed != version:
                raise ReplicaError(
                    f"replica {self.name}: holds committed version {st.committed}, not {version}"
                    " (it cannot be restored from itself: bootstrap it again from a checkpoint"
                    f" of version {version})"
                )
        self._start_catch_up()

    # -- reads ----------------------------------------------------------------------------------
    def checkpoint_for(self, version: int) -> AbstractContextManager[Path]:
        """A lease on `version`'s slot (``with ... as path``): the directory of that committed
        version, unchanged while the lease is held."""
        return self.store.lease(version, timeout_s=self.lease_timeout_s, holder="restore")

    def checkpoints(self) -> Callable[[int], AbstractContextManager[Path]]:
        """`checkpoint_for` for engine handles on this host, taking leases by root (works
        from any thread or process, also while this receiver is restored)."""
        from shared_codec.replica.leases import lease

        root, timeout = self.root, self.lease_timeout_s
        return lambda v: lease(root, v, timeout_s=timeout, holder="restore")


__all__ = ["ReplicaReceiver"]
