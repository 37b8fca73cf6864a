"""Affine maps and ownership in-process, without torchrun, Megatron ranks or the bridge.

What is pure is tested on synthetic inputs: the stable name hash, the owner choice over holder
groups (`ParallelGroups` built per synthetic rank), the EP-global expert name, the run encoding
of affine maps and their projection, and the probe that measures affine maps
(`tasks.classify_tasks`). The probe is driven by FAKE mappings that imitate megatron-bridge's
gathers for one rank of a TP=2 job (column split, row split, gated-MLP halves, replicated) plus
non-affine ones; the real mappings run their gathers on megatron-core's process groups and are
exercised on real ranks by tests/integration/megatron/test_owner.py.
"""

from __future__ import annotations

import hashlib
import itertools
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

from megatron_dcr_hooks.conversion import ParamTask, global_param_name
from megatron_dcr_hooks.groups import ParallelGroups, RankGroup
from megatron_dcr_hooks.ownership import holders_of, owns, residual_owner
from megatron_dcr_hooks.tasks import (
    ID_SHIFT,
    AffineMap,
    Task,
    TaskKind,
    _runs,
    classify_tasks,
)
from shared_codec.errors import OwnerBuildError
from shared_codec.scan import stable_hash

# -- synthetic layouts ---------------------------------------------------------------------------


def _rg(rank: int, size: int) -> RankGroup:
    return RankGroup(group=None, rank=rank, size=size)


def dense_groups(tp: int, dp: int, rank: int) -> ParallelGroups:
    """Megatron's default order for a dense job: TP fastest, then DP (no EP, no PP)."""
    tp_rank, dp_rank = rank % tp, rank // tp
    return ParallelGroups(
        world=_rg(rank, tp * dp),
        tp=_rg(tp_rank, tp),
        dp=_rg(dp_rank, dp),
        ep=_rg(0, 1),
        expert_dp=_rg(dp_rank, dp),
        pp=_rg(0, 1),
    )


