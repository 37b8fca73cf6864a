"""LoRA adapters as transactional refits (issue 34 item 4): versions of an adapter refit by delta,
loaded through vLLM's own LoRA manager, several versions live, activated on every rank at once.

An adapter is named by an *alias* (the name requests use: ``--lora-modules alias=path`` on
``vllm serve``, or ``LoRARequest(alias, ...)``). Its canonical tensors are its PEFT state dict
(``base_model.model.<module>.lora_A.weight`` ...) and its ``adapter_config.json``. Each worker
keeps the committed version's tensors on the host (`AdapterReceiver`):

- ``load(alias, path, version)``: a dense load: the PEFT directory `path` becomes committed
  version `version` and is added to vLLM's LoRA manager as ``<alias>@<version>``; how an engine
  starts or rejoins;
- ``fetch(alias, store, version, attempt)``: the attempt's payloads (XOR masks or overwrites of
  the adapter tensors against the committed version) are fetched, validated and staged as for
  the base weights (staging.py), applied to a copy of the committed tensors, written as a PEFT
  directory and added to vLLM's LoRA manager as the *candidate* ``<alias>@<version>``: loaded
  by vLLM's own loader, from the same bytes a dense load of that version reads. Requests keep
  using the committed version;
- ``commit(alias, version)``: the candidate becomes the committed version; versions beyond
  ``max_live_versions`` (the oldest first) leave vLLM's LoRA manager;
- ``abort(alias, attempt)``: the candidate is removed and the attempt fenced; the committed
  version stays active. Nothing a fetch does touches the committed version, so a failed refit
  never leaves a dirty adapter.

Activation is atomic on all ranks: the engine core resolves every request naming the alias to
the committed version's ``LoRARequest`` (`resolving_preprocess`, before the request's block
hashes are computed, so KV computed under one version is never reused by another), and moves
it only when every rank's reply to ``dcr_adapter_load`` / ``dcr_adapter_commit`` names the same
version (`activate_from`, called by the engine core's ``collective_rpc`` patch, versions.py).
Requests already admitted keep the version they were resolved to; it stays live.

Limitations:
1. The candidate is written under ``DCR_ADAPTER_DIR`` (default: a fresh temporary directory per
   worker process); each rank writes its own copy.
2. A request resolved just before a commit runs on the previous (still live) version.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import shutil
import tempfile
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from shared_codec.checkpoint import combined_digest, tensor_digest
from shared_codec.decode import decode_payload
from shared_codec.dtypes import dtype_of
from shared_codec.errors import ProtocolError
from shared_codec.peft import read_adapter, write_adapter
from shared_codec.records import apply_items
from vllm_dcr_plugin.sources import FetchSteps, fetch_attempt, payload_source
from vllm_dcr_plugin.staging import StagingArea, tensor_specs

log = logging.getLogger(__name__)

ENV_DIR = "DCR_ADAPTER_DIR"
ENV_LIVE = "DCR_ADAPTER_LIVE_VERSIONS"


def lora_id(alias: str, version: int) -> int:
    """vLLM's ``lora_int_id`` of `alias` at `version`: unique per (alias, version), > 0."""
    return ((zlib.crc32(alias.encode()) & 0x7FFF) << 32) + int(version) + 1


def lora_name(alias: str, version: int) -> str:
    return f"{alias}@{int(version)}"


def tensors_digest(tensors: dict[str, torch.Tensor]) -> str:
    return combined_digest({n: tensor_digest(t) for n, t in tensors.items()})


