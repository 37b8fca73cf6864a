"""The named-tensor owner (shared_codec.named) on real transports and gloo groups.

Oracle: the payloads an attempt publishes on a ``dir`` transport, decoded and applied with the
reference applier (`shared_codec.records.apply_items`) to the committed checkpoint, give the
stream's stored bits exactly (`bits_equal`). Two-rank cases run two real gloo processes.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from shared_codec.checkpoint import bits_equal
from shared_codec.decode import decode_payload
from shared_codec.errors import ArgumentError, ProtocolError
from shared_codec.named import NamedOwnerConfig, NamedTensorOwner
from shared_codec.records import Kind, apply_items
from shared_codec.transport.spec import TransportSpec


def _checkpoint(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "model.embed_tokens.weight": torch.randn(64, 32, generator=g).bfloat16(),
        "model.layers.0.mlp.down_proj.weight": torch.randn(32, 48, generator=g).bfloat16(),
        "model.layers.0.mlp.up_proj.weight": torch.randn(48, 32, generator=g).bfloat16(),
        "model.layers.0.input_layernorm.weight": torch.ones(32, dtype=torch.bfloat16),
        "model.norm.weight": torch.randn(32, generator=g),  # an fp32 tensor
        "lm_head.weight": torch.randn(64, 32, generator=g).bfloat16(),
    }


def _step(ckpt: dict[str, torch.Tensor], seed: int, rate: float = 0.03) -> dict[str, torch.Tensor]:
    """A sparse update: `rate` of the elements of every tensor but the layernorm move."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, t in ckpt.items():
        t = t.clone()
        if "layernorm" not in name:
            mask = torch.rand(t.shape, generator=g) < rate
            t[mask] = (t.float()[mask] + 0.05 * torch.randn(int(mask.sum()), generator=g)).to(
                t.dtype
            )
        out[name] = t
    return out


def _applied(spec: dict, version: int, attempt: int, held: dict[str, torch.Tensor]) -> list:
    """Apply attempt (`version`, `attempt`)'s payloads to a copy of `held`; the items."""
    source = TransportSpec.parse(spec).open_source()
    items = [
        i for p in source.fetch(version, attempt, timeout_s=5) for i in decode_payload(p).items
    ]
    apply_items(held, items)
    return items


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(bits_equal(a[n], b[n]) for n in a)


def test_build_commit_retry_and_next_version(tmp_path: Path) -> None:
    spec = {"kind": "dir", "root": str(tmp_path / "payloads")}
    v0 = _checkpoint()
    owner = NamedTensorOwner(
        spec,
        v0,
        config=NamedOwnerConfig(
            overwrite_only={"lm_head.weight"}, bucket_bytes=512, min_bucket_bytes=128
        ),
    )
    v1 = _step(v0, 1)
    rep = owner.take_weights(v1.items())
    assert rep.version == 1 and rep.owned == len(v0) and 0 < rep.element_change_rate < 0.05
    reply = owner.build(1, 0, False)
    assert reply.payloads > 1 and reply.baseline_id == "named-v0"  # bounded buckets
    held = {n: t.clone() for n, t in v0.items()}
    items = _applied(spec, 1, 0, held)
    assert _same(held, v1)
    kinds = {i.name: i.kind for i in items}
    assert kinds["lm_head.weight"] == Kind.OVERWRITE  # overwrite_only
    assert kinds["model.embed_tokens.weight"] == Kind.XOR
    assert "model.layers.0.input_layernorm.weight" not in kinds  # unchanged: nothing sent
    # a failed attempt left a partial write: the retry's overwrites repair it
    partial = {n: t.clone() for n, t in v0.items()}
    apply_items(partial, items[:1])
    owner.abort(1, 0)
    owner.build(1, 1, True)
    retry_items = _applied(spec, 1, 1, partial)
    assert all(i.kind == Kind.OVERWRITE for i in retry_items)
    assert _same(partial, v1)
    owner.verify(1)
    owner.commit(1)
    owner.commit(1)  # idempotent
    assert owner.committed_version == 1 and owner.candidate is None
    assert _same(owner.baseline, v1)
    v2 = _step(v1, 2)
    owner.take_weights(v2.items())
    owner.build(2, 0, False)
    _applied(spec, 2, 0, held)
    assert _same(held, v2)


