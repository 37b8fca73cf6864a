"""Test-only owners for the native-backend tests (labelled: they stand in for a Megatron job)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from shared_codec.buckets import BucketConfig, encode_items
from shared_codec.checkpoint import load_checkpoint
from shared_codec.format import PayloadMeta
from shared_codec.records import Kind, diff_tensors
from shared_codec.transport.publish import publish_attempt


class CheckpointOwners:
    """Test-only `Owners`: attempt a of version v publishes the delta v-1 -> v between two
    canonical checkpoints (XOR, or overwrites on a retry, and for the tensors in
    `overwrite_only`: what the receivers' prewarm reports name) as one owner, then seals it."""

    def __init__(self, versions: list[Path], transport: dict[str, Any]) -> None:
        self.versions, self.transport = versions, transport
        self.builds: list[tuple[int, int, bool]] = []
        self.overwrite_only: set[str] = set()

    def build(self, version: int, attempt: int, retry: bool) -> dict[str, Any]:
        self.builds.append((version, attempt, retry))
        old, new = (load_checkpoint(self.versions[v]) for v in (version - 1, version))
        items = [
            diff_tensors(
                n,
                old[n],
                new[n],
                kind=Kind.OVERWRITE if retry or n in self.overwrite_only else Kind.XOR,
            )
            for n in sorted(new)
        ]
        meta = PayloadMeta(
            version=version, base_version=version - 1, attempt=attempt, owner=0, sequence=0
        )
        payloads = encode_items(
            [i for i in items if i.count], meta, BucketConfig(bucket_bytes=4096, threads=0)
        )
        publish_attempt(
            self.transport, version=version, attempt=attempt, base_version=version - 1,
            payloads={0: payloads},
        )  # fmt: skip
        return {"baseline_id": f"ckpt-v{version - 1}", "payloads": len(payloads)}

    def verify(self, version: int) -> None:
        pass  # checkpoints do not move after the build

    def commit(self, version: int) -> None:
        pass

    def abort(self, version: int, attempt: int) -> None:
        pass
