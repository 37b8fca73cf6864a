"""The canonical replica's store (shared_codec/replica): real files (a sharded safetensors
checkpoint), real payloads from the codec's encoder, oracles by stored bits.

Bootstrap and five stage/commit transitions (XOR, overwrite, mixed) bit-exact against
`records.apply_items`; overwrite retries after a partial attempt; abort; refusals of stale,
duplicate, foreign, corrupt and truncated payloads that change nothing; leases; recovery from
a dirty slot whose log record is missing or torn; the log record is the attempt's payloads,
replayed after a restart; the catch-up after a commit; writes left unsynced by a stage or an
unsynced commit, lost as in a power loss, redone from the log. Crash points are killed for real in
tests/integration/shared_codec/test_replica_kill.py."""

from __future__ import annotations

import hashlib
import json
import threading
import time
from pathlib import Path

import pytest
import torch

from shared_codec.checkpoint import combined_digest, load_checkpoint, state_digests
from shared_codec.errors import (
    ArgumentError,
    LeaseHeld,
    PayloadError,
    ProtocolError,
    ReplicaError,
)
from shared_codec.records import Kind, make_item
from shared_codec.replica import ReplicaStore, lease
from shared_codec.replica.log import LogCorrupt, decode_record, read_record, record_name
from shared_codec.replica.state import STATE_FILE, SlotStatus
from tests.unit.shared_codec.replica_cases import (
    applied,
    encode,
    items_between,
    lineage_of,
    other_files,
    same_bits,
    tensor_files,
    write_checkpoint,
)

KINDS = ("xor", "overwrite", "mixed", "xor", "overwrite")
SHARD = "model-00001-of-00002.safetensors"


@pytest.fixture(scope="module")
def initial(tmp_path_factory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("replica") / "initial")


@pytest.fixture(scope="module")
def lineage(initial) -> list[dict[str, torch.Tensor]]:
    """oracle[v] for v = 0..5: the initial tensors, then each evolved from the previous."""
    return lineage_of(initial, 5)


@pytest.fixture
def store(tmp_path, initial):
    s = ReplicaStore(tmp_path / "root")
    s.bootstrap(initial)
    yield s
    s.close()


def payloads(lineage, v: int, attempt: int = 0, kind: str = "xor", **kw) -> list[bytes]:
    return encode(items_between(lineage[v - 1], lineage[v], kind), v, attempt, **kw)


def snapshot(root: Path) -> dict[str, str]:
    """A hash of every file under the root but the lease directory (what 'nothing changed'
    compares)."""
    out = {}
    for f in sorted(root.rglob("*")):
        if f.is_file() and "leases" not in f.relative_to(root).parts:
            out[str(f.relative_to(root))] = hashlib.sha256(f.read_bytes()).hexdigest()
    return out


def test_five_versions_bit_exact(store, initial, lineage) -> None:
    files0, mapping0 = other_files(initial), tensor_files(initial)
    for v, kind in enumerate(KINDS, start=1):
        res = store.stage(v, 0, payloads(lineage, v, kind=kind))
        if v % 2:  # hashed before the commit; on even versions only after it (digests.py)
            assert store.digest(v) == combined_digest(state_digests(lineage[v]))
        assert res.base_version == v - 1 and res.elements > 0 and res.payloads >= 4
        assert store.commit(v) is True
        assert store.commit(v) is False  # a repeated commit
        path = store.checkpoint_for(v)
        assert same_bits(load_checkpoint(path), lineage[v]) == []
        assert other_files(path) == files0
        assert tensor_files(path) == mapping0
        # the other slot still holds v - 1 cleanly (it catches up at the next stage)
        assert same_bits(load_checkpoint(store.checkpoint_for(v - 1)), lineage[v - 1]) == []
        assert store.digest() == combined_digest(state_digests(lineage[v]))
        assert sorted(p.name for p in (store.root / "log").iterdir()) == [record_name(v, 0)]
    with pytest.raises(ReplicaError, match="version 3 is not held"):
        store.checkpoint_for(3)
    # a reopened store recomputes the committed digest from the files
    store.close()
    again = ReplicaStore(store.root)
    assert again.digest() == combined_digest(state_digests(lineage[5]))
    assert again.status().committed == 5
    again.close()