def test_a_failed_transition_then_the_next_stream_diffs_against_the_committed(
    tmp_path: Path,
) -> None:
    spec = {"kind": "dir", "root": str(tmp_path / "payloads")}
    v0 = _checkpoint()
    owner = NamedTensorOwner(spec, v0)
    owner.take_weights(_step(v0, 1).items())
    owner.build(1, 0, False)
    owner.abort(1, 0)  # every attempt failed: nothing committed
    v2 = _step(_step(v0, 1), 2)  # the trainer moved on (a skipped sync)
    owner.take_weights(v2.items())
    owner.build(1, 3, False)  # the next version is still committed + 1
    held = {n: t.clone() for n, t in v0.items()}
    _applied(spec, 1, 3, held)
    assert _same(held, v2)
    # an unchanged stream (a skipped optimizer step) is a version with no payload
    owner.commit(1)
    owner.take_weights(v2.items())
    assert owner.build(2, 0, False).payloads == 0
    assert list(TransportSpec.parse(spec).open_source().fetch(2, 0, timeout_s=5)) == []


@pytest.mark.parametrize(
    "case,match",
    [
        ("unknown", "is no canonical tensor"),
        ("dtype", "got torch.float32"),
        ("shape", r"\[64, 31\]"),
        ("twice", "came twice"),
        ("missing", "lacked 1 canonical tensor"),
        ("not a tensor", "a torch.Tensor was expected"),
    ],
)
def test_bad_streams_are_refused_and_change_nothing(tmp_path: Path, case: str, match: str) -> None:
    spec = {"kind": "dir", "root": str(tmp_path / "payloads")}
    v0 = _checkpoint()
    owner = NamedTensorOwner(spec, v0)
    pairs = list(_step(v0, 1).items())
    if case == "unknown":
        pairs.append(("model.layers.9.mlp.up_proj.weight", torch.zeros(2)))
    elif case == "dtype":
        pairs[0] = (pairs[0][0], pairs[0][1].float())
    elif case == "shape":
        pairs[0] = (pairs[0][0], pairs[0][1][:, :31])
    elif case == "twice":
        pairs.append(pairs[1])
    elif case == "missing":
        pairs.pop()
    else:
        pairs[0] = (pairs[0][0], pairs[0][1].tolist())
    consumed = []

    def stream():
        for p in pairs:
            consumed.append(p[0])
            yield p

    with pytest.raises(ArgumentError, match=match):
        owner.take_weights(stream())
    assert len(consumed) == len(pairs)  # the whole stream was read (a collective elsewhere)
    assert owner.candidate is None and _same(owner.baseline, v0)
    with pytest.raises(ProtocolError, match="no weights were taken for version 1"):
        owner.build(1, 0, False)
    assert not (tmp_path / "payloads").exists() or not any((tmp_path / "payloads").rglob("*.dcr"))


def _two_ranks(rank: int, root: str, out: str) -> None:
    store = dist.FileStore(os.path.join(root, "store"), 2)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
    try:
        spec = {"kind": "dir", "root": os.path.join(root, "payloads")}
        v0 = _checkpoint()
        owner = NamedTensorOwner(spec, v0, group=dist.group.WORLD)
        versions = [v0]
        for v in (1, 2):
            versions.append(_step(versions[-1], v))
            owner.take_weights(versions[-1].items())
            if rank == 0:
                owner.build(v, 0, False)
                owner.commit(v)
        owner.take_weights(versions[-1].items())  # the other ranks advance their baselines
        baselines = {"full": owner.baseline}
        # a split producer (a WeightSource's held_names): rank 1 holds only the embedding
        held = None if rank == 0 else ["model.embed_tokens.weight"]
        owner = NamedTensorOwner(
            spec, versions[-1], group=dist.group.WORLD, committed_version=2, held_names=held
        )
        v3 = _step(versions[-1], 3)

        class Split:
            def held_names(self):
                return held

            def __iter__(self):
                for n, t in v3.items():
                    yield n, (t if held is None or n in held else None)

        owner.take_weights(Split())
        if rank == 0:
            owner.build(3, 0, False)
            owner.commit(3)
        owner.take_weights(Split())  # the other ranks advance their baselines here
        baselines["split"] = owner.baseline
        torch.save(
            {"rank": rank, "baselines": baselines, "owned": sorted(baselines["full"])},
            os.path.join(out, f"rank{rank}.pt"),
        )
    finally:
        dist.destroy_process_group()


