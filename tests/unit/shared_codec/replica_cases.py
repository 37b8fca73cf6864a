"""Shared by the replica store's unit and kill tests: a real sharded safetensors checkpoint (the
tiny qwen3 fixture, split over two files with an index, norms in float32), a lineage of policy
versions changed at the bit level (NaN payloads, signed zeros included), and real payloads
encoded by the codec's own encoder from the differences, over two owners; `LineageOwners`, a
TEST DOUBLE of the owner service publishing them through real sinks."""

from __future__ import annotations

import json
import shutil
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from shared_codec.buckets import BucketConfig, encode_items
from shared_codec.checkpoint import bits_equal, load_checkpoint
from shared_codec.dtypes import tensor_bits
from shared_codec.format import PayloadMeta
from shared_codec.records import DeltaItem, Kind, apply_items, diff_checkpoints
from shared_codec.transport.base import Seal
from shared_codec.transport.spec import open_sink, open_store

SHARDS = ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors")
#: small buckets, so every version is several payloads per owner
CONFIG = BucketConfig(bucket_bytes=4096, min_bucket_bytes=1024, threads=0)


def write_checkpoint(path: Path) -> Path:
    """The tiny qwen3 checkpoint as two safetensors shards plus an index, its norms as float32;
    the config and tokenizer files beside them."""
    from safetensors.torch import save_file

    from dcr_tools.fixtures import write_tiny_model

    tiny = write_tiny_model("qwen3", path.with_name(path.name + "-single"))
    tensors = load_checkpoint(tiny)
    path.mkdir(parents=True)
    for f in tiny.iterdir():
        if not f.name.endswith(".safetensors"):
            shutil.copy2(f, path / f.name)
    weight_map: dict[str, str] = {}
    parts: list[dict[str, torch.Tensor]] = [{}, {}]
    for i, name in enumerate(sorted(tensors)):
        t = tensors[name]
        if name.endswith("norm.weight"):
            t = t.float()
        parts[i % 2][name] = t.contiguous()
        weight_map[name] = SHARDS[i % 2]
    for shard, part in zip(SHARDS, parts, strict=True):
        save_file(part, str(path / shard), metadata={"format": "pt"})
    total = sum(t.numel() * t.element_size() for p in parts for t in p.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (path / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    shutil.rmtree(tiny)
    return path


def evolve(
    tensors: dict[str, torch.Tensor], seed: int, rate: float = 0.03
) -> dict[str, torch.Tensor]:
    """The next version: about `rate` of each tensor's elements get random new bits (so NaN
    payloads, infinities and signed zeros appear), a few tensors stay unchanged."""
    rng = np.random.default_rng(seed)
    out = {}
    for i, name in enumerate(sorted(tensors)):
        t = tensors[name].clone()
        if (i + seed) % 7 != 3:
            bits = tensor_bits(t)  # shares memory with t
            pos = np.flatnonzero(rng.random(bits.shape[0]) < rate)
            flips = rng.integers(1, np.iinfo(bits.dtype).max, size=pos.shape[0], dtype=bits.dtype)
            bits[pos] ^= flips
        out[name] = t
    return out


def lineage_of(initial: Path, versions: int, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    """oracle[v] for v = 0..`versions`: the initial checkpoint's tensors, then each evolved
    from the previous (`evolve` with seed `seed` + v)."""
    out = [load_checkpoint(initial)]
    for v in range(1, versions + 1):
        out.append(evolve(out[-1], seed=seed + v))
    return out


def items_between(
    old: dict[str, torch.Tensor], new: dict[str, torch.Tensor], kind: str
) -> list[DeltaItem]:
    """The items turning `old` into `new`: ``xor``, ``overwrite``, or ``mixed`` (overwrites
    for the norms, XOR for the rest); owner 0 for even-indexed tensors, 1 for the others."""
    names = sorted(old)
    items: list[DeltaItem] = []
    for owner in (0, 1):
        mine = set(names[owner::2])
        overwrite = {n for n in mine if kind == "overwrite" or (kind == "mixed" and "norm" in n)}
        items += diff_checkpoints(
            {n: old[n] for n in mine},
            {n: new[n] for n in mine},
            kind=Kind.XOR,
            overwrite=overwrite,
            owner=owner,
        )
    return items


def encode(
    items: list[DeltaItem],
    version: int,
    attempt: int,
    *,
    key: bytes | None = None,
    base: int | None = None,
    sequence: int = 0,
) -> list[bytes]:
    """The payloads of `items` for (version, attempt) on `base` (default version - 1), per
    owner, numbered from `sequence`."""
    out: list[bytes] = []
    config = replace(CONFIG, key=key)
    for owner in (0, 1):
        mine = [it for it in items if it.owner == owner]
        meta = PayloadMeta(
            version=version,
            base_version=version - 1 if base is None else base,
            attempt=attempt,
            owner=owner,
            sequence=sequence,
        )
        out += encode_items(mine, meta, config)
    return out


def applied(base: dict[str, torch.Tensor], items: list[DeltaItem]) -> dict[str, torch.Tensor]:
    """The oracle: a copy of `base` with `items` applied (`records.apply_items`)."""
    out = {k: v.clone() for k, v in base.items()}
    apply_items(out, items)
    return out


def same_bits(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    """Names whose stored bits differ (or that only one side has); empty when equal."""
    return sorted(
        n for n in a.keys() | b.keys() if n not in a or n not in b or not bits_equal(a[n], b[n])
    )


def caught_up(root: Path, version: int, timeout_s: float = 30.0) -> list[dict[str, torch.Tensor]]:
    """Both slots' tensors once they hold committed `version` cleanly (a receiver catches the
    lagging slot up in the background after each commit; nothing else may write the root
    meanwhile)."""
    from shared_codec.replica import read_status
    from shared_codec.replica.state import SlotStatus

    deadline = time.monotonic() + timeout_s
    while True:
        st = read_status(root)
        if st.committed == version and all(
            s.status == SlotStatus.CLEAN and s.version == version for s in st.slots
        ):
            return [load_checkpoint(root / f"slot{i}") for i in (0, 1)]
        assert time.monotonic() < deadline, f"{root}: not caught up to v{version}: {st}"
        time.sleep(0.05)


def other_files(directory: Path) -> dict[str, bytes]:
    """The bytes of every non-safetensors file of a checkpoint directory, by name."""
    return {
        f.name: f.read_bytes() for f in directory.iterdir() if not f.name.endswith(".safetensors")
    }


def tensor_files(directory: Path) -> dict[str, str]:
    """Which safetensors file holds each tensor."""
    from shared_codec.replica.layout import read_layout

    return {name: loc.file for name, loc in read_layout(directory).items()}


class LineageOwners:
    """TEST DOUBLE of the owner service: attempt a of version v publishes lineage[v-1] ->
    lineage[v] from two owners (XOR on attempt 0, overwrites on a retry) and seals it.
    `drop`: attempts whose last payload is sent but left out of what reaches the store (lost
    in transport: the seal names it, the object is missing)."""

    def __init__(self, lineage: list[dict[str, torch.Tensor]], spec: dict[str, Any]) -> None:
        self.lineage, self.spec = lineage, spec
        self.drop: set[tuple[int, int]] = set()
        self.calls: list[tuple[str, int]] = []

    def build(self, version: int, attempt: int, retry: bool) -> dict[str, Any]:
        items = items_between(
            self.lineage[version - 1], self.lineage[version], "overwrite" if retry else "xor"
        )
        ids: list[str] = []
        store = open_store(self.spec)
        for owner in (0, 1):
            mine = [it for it in items if it.owner == owner]
            with open_sink(self.spec, version=version, attempt=attempt, owner=owner) as sink:
                for p in encode(mine, version, attempt):
                    sink.send(p)
                ids += sink.finish().payload_ids
        if (version, attempt) in self.drop:
            lost = [k for k in store.list(f"v{version:012d}/a{attempt:06d}/") if "dcrp" in k]
            store.delete(sorted(lost)[-1])
        with open_sink(self.spec, version=version, attempt=attempt) as sink:
            sink.seal(Seal(base_version=version - 1, owners=(0, 1), payload_ids=tuple(ids)))
        return {"baseline_id": f"lineage-v{version - 1}", "payloads": len(ids)}

    def verify(self, version: int) -> None:
        pass

    def commit(self, version: int) -> None:
        self.calls.append(("commit", version))

    def abort(self, version: int, attempt: int) -> None:
        self.calls.append(("abort", version))