def test_bootstrap_is_idempotent_and_refuses_another_checkpoint(tmp_path, initial) -> None:
    root = tmp_path / "root"
    with ReplicaStore(root) as s:
        with pytest.raises(ProtocolError, match="not bootstrapped"):
            s.stage(1, 0, [])
        s.bootstrap(initial)
        before = snapshot(root)
        assert s.bootstrap(initial).committed == 0  # the same checkpoint: nothing to do
        assert snapshot(root) == before
        other = tmp_path / "other"
        other.mkdir()
        for f in initial.iterdir():
            (other / f.name).write_bytes(f.read_bytes())
        (other / "config.json").write_text("{}")
        with pytest.raises(ReplicaError, match="already holds a replica bootstrapped from"):
            s.bootstrap(other)
        with pytest.raises(ReplicaError, match="already holds"):
            s.bootstrap(initial, version=3)
        assert snapshot(root) == before
        with pytest.raises(ReplicaError, match="another process holds"):
            ReplicaStore(root)
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "notes.txt").write_text("mine")
    with ReplicaStore(busy) as s, pytest.raises(ReplicaError, match="not empty"):
        s.bootstrap(initial)
    with ReplicaStore(tmp_path / "at7") as s:
        assert s.bootstrap(initial, version=7).committed == 7
        assert s.checkpoint_for(7).name == "slot0"


def test_overwrite_retry_after_partial_attempt(store, lineage) -> None:
    # attempt 0 of version 1: only owner 0's payloads arrived, and a bogus XOR of elements
    # version 1 does not change: the retry must undo both
    partial = [it for it in items_between(lineage[0], lineage[1], "xor") if it.owner == 0]
    name = sorted(lineage[0])[1]
    bogus = make_item(name, lineage[0][name].dtype, lineage[0][name].shape, 1, Kind.XOR,
                      torch.arange(0, 64, 2).numpy(), torch.full((32,), 0x5A5A).numpy().astype("uint16"))  # fmt: skip
    store.stage(1, 0, encode([*partial, bogus], 1, 0))
    assert store.digest(1) == combined_digest(state_digests(applied(lineage[0], [*partial, bogus])))
    with pytest.raises(ProtocolError, match="already staged"):
        store.stage(1, 0, encode(partial, 1, 0))
    store.stage(1, 1, payloads(lineage, 1, attempt=1, kind="overwrite"))
    assert store.digest(1) == combined_digest(state_digests(lineage[1]))
    # the undone attempt's record stays until the slot is durable (a redo undoes it again)
    assert sorted(p.name for p in (store.root / "log").iterdir()) == [
        record_name(1, 0), record_name(1, 1)
    ]  # fmt: skip
    with pytest.raises(ProtocolError, match="attempt 0 is not staged"):
        store.commit(1, attempt=0)
    store.commit(1, attempt=1)
    assert sorted(p.name for p in (store.root / "log").iterdir()) == [record_name(1, 1)]
    assert same_bits(load_checkpoint(store.checkpoint_for(1)), lineage[1]) == []
    # version 2 catches the lagging slot up (replays version 1's record), then retries too
    store.stage(2, 0, payloads(lineage, 2, 0, "xor")[:2])
    store.stage(2, 5, payloads(lineage, 2, attempt=5, kind="mixed"))
    store.commit(2)
    assert same_bits(load_checkpoint(store.checkpoint_for(2)), lineage[2]) == []
    assert same_bits(load_checkpoint(store.checkpoint_for(1)), lineage[1]) == []


