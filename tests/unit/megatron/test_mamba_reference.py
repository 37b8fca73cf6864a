"""The test-only CPU stand-in for mamba_ssm's kernels (dcr_tools/trainers/mamba_reference.py)
computes the Mamba-2 maths: the chunked SSD scan equals the plain per-step recurrence (float64,
any chunk size, a length that is not a multiple of it), the split-conv1d path equals its parts,
the gated RMSNorm is per group; and the import hook serves it only when mamba_ssm is absent.
These are the stand-in's own checks; DCR's owner tests on top of it are bit-exact
(tests/integration/megatron/test_owner.py, nemotron-h)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from dcr_tools.trainers import mamba_reference as mr

B, L, H, P, G, N = 2, 37, 4, 8, 2, 5


def _inputs(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g, dtype=torch.float64)

    return {
        "x": rnd(B, L, H, P), "dt": rnd(B, L, H), "A": -torch.rand(H, generator=g).double() - 0.5,
        "B": rnd(B, L, G, N), "C": rnd(B, L, G, N), "D": rnd(H), "z": rnd(B, L, H, P),
        "dt_bias": rnd(H),
    }  # fmt: skip


def _recurrence(t: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """h_t = exp(dt_t A) h_{t-1} + dt_t x_t B_t^T; y_t = C_t h_t + D x_t, gated by silu(z)."""
    dt = F.softplus(t["dt"] + t["dt_bias"])
    bh = t["B"].repeat_interleave(H // G, dim=2)
    ch = t["C"].repeat_interleave(H // G, dim=2)
    state = torch.zeros(B, H, P, N, dtype=torch.float64)
    ys = []
    for i in range(L):
        decay = torch.exp(dt[:, i] * t["A"])[:, :, None, None]
        state = state * decay + (t["x"][:, i] * dt[:, i, :, None])[..., None] * bh[:, i, :, None]
        ys.append(torch.einsum("bhpn,bhn->bhp", state, ch[:, i]))
    y = (torch.stack(ys, 1) + t["x"] * t["D"][:, None]) * F.silu(t["z"])
    return y, state


@pytest.mark.parametrize("chunk", [4, 8, 64])
def test_chunked_scan_equals_the_recurrence(chunk: int) -> None:
    t = _inputs()
    y, final = mr.mamba_chunk_scan_combined(
        t["x"], t["dt"], t["A"], t["B"], t["C"], chunk, D=t["D"], z=t["z"],
        dt_bias=t["dt_bias"], dt_softplus=True, return_final_states=True,
    )  # fmt: skip
    want_y, want_state = _recurrence(t)
    # the stand-in computes in float32 (as the kernels do)
    assert torch.allclose(y.double(), want_y, atol=1e-4, rtol=1e-4)
    assert torch.allclose(final.double(), want_state, atol=1e-4, rtol=1e-4)


def test_split_conv1d_scan_is_conv_then_scan() -> None:
    t = _inputs(1)
    dim, gn = H * P, G * N
    w = torch.randn(dim + 2 * gn, 4, dtype=torch.float64)
    bias = torch.randn(dim + 2 * gn, dtype=torch.float64)
    z, x = t["z"].reshape(B, L, dim), t["x"].reshape(B, L, dim)
    xbc = torch.cat([x, t["B"].reshape(B, L, gn), t["C"].reshape(B, L, gn)], dim=-1)
    zxbcdt = torch.cat([z, xbc, t["dt"]], dim=-1)
    out = mr.mamba_split_conv1d_scan_combined(
        zxbcdt, w, bias, t["dt_bias"], t["A"], t["D"], 8, headdim=P, ngroups=G
    )
    # causal depthwise conv by hand: out[t] = sum_k w[k] * in[t - (W-1) + k]
    padded = F.pad(xbc, (0, 0, 3, 0))
    conv = sum(padded[:, k : k + L] * w[:, k] for k in range(4)) + bias
    conv = F.silu(conv)
    cx, cb, cc = torch.split(conv, [dim, gn, gn], dim=-1)
    want = dict(t, x=cx.reshape(B, L, H, P), B=cb.reshape(B, L, G, N), C=cc.reshape(B, L, G, N))
    want_y, _ = _recurrence(want)
    assert torch.allclose(out.double(), want_y.reshape(B, L, dim), atol=1e-4, rtol=1e-4)


def test_gated_rmsnorm_is_per_group() -> None:
    x, z = torch.randn(3, 16, dtype=torch.float64), torch.randn(3, 16, dtype=torch.float64)
    norm = mr.RMSNorm(16, eps=1e-5, group_size=8, norm_before_gate=False, dtype=torch.float64)
    gated = x * F.silu(z)
    halves = [h / torch.sqrt(h.square().mean(-1, keepdim=True) + 1e-5) for h in gated.split(8, -1)]
    assert torch.allclose(norm(x, z).double(), torch.cat(halves, -1), atol=1e-6)


def test_import_hook_serves_the_stand_in_only_without_mamba_ssm() -> None:
    probe = (
        "import importlib.util, sys\n"
        "from dcr_tools.trainers import mamba_reference as mr\n"
        "real = importlib.util.find_spec('mamba_ssm') is not None\n"
        "mr.install(); mr.install()\n"
        "import mamba_ssm.ops.triton.ssd_combined as m\n"
        "from mamba_ssm.ops.triton.layernorm_gated import RMSNorm\n"
        "assert mr.is_stand_in(m) != real, (real, m)\n"
        "assert (RMSNorm is mr.RMSNorm) != real\n"
        "assert sum(isinstance(f, mr._StandInFinder) for f in sys.meta_path) == 1\n"
        "print('ok', real)\n"
    )
    repo = Path(__file__).resolve().parents[3]
    env = dict(os.environ, PYTHONPATH=str(repo))
    out = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=True,
        cwd=repo, env=env,
    )  # fmt: skip
    assert out.stdout.startswith("ok")