def moe_groups(ep: int, edp: int, rank: int) -> ParallelGroups:
    """An expert layout with expert TP 1: EP fastest, then expert-DP (dense part: DP = world)."""
    world = ep * edp
    return ParallelGroups(
        world=_rg(rank, world),
        tp=_rg(0, 1),
        dp=_rg(rank, world),
        ep=_rg(rank % ep, ep),
        expert_dp=_rg(rank // ep, edp),
        pp=_rg(0, 1),
    )


def fake_task(name: str, *, replicated: bool = False, expert: bool = False) -> Task:
    p = torch.nn.Parameter(torch.zeros(2, dtype=torch.bfloat16), requires_grad=False)
    pt = ParamTask(
        local_name=name, global_name=name, param=p, module=torch.nn.Module(), mapping=None
    )
    return Task(index=0, param_task=pt, kind=TaskKind.AFFINE, replicated=replicated, expert=expert)


NAMES = [f"decoder.layers.{i}.self_attention.linear_proj.weight" for i in range(40)] + [
    f"decoder.layers.{i}.mlp.linear_fc1.weight" for i in range(40)
]


# -- hashing and ownership -----------------------------------------------------------------------


def test_stable_hash_is_blake2b_and_pinned() -> None:
    name = "decoder.layers.0.mlp.linear_fc1.weight"
    digest = hashlib.blake2b(name.encode(), digest_size=8).digest()
    assert stable_hash(name) == int.from_bytes(digest, "little")
    # pinned: a change here would move owners between releases of DCR
    assert stable_hash("embedding.word_embeddings.weight") == 0x30E5F985DF2E243F
    assert stable_hash(name) == 0xC1BF01899F7E93B9
    assert len({stable_hash(n) for n in NAMES}) == len(NAMES)


@pytest.mark.parametrize(("tp", "dp"), [(1, 2), (2, 2), (2, 3), (4, 2)])
def test_tp_shards_have_exactly_one_owner_among_their_dp_replicas(tp: int, dp: int) -> None:
    for name in NAMES:
        t = fake_task(name)
        for tp_rank in range(tp):  # one shard per TP rank, held by its DP replicas
            replicas = [dp_rank * tp + tp_rank for dp_rank in range(dp)]
            owners = [r for r in replicas if owns(t, dense_groups(tp, dp, r))]
            assert len(owners) == 1, (name, tp_rank, owners)
            assert all(holders_of(t, dense_groups(tp, dp, r)).size == dp for r in replicas)


@pytest.mark.parametrize(("tp", "dp"), [(2, 1), (2, 2), (4, 2)])
def test_replicated_tensors_have_exactly_one_owner_in_the_job(tp: int, dp: int) -> None:
    for name in NAMES:
        t = fake_task(name, replicated=True)
        owners = [r for r in range(tp * dp) if owns(t, dense_groups(tp, dp, r))]
        assert len(owners) == 1, (name, owners)
    # holder positions are a bijection onto the group
    t = fake_task(NAMES[0], replicated=True)
    idx = sorted(holders_of(t, dense_groups(tp, dp, r)).index for r in range(tp * dp))
    assert idx == list(range(tp * dp))


@pytest.mark.parametrize(("ep", "edp"), [(2, 1), (2, 2), (1, 4)])
def test_expert_shards_have_exactly_one_owner_among_expert_dp(ep: int, edp: int) -> None:
    for i in range(16):
        t = fake_task(
            f"decoder.layers.0.mlp.experts.local_experts.{i}.linear_fc1.weight", expert=True
        )
        for ep_rank in range(ep):
            replicas = [e * ep + ep_rank for e in range(edp)]
            owners = [r for r in replicas if owns(t, moe_groups(ep, edp, r))]
            assert len(owners) == 1


def test_owner_choice_is_fixed_and_spread() -> None:
    tp, dp = 2, 4
    first = {(n, r): owns(fake_task(n), dense_groups(tp, dp, r)) for n in NAMES for r in range(8)}
    # fixed across attempts (and task order): the same answer every time, in any order
    for n, r in reversed(list(first)):
        assert owns(fake_task(n), dense_groups(tp, dp, r)) == first[(n, r)]
    # spread: every DP replica owns some of the 80 tensors
    per_dp = {d: sum(first[(n, d * tp)] for n in NAMES) for d in range(dp)}
    assert all(v > 0 for v in per_dp.values()), per_dp


def test_residual_owner_is_one_job_rank() -> None:
    for n in NAMES:
        assert residual_owner(n, 4) in range(4)
        assert residual_owner(n, 4) == stable_hash("residual:" + n) % 4
    assert len({residual_owner(n, 4) for n in NAMES}) == 4


def test_rank_group_rejects_positions_outside_the_group() -> None:
    with pytest.raises(ValueError, match="outside a group of size 2"):
        RankGroup(group=None, rank=2, size=2)
    with pytest.raises(ValueError):
        RankGroup(group=None, rank=0, size=0)


def test_global_expert_name_uses_the_given_ep_position() -> None:
    cfg = SimpleNamespace(num_moe_experts=8)
    local = "decoder.layers.1.mlp.experts.local_experts.3.linear_fc2.weight"
    assert global_param_name(local, cfg, 0, 2) == local
    assert global_param_name(local, cfg, 1, 2) == local.replace(".3.", ".7.")
    assert global_param_name(local, cfg, 3, 4) == local.replace(".3.", ".9.")
    dense = "decoder.layers.1.mlp.linear_fc1.weight"
    assert global_param_name(dense, cfg, 1, 2) == dense
    assert global_param_name(local, SimpleNamespace(num_moe_experts=None), 1, 2) == local


# -- runs and projection -------------------------------------------------------------------------


def test_runs_merge_contiguous_segments_and_project_back() -> None:
    # local 0..5 -> "a"[10..15]; local 6..8 -> "b"[0..2]; local 9 -> "a"[3]
    local = np.arange(10)
    name_of = np.array([0] * 6 + [1] * 3 + [0])
    hf = np.array([10, 11, 12, 13, 14, 15, 0, 1, 2, 3])
    rng = np.random.default_rng(0)
    perm = rng.permutation(10)  # the probe's order is arbitrary
    amap = _runs(local[perm], name_of[perm], hf[perm], ["a", "b"])
    assert amap.local_start.tolist() == [0, 6, 9]
    assert amap.length.tolist() == [6, 3, 1]
    assert amap.covered == 10
    q = np.array([0, 5, 6, 8, 9])
    ni, hi = amap.project(q)
    assert ni.tolist() == [0, 0, 1, 1, 0] and hi.tolist() == [10, 15, 0, 2, 3]
    assert amap.project(np.empty(0, np.int64))[0].size == 0


def test_projection_outside_the_map_is_an_owner_build_error() -> None:
    amap = _runs(np.array([2, 3]), np.array([0, 0]), np.array([0, 1]), ["a"])
    with pytest.raises(OwnerBuildError, match="outside"):
        amap.project(np.array([4]))
    with pytest.raises(OwnerBuildError):
        amap.project(np.array([0]))


def test_empty_map() -> None:
    amap = _runs(np.empty(0, np.int64), np.empty(0, np.int32), np.empty(0, np.int64), ["a"])
    assert isinstance(amap, AffineMap) and amap.covered == 0


# -- the probe on FAKE bridge mappings (one rank of a TP=2 job) -----------------------------------


def _peer_shards(x: torch.Tensor, rank: int, tp: int) -> list[torch.Tensor]:
    """FAKE all-gather: every TP rank's shard as the real gather would deliver it during the
    probe. Probe ids are ``s * ((rank + 1) << 40 | i)`` with s = 1 or 2, so a peer's shard is
    ours with its rank tag replaced; real (float) tensors are just repeated."""
    if x.is_floating_point():
        return [x] * tp
    s = (x.reshape(-1)[0] >> ID_SHIFT) // (rank + 1)
    return [x + s * ((k - rank) << ID_SHIFT) for k in range(tp)]


class FakeColumn:
    """FAKE ColumnParallelMapping: rows split over TP (dim 0)."""

    def __init__(self, rank: int, tp: int) -> None:
        self.rank, self.tp = rank, tp

    def megatron_to_hf(self, x: torch.Tensor, module: Any) -> dict[str, torch.Tensor]:
        return {"col.weight": torch.cat(_peer_shards(x, self.rank, self.tp), 0)}


class FakeRow(FakeColumn):
    """FAKE RowParallelMapping: columns split over TP (dim 1)."""

    def megatron_to_hf(self, x: torch.Tensor, module: Any) -> dict[str, torch.Tensor]:
        return {"row.weight": torch.cat(_peer_shards(x, self.rank, self.tp), 1)}


class FakeGated(FakeColumn):
    """FAKE GatedMLPMapping: each shard is [gate rows of r; up rows of r]."""

    def megatron_to_hf(self, x: torch.Tensor, module: Any) -> dict[str, torch.Tensor]:
        shards = _peer_shards(x, self.rank, self.tp)
        half = x.shape[0] // 2
        return {
            "gate.weight": torch.cat([s[:half] for s in shards], 0),
            "up.weight": torch.cat([s[half:] for s in shards], 0),
        }


class FakeReplicated(FakeColumn):
    """FAKE ReplicatedMapping (norms)."""

    def megatron_to_hf(self, x: torch.Tensor, module: Any) -> dict[str, torch.Tensor]:
        return {"norm.weight": x.clone()}


class FakeScaled(FakeColumn):
    """FAKE arithmetic conversion (x + 1): not a placement, so residual."""

    def megatron_to_hf(self, x: torch.Tensor, module: Any) -> dict[str, torch.Tensor]:
        return {"scaled.weight": x + 1}


class FakePadded(FakeColumn):
    """FAKE padded embedding: gathered rows plus one padding row that no source id fills."""

    def megatron_to_hf(self, x: torch.Tensor, module: Any) -> dict[str, torch.Tensor]:
        full = torch.cat(_peer_shards(x, self.rank, self.tp), 0)
        return {"emb.weight": torch.cat([full, torch.zeros_like(full[:1])], 0)}


class FakeUpcast(FakeColumn):
    """FAKE dtype-changing conversion (bf16 -> fp32): residual (XOR would not carry over)."""

    def megatron_to_hf(self, x: torch.Tensor, module: Any) -> dict[str, torch.Tensor]:
        return {"up32.weight": x.float() if x.is_floating_point() else x}


def _param_task(name: str, shape: tuple[int, ...], mapping: Any, seed: int = 0) -> ParamTask:
    g = torch.Generator().manual_seed(seed)
    p = torch.nn.Parameter(torch.randn(shape, generator=g).to(torch.bfloat16), requires_grad=False)
    return ParamTask(
        local_name=name, global_name=name, param=p, module=torch.nn.Module(), mapping=mapping
    )


def _classify(rank: int, tp: int = 2, **kw: Any) -> dict[str, Task]:
    pts = [
        _param_task("col", (4, 3), FakeColumn(rank, tp)),
        _param_task("row", (3, 2), FakeRow(rank, tp)),
        _param_task("gated", (4, 3), FakeGated(rank, tp)),
        _param_task("norm", (3,), FakeReplicated(rank, tp)),
        _param_task("scaled", (2, 2), FakeScaled(rank, tp)),
        _param_task("padded", (2, 3), FakePadded(rank, tp)),
        _param_task("up32", (2, 2), FakeUpcast(rank, tp)),
    ]
    tasks = classify_tasks(pts, dense_groups(tp, 1, rank), **kw)
    return {t.param_task.local_name: t for t in tasks}


def _expected(name: str, rank: int) -> list[tuple[str, int]]:
    """Hand-written canonical coordinates of every local element of rank `rank` (TP=2)."""
    if name == "col":  # rows split: local (i, j) -> (4 * rank + i, j) of [8, 3]
        return [("col.weight", (4 * rank + i) * 3 + j) for i in range(4) for j in range(3)]
    if name == "row":  # columns split: local (i, j) -> (i, 2 * rank + j) of [3, 4]
        return [("row.weight", i * 4 + 2 * rank + j) for i in range(3) for j in range(2)]
    if name == "gated":  # [g_r; u_r]: local row i < 2 -> gate row 2r + i, else up row 2r + i - 2
        out = []
        for i in range(4):
            t, row = ("gate.weight", 2 * rank + i) if i < 2 else ("up.weight", 2 * rank + i - 2)
            out += [(t, row * 3 + j) for j in range(3)]
        return out
    if name == "norm":
        return [("norm.weight", j) for j in range(3)]
    raise AssertionError(name)


@pytest.mark.parametrize("rank", [0, 1])
def test_probe_measures_the_affine_layouts(rank: int) -> None:
    tasks = _classify(rank)
    for name in ("col", "row", "gated", "norm"):
        t = tasks[name]
        assert t.kind is TaskKind.AFFINE, name
        assert t.amap is not None and t.amap.covered == t.param.numel()
        ni, hi = t.amap.project(np.arange(t.param.numel()))
        got = [(t.amap.names[int(a)], int(b)) for a, b in zip(ni, hi)]
        assert got == _expected(name, rank), name
    assert tasks["col"].hf_shapes == {"col.weight": (8, 3)}
    assert tasks["row"].hf_shapes == {"row.weight": (3, 4)}
    assert tasks["gated"].hf_shapes == {"gate.weight": (4, 3), "up.weight": (4, 3)}
    assert tasks["gated"].amap is not None and len(tasks["gated"].amap.length) == 2  # two runs
    assert tasks["norm"].replicated and not tasks["col"].expert


def test_probe_classifies_non_placements_as_residual() -> None:
    tasks = _classify(0)
    for name in ("scaled", "padded", "up32"):
        assert tasks[name].kind is TaskKind.RESIDUAL, name
        assert tasks[name].amap is None
    assert tasks["up32"].hf_dtype == torch.float32
    assert tasks["padded"].hf_shapes == {"emb.weight": (5, 3)}


def test_force_residual_by_mapping_class_name() -> None:
    tasks = _classify(1, force_residual=("FakeGated",))
    assert tasks["gated"].kind is TaskKind.RESIDUAL
    assert tasks["col"].kind is TaskKind.AFFINE


def test_split_then_project_merges_back_exactly() -> None:
    """Split canonical tensors into both ranks' shards with the fake layouts, change random
    elements, project every rank's changed local indices: the scattered values rebuild the
    changed canonical tensors bit for bit, and no canonical element is written twice."""
    rng = np.random.default_rng(1)
    per_rank = {r: _classify(r) for r in (0, 1)}
    canon: dict[str, np.ndarray] = {}
    shards: dict[tuple[int, str], np.ndarray] = {}
    placed: set[tuple[str, int]] = set()
    for r, tasks in per_rank.items():
        for name in ("col", "row", "gated", "norm"):
            if name == "norm" and r == 1:
                continue  # replicated: rank 1 holds a bitwise copy; its one owner is rank 0
            t = tasks[name]
            bits = rng.integers(0, 1 << 16, t.param.numel(), dtype=np.uint16)
            shards[(r, name)] = bits
            assert t.amap is not None
            ni, hi = t.amap.project(np.arange(bits.size))
            for k, shape in t.hf_shapes.items():
                canon.setdefault(k, np.zeros(int(np.prod(shape)), np.uint16))
            for a, b, v in zip(ni, hi, bits):
                assert (t.amap.names[int(a)], int(b)) not in placed
                placed.add((t.amap.names[int(a)], int(b)))
                canon[t.amap.names[int(a)]][b] = v
    # the shards of both ranks cover every canonical element exactly once (a merge)
    assert len(placed) == sum(v.size for v in canon.values())
    new = {k: v.copy() for k, v in canon.items()}
    written: set[tuple[str, int]] = set()
    for (r, name), bits in shards.items():
        t = per_rank[r][name]
        assert t.amap is not None
        changed = np.sort(rng.choice(bits.size, size=max(1, bits.size // 3), replace=False))
        bits[changed] ^= 0x5A5A
        ni, hi = t.amap.project(changed)
        for a, b, v in zip(ni, hi, bits[changed]):
            key = (t.amap.names[int(a)], int(b))
            assert key not in written
            written.add(key)
            new[key[0]][key[1]] = v
    assert sum(int((new[k] != canon[k]).sum()) for k in canon) == len(written)
    # oracle: the canonical tensors merged again from the changed shards
    for (r, name), bits in shards.items():
        t = per_rank[r][name]
        assert t.amap is not None
        ni, hi = t.amap.project(np.arange(bits.size))
        for a, b, v in zip(ni, hi, bits):
            assert new[t.amap.names[int(a)]][b] == v


def test_owners_in_the_job_equal_the_distinct_shards() -> None:
    # TP=2 x DP=2: a TP-sharded tensor has two distinct shards (one owner each), a replicated
    # one a single copy (one owner in the whole job)
    for name, replicated in itertools.product(NAMES[:10], (False, True)):
        t = fake_task(name, replicated=replicated)
        owners = [r for r in range(4) if owns(t, dense_groups(2, 2, r))]
        assert len(owners) == (1 if replicated else 2)
        if not replicated:  # the two owners hold different shards (different TP ranks)
            assert {dense_groups(2, 2, r).tp.rank for r in owners} == {0, 1}


def test_each_once_accepts_only_a_permutation_of_all_local_indices() -> None:
    """Pure unit: the classifier's exactly-once check (a bitmap, no sort)."""
    from megatron_dcr_hooks.tasks import each_once

    perm = np.random.default_rng(0).permutation(1000).astype(np.int64)
    assert each_once(perm, 1000)
    assert each_once(np.empty(0, np.int64), 0)
    dup = perm.copy()
    dup[5] = dup[6]  # one index twice, one missing
    assert not each_once(dup, 1000)
    assert not each_once(perm[:-1], 1000)  # one missing
    assert not each_once(np.append(perm, 3), 1000)  # one extra
    out = perm.copy()
    out[0] = 1000  # out of range
    assert not each_once(out, 1000)
    neg = perm.copy()
    neg[0] = -1
    assert not each_once(neg, 1000)