def test_abort(store, lineage) -> None:
    store.stage(1, 0, payloads(lineage, 1))
    assert store.abort(1, 3) is False  # another attempt: nothing to undo
    assert store.abort(1, 0) is True
    assert store.abort(1, 0) is False
    st = store.status()
    assert [s.status for s in st.slots] == [SlotStatus.CLEAN, SlotStatus.CLEAN]
    assert same_bits(load_checkpoint(store.root / "slot1"), lineage[0]) == []
    assert list((store.root / "log").iterdir()) == []
    with pytest.raises(ProtocolError, match="not staged"):
        store.commit(1)
    store.stage(1, 1, payloads(lineage, 1, attempt=1))
    store.commit(1)
    # aborting a stage that also caught the lagging slot up leaves it clean at the committed
    store.stage(2, 0, payloads(lineage, 2))
    assert store.abort(2, 0) is True
    st = store.status()
    assert st.slots[0].status == SlotStatus.CLEAN and st.slots[0].version == 1
    assert same_bits(load_checkpoint(store.root / "slot0"), lineage[1]) == []
    assert store.checkpoint_for(1) == store.root / "slot1"  # the committed slot first
    store.stage(2, 1, payloads(lineage, 2, attempt=1))
    store.commit(2)
    assert same_bits(load_checkpoint(store.checkpoint_for(2)), lineage[2]) == []


def test_catch_up_after_commit(store, lineage) -> None:
    store.stage(1, 0, payloads(lineage, 1))
    store.commit(1)
    assert store.status().slots[1 - store.status().committed_slot].version == 0  # lags
    with lease(store.root, 0, holder="reader"):  # a reader of version 0 keeps it
        before = snapshot(store.root)
        with pytest.raises(LeaseHeld):
            store.catch_up(lease_timeout_s=0.1)
        assert snapshot(store.root) == before
    assert store.catch_up() is True
    st = store.status()
    assert [(s.status, s.version) for s in st.slots] == [(SlotStatus.CLEAN, 1)] * 2
    assert same_bits(load_checkpoint(store.root / "slot0"), lineage[1]) == []
    with pytest.raises(ReplicaError, match="version 0 is not held"):
        store.checkpoint_for(0)
    assert store.catch_up() is False  # nothing lags
    store.stage(2, 0, payloads(lineage, 2, kind="mixed"))
    assert store.catch_up() is False  # a staged shadow is not touched
    store.commit(2)
    assert same_bits(load_checkpoint(store.checkpoint_for(2)), lineage[2]) == []
    assert same_bits(load_checkpoint(store.checkpoint_for(1)), lineage[1]) == []


def _lose_writes(slot_dir: Path, durable_dir: Path) -> None:
    """Simulate a power loss that dropped every unsynced write of `slot_dir`: its tensor files
    become what reached the disk, `durable_dir`'s (the version it held when last synced)."""
    for f in sorted(durable_dir.glob("*.safetensors")):
        (slot_dir / f.name).write_bytes(f.read_bytes())


def test_a_restart_redoes_unsynced_writes_from_the_log(tmp_path, initial, lineage) -> None:
    root = tmp_path / "root"
    with ReplicaStore(root) as store:
        store.bootstrap(initial)
        store.stage(1, 0, payloads(lineage, 1))
        assert store.status().shadow.touched == (0,)  # staged, not synced: the log redoes it
        store.commit(1, sync=False)  # as a receiver commits: synced later, off the refit
        st = store.status()
        assert st.slots[st.committed_slot].touched == (0,)
        with pytest.raises(ReplicaError, match="not durable yet"), lease(root, 1, timeout_s=0.2):
            pass  # readers wait for the sync
    c, base = root / f"slot{st.committed_slot}", root / f"slot{1 - st.committed_slot}"
    _lose_writes(c, base)
    assert same_bits(load_checkpoint(c), lineage[0]) == []
    with ReplicaStore(root) as store:  # recovery: redone from the log (base: the other slot)
        st = store.status()
        assert st.committed == 1 and st.slots[st.committed_slot].touched == ()
        assert same_bits(load_checkpoint(c), lineage[1]) == []
        with store.lease(1) as path:
            assert path == c
        assert store.catch_up() is True
        store.stage(2, 0, payloads(lineage, 2, kind="mixed"))
    _lose_writes(base, c)  # the staged attempt's writes lost too: the shadow is v1 on disk
    with ReplicaStore(root) as store:
        st = store.status()
        assert st.staged == 2 and st.shadow.touched == ()
        assert same_bits(load_checkpoint(base), lineage[2]) == []
        store.commit(2, sync=False)
        assert store.sync_committed() is False  # the redo made it durable already
        assert same_bits(load_checkpoint(store.checkpoint_for(2)), lineage[2]) == []
        assert same_bits(load_checkpoint(store.checkpoint_for(1)), lineage[1]) == []
        assert sorted(p.name for p in (root / "log").iterdir()) == [record_name(2, 0)]