def loaded_digest(worker: Any, lora_int_id: int) -> str | None:
    """The digest of what vLLM's LoRA manager holds for `lora_int_id` on this worker (every
    module's ``lora_a``, ``lora_b`` and scaling), None when it is not loaded."""
    manager = getattr(getattr(worker, "model_runner", None), "lora_manager", None)
    registered = getattr(getattr(manager, "_adapter_manager", None), "_registered_adapters", {})
    model = registered.get(lora_int_id) if registered is not None else None
    if model is None:
        return None
    per: dict[str, str] = {}
    for name, w in sorted(model.loras.items()):
        for part in ("lora_a", "lora_b"):
            t = getattr(w, part, None)
            parts = t if isinstance(t, list | tuple) else [t]  # packed layers: one per slice
            for i, piece in enumerate(parts):
                if isinstance(piece, torch.Tensor):
                    per[f"{name}.{part}.{i}"] = tensor_digest(piece)
        per[f"{name}.scaling"] = repr(getattr(w, "scaling", None))
    if not any(k.endswith((".lora_a.0", ".lora_b.0", ".lora_a.1", ".lora_b.1")) for k in per):
        return None  # nothing recognisable: no digest rather than one of the scalings only
    return combined_digest(per)


@dataclass
class Adapter:
    """One alias on one worker: the committed version's config and tensors, the live versions
    (version -> directory), the candidate of an attempt, and the attempts' staging."""

    alias: str
    config: dict[str, Any]
    tensors: dict[str, torch.Tensor]
    version: int
    live: dict[int, Path] = field(default_factory=dict)
    candidate: tuple[int, int, dict[str, torch.Tensor]] | None = None  # version, attempt
    staging: StagingArea = field(default_factory=StagingArea)

    def table(self) -> list:
        return [[n, dtype_of(t.dtype).name, list(t.shape)] for n, t in self.tensors.items()]


