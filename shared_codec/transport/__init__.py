"""Transports: how payloads travel from owners to rollout nodes without a cross-cluster
collective. The interfaces (`base.py`: `PayloadSink` on the trainer side, `PayloadSource` on the
rollout side, `ObjectStore`, the sealed-set records) are opened from one typed spec
(`spec.py`: `TransportSpec`, its kind registry, and `open_sink` / `open_source` / `open_store` /
`forget`; `publish.py`: one process publishing a whole attempt), whatever the transport: object storage (`objects.py`) over a local directory or
any S3-compatible endpoint (`store.py`), or a ZeroMQ relay tree (`relay/`, imported on use: it
needs pyzmq) whose nodes spool payloads for their engines.
"""

from shared_codec.transport.base import (
    ObjectStore,
    PayloadSink,
    PayloadSource,
    Seal,
    SealedAttempt,
    SinkReport,
)
from shared_codec.transport.objects import ObjectFetcher, ObjectPublisher, write_manifest
from shared_codec.transport.publish import publish_attempt
from shared_codec.transport.spec import (
    Role,
    TransportSpec,
    forget,
    open_sink,
    open_source,
    open_store,
)
from shared_codec.transport.store import DirectoryStore, S3Store, TransportError

__all__ = [
    "DirectoryStore",
    "ObjectFetcher",
    "ObjectPublisher",
    "ObjectStore",
    "PayloadSink",
    "PayloadSource",
    "Role",
    "S3Store",
    "Seal",
    "SealedAttempt",
    "SinkReport",
    "TransportError",
    "TransportSpec",
    "forget",
    "open_sink",
    "open_source",
    "open_store",
    "publish_attempt",
    "write_manifest",
]
