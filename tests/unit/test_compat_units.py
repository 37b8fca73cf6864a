"""Pure unit tests of the compatibility layers' decisions and refusals (no engine, no ranks)."""

from __future__ import annotations

import subprocess

import pytest

from dcr_tools.procs import PYTHON, REPO, base_env


def test_vllm_resident_condition_env_override(monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm_dcr_plugin import cpu_compat

    monkeypatch.setitem(cpu_compat._state, "enabled_by_extension", False)
    monkeypatch.delenv(cpu_compat.ENV_FLAG, raising=False)
    assert cpu_compat.dcr_enabled() is False
    monkeypatch.setitem(cpu_compat._state, "enabled_by_extension", True)
    assert cpu_compat.dcr_enabled() is True
    monkeypatch.setenv(cpu_compat.ENV_FLAG, "0")
    assert cpu_compat.dcr_enabled() is False
    monkeypatch.setenv(cpu_compat.ENV_FLAG, "1")
    monkeypatch.setitem(cpu_compat._state, "enabled_by_extension", False)
    assert cpu_compat.dcr_enabled() is True


def test_torch_moe_matches_a_dense_reference() -> None:
    """The resident-layout MoE path equals a per-token loop over the same weights."""
    import torch

    from vllm_dcr_plugin.cpu_compat import _torch_moe_apply

    g = torch.Generator().manual_seed(0)
    E, H, inter, M, k = 4, 8, 6, 5, 2
    w1 = torch.randn(E, 2 * inter, H, generator=g)
    w2 = torch.randn(E, H, inter, generator=g)
    x = torch.randn(M, H, generator=g)
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(M)])
    weights = torch.rand(M, k, generator=g)
    out = torch.empty(M, H)
    _torch_moe_apply(object(), out, x, w1, w2, weights, ids, "silu", E, None)
    ref = torch.zeros(M, H)
    for t in range(M):
        for j in range(k):
            e = int(ids[t, j])
            gu = w1[e] @ x[t]
            h = torch.nn.functional.silu(gu[:inter]) * gu[inter:]
            ref[t] += weights[t, j] * (w2[e] @ h)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    # expert_map: experts 2 and 3 are not on this rank -> their contributions vanish
    emap = torch.tensor([0, 1, -1, -1])
    out2 = torch.empty(M, H)
    _torch_moe_apply(object(), out2, x, w1[:2], w2[:2], weights, ids, "silu", E, emap)
    ref2 = torch.zeros(M, H)
    for t in range(M):
        for j in range(k):
            e = int(ids[t, j])
            if e < 2:
                gu = w1[e] @ x[t]
                ref2[t] += weights[t, j] * (
                    w2[e] @ (torch.nn.functional.silu(gu[:inter]) * gu[inter:])
                )
    torch.testing.assert_close(out2, ref2, rtol=1e-5, atol=1e-5)


def test_megatron_layer_refuses_vllm_process() -> None:
    code = (
        "import vllm, megatron_dcr_hooks.cpu_compat as c\n"
        "from shared_codec.errors import CompatibilityError\n"
        "try:\n    c.enable()\nexcept CompatibilityError as e:\n    print('refused:', e)\n"
    )
    r = subprocess.run(
        [PYTHON, "-c", code], cwd=REPO, env=base_env(), capture_output=True, text=True, timeout=180
    )
    assert "refused: megatron_dcr_hooks.cpu_compat must not be enabled" in r.stdout, r.stderr[
        -2000:
    ]