class AdapterReceiver:
    """The adapters of one worker (see the module docstring). `worker`: the vLLM worker (its
    ``add_lora`` / ``remove_lora``); `root`: where version directories are written;
    `max_live_versions`: versions of an alias kept in vLLM's LoRA manager (>= 2: the committed
    one and the one before it, so that requests resolved just before a commit still run)."""

    def __init__(self, worker: Any, root: Path, max_live_versions: int = 2) -> None:
        if max_live_versions < 2:
            raise ProtocolError(f"max_live_versions must be >= 2, got {max_live_versions}")
        self.worker, self.root, self.max_live = worker, root, int(max_live_versions)
        self.adapters: dict[str, Adapter] = {}

    @classmethod
    def from_env(cls, worker: Any) -> AdapterReceiver:
        root = os.environ.get(ENV_DIR) or tempfile.mkdtemp(prefix="dcr-adapters-")
        live = int(os.environ.get(ENV_LIVE, "2"))
        path = Path(root) / f"rank{int(getattr(worker, 'rank', 0))}"
        path.mkdir(parents=True, exist_ok=True)
        return cls(worker, path, live)

    def _adapter(self, alias: str) -> Adapter:
        adapter = self.adapters.get(alias)
        if adapter is None:
            raise ProtocolError(
                f"adapter {alias!r} is not loaded on this rank: call dcr_adapter_load first "
                f"(loaded: {sorted(self.adapters)})"
            )
        return adapter

    def _add(self, alias: str, version: int, path: Path) -> None:
        from vllm.lora.request import LoRARequest

        # in place: a dense load of a version already held (a rejoin) replaces it
        ident = lora_id(alias, version)
        request = LoRARequest(lora_name(alias, version), ident, str(path), load_inplace=True)
        if not self.worker.add_lora(request):
            raise ProtocolError(f"vLLM's LoRA manager did not add {request.lora_name}")

    def _remove(self, alias: str, version: int, path: Path | None) -> None:
        with contextlib.suppress(Exception):  # already evicted by vLLM's LRU cache
            self.worker.remove_lora(lora_id(alias, version))
        if path is not None:
            shutil.rmtree(path, ignore_errors=True)

    def _reply(self, adapter: Adapter, version: int, path: Path, **extra: Any) -> dict[str, Any]:
        ident = lora_id(adapter.alias, version)
        return {
            "alias": adapter.alias,
            "version": int(version),
            "lora_name": lora_name(adapter.alias, version),
            "lora_id": ident,
            "lora_path": str(path),
            "loaded_digest": loaded_digest(self.worker, ident),
            **extra,
        }

    def load(self, alias: str, path: str, version: int) -> dict[str, Any]:
        """Dense load (module docstring): `path`'s adapter is committed `version`, active."""
        config, tensors = read_adapter(path)
        adapter = self.adapters.get(alias)
        if adapter is not None and adapter.candidate is not None:  # a dense load supersedes it
            stale = adapter.candidate[0]
            adapter.candidate = None
            self._remove(alias, stale, self.root / alias / f"v{stale}")
        target = self.root / alias / f"v{int(version)}"
        target.parent.mkdir(parents=True, exist_ok=True)
        write_adapter(target, config, tensors)
        self._add(alias, version, target)
        old = adapter.live if adapter is not None else {}
        fresh = Adapter(alias, config, tensors, int(version), live={**old, int(version): target})
        self.adapters[alias] = fresh
        evicted = self._evict(fresh)
        return self._reply(
            fresh, version, target, digest=tensors_digest(tensors), evicted=evicted, active=True
        )

    def fetch(
        self, alias: str, spec: Any, version: int, attempt: int, timeout_s: float
    ) -> dict[str, Any]:
        """Fetch and apply an attempt into a candidate version (module docstring)."""
        adapter = self._adapter(alias)
        if int(version) != adapter.version + 1:
            raise ProtocolError(
                f"adapter {alias!r}: version {version} is not the next one after the committed "
                f"version {adapter.version}; nothing fetched"
            )
        if adapter.candidate is not None:
            raise ProtocolError(
                f"adapter {alias!r}: attempt {adapter.candidate[1]} of version "
                f"{adapter.candidate[0]} awaits commit or abort; nothing fetched"
            )
        if attempt in adapter.staging.fenced:
            raise ProtocolError(f"adapter {alias!r}: attempt {attempt} was aborted")
        specs = tensor_specs(adapter.table())
        area = adapter.staging

        def stage(payload: bytes) -> dict[str, Any]:
            return area.stage(
                [payload],
                committed_version=adapter.version,
                tensors=specs,
                no_xor=set(),
                unsupported=set(),
            )

        steps = FetchSteps(stage=stage, seal=area.seal, check_sealed=lambda: None)
        source = payload_source(spec, key=area.key)
        counts, _ = fetch_attempt(source, int(version), int(attempt), float(timeout_s), steps,
                                  rank=int(getattr(self.worker, "rank", 0)))  # fmt: skip
        staged = area.take(int(attempt))
        tensors = {n: t.clone() for n, t in adapter.tensors.items()}
        items = [
            it
            for p in staged
            for it in (
                p.decoded or decode_payload(p.data, key=area.key, max_body=area.max_body)
            ).items
        ]
        apply_items(tensors, items)
        target = self.root / alias / f"v{int(version)}"
        write_adapter(target, adapter.config, tensors)
        try:
            self._add(alias, version, target)
        except Exception:
            shutil.rmtree(target, ignore_errors=True)
            raise
        adapter.candidate = (int(version), int(attempt), tensors)
        return self._reply(
            adapter, version, target, attempt=int(attempt), items=len(items),
            digest=tensors_digest(tensors), fetch=counts, active=False,
        )  # fmt: skip

    def commit(self, alias: str, version: int) -> dict[str, Any]:
        """The candidate of `version` becomes the committed, active version."""
        adapter = self._adapter(alias)
        if int(version) == adapter.version:  # a repeated commit
            return self._reply(
                adapter, version, adapter.live[adapter.version], changed=False, active=True
            )
        if adapter.candidate is None or adapter.candidate[0] != int(version):
            raise ProtocolError(
                f"adapter {alias!r}: no candidate of version {version} to commit (committed "
                f"version {adapter.version})"
            )
        _, _, tensors = adapter.candidate
        path = self.root / alias / f"v{int(version)}"
        adapter.tensors, adapter.version, adapter.candidate = tensors, int(version), None
        adapter.live[int(version)] = path
        adapter.staging.new_transition()
        evicted = self._evict(adapter)
        return self._reply(adapter, version, path, changed=True, evicted=evicted, active=True)

    def abort(self, alias: str, attempt: int) -> dict[str, Any]:
        """Fence `attempt`; its candidate leaves vLLM's LoRA manager. The committed version
        stays active."""
        adapter = self._adapter(alias)
        adapter.staging.fence(int(attempt))
        dropped = None
        if adapter.candidate is not None and adapter.candidate[1] == int(attempt):
            version = adapter.candidate[0]
            adapter.candidate = None
            self._remove(alias, version, self.root / alias / f"v{version}")
            dropped = version
        path = adapter.live[adapter.version]
        return self._reply(adapter, adapter.version, path, dropped=dropped, active=True)

    def _evict(self, adapter: Adapter) -> list[int]:
        """Versions beyond `max_live` (oldest first) leave vLLM's LoRA manager."""
        old = sorted(v for v in adapter.live if v != adapter.version)
        evicted = old[: max(0, len(adapter.live) - self.max_live)]
        for v in evicted:
            self._remove(adapter.alias, v, adapter.live.pop(v))
        return evicted

    def status(self) -> dict[str, Any]:
        """Per alias: committed version, live versions, candidate, tensors' digest; and under
        ``loaded`` the digest of every adapter vLLM's LoRA manager holds (by lora id)."""
        listed = getattr(self.worker, "list_loras", None)
        ids = sorted(listed()) if callable(listed) else []
        adapters = {
            alias: {
                "version": a.version,
                "live": sorted(a.live),
                "candidate": None if a.candidate is None else list(a.candidate[:2]),
                "digest": tensors_digest(a.tensors),
            }
            for alias, a in self.adapters.items()
        }
        return {
            "adapters": adapters,
            "loaded": {str(i): loaded_digest(self.worker, i) for i in ids},
        }