def test_the_log_record_is_the_payloads(tmp_path, initial, lineage) -> None:
    root = tmp_path / "root"
    sent = payloads(lineage, 1, kind="mixed")
    with ReplicaStore(root) as store:
        store.bootstrap(initial)
        store.stage(1, 0, sent)
    path = root / "log" / record_name(1, 0)
    assert read_record(root / "log", 1, 0).payloads == tuple(sent)
    assert sum(map(len, sent)) < path.stat().st_size < sum(map(len, sent)) + 512
    # reopened, the store has no memory of what the attempt wrote: its abort decodes the
    # payloads from the log again and copies the committed bits back (no whole-slot copy)
    with ReplicaStore(root) as store:
        assert store.abort(1, 0) is True
        assert store.copies == 0
        assert same_bits(load_checkpoint(root / "slot1"), lineage[0]) == []
        store.stage(1, 1, payloads(lineage, 1, attempt=1))
        store.commit(1)
    with ReplicaStore(root) as store:  # the lagging slot catches up from the log too
        assert store.catch_up() is True and store.copies == 0
        assert same_bits(load_checkpoint(root / "slot0"), lineage[1]) == []
    # a record of another format (format 1 held old and new bits) is never replayed
    data = bytearray(path.with_name(record_name(1, 1)).read_bytes())
    data[4] = 1
    with pytest.raises(LogCorrupt, match="checksum"):
        decode_record(bytes(data), version=1, attempt=1)
    body = bytes(data[:-32])
    with pytest.raises(LogCorrupt, match=r"format \(1, this store reads 2\)"):
        decode_record(body + hashlib.blake2b(body, digest_size=32).digest(), version=1, attempt=1)


def _flip(data: bytes, at: int) -> bytes:
    b = bytearray(data)
    b[at] ^= 0x40
    return bytes(b)


def _stage_streamed(store: ReplicaStore, v: int, a: int, pls: list[bytes]):
    """Stage through `ReplicaStore.decoder`, fed payload by payload (as a receiver does)."""
    with store.decoder(v, a) as d:
        for data in pls:
            d.add(data)
        return store.stage(v, a, d.payloads, decoded=d)


def test_decoded_as_they_arrive_stages_the_same(tmp_path, initial, lineage) -> None:
    """The receiver's path (staged bits computed per payload on arrival) against the batch
    path, bit for bit, for every kind, and for an attempt whose items overlap (computed
    again in (owner, sequence) order)."""
    roots = {m: tmp_path / m for m in ("batch", "streamed")}
    stores = {m: ReplicaStore(r) for m, r in roots.items()}
    try:
        for store in stores.values():
            store.bootstrap(initial)
        partial = [it for it in items_between(lineage[0], lineage[1], "xor") if it.owner == 0]
        first = partial[0]  # owner 1 overwrites 32 of the elements owner 0 XORs
        bogus = make_item(first.name, first.dtype, first.shape, 1, Kind.OVERWRITE,
                          first.indices[:32], torch.full((32,), 0x5A5A).numpy().astype("uint16"))  # fmt: skip
        overlapping = encode([*partial, bogus], 1, 0)
        want = applied(lineage[0], [*partial, bogus])
        stores["batch"].stage(1, 0, overlapping)
        res = _stage_streamed(stores["streamed"], 1, 0, list(reversed(overlapping)))
        assert res.payloads == len(overlapping)
        for m in stores:
            assert stores[m].digest(1) == combined_digest(state_digests(want)), m
        for v, kind in enumerate(KINDS, start=1):
            a = 0 if v > 1 else 1
            pls = payloads(lineage, v, attempt=a, kind=kind)
            batch = stores["batch"].stage(v, a, pls)
            got = _stage_streamed(stores["streamed"], v, a, list(reversed(pls)))  # any order
            assert (got.tensors, got.elements) == (batch.tensors, batch.elements) != (0, 0)
            for m, store in stores.items():
                assert store.digest(v) == combined_digest(state_digests(lineage[v])), (m, v)
                store.commit(v)
        assert same_bits(load_checkpoint(roots["streamed"] / "slot1"), lineage[5]) == []
    finally:
        for store in stores.values():
            store.close()


