"""The version-salted prefix cache (vllm_dcr_plugin.prefix_salt) on vLLM's own ``Request`` and
block hasher (no engine): a request's block hashes carry the weight version, requests of one
version share them, a version change salts waiting requests again and leaves started ones. The
engine core here is a FAKE (the attributes the wrappers read); the real engine is
tests/integration/vllm/test_prefix_salt.py."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
from vllm import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.request import Request

from vllm_dcr_plugin import patches, prefix_salt
from vllm_dcr_plugin.prefix_salt import salt_of, salt_request

BLOCK = 4
PROMPT = list(range(100, 113))  # three full blocks


@pytest.fixture(scope="module", autouse=True)
def _none_hash() -> None:
    init_none_hash(sha256)


def request(rid: str = "r", salt: str | None = None) -> Request:
    return Request(
        rid,
        PROMPT,
        SamplingParams(max_tokens=4),
        None,
        cache_salt=salt,
        block_hasher=get_request_block_hasher(BLOCK, sha256),
    )


def test_salts_carry_the_version_and_keep_the_request_s_own() -> None:
    assert salt_of(None, "3") == "dcr-weights:3"
    assert salt_of("user", "3") == "user|dcr-weights:3"


def test_block_hashes_carry_the_version() -> None:
    a, b, c = request("a"), request("b"), request("c")
    plain = list(a.block_hashes)
    assert len(plain) == 3
    assert salt_request(a, "1") and salt_request(b, "1") and salt_request(c, "2")
    assert a.block_hashes == b.block_hashes  # one version: shared
    assert all(x != y for x, y in zip(a.block_hashes, c.block_hashes))  # none across versions
    assert all(x != y for x, y in zip(a.block_hashes, plain))
    assert not salt_request(a, "1")  # unchanged: nothing recomputed
    assert salt_request(a, "2") and a.block_hashes == c.block_hashes
    own = request("d", salt="user")
    salt_request(own, "2")
    assert own.cache_salt == "user|dcr-weights:2" and own.block_hashes != c.block_hashes
    salt_request(own, "3")
    assert own.cache_salt == "user|dcr-weights:3"  # its own salt kept, not stacked


class FakeCore:  # FAKE: what the wrappers read and call on vLLM's EngineCore
    def __init__(self, requests: dict[str, Any]) -> None:
        self.version = "0"
        self.scheduler = SimpleNamespace(requests=requests)
        self.added: list[Any] = []

    def get_weight_version(self) -> str:
        return self.version

    def set_weight_version(self, v: str) -> None:
        self.version = v

    def add_request(self, req: Any, wave: int = 0) -> None:
        self.added.append(req)


def test_a_version_change_salts_waiting_requests_again_and_keeps_started_ones() -> None:
    waiting, started = request("w"), request("s")
    core = FakeCore({"w": waiting, "s": started})
    add = prefix_salt.salting_add_request(FakeCore.add_request)
    add(core, waiting)
    add(core, started)
    assert waiting.cache_salt == started.cache_salt == "dcr-weights:0"
    started.num_computed_tokens = 8  # it ran (a keep-mode request frozen by a pause)
    kept = list(started.block_hashes)
    stamp = prefix_salt.salting_set_weight_version(FakeCore.set_weight_version)
    stamp(core, "1")
    assert core.version == "1" and waiting.cache_salt == "dcr-weights:1"
    assert started.cache_salt == "dcr-weights:0" and started.block_hashes == kept
    fresh = request("f")
    add(core, fresh)
    assert fresh.block_hashes == waiting.block_hashes


def test_the_salting_patches_are_in_the_table() -> None:
    names = {p.name: p for p in patches.PATCHES}
    for name in ("preprocess_add_request", "add_request", "set_weight_version"):
        p = names[f"engine_core.{name}"]
        assert p.target == f"vllm.v1.engine.core:EngineCore.{name}" and p.enforce_pin