def receiver_of(worker: Any) -> AdapterReceiver:
    """The worker's one `AdapterReceiver` (created on first use)."""
    receiver = getattr(worker, "_dcr_adapters", None)
    if receiver is None:
        receiver = AdapterReceiver.from_env(worker)
        worker._dcr_adapters = receiver
    return receiver


# -- the engine core: which version an alias resolves to --------------------------------------
#: alias -> (lora name, lora id, lora path) of its committed version, in the engine core process
_ACTIVE: dict[str, tuple[str, int, str]] = {}


def activate_from(method: str, replies: list[Any]) -> None:
    """After ``dcr_adapter_load`` / ``dcr_adapter_commit``: when every rank answered ok with the
    same active version, the alias resolves to it from now on (module docstring)."""
    if method not in ("dcr_adapter_load", "dcr_adapter_commit") or not replies:
        return
    if not all(isinstance(r, dict) and r.get("ok") and r.get("active") for r in replies):
        return
    versions = {(r["alias"], r["lora_name"], int(r["lora_id"])) for r in replies}
    if len(versions) != 1:
        log.error("dcr: ranks answered %s with different adapter versions: %s", method, versions)
        return
    alias, name, ident = versions.pop()
    if _ACTIVE.get(alias, ("", 0, ""))[1] != ident:
        log.info("dcr: adapter %s now resolves to %s", alias, name)
    _ACTIVE[alias] = (name, ident, str(replies[0]["lora_path"]))


def resolve(request: Any) -> None:
    """Point a request naming an alias at the alias's committed version (in place)."""
    lora = getattr(request, "lora_request", None)
    active = _ACTIVE.get(getattr(lora, "lora_name", None) or "") if lora is not None else None
    if active is None:
        return
    from vllm.lora.request import LoRARequest

    name, ident, path = active
    request.lora_request = LoRARequest(name, ident, path)


def resolving_preprocess(original: Callable[..., Any]) -> Callable[..., Any]:
    """``EngineCore.preprocess_add_request`` resolving the request's adapter alias first."""

    @functools.wraps(original)
    def preprocess_add_request(self: Any, request: Any) -> Any:
        resolve(request)
        return original(self, request)

    return preprocess_add_request


def active() -> Iterator[tuple[str, str]]:
    """(alias, lora name) of every alias the engine core resolves."""
    return ((alias, name) for alias, (name, _, _) in _ACTIVE.items())