def test_two_ranks_split_the_scan_and_rank0_publishes(tmp_path: Path) -> None:
    mp.start_processes(
        _two_ranks, args=(str(tmp_path), str(tmp_path)), nprocs=2, start_method="spawn"
    )
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in (0, 1)]
    v0 = _checkpoint()
    owned = [set(r["owned"]) for r in ranks]
    assert owned[0] and owned[1] and not owned[0] & owned[1] and owned[0] | owned[1] == set(v0)
    spec = {"kind": "dir", "root": str(tmp_path / "payloads")}
    held = {n: t.clone() for n, t in v0.items()}
    versions = [v0]
    for v in (1, 2, 3):
        versions.append(_step(versions[-1], v))
        items = _applied(spec, v, 0, held)
        assert _same(held, versions[-1]), v
        owners = {i.name: i.owner for i in items}
        if v < 3:  # each rank scans its share, and its records carry its owner id
            assert set(owners.values()) == {0, 1}
        else:  # only a holder owns a name: rank 1 owns at most the embedding
            assert set(ranks[1]["baselines"]["split"]) <= {"model.embed_tokens.weight"}
            assert {n for n, o in owners.items() if o == 1} == set(ranks[1]["baselines"]["split"])
    for r in ranks:  # every rank's baselines advanced to the committed versions
        assert all(bits_equal(t, versions[2][n]) for n, t in r["baselines"]["full"].items())
        assert all(bits_equal(t, versions[3][n]) for n, t in r["baselines"]["split"].items())


def _fsdp2_ranks(rank: int, root: str) -> None:
    """Two gloo ranks train an HF Qwen3 (transformers) sharded by FSDP2 (``fully_shard``) on
    CPU; after each step every rank hands its FSDP2 full state dict (torch's own
    ``get_model_state_dict``) to the owner, and rank 0 publishes and commits."""
    import transformers
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group(
        "gloo", store=dist.FileStore(os.path.join(root, "store"), 2), rank=rank, world_size=2
    )
    try:
        cfg = transformers.Qwen3Config(
            vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=8, tie_word_embeddings=False,
        )  # fmt: skip
        torch.manual_seed(0)
        model = transformers.Qwen3ForCausalLM(cfg).to(torch.bfloat16)
        mesh = init_device_mesh("cpu", (2,))
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        opt = torch.optim.SGD(model.parameters(), lr=1e-4)
        options = StateDictOptions(full_state_dict=True)  # every rank: the full tensors
        states = [get_model_state_dict(model, options=options)]
        spec = {"kind": "dir", "root": os.path.join(root, "payloads")}
        owner = NamedTensorOwner(spec, states[0], group=dist.group.WORLD)
        g = torch.Generator().manual_seed(rank)
        for v in (1, 2):
            ids = torch.randint(0, 128, (2, 8), generator=g)
            model(input_ids=ids, labels=ids).loss.backward()
            opt.step()
            opt.zero_grad()
            states.append(get_model_state_dict(model, options=options))
            rep = owner.take_weights(states[-1].items())
            if rank == 0:
                owner.build(v, 0, False)
                owner.commit(v)
            torch.save(rep.owned, os.path.join(root, f"owned{rank}-{v}.pt"))
        if rank == 0:
            torch.save([{n: t.clone() for n, t in s.items()} for s in states], f"{root}/states.pt")
    finally:
        dist.destroy_process_group()


def test_an_fsdp2_full_state_dict_stream_refits_bit_exact(tmp_path: Path) -> None:
    mp.start_processes(_fsdp2_ranks, args=(str(tmp_path),), nprocs=2, start_method="spawn")
    states = torch.load(tmp_path / "states.pt")
    spec = {"kind": "dir", "root": str(tmp_path / "payloads")}
    held = {n: t.clone() for n, t in states[0].items()}
    for v in (1, 2):
        assert not _same(states[v], states[v - 1])  # the step moved some bits
        items = _applied(spec, v, 0, held)
        assert _same(held, states[v]), v
        assert {i.owner for i in items} == {0, 1}  # both ranks scanned their share
        owned = [torch.load(tmp_path / f"owned{r}-{v}.pt") for r in (0, 1)]
        assert owned[0] + owned[1] == len(states[0])
