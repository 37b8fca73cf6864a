"""The receiver's configuration: one frozen `ReceiverConfig`, and the only module of the plugin
that reads the environment.

A vLLM worker gets its settings from its process environment (vLLM starts the workers; DCR has
no command line there). `ReceiverConfig.from_env` reads them once, when the worker's receiver is
created (vllm_dcr_plugin.worker.receiver_of), and the config is passed down from there:

- ``DCR_PLACEMENT``: ``plan`` (default) or ``loader``, the start-up placement mode
  (placement.py; ``dcr_set_placement`` changes it later);
- ``DCR_PAYLOAD_KEY``: hex of the shared payload secret, 1 to 64 bytes (payloads must then
  carry a keyed digest; docs/operations.md);
- ``DCR_METRICS_PORT``: serve each rank's Prometheus metrics on this port + rank
  (metrics.py), on ``DCR_METRICS_ADDR`` (default 127.0.0.1);
- ``DCR_RECEIVER_OBSERVER``: ``package.module:attr`` of an optional observer factory
  (observer.py), e.g. the test-only fault plan ``dcr_tools.faults:FaultPlan``.

One process flag is not a receiver setting and is read at each use instead
(`resident_weights_flag`): ``VLLM_DCR_RESIDENT_WEIGHTS`` (``1`` / ``0``) forces the CPU loader
condition on or off (cpu_compat.py), because vLLM consults it while it loads the model, before
any receiver exists.

Errors: a malformed payload key is a `ProtocolError` (the RPC that created the receiver answers
``ok: false`` naming the variable); any other malformed value is a `ValueError`.

Limitations:
1. Read once per receiver: changing the environment of a running worker changes nothing (the
   placement mode has its RPC; the rest needs a restart).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from shared_codec.errors import ProtocolError
from shared_codec.format import MAX_KEY_SIZE
from vllm_dcr_plugin.placement import PlacementMode

ENV_PLACEMENT = "DCR_PLACEMENT"
ENV_PAYLOAD_KEY = "DCR_PAYLOAD_KEY"
ENV_METRICS_PORT = "DCR_METRICS_PORT"
ENV_METRICS_ADDR = "DCR_METRICS_ADDR"
ENV_OBSERVER = "DCR_RECEIVER_OBSERVER"
ENV_RESIDENT_WEIGHTS = "VLLM_DCR_RESIDENT_WEIGHTS"


@dataclass(frozen=True, slots=True, kw_only=True)
class ReceiverConfig:
    """Settings of one rank's receiver (see the module docstring for their variables).

    `metrics_port`: the base port (each rank serves on base + rank), None: no HTTP server;
    `observer`: ``module:attr`` of an observer factory (observer.load_observer), None: none."""

    placement: PlacementMode = PlacementMode.PLAN
    payload_key: bytes | None = None
    metrics_port: int | None = None
    metrics_addr: str = "127.0.0.1"
    observer: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.placement, PlacementMode):
            raise ValueError(f"placement must be a PlacementMode, got {self.placement!r}")
        if self.payload_key is not None and not 1 <= len(self.payload_key) <= MAX_KEY_SIZE:
            raise ValueError(f"payload_key must be 1 to {MAX_KEY_SIZE} bytes")
        if self.metrics_port is not None and not 0 <= self.metrics_port < 65536:
            raise ValueError(f"metrics_port must be a TCP port, got {self.metrics_port}")
        if self.observer is not None and not _is_object_path(self.observer):
            raise ValueError(f"observer must be 'package.module:attr', got {self.observer!r}")

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> ReceiverConfig:
        """The config the variables of `environ` (default: this process's) describe."""
        env = os.environ if environ is None else environ
        mode = env.get(ENV_PLACEMENT) or PlacementMode.PLAN.value
        port = env.get(ENV_METRICS_PORT, "").strip()
        return cls(
            placement=PlacementMode.parse(mode, ENV_PLACEMENT),
            payload_key=key_from_env(env),
            metrics_port=int(port) if port else None,
            metrics_addr=env.get(ENV_METRICS_ADDR, "127.0.0.1"),
            observer=env.get(ENV_OBSERVER, "").strip() or None,
        )


def key_from_env(environ: Mapping[str, str] | None = None) -> bytes | None:
    """The shared payload secret from ``DCR_PAYLOAD_KEY`` (hex, 1 to 64 bytes), if set;
    `ProtocolError` for anything else (not hex, or too long for a BLAKE2b key)."""
    env = os.environ if environ is None else environ
    raw = env.get(ENV_PAYLOAD_KEY, "").strip()
    if not raw:
        return None
    try:
        key = bytes.fromhex(raw)
    except ValueError:
        raise ProtocolError(f"{ENV_PAYLOAD_KEY} must be hex-encoded") from None
    if len(key) > MAX_KEY_SIZE:
        raise ProtocolError(
            f"{ENV_PAYLOAD_KEY} is {len(key)} bytes; a payload key is at most {MAX_KEY_SIZE}"
        )
    return key


def resident_weights_flag() -> bool | None:
    """``VLLM_DCR_RESIDENT_WEIGHTS`` now: True (``1``), False (``0``), None (unset or other)."""
    flag = os.environ.get(ENV_RESIDENT_WEIGHTS)
    if flag is not None and flag.strip() in ("0", "1"):
        return flag.strip() == "1"
    return None


def _is_object_path(path: str) -> bool:
    module, sep, attr = path.partition(":")
    parts = [*module.split("."), *attr.split(".")]
    return bool(sep) and all(p.isidentifier() for p in parts)