def test_refusals_change_nothing(tmp_path, initial, lineage) -> None:
    with ReplicaStore(tmp_path / "root") as store:
        store.bootstrap(initial)
        store.stage(1, 0, payloads(lineage, 1))
        store.commit(1)
        good = payloads(lineage, 2)
        names = sorted(lineage[0])
        t = lineage[0][names[0]]
        foreign_shape = make_item(names[0], t.dtype, (t.numel(),), 0, Kind.XOR,
                                  torch.tensor([1]).numpy(), torch.tensor([1]).numpy().astype("uint16"))  # fmt: skip
        unknown = make_item("model.not_here.weight", torch.bfloat16, (4,), 0, Kind.XOR,
                            torch.tensor([1]).numpy(), torch.tensor([1]).numpy().astype("uint16"))  # fmt: skip
        cases = {
            "stale": (2, 0, payloads(lineage, 1), PayloadError, "field base_version"),
            "other version": (
                2,
                0,
                encode(items_between(lineage[1], lineage[2], "xor"), 3, 0, base=1),
                PayloadError,
                "field version",
            ),  # fmt: skip
            "other attempt": (2, 1, good, PayloadError, "field attempt"),
            "duplicate": (2, 0, [*good, good[0]], PayloadError, "duplicate"),
            "xor twice": (
                2,
                0,
                [
                    *good,
                    *encode(items_between(lineage[1], lineage[2], "xor")[:1], 2, 0, sequence=50),
                ],  # fmt: skip
                PayloadError,
                "already XORed",
            ),
            "corrupt": (2, 0, [good[0], _flip(good[1], len(good[1]) // 2)], PayloadError, "digest"),
            "truncated": (2, 0, [good[0][:-7]], PayloadError, "payload"),
            "not bytes": (2, 0, ["text"], PayloadError, "not bytes"),
            "keyed": (2, 0, payloads(lineage, 2, key=b"k" * 16), PayloadError, "no key configured"),
            "wrong shape": (2, 0, encode([foreign_shape], 2, 0), PayloadError, "items"),
            "unknown tensor": (2, 0, encode([unknown], 2, 0), PayloadError, "no such destination"),
            "gap": (3, 0, good, ArgumentError, "not the next one"),
            "stale version": (1, 0, good, ArgumentError, "not the next one"),
            "negative attempt": (2, -1, good, ArgumentError, "attempt"),
        }
        before, digest = snapshot(store.root), store.digest()
        for label, (v, a, pls, err, match) in cases.items():
            with pytest.raises(err, match=match):
                store.stage(v, a, pls)
            assert snapshot(store.root) == before, label
            assert store.digest() == digest, label
            # the same payloads decoded as they arrive (a receiver's path): refused as early
            # (a gap or stale version is a payload of another version to that decoder)
            with pytest.raises((PayloadError, ArgumentError)):
                _stage_streamed(store, v, a, pls)
            assert snapshot(store.root) == before, label
        with store.decoder(2, 0) as d, pytest.raises(ArgumentError, match="decoded payloads"):
            for data in good:
                d.add(data)
            store.stage(2, 1, good, decoded=d)  # decoded for another attempt
        assert snapshot(store.root) == before
        with pytest.raises(ProtocolError, match="not staged"):
            store.commit(2)
        assert snapshot(store.root) == before
        # and the store still works
        store.stage(2, 0, good)
        assert store.digest(2) == combined_digest(state_digests(lineage[2]))


def test_keyed_payloads(tmp_path, initial, lineage) -> None:
    key = b"s" * 32
    with ReplicaStore(tmp_path / "root", key=key) as store:
        store.bootstrap(initial)
        with pytest.raises(PayloadError, match="unauthenticated"):
            store.stage(1, 0, payloads(lineage, 1))
        with pytest.raises(PayloadError, match="digest"):
            store.stage(1, 0, payloads(lineage, 1, key=b"x" * 32))
        store.stage(1, 0, payloads(lineage, 1, key=key))
        store.commit(1)
        assert same_bits(load_checkpoint(store.checkpoint_for(1)), lineage[1]) == []


def test_leases(store, lineage) -> None:
    # a lease of the committed version never blocks a stage (the committed slot is not written)
    with store.lease(0, holder="restore engine-0") as path:
        assert path == store.root / "slot0"
        store.stage(1, 0, payloads(lineage, 1))
        with pytest.raises(ReplicaError, match="version 1 is not held"):
            with store.lease(1):
                pass
        store.commit(1)
    # slot0 now holds version 0 = committed - 1: leasing it blocks the stage that would dirty it
    before = snapshot(store.root)
    with lease(store.root, 0, holder="restore engine-1") as path:
        assert path == store.root / "slot0"
        with pytest.raises(LeaseHeld, match=r"slot 0 is leased \(pid \d+ \(restore engine-1"):
            store.stage(2, 0, payloads(lineage, 2))
        assert snapshot(store.root) == before
        assert same_bits(load_checkpoint(path), lineage[0]) == []
    # a stage waits for a lease released within its timeout
    held = threading.Event()

    def reader() -> None:
        with store.lease(0, holder="slow reader"):
            held.set()
            time.sleep(0.3)

    th = threading.Thread(target=reader)
    th.start()
    held.wait(5)
    t0 = time.monotonic()
    store.stage(2, 0, payloads(lineage, 2), lease_timeout_s=10)
    assert time.monotonic() - t0 >= 0.2
    th.join()
    with pytest.raises(ReplicaError, match="version 0 is not held"):
        with store.lease(0):
            pass
    store.commit(2)
    with store.lease(1) as p1, store.lease(2) as p2:  # both slots held at once
        assert {p1.name, p2.name} == {"slot0", "slot1"}
    assert list((store.root / "leases").glob("slot*.*.*")) == []  # holder files removed


def _dirty(root: Path, touched: list[int]) -> None:
    """Rewrite STATE.json as if a crash left the shadow dirty after writing `touched`."""
    st = json.loads((root / STATE_FILE).read_text())
    sh = 1 - st["committed_slot"]
    st["slots"][sh] = {
        "status": "dirty", "version": st["committed"], "target": st["committed"] + 1,
        "attempt": None, "touched": touched,
    }  # fmt: skip
    (root / STATE_FILE).write_text(json.dumps(st))


@pytest.mark.parametrize("damage", ["missing", "torn"])
def test_recover_copies_the_committed_slot_when_the_log_is_unusable(
    tmp_path, initial, lineage, damage
) -> None:
    root = tmp_path / "root"
    with ReplicaStore(root) as store:
        store.bootstrap(initial)
        store.stage(1, 0, payloads(lineage, 1))
    rec = root / "log" / record_name(1, 0)
    _dirty(root, [0])
    if damage == "missing":
        rec.unlink()
    else:
        rec.write_bytes(rec.read_bytes()[:-100])
        with pytest.raises(LogCorrupt, match="checksum"):
            read_record(root / "log", 1, 0)
    with ReplicaStore(root) as store:
        assert store.copies == 1
        st = store.status()
        assert [s.status for s in st.slots] == [SlotStatus.CLEAN, SlotStatus.CLEAN]
        assert same_bits(load_checkpoint(root / "slot1"), lineage[0]) == []
        store.stage(1, 1, payloads(lineage, 1, attempt=1))
        store.commit(1)
    # a lagging slot whose catch-up record is gone is rebuilt by copying too (a store that
    # wrote the record itself catches up from memory: reopened, it must read the log)
    (root / "log" / record_name(1, 1)).unlink()
    with ReplicaStore(root) as store:
        store.stage(2, 0, payloads(lineage, 2))
        assert store.copies == 1
        store.commit(2)
        assert same_bits(load_checkpoint(store.checkpoint_for(2)), lineage[2]) == []
        assert same_bits(load_checkpoint(store.checkpoint_for(1)), lineage[1]) == []


def test_malformed_state_is_refused(tmp_path, initial) -> None:
    root = tmp_path / "root"
    with ReplicaStore(root) as store:
        store.bootstrap(initial)
    st = json.loads((root / STATE_FILE).read_text())
    st["slots"][0]["version"] = 4  # the committed slot does not hold the committed version
    (root / STATE_FILE).write_text(json.dumps(st))
    with pytest.raises(ReplicaError, match="inconsistent state"):
        ReplicaStore(root)
    (root / STATE_FILE).write_text("{")
    with pytest.raises(ReplicaError, match="not JSON"):
        ReplicaStore(root)


def test_bootstrap_refuses_what_it_cannot_hold(tmp_path, initial) -> None:
    bad = tmp_path / "bad"
    bad.mkdir()
    with (
        ReplicaStore(tmp_path / "r1") as s,
        pytest.raises(ReplicaError, match="no \\*.safetensors"),
    ):
        s.bootstrap(bad)
    (bad / "model.safetensors").write_bytes(b"\xff" * 16)
    with ReplicaStore(tmp_path / "r2") as s, pytest.raises(ReplicaError, match="header length"):
        s.bootstrap(bad)
    assert not (tmp_path / "r2" / "slot0").exists()


def test_a_staged_attempt_survives_a_restart(tmp_path, initial, lineage) -> None:
    root = tmp_path / "root"
    with ReplicaStore(root) as store:
        store.bootstrap(initial)
        store.stage(1, 4, payloads(lineage, 1, attempt=4))
        staged = store.digest(1)
    with ReplicaStore(root) as store:
        st = store.status()
        assert (st.slots[1].status, st.slots[1].target, st.slots[1].attempt) == (
            SlotStatus.STAGED, 1, 4,
        )  # fmt: skip
        assert store.digest(1) == staged == combined_digest(state_digests(lineage[1]))
        with pytest.raises(ReplicaError, match="neither committed nor staged"):
            store.digest(2)
        store.commit(1)
        assert store.digest() == staged
        assert same_bits(load_checkpoint(store.checkpoint_for(1)), lineage[1]) == []


def test_cli_bootstrap_and_status(tmp_path, initial, capsys) -> None:
    from dcr_tools.cli import main

    root = tmp_path / "root"
    assert main(["replica", "status", str(root)]) == 1
    assert "not bootstrapped" in capsys.readouterr().err
    assert main(["replica", "bootstrap", str(root), str(initial), "--version", "3"]) == 0
    capsys.readouterr()
    with ReplicaStore(root):  # status reads STATE.json without the writer lock
        assert main(["replica", "status", str(root), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["committed"] == 3 and [s["status"] for s in out["slots"]] == ["clean", "clean"]
    other = tmp_path / "other"
    other.mkdir()
    (other / "model.safetensors").write_bytes((initial / SHARD).read_bytes())
    assert main(["replica", "bootstrap", str(root), str(other)]) == 1
    assert "already holds a replica" in capsys.readouterr().err
