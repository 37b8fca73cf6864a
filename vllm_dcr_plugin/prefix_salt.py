"""A version-salted prefix cache (issue 34 item 2): KV computed under one weight version is
never reused by a request of another, with no global reset.

vLLM 0.32 hashes a request's ``cache_salt`` into the hash of its first KV block, and every later
block chains on it, so two requests share cached blocks only when their salts are equal. The
engine core here salts every request with the engine's ``weight_version`` (versions.py: the
committed version, stamped in the same call as the commit on both DCR paths):

- `salting_preprocess` (``EngineCore.preprocess_add_request``, vLLM's input thread): a new
  request is built with ``"<its own salt>|dcr-weights:<version>"`` (``"dcr-weights:<version>"``
  without one), so its block hashes carry the version;
- `salting_add_request` (``EngineCore.add_request``, the engine core's main thread, where
  versions change): salted again, block hashes included, if the version moved in between;
- `salting_set_weight_version` (``EngineCore.set_weight_version``: vLLM's own
  ``finish_weight_update`` / ``update_weight_version``, and DCR's stamp): after the version
  changes, every request that waits and has not started (no computed and no output token) is
  salted again, so a request queued under a pause does not meet the old version's blocks.
  Requests that started keep their salt and their cache: a keep-mode pause freezes them with
  the KV of the version they started on, and they continue with it (vLLM's semantics of an
  in-flight update).

Why not the global reset DCR used before: vLLM's ``reset_prefix_cache()`` refuses (returns
False, logs a warning) while any block is in use, i.e. exactly while keep-mode requests are
frozen, so in async RL the old version's prefix cache survived the update. Salting needs no
reset, and a request of the new version cannot hit an old block whether or not one ran.

Off with ``DCR_PREFIX_SALT=0`` in the engine's environment (read when the engine core starts).

Limitations:
1. Old versions' blocks are not freed at a commit; they age out of vLLM's LRU free queue like
   any unused cached block.
2. Requests of a version share cache only with that version: between an apply and its commit
   the version is ``"<t>-uncommitted.<n>"`` (versions.py), so a request that ran there shares no
   block with the same version once committed (a miss, never a wrong hit).
3. A KV connector's external cache is keyed by vLLM's block hashes too, so it is salted alike;
   nothing else of a connector is handled.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)

ENV = "DCR_PREFIX_SALT"
TAG = "dcr-weights:"
_UNSET = object()


def enabled() -> bool:
    return os.environ.get(ENV, "1") != "0"


def salt_of(own: str | None, version: str) -> str:
    """The salt of a request whose own salt is `own`, under weight version `version`."""
    return f"{TAG}{version}" if own is None else f"{own}|{TAG}{version}"


def salt_request(request: Any, version: str) -> bool:
    """Salt `request` (a vLLM ``Request``) with `version`; recompute its block hashes when the
    salt changed. True when it changed."""
    own: Any = getattr(request, "_dcr_own_salt", _UNSET)
    if own is _UNSET:
        own = request.cache_salt
        request._dcr_own_salt = own
    salt = salt_of(own, version)
    if request.cache_salt == salt:
        return False
    request.cache_salt = salt
    request.block_hashes = []  # the first block's hash carries the salt; the rest chain on it
    request.update_block_hashes()
    return True


def not_started(request: Any) -> bool:
    """A request the scheduler holds that computed nothing yet (salted again on a change)."""
    return (
        not request.is_finished()
        and request.num_computed_tokens == 0
        and request.num_output_tokens == 0
    )


def salting_preprocess(original: Callable[..., Any]) -> Callable[..., Any]:
    """``EngineCore.preprocess_add_request`` (vLLM's input thread): the new ``Request`` is built
    with the salt of the version now, so its block hashes are computed once; `add_request`
    checks the version again on the main thread (a commit may land in between)."""
    on = enabled()

    @functools.wraps(original)
    def preprocess_add_request(self: Any, request: Any) -> Any:
        if not on:
            return original(self, request)
        own = request.cache_salt
        request.cache_salt = salt_of(own, self.get_weight_version())
        req, wave = original(self, request)
        req._dcr_own_salt = own
        return req, wave

    return preprocess_add_request


def salting_add_request(original: Callable[..., Any]) -> Callable[..., Any]:
    """``EngineCore.add_request`` salting the request with the engine's weight version."""
    on = enabled()

    @functools.wraps(original)
    def add_request(self: Any, request: Any, request_wave: int = 0) -> Any:
        if on:
            salt_request(request, self.get_weight_version())
        return original(self, request, request_wave)

    return add_request


def salting_set_weight_version(original: Callable[..., Any]) -> Callable[..., Any]:
    """``EngineCore.set_weight_version`` salting the waiting, not-started requests again."""
    on = enabled()

    @functools.wraps(original)
    def set_weight_version(self: Any, weight_version: str) -> Any:
        out = original(self, weight_version)
        if on:
            requests = getattr(getattr(self, "scheduler", None), "requests", {})
            moved = sum(
                salt_request(r, weight_version) for r in list(requests.values()) if not_started(r)
            )
            if moved:
                log.info("dcr: %d waiting request(s) salted for weights %s", moved, weight_version)
        return out

    return set_weight_version
