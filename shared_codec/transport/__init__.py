"""Transports: how payloads travel from owners to rollout nodes without a cross-cluster
collective: object storage (`objects.py`) over a local directory or any S3-compatible endpoint
(`store.py`), and a ZeroMQ relay tree (`relay.py`, imported on use: it needs pyzmq).
"""

from shared_codec.transport.objects import ObjectFetcher, ObjectPublisher, write_manifest
from shared_codec.transport.store import DirectoryStore, S3Store, TransportError

__all__ = [
    "DirectoryStore",
    "ObjectFetcher",
    "ObjectPublisher",
    "S3Store",
    "TransportError",
    "write_manifest",
]
