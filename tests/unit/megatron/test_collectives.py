"""DCR's collectives on the backend of their group, and detection on the device, in-process.

The device-only group is a TEST DOUBLE (tests/device_only.py): a real ``ProcessGroup`` whose
only backend is registered for ``cuda``, so torch refuses CPU tensors on it exactly as NCCL
does. The streamed device scan (`DeviceScan`) runs here on host tensors; its oracle is the
compiled host scan (`changed_bits` on the host), compared array for array.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.distributed as dist

from megatron_dcr_hooks.collectives import (
    all_gather,
    all_reduce,
    broadcast,
    group_device,
    with_host,
)
from megatron_dcr_hooks.groups import ParallelGroups, RankGroup, takes_host_tensors
from shared_codec.scan import DeviceScan, changed_bits
from tests.device_only import device_only_group


def _gloo() -> dist.ProcessGroupGloo:
    return dist.ProcessGroupGloo(dist.HashStore(), 0, 1)


def _groups(world: RankGroup, **kw) -> ParallelGroups:
    one = RankGroup(group=_gloo(), rank=0, size=1)
    return ParallelGroups(world=world, tp=one, dp=one, ep=one, expert_dp=one, pp=one, **kw)


# -- the double and the backend rule -------------------------------------------------------------


def test_the_device_only_double_refuses_cpu_tensors_as_nccl_does() -> None:
    pg = device_only_group()
    with pytest.raises(RuntimeError, match="No backend type associated with device type cpu"):
        dist.all_reduce(torch.ones(2), group=pg)


def test_which_groups_take_host_tensors() -> None:
    assert takes_host_tensors(None)
    assert takes_host_tensors(_gloo())
    mixed = dist.ProcessGroup(dist.HashStore(), 0, 1)  # as 'cpu:gloo,cuda:nccl' registers
    gloo = _gloo()
    mixed._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.GLOO, gloo)
    mixed._register_backend(torch.device("cuda"), dist.ProcessGroup.BackendType.GLOO, gloo)
    assert takes_host_tensors(mixed)
    assert not takes_host_tensors(device_only_group())


def test_group_device() -> None:
    assert group_device(_gloo()) == torch.device("cpu")
    if not torch.accelerator.is_available():  # a CUDA build without a device included
        with pytest.raises(RuntimeError, match="gloo"):
            group_device(device_only_group())
    else:
        assert group_device(device_only_group()).type != "cpu"


def test_collectives_on_a_host_group_give_host_tensors() -> None:
    g = _gloo()
    assert all_reduce(torch.tensor([3, 4]), g).tolist() == [3, 4]
    assert [t.tolist() for t in all_gather(torch.tensor([5]), g, 1)] == [[5]]
    assert broadcast(torch.tensor([7, 8]), g).tolist() == [7, 8]


def test_host_group_resolution() -> None:
    gloo_world = RankGroup(group=_gloo(), rank=0, size=1)
    g = _groups(gloo_world)
    assert g.host is gloo_world and with_host(g) is g  # gloo world: the world itself
    dev_world = RankGroup(group=device_only_group(), rank=0, size=1)
    g = _groups(dev_world)
    assert g.host is None
    with pytest.raises(ValueError, match="no host group"):
        _ = g.cpu_world
    resolved = with_host(g)
    assert resolved.world is dev_world and resolved.cpu_world.group is not dev_world.group
    assert takes_host_tensors(resolved.cpu_world.group)
    assert all_reduce(torch.tensor([2]), resolved.cpu_world.group).tolist() == [2]
    passed = RankGroup(group=_gloo(), rank=0, size=1)
    assert with_host(_groups(dev_world, host=passed)).cpu_world is passed  # given: used
    assert resolved.replace(world=dev_world).host is None  # a new world drops the old host
    with pytest.raises(ValueError, match="does not span the world"):
        _groups(dev_world, host=RankGroup(group=_gloo(), rank=0, size=2))


# -- detection on the device vs on the host ------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.int8])
@pytest.mark.parametrize("chunk_bytes", [8, 40, 1 << 20])
@pytest.mark.parametrize("rate", [0.0, 0.01, 0.5, 1.0])
def test_streamed_scan_equals_the_host_scan(
    dtype: torch.dtype, chunk_bytes: int, rate: float
) -> None:
    g = torch.Generator().manual_seed(int(rate * 100) + chunk_bytes)
    n = 1237  # not a multiple of any chunk
    if dtype.is_floating_point:
        base = torch.randn(n, generator=g).to(dtype)
    else:
        base = torch.randint(-100, 100, (n,), generator=g, dtype=dtype)
    shard = base.clone().reshape(1, n)
    hit = torch.rand(n, generator=g) < rate
    flat = shard.reshape(-1)
    flat[hit] = (flat[hit].float() + 3).to(dtype)
    tracker = base.clone()
    want = changed_bits(shard, tracker)
    got = DeviceScan(chunk_bytes)(shard, tracker)
    for w, h in zip(want, got, strict=True):
        assert w.dtype == h.dtype
        np.testing.assert_array_equal(w, h)
    assert got[0].size == int(hit.sum())


def test_streamed_scan_refuses_a_mismatched_tracker() -> None:
    with pytest.raises(ValueError, match="does not match"):
        DeviceScan()(torch.zeros(4, dtype=torch.bfloat16), torch.zeros(5, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match=">= 8"):
        DeviceScan(4)
