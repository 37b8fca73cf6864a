"""The RPC error contract of `DCRWorkerExtension` (docs/protocol.md, "Errors"), with a FAKE
loader (pure unit test, labelled as such; the same contract against real vLLM engines, TP=1 and
TP=2, is in test_receiver.py / receiver_program.py): for every ``dcr_*`` RPC, every bad argument
- wrong type or count, an unknown keyword, an unknown store kind or spec key, a dtype the codec
does not carry, a negative version or attempt, a checkpoint that is not one - is an
``ok: False`` reply carrying ``ProtocolError: <rpc>: bad arguments: ...`` that names the
argument, never an exception that escapes into vLLM's executor; it changes nothing (digest,
state, prewarm table, staged payloads, fences and seals before == after), and a valid call of
the same RPC afterwards does what it should."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from shared_codec.checkpoint import save_checkpoint
from tests.unit.vllm.test_exactly_once import REFIT, _encode, _ids, _items, _publish, _versions
from tests.unit.vllm.test_receiver_units import CANON, FakeLoaderModel, _assert_holds, _dense
from vllm_dcr_plugin import cpu_compat
from vllm_dcr_plugin.receiver import Receiver

_enabled = cpu_compat._state["enabled_by_extension"]
from vllm_dcr_plugin.extension import DCRWorkerExtension  # noqa: E402

# importing the extension marks this process as serving DCR; the unit tests' process does not
cpu_compat._state["enabled_by_extension"] = _enabled

TABLE = [[n, "bfloat16", list(s)] for n, (s, _) in CANON.items()]
_EXPECT = {"version": 1, "base_version": 0, "payload_ids": ["ab" * 16]}


def _extension() -> tuple[DCRWorkerExtension, dict, dict]:
    """FAKE worker: the extension with a receiver over the fake loader model (no vLLM), whose
    weights hold v0; returns it with the canonical tensors of v0 and v1."""
    v0, v1 = _versions()
    model = FakeLoaderModel()
    _dense(model, v0)
    ext = DCRWorkerExtension()
    ext.rank = 0  # type: ignore[attr-defined]
    ext._dcr_state = Receiver(model, rank={"rank": 0})  # type: ignore[attr-defined]
    return ext, v0, v1


def _snapshot(ext: DCRWorkerExtension) -> tuple:
    """Everything a call could change: weights, state, prewarm table, staging."""
    rx = ext._dcr_receiver()
    st = rx.staging
    staged = {a: sorted(per) for a, per in st.staged.items()}
    return (
        ext.dcr_digest()["digest"],
        ext.dcr_status(),
        dict(rx.tensors),
        rx.scratch is not None,
        staged,
        set(st.fenced),
        dict(st.sealed),
        {a: set(ids) for a, ids in st.applied.items()},
        st.key,
    )


def _payloads(ext: DCRWorkerExtension, v0: dict, v1: dict) -> list[bytes]:
    report = {"overwrite_only": ext._dcr_receiver().found.overwrite_only}
    return _encode(_items(v0, v1, report))


def _write_checkpoint(root: Path, tensors: dict[str, torch.Tensor]) -> str:
    save_checkpoint(tensors, root)
    return str(root)


# rpc -> (tmp_path -> [(what, args, kwargs, the name the error must carry)])
Cases = Callable[[Path], list[tuple[str, tuple, dict, str]]]


def _fetch_cases(tmp: Path) -> list:
    store = {"kind": "dir", "root": str(tmp / "store")}
    return [
        ("unknown store kind", ({"kind": "ftp", "root": "/x"}, 1, 0), {}, "store"),
        ("store spec not JSON", ("{not json", 1, 0), {}, "store is not valid JSON"),
        ("store spec without root", ({"kind": "dir"}, 1, 0), {}, "'root'"),
        ("store spec a list", ([1, 2], 1, 0), {}, "store must be a store spec"),
        ("unknown store spec key", ({**store, "rot": "/x"}, 1, 0), {}, "'rot'"),
        (
            "s3 prefix not a string",
            ({"kind": "s3", "bucket": "b", "prefix": 3}, 1, 0),
            {},
            "store.prefix",
        ),  # fmt: skip
        ("negative version", (store, -2, 0), {}, "version must be >= 0"),
        ("version past 2**63", (store, 2**64, 0), {}, "version must be < 2**63"),
        ("attempt not an int", (store, 1, "zero"), {}, "attempt must be an integer"),
        ("zero timeout", (store, 1, 0, 0), {}, "timeout_s must be > 0"),
        ("NaN timeout", (store, 1, 0, float("nan")), {}, "timeout_s must be > 0"),
        ("apply opts not a dict", (store, 1, 0, 5.0, "yes"), {}, "apply must be a dict"),
        (
            "apply opts with a fault",
            (store, 1, 0, 5.0, {"kill_after_items": 1}),
            {},
            "kill_after_items",
        ),  # fmt: skip
        ("apply.verify not a bool", (store, 1, 0, 5.0, {"verify": "maybe"}), {}, "apply.verify"),
        (
            "old kill_after_payloads",
            (store, 1, 0, 5.0, None, {"verify": True}),
            {},
            "takes (store, version, attempt, timeout_s, apply)",
        ),  # fmt: skip
        ("missing attempt", (store, 1), {}, "'attempt'"),
    ]


def _apply_cases(tmp: Path) -> list:
    return [
        ("attempt not an int", ("one",), {}, "attempt must be an integer"),
        ("attempt a float", (1.5,), {}, "attempt must be an integer"),
        ("negative attempt", (-1,), {}, "attempt must be >= 0"),
        ("verify not a bool", (0,), {"verify": "maybe"}, "verify must be a boolean"),
        ("old fault argument, positional", (0, False, 5), {}, "expect must be a dict"),
        ("old fault argument, keyword", (0,), {"fail_after_items": 2}, "'fail_after_items'"),
        ("expect not a dict", (0,), {"expect": [1]}, "expect must be a dict"),
        ("expect not JSON", (0,), {"expect": "{"}, "expect is not valid JSON"),
        (
            "expect without ids",
            (0,),
            {"expect": {"version": 1, "base_version": 0}},
            "expect takes exactly",
        ),  # fmt: skip
        ("expect unknown key", (0,), {"expect": {**_EXPECT, "count": 1}}, "'count'"),
        (
            "expect ids not a list",
            (0,),
            {"expect": {**_EXPECT, "payload_ids": "ab"}},
            "expect.payload_ids",
        ),  # fmt: skip
        (
            "expect ids not hex",
            (0,),
            {"expect": {**_EXPECT, "payload_ids": ["zz"]}},
            "expect.payload_ids",
        ),  # fmt: skip
        (
            "expect id too short",
            (0,),
            {"expect": {**_EXPECT, "payload_ids": ["ab"]}},
            "expect.payload_ids",
        ),  # fmt: skip
        (
            "expect id listed twice",
            (0,),
            {"expect": {**_EXPECT, "payload_ids": ["ab" * 16] * 2}},
            "expect.payload_ids",
        ),  # fmt: skip
        (
            "expect negative version",
            (0,),
            {"expect": {**_EXPECT, "version": -1}},
            "expect.version",
        ),  # fmt: skip
        (
            "expect base not an int",
            (0,),
            {"expect": {**_EXPECT, "base_version": "x"}},
            "expect.base_version",
        ),  # fmt: skip
    ]


def _dense_load_cases(tmp: Path) -> list:
    empty = tmp / "empty"
    empty.mkdir()
    garbage = tmp / "garbage"
    garbage.mkdir()
    (garbage / "model.safetensors").write_bytes(b"\x08" + b"\x00" * 7 + b"not a header")
    truncated = tmp / "truncated"
    truncated.mkdir()
    good = Path(_write_checkpoint(tmp / "good", {"t.weight": torch.zeros(6, 4)}))
    data = (good / "model.safetensors").read_bytes()
    (truncated / "model.safetensors").write_bytes(data[:-8])
    other = _write_checkpoint(
        tmp / "other-model",
        {"c.weight": torch.zeros(10, dtype=torch.bfloat16), "t.weight": torch.zeros(4, 6)},
    )
    return [
        ("missing path", (str(tmp / "nope"), 1), {}, "path must name an existing directory"),
        ("path a file", (str(good / "model.safetensors"), 1), {}, "path must name"),
        ("path not a string", (3, 1), {}, "path must name"),
        ("no safetensors files", (str(empty), 1), {}, "path: no *.safetensors files"),
        (
            "garbage safetensors",
            (str(garbage), 1),
            {},
            "path: model.safetensors is not a readable",
        ),  # fmt: skip
        (
            "truncated safetensors",
            (str(truncated), 1),
            {},
            "path: model.safetensors is not a readable",
        ),  # fmt: skip
        ("another model's shapes", (other, 1), {}, "path: tensor t.weight"),
        ("negative version", (str(good), -1), {}, "version must be >= 0"),
    ]


def _adapter_dir(tmp: Path, seed: int = 0) -> tuple[str, dict[str, torch.Tensor]]:
    """A small PEFT LoRA directory (config + tensors) for the adapter RPCs."""
    from shared_codec.peft import write_adapter

    g = torch.Generator().manual_seed(seed)
    tensors = {
        "base_model.model.layers.0.q_proj.lora_A.weight": torch.randn(2, 6, generator=g),
        "base_model.model.layers.0.q_proj.lora_B.weight": torch.randn(6, 2, generator=g),
    }
    tensors = {n: t.to(torch.bfloat16) for n, t in tensors.items()}
    (tmp / "adapters").mkdir(exist_ok=True)
    path = write_adapter(tmp / "adapters" / f"a{seed}", {"peft_type": "LORA", "r": 2}, tensors)
    return str(path), tensors


def _adapter_cases(rpc: str) -> Cases:
    alias_cases = [
        ("alias with a slash", ("a/b",), "alias must be"),
        ("alias not a string", (7,), "alias must be"),
    ]

    def cases(tmp: Path) -> list:
        good, _ = _adapter_dir(tmp)
        store = {"kind": "dir", "root": str(tmp / "store")}
        rest = {
            "dcr_adapter_load": (good, 0),
            "dcr_adapter_fetch": (store, 1, 0),
            "dcr_adapter_commit": (1,),
            "dcr_adapter_abort": (0,),
        }[rpc]
        out = [(what, a + rest, {}, named) for what, a, named in alias_cases]
        if rpc == "dcr_adapter_load":
            out += [
                ("missing path", ("a", str(tmp / "nope"), 0), {}, "path must name"),
                ("negative version", ("a", good, -1), {}, "version must be >= 0"),
            ]
        elif rpc == "dcr_adapter_fetch":
            out += [
                ("bad store kind", ("a", {"kind": "ftp"}, 1, 0), {}, "store"),
                ("negative attempt", ("a", store, 1, -1), {}, "attempt must be >= 0"),
                ("zero timeout", ("a", store, 1, 0, 0), {}, "timeout_s must be > 0"),
            ]
        else:
            out += [("float number", ("a", 1.5), {}, "must be an integer")]
        return out

    return cases


BAD: dict[str, Cases] = {
    **{
        rpc: _adapter_cases(rpc)
        for rpc in (
            "dcr_adapter_load",
            "dcr_adapter_fetch",
            "dcr_adapter_commit",
            "dcr_adapter_abort",
        )
    },
    "dcr_adapter_status": lambda tmp: [("an argument", (1,), {}, "dcr_adapter_status takes ()")],
    "dcr_prewarm": lambda tmp: [
        ("bad dtype name", ([["t.weight", "bfloat17", [6, 4]]],), {}, "tensors[0]"),
        ("negative dimension", ([["t.weight", "bfloat16", [-6, 4]]],), {}, "tensors[0]"),
        ("float dimension", ([["t.weight", "bfloat16", [6.0, 4]]],), {}, "tensors[0]"),
        ("short table entry", ([["t.weight", "bfloat16"]],), {}, "tensors[0]"),
        ("empty name", ([["", "bfloat16", [1]]],), {}, "tensors[0]"),
        ("name listed twice", (TABLE + TABLE[:1],), {}, f"tensors[{len(TABLE)}]"),
        ("table not a list", ("t.weight",), {}, "tensors must be a list"),
        ("negative version", (TABLE, -1), {}, "committed_version must be >= 0"),
        ("version a bool", (TABLE, True), {}, "committed_version must be an integer"),
        ("unknown keyword", (TABLE,), {"version": 0}, "'version'"),
    ],
    "dcr_stage": lambda tmp: [
        ("payloads not bytes", ([1, 2],), {}, "payloads[0] must be bytes"),
        ("one element not bytes", ([b"x", "y"],), {}, "payloads[1] must be bytes"),
        ("payloads a string", ("abc",), {}, "payloads must be a list"),
        ("missing payloads", (), {}, "'payloads'"),
    ],
    "dcr_fetch": _fetch_cases,
    "dcr_apply": _apply_cases,
    "dcr_commit": lambda tmp: [
        ("missing version", (), {}, "'version'"),
        ("negative version", (-1,), {}, "version must be >= 0"),
        ("version a list", ([1],), {}, "version must be an integer"),
        ("version text", ("one",), {}, "version must be an integer"),
    ],
    "dcr_abort": lambda tmp: [
        ("attempt a bool", (True,), {}, "attempt must be an integer"),
        ("negative attempt", (-3,), {}, "attempt must be >= 0"),
        ("two attempts", (1, 2), {}, "takes (attempt)"),
    ],
    "dcr_dense_load": _dense_load_cases,
    "dcr_memory": lambda tmp: [
        ("reset_peak not a bool", ("sometimes",), {}, "reset_peak must be a boolean"),
        ("reset_peak 2", (2,), {}, "reset_peak must be a boolean"),
    ],
    "dcr_digest": lambda tmp: [
        ("an argument", (1,), {}, "dcr_digest takes ()"),
        ("a keyword", (), {"tensor": "t"}, "'tensor'"),
    ],
    "dcr_metrics": lambda tmp: [("an argument", ("text",), {}, "dcr_metrics takes ()")],
    "dcr_status": lambda tmp: [("a keyword", (), {"verbose": True}, "'verbose'")],
    "dcr_info": lambda tmp: [("an argument", (0,), {}, "dcr_info takes ()")],
    "dcr_set_placement": lambda tmp: [
        ("unknown mode", ("fast",), {}, "mode"),
        ("mode not a string", (1,), {}, "mode must be a string"),
        ("missing mode", (), {}, "'mode'"),
    ],
    "dcr_verify_plan": lambda tmp: [("an argument", (1,), {}, "dcr_verify_plan takes ()")],
}


def _valid(rpc: str, ext: DCRWorkerExtension, v0: dict, v1: dict, tmp: Path) -> None:
    """A valid call of `rpc` after the bad ones: it works and does what it should."""
    rx = ext._dcr_receiver()
    digest0 = ext.dcr_digest()["digest"]
    payloads = _payloads(ext, v0, v1)
    if rpc == "dcr_prewarm":
        rep = ext.dcr_prewarm(TABLE, "0")
        assert rep["ok"] and rep["tensors"] == len(TABLE), rep
        assert ext.dcr_digest()["digest"] == digest0  # side-effect free
    elif rpc in ("dcr_stage", "dcr_apply", "dcr_commit"):
        # staged before the bad calls (see the test): apply exactly them, commit
        ids = _ids(rx, payloads)
        expect = {"version": 1, "base_version": 0, "payload_ids": ids}
        ack = ext.dcr_apply(0, verify=True, expect=expect)
        assert ack["ok"] and ack["items"] == len(REFIT), ack
        _assert_holds(rx.model, v1)  # type: ignore[arg-type]
        assert ext.dcr_commit(1)["committed_version"] == 1
        assert ext.dcr_status()["state"] == "clean"
    elif rpc == "dcr_fetch":
        spec = _publish(tmp / "published", payloads)
        got = ext.dcr_fetch(spec, 1, 0, 10.0, {"verify": True})
        assert got["ok"] and got["staged"] == len(REFIT) and got["ack"]["ok"], got
        _assert_holds(rx.model, v1)  # type: ignore[arg-type]
    elif rpc == "dcr_abort":
        out = ext.dcr_abort(0)
        assert out["ok"] and out["dropped"] == len(REFIT), out
        assert ext.dcr_stage(payloads)["rejected"]  # fenced: its late payloads are refused
    elif rpc == "dcr_dense_load":
        path = _write_checkpoint(tmp / "v1", v1)
        assert ext.dcr_dense_load(path, 1)["ok"]
        _assert_holds(rx.model, v1)  # type: ignore[arg-type]
        assert ext.dcr_status()["committed_version"] == 1
    elif rpc == "dcr_memory":
        assert ext.dcr_memory(True)["ok"]
    elif rpc == "dcr_digest":
        assert ext.dcr_digest()["digest"] == digest0
    elif rpc == "dcr_metrics":
        assert "dcr_" in ext.dcr_metrics()["text"]
    elif rpc == "dcr_set_placement":
        assert ext.dcr_set_placement("loader")["placement"] == "loader"
    elif rpc == "dcr_verify_plan":
        rep = ext.dcr_verify_plan()
        assert rep["ok"] and rep["matches"], rep
        assert ext.dcr_digest()["digest"] == digest0
    elif rpc.startswith("dcr_adapter_"):
        _valid_adapter(ext, tmp)
    else:  # dcr_status; dcr_info needs vLLM's parallel state (the real-engine test calls it)
        assert ext.dcr_status()["state"] == "clean"


def _valid_adapter(ext: DCRWorkerExtension, tmp: Path) -> None:
    """The adapter RPCs on a FAKE LoRA manager (recording add_lora / remove_lora): a load, a
    delta refit into a candidate, its commit; a fenced attempt leaves the committed version."""
    from shared_codec.peft import read_adapter
    from shared_codec.records import Kind, diff_tensors
    from vllm_dcr_plugin.adapters import lora_id

    added: list[int] = []
    ext.add_lora = lambda request: added.append(request.lora_int_id) or True  # type: ignore[attr-defined]
    ext.remove_lora = lambda ident: added.remove(ident) or True  # type: ignore[attr-defined]
    path0, t0 = _adapter_dir(tmp, 0)
    _, t1 = _adapter_dir(tmp, 1)
    assert ext.dcr_adapter_load("a", path0, 0)["lora_id"] == lora_id("a", 0)
    items = [diff_tensors(n, t0[n], t1[n], kind=Kind.XOR, owner=0) for n in t0]
    spec = _publish(tmp / "adapter-store", _encode(items))
    got = ext.dcr_adapter_fetch("a", spec, 1, 0, 10.0)
    assert got["ok"] and not got["active"] and got["items"] == 2, got
    assert added == [lora_id("a", 0), lora_id("a", 1)]
    assert ext.dcr_adapter_status()["adapters"]["a"]["candidate"] == [1, 0]
    done = ext.dcr_adapter_commit("a", 1)
    assert done["ok"] and done["active"] and done["lora_name"] == "a@1", done
    _, written = read_adapter(done["lora_path"])
    assert all(torch.equal(written[n], t1[n]) for n in t1)  # bit-exact with the new version
    assert ext.dcr_adapter_abort("a", 5)["version"] == 1  # nothing to drop; v1 stays


@pytest.mark.parametrize("rpc", sorted(BAD))
def test_bad_arguments_are_protocol_error_replies_that_change_nothing(
    rpc: str, tmp_path: Path
) -> None:
    ext, v0, v1 = _extension()
    assert ext.dcr_prewarm(TABLE, 0)["ok"]
    if rpc in ("dcr_stage", "dcr_apply", "dcr_commit", "dcr_abort"):
        # something staged, so that a bad call could (but must not) consume or drop it
        assert len(ext.dcr_stage(_payloads(ext, v0, v1))["staged"]) == len(REFIT)
    before = _snapshot(ext)
    cases = BAD[rpc](tmp_path)
    assert cases
    for what, args, kwargs, named in cases:
        reply = getattr(ext, rpc)(*args, **kwargs)
        assert reply["ok"] is False, (what, reply)
        assert reply["error"].startswith(f"ProtocolError: {rpc}: bad arguments: "), (what, reply)
        assert named in reply["error"], (what, named, reply["error"])
        assert reply["rank"] == 0, (what, reply)
        assert _snapshot(ext) == before, what
    _valid(rpc, ext, v0, v1, tmp_path)


def test_every_rpc_has_bad_argument_cases() -> None:
    rpcs = {n for n in dir(DCRWorkerExtension) if n.startswith("dcr_")}
    assert rpcs == set(BAD)


def test_calls_out_of_order_are_protocol_errors_that_change_nothing(tmp_path: Path) -> None:
    """Missing prewarm, a commit of a version never applied, an apply of an aborted attempt:
    ``ok: False`` with a ProtocolError saying what is missing; nothing changes."""
    ext, v0, v1 = _extension()
    payloads = _payloads(ext, v0, v1)
    spec = _publish(tmp_path / "store", payloads)
    before = _snapshot(ext)
    for what, reply in {
        "stage": ext.dcr_stage(payloads),
        "fetch": ext.dcr_fetch(spec, 1, 0, 5.0),
        "apply": ext.dcr_apply(0),
    }.items():
        assert reply["ok"] is False and reply["error"].startswith("ProtocolError: "), (what, reply)
        assert "dcr_prewarm has not been called" in reply["error"], (what, reply)
        assert _snapshot(ext) == before, what
    assert ext.dcr_prewarm(TABLE, 0)["ok"]
    payloads = _payloads(ext, v0, v1)  # now t and c are overwrite-only
    before = _snapshot(ext)
    reply = ext.dcr_commit(1)  # nothing applied
    assert reply["ok"] is False and "cannot commit version 1" in reply["error"], reply
    assert _snapshot(ext) == before
    assert len(ext.dcr_stage(payloads)["staged"]) == len(REFIT)
    assert ext.dcr_abort(0)["dropped"] == len(REFIT)
    before = _snapshot(ext)
    reply = ext.dcr_apply(0)
    assert reply["ok"] is False and "attempt 0 was aborted" in reply["error"], reply
    assert _snapshot(ext) == before
    # a new attempt goes through
    again = _encode(
        _items(v0, v1, {"overwrite_only": ext._dcr_receiver().found.overwrite_only}), attempt=1
    )
    assert len(ext.dcr_stage(again)["staged"]) == len(REFIT)
    assert ext.dcr_apply(1, verify=True)["ok"]
    _assert_holds(ext._dcr_receiver().model, v1)  # type: ignore[arg-type]


def test_a_table_too_large_to_prewarm_is_a_protocol_error_reply() -> None:
    """A shape no model has (2**61 bytes of scratch): refused, nothing changed, not an
    allocation error escaping the RPC."""
    ext, *_ = _extension()
    assert ext.dcr_prewarm(TABLE, 0)["ok"]
    before = _snapshot(ext)
    reply = ext.dcr_prewarm([["t.weight", "bfloat16", [2**40, 2**20]]], 0)
    assert reply["ok"] is False and reply["error"].startswith("ProtocolError: tensors: "), reply
    assert "cannot be allocated" in reply["error"]
    assert _snapshot(ext) == before
    assert ext.dcr_prewarm(TABLE, 0)["ok"]


def test_missing_model_is_a_protocol_error_reply() -> None:
    reply = DCRWorkerExtension().dcr_status()
    assert reply["ok"] is False and reply["error"].startswith("ProtocolError: "), reply
    assert "no loaded model" in reply["error"]


def test_a_dense_load_that_fails_part_way_leaves_the_receiver_dirty(tmp_path: Path) -> None:
    """A checkpoint that passes the header checks but stops the loader part-way (here: a FAKE
    loader that raises on a tensor it cannot take) is an ``ok: False`` reply, never an
    escaping exception, and the receiver says its weights are a mixture (dirty)."""
    ext, v0, v1 = _extension()
    assert ext.dcr_prewarm(TABLE, 0)["ok"]
    # t.weight comes last in the file and has a shape the loader cannot take: c, d, e, f, g
    # are written before it fails
    bad = {**v1, "t.weight": v1["t.weight"][:, :3].contiguous()}
    path = _write_checkpoint(tmp_path / "bad", bad)
    rx: Any = ext._dcr_receiver()
    del rx.tensors["t.weight"]  # not in the table: not shape-checked, it reaches the loader
    reply = ext.dcr_dense_load(path, 1)
    assert reply["ok"] is False and reply["error"].startswith("LoaderConditionError: "), reply
    assert "failed part-way" in reply["error"] and "dirty" in reply["error"]
    status = ext.dcr_status()
    assert status["state"] == "dirty" and status["committed_version"] == 0
    good = _write_checkpoint(tmp_path / "v1", v1)
    assert ext.dcr_dense_load(good, 1)["ok"] and ext.dcr_status()["state"] == "clean"
    _assert_holds(rx.model, v1)


def test_bad_store_spec_past_the_boundary_is_a_protocol_error(tmp_path: Path) -> None:
    """A direct receiver call (no RPC boundary) with a spec `open_store` refuses."""
    from shared_codec.errors import ProtocolError

    rx = Receiver(FakeLoaderModel(), rank={"rank": 0})
    rx.prewarm(TABLE)
    with pytest.raises(ProtocolError, match="bad store spec"):
        rx.fetch({"kind": "nfs", "root": str(tmp_path)}, 1, 0, timeout_s=1)
    assert rx.status()["state"] == "clean"


def test_an_unexpected_exception_is_an_internal_error_reply(monkeypatch, caplog) -> None:
    """A defect below an RPC (here a FAKE digest that raises `KeyError`) is an ``ok: False``
    reply marked ``internal`` on that rank, with its traceback logged, never an exception that
    would leave the other ranks' replies queued in vLLM's executor; the next call answers."""
    ext, _, _ = _extension()
    assert ext.dcr_prewarm(TABLE, 0)["ok"]
    rx: Any = ext._dcr_receiver()
    before = ext.dcr_digest()["digest"]

    def broken() -> dict:
        raise KeyError("planted defect")

    monkeypatch.setattr(rx, "digest", broken)
    with caplog.at_level("ERROR", logger="dcr.extension"):
        reply = ext.dcr_digest()
    assert reply == {
        "ok": False,
        "rank": 0,
        "error": "KeyError: 'planted defect'",
        "rpc": "dcr_digest",
        "internal": True,
        # the rank's weights state rides on every reply (versions.py)
        "weights": {
            "state": "clean",
            "committed_version": 0,
            "target_version": None,
            "apply_calls": 0,
        },
    }
    assert "dcr_digest failed on rank 0" in caplog.text and "planted defect" in caplog.text
    monkeypatch.undo()
    assert ext.dcr_status()["ok"] and ext.dcr_digest()["digest"] == before


def test_a_fetch_beyond_the_next_version_is_refused_at_once(tmp_path: Path) -> None:
    """A ``dcr_fetch`` whose version is not committed + 1 is refused before anything is read
    (issue 29: with a gap nothing is ever published for it, and the fetch waited out its whole
    timeout); nothing changes, and the next version is fetched as usual."""
    import time

    ext, v0, v1 = _extension()
    assert ext.dcr_prewarm(TABLE, 0)["ok"]
    spec = _publish(tmp_path / "store", _payloads(ext, v0, v1))
    before = _snapshot(ext)
    t0 = time.monotonic()
    reply = ext.dcr_fetch(spec, 3, 0, 60.0)
    assert time.monotonic() - t0 < 5.0  # not its 60 s timeout
    assert reply["ok"] is False and "version 3 is not the next one" in reply["error"], reply
    assert "committed version 0" in reply["error"] and _snapshot(ext) == before
    assert ext.dcr_fetch(spec, 1, 0, 10.0, {"verify": True})["ok"]


def test_rpcs_refuse_an_engine_with_a_speculative_draft(tmp_path: Path) -> None:
    """The ``dcr_*`` RPCs refit the base model only: on a FAKE worker that runs a draft model,
    ``dcr_prewarm`` and ``dcr_dense_load`` are refused naming the native backend, nothing
    changed (the backend ``dcr`` refits both: test_native_draft.py)."""
    ext, v0, _ = _extension()
    ext.get_draft_model = FakeLoaderModel  # type: ignore[attr-defined]
    before = _snapshot(ext)
    path = save_checkpoint(v0, tmp_path / "v0")
    for reply in (ext.dcr_prewarm(TABLE, 0), ext.dcr_dense_load(str(path), 0)):
        assert reply["ok"] is False and reply["error"].startswith("ProtocolError: "), reply
        assert "runs a speculative draft model" in reply["error"], reply
        assert "weight-transfer API with backend 'dcr'" in reply["error"], reply
    assert _snapshot(ext) == before
