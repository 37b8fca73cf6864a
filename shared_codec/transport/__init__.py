"""Transports: how payloads travel from owners to rollout nodes without a cross-cluster
collective. One seam (`seam.py`): `open_sink(spec, ...)` on the trainer side and
`open_source(spec)` on the rollout side (and `forget(spec, before_version)`, retention),
whatever the transport: object storage (`objects.py`)
over a local directory or any S3-compatible endpoint (`store.py`), or a ZeroMQ relay tree
(`relay/`, imported on use: it needs pyzmq) whose nodes spool payloads for their engines.
"""

from shared_codec.transport.objects import ObjectFetcher, ObjectPublisher, write_manifest
from shared_codec.transport.seam import (
    PayloadSink,
    PayloadSource,
    Seal,
    SealedAttempt,
    SinkReport,
    forget,
    open_sink,
    open_source,
)
from shared_codec.transport.store import DirectoryStore, S3Store, TransportError

__all__ = [
    "DirectoryStore",
    "ObjectFetcher",
    "ObjectPublisher",
    "PayloadSink",
    "PayloadSource",
    "S3Store",
    "Seal",
    "SealedAttempt",
    "SinkReport",
    "TransportError",
    "forget",
    "open_sink",
    "open_source",
    "write_manifest",
]
