"""TEST-ONLY CPU STAND-IN for the CUDA kernels of the ``mamba_ssm`` package (plain PyTorch).

megatron-core's Mamba-2 mixer needs ``mamba_ssm`` (Triton/CUDA kernels) and refuses to build
without it: megatron/core/ssm/mamba_mixer.py (0.19.2) imports ``RMSNorm`` from
``mamba_ssm.ops.triton.layernorm_gated`` and ``mamba_chunk_scan_combined`` /
``mamba_split_conv1d_scan_combined`` from ``mamba_ssm.ops.triton.ssd_combined`` (lines 68-79),
sets ``RMSNormGated = MagicMock()`` when that fails (lines 89-93) and ``MambaMixer.__init__``
raises ``ImportError("MambaSSM is not installed...")`` (lines 202-205). ``mamba_ssm`` builds its
kernels with CUDA and Triton has no CPU backend here, so on this machine the Mamba layers of
Nemotron-H cannot be built at all.

`install()` puts an import hook at the end of ``sys.meta_path`` that serves modules named
``mamba_ssm.ops.triton.layernorm_gated`` and ``mamba_ssm.ops.triton.ssd_combined`` (only when
no real ``mamba_ssm`` is found first) whose functions are the well-known pure-PyTorch reference
formulations of the same maths (mamba_ssm's own ``rms_norm_ref``, ``ssd_minimal_discrete`` and
``mamba_split_conv1d_scan_ref``; causal conv1d as a grouped ``torch.nn.functional.conv1d``).
Autograd gives the backward pass. They are NOT the kernels: results agree with them only up to
floating-point rounding (different summation order), and they are slow (quadratic in the chunk
length). They exist so that real megatron-core Mamba layers can be built, trained and converted
by real gloo ranks in CPU tests of DCR's owner side, which only depends on which stored bits
change, never on how the kernels compute them. Nothing in ``megatron_dcr_hooks``,
``shared_codec`` or ``vllm_dcr_plugin`` imports this module; it is installed by the CPU test
builder (`dcr_tools.trainers.model.provider_settings`, before any bridge module imports the
mixer) and answers only when ``mamba_ssm`` itself is not importable.

Covered (the non-Transformer-Engine training path of megatron-core 0.19.2's ``MambaMixer``):
``_ssm_training`` (``use_mamba_mem_eff_path``, the default: ``mamba_split_conv1d_scan_combined``
without the fused norm / out-projection, then ``ExtendedRMSNorm(y)``), ``_ssm_prefill`` for
static batching (``mamba_chunk_scan_combined``; its conv falls back to megatron's own
``nn.Conv1d`` when ``causal_conv1d`` is missing, mamba_mixer.py lines 913-914). Not covered:
packed sequences (``seq_idx``), initial states, dynamic-batching inference (megatron's own
Triton ops under ``megatron/core/ssm/ops``), ``causal_conv1d``.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types
from typing import Any

import torch
import torch.nn.functional as F

#: the package name megatron-core imports; set on the stand-in modules so they say what they are
STAND_IN_NOTE = "dcr_tools CPU stand-in (plain PyTorch reference), not the mamba_ssm kernels"


def _rearrange_groups(t: torch.Tensor, group: int) -> torch.Tensor:
    return t.reshape(*t.shape[:-1], t.shape[-1] // group, group)


def rms_norm_ref(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    z: torch.Tensor | None = None,
    eps: float = 1e-6,
    group_size: int | None = None,
    norm_before_gate: bool = True,
) -> torch.Tensor:
    """Gated (grouped) RMSNorm, mamba_ssm's ``rms_norm_ref`` (fp32 inside, input dtype out):
    ``norm(x * silu(z))`` when not `norm_before_gate`, else ``norm(x) * silu(z)``."""
    dtype = x.dtype
    xf = x.float()
    zf = z.float() if z is not None else None
    if zf is not None and not norm_before_gate:
        xf = xf * F.silu(zf)
    g = xf.shape[-1] if group_size is None else group_size
    xg = _rearrange_groups(xf, g)
    rstd = torch.rsqrt(xg.square().mean(dim=-1, keepdim=True) + eps)
    out = (xg * rstd).reshape(xf.shape) * weight.float()
    if bias is not None:
        out = out + bias.float()
    if zf is not None and norm_before_gate:
        out = out * F.silu(zf)
    return out.to(dtype)


class RMSNorm(torch.nn.Module):
    """``mamba_ssm.ops.triton.layernorm_gated.RMSNorm``'s interface on `rms_norm_ref`."""

    def __init__(
        self,
        hidden_size: int,
        eps: float = 1e-5,
        group_size: int | None = None,
        norm_before_gate: bool = True,
        device: Any = None,
        dtype: Any = None,
    ) -> None:
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, device=device, dtype=dtype))
        self.register_parameter("bias", None)
        self.group_size = group_size
        self.norm_before_gate = norm_before_gate

    def forward(self, x: torch.Tensor, z: torch.Tensor | None = None) -> torch.Tensor:
        return rms_norm_ref(
            x, self.weight, None, z=z, eps=self.eps, group_size=self.group_size,
            norm_before_gate=self.norm_before_gate,
        )  # fmt: skip


def _segsum(x: torch.Tensor) -> torch.Tensor:
    """Stable segment sums: out[..., i, j] = sum(x[..., j+1 : i+1]) for j <= i, else -inf."""
    t = x.size(-1)
    x = x[..., None].expand(*x.shape, t)
    below = torch.tril(torch.ones(t, t, dtype=torch.bool, device=x.device), diagonal=-1)
    x = x.masked_fill(~below, 0)
    out = torch.cumsum(x, dim=-2)
    keep = torch.tril(torch.ones(t, t, dtype=torch.bool, device=x.device), diagonal=0)
    return out.masked_fill(~keep, -torch.inf)


def ssd_minimal_discrete(
    x: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    c: torch.Tensor,
    block_len: int,
    initial_states: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The Mamba-2 SSD chunked scan (the paper's ``ssd_minimal_discrete``), fp32.

    x (batch, length, heads, headdim) already multiplied by dt; a (batch, length, heads) = A*dt;
    b, c (batch, length, heads, state). length must divide by `block_len`. Returns
    (y like x, final state (batch, heads, headdim, state))."""
    bsz, length = x.shape[:2]
    nc = length // block_len

    def chunks(t: torch.Tensor) -> torch.Tensor:
        return t.reshape(bsz, nc, block_len, *t.shape[2:])

    x, a, b, c = chunks(x), chunks(a), chunks(b), chunks(c)
    a = a.permute(0, 3, 1, 2)  # b h c l
    a_cumsum = torch.cumsum(a, dim=-1)
    # 1. intra-chunk outputs (diagonal blocks)
    decay = torch.exp(_segsum(a))
    y_diag = torch.einsum("bclhn,bcshn,bhcls,bcshp->bclhp", c, b, decay, x)
    # 2. each chunk's final state
    decay_states = torch.exp(a_cumsum[:, :, :, -1:] - a_cumsum)
    states = torch.einsum("bclhn,bhcl,bclhp->bchpn", b, decay_states, x)
    # 3. inter-chunk recurrence
    if initial_states is None:
        initial_states = torch.zeros_like(states[:, :1])
    else:
        initial_states = initial_states[:, None]
    states = torch.cat([initial_states, states], dim=1)
    decay_chunk = torch.exp(_segsum(F.pad(a_cumsum[:, :, :, -1], (1, 0))))
    new_states = torch.einsum("bhzc,bchpn->bzhpn", decay_chunk, states)
    states, final_state = new_states[:, :-1], new_states[:, -1]
    # 4. state -> output per chunk
    y_off = torch.einsum("bclhn,bchpn,bhcl->bclhp", c, states, torch.exp(a_cumsum))
    return (y_diag + y_off).reshape(bsz, length, *x.shape[3:]), final_state


def mamba_chunk_scan_combined(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    chunk_size: int,
    D: torch.Tensor | None = None,
    z: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    initial_states: torch.Tensor | None = None,
    seq_idx: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
    dt_softplus: bool = False,
    dt_limit: tuple[float, float] = (0.0, float("inf")),
    return_final_states: bool = False,
    return_varlen_states: bool = False,
    **unsupported: Any,
) -> Any:
    """mamba_ssm's ``mamba_chunk_scan_combined`` (x, z (b, l, h, p); dt (b, l, h); A (h,);
    B, C (b, l, g, n); D (h,) or (h, p)) on `ssd_minimal_discrete`: y = SSD(x dt, A dt, B, C)
    + D x, times silu(z) when z is given; output in x's dtype."""
    if seq_idx is not None or cu_seqlens is not None or return_varlen_states or unsupported:
        raise NotImplementedError(
            f"{STAND_IN_NOTE}: packed / varlen sequences and {sorted(unsupported)} not covered"
        )
    bsz, length, heads, _ = x.shape
    groups = B.shape[2]
    dtf = dt.float()
    if dt_bias is not None:
        dtf = dtf + dt_bias.float()
    if dt_softplus:
        dtf = F.softplus(dtf)
    if dt_limit != (0.0, float("inf")):
        dtf = dtf.clamp(min=dt_limit[0], max=dt_limit[1])
    xf = x.float()
    bf = B.float().repeat_interleave(heads // groups, dim=2)
    cf = C.float().repeat_interleave(heads // groups, dim=2)
    pad = (-length) % chunk_size
    xd, ad = xf * dtf[..., None], A.float() * dtf
    if pad:
        xd, ad = F.pad(xd, (0, 0, 0, 0, 0, pad)), F.pad(ad, (0, 0, 0, pad))
        bf, cf = F.pad(bf, (0, 0, 0, 0, 0, pad)), F.pad(cf, (0, 0, 0, 0, 0, pad))
    init = initial_states.float() if initial_states is not None else None
    y, final = ssd_minimal_discrete(xd, ad, bf, cf, chunk_size, init)
    y = y[:, :length]
    if D is not None:
        d = D.float()
        y = y + xf * (d[:, None] if d.dim() == 1 else d)
    if z is not None:
        y = y * F.silu(z.float())
    y = y.to(x.dtype)
    return (y, final) if return_final_states else y


def causal_conv1d_ref(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, activation: str | None
) -> torch.Tensor:
    """Depthwise causal conv1d: x (b, d, l), weight (d, w) -> (b, d, l), then silu if asked."""
    width = weight.shape[-1]
    out = F.conv1d(x, weight[:, None, :], bias, padding=width - 1, groups=x.shape[1])
    out = out[..., : x.shape[-1]]
    return F.silu(out) if activation in ("silu", "swish") else out


def mamba_split_conv1d_scan_combined(
    zxbcdt: torch.Tensor,
    conv1d_weight: torch.Tensor,
    conv1d_bias: torch.Tensor | None,
    dt_bias: torch.Tensor,
    A: torch.Tensor,
    D: torch.Tensor,
    chunk_size: int,
    initial_states: torch.Tensor | None = None,
    seq_idx: torch.Tensor | None = None,
    dt_limit: tuple[float, float] = (0.0, float("inf")),
    return_final_states: bool = False,
    activation: str = "silu",
    rmsnorm_weight: torch.Tensor | None = None,
    rmsnorm_eps: float = 1e-6,
    outproj_weight: torch.Tensor | None = None,
    outproj_bias: torch.Tensor | None = None,
    headdim: int | None = None,
    ngroups: int = 1,
    norm_before_gate: bool = True,
) -> Any:
    """mamba_ssm's ``mamba_split_conv1d_scan_combined`` (its ``mamba_split_conv1d_scan_ref``):
    split zxbcdt (b, l, [z, x, B, C, dt]), causal conv + silu over [x, B, C], the SSD scan with
    D and the silu(z) gate (or the gated RMSNorm when `rmsnorm_weight` is given), optional out
    projection. Returns (b, l, heads x headdim)."""
    if seq_idx is not None:
        raise NotImplementedError(f"{STAND_IN_NOTE}: packed sequences (seq_idx) not covered")
    if D.dim() == 1:
        if headdim is None:
            raise ValueError("headdim is required when D is per head")
        (heads,) = D.shape
    else:
        heads, headdim = D.shape
    bsz, length, _ = zxbcdt.shape
    dim = heads * headdim
    dstate = (conv1d_weight.shape[0] - dim) // ngroups // 2
    if zxbcdt.shape[-1] != 2 * dim + 2 * ngroups * dstate + heads:
        raise ValueError(f"zxbcdt width {zxbcdt.shape[-1]} does not match the split sizes")
    z, xbc, dt = torch.split(zxbcdt, [dim, dim + 2 * ngroups * dstate, heads], dim=-1)
    xbc = causal_conv1d_ref(xbc.transpose(1, 2), conv1d_weight, conv1d_bias, activation)
    xbc = xbc.transpose(1, 2)
    x, b, c = torch.split(xbc, [dim, ngroups * dstate, ngroups * dstate], dim=-1)
    x = x.reshape(bsz, length, heads, headdim)
    b = b.reshape(bsz, length, ngroups, dstate)
    c = c.reshape(bsz, length, ngroups, dstate)
    z = z.reshape(bsz, length, heads, headdim)
    res = mamba_chunk_scan_combined(
        x, dt, A, b, c, chunk_size, D=D, z=z if rmsnorm_weight is None else None,
        dt_bias=dt_bias, initial_states=initial_states, dt_softplus=True, dt_limit=dt_limit,
        return_final_states=return_final_states,
    )  # fmt: skip
    y, final = res if return_final_states else (res, None)
    out = y.reshape(bsz, length, dim)
    if rmsnorm_weight is not None:
        out = rms_norm_ref(
            out, rmsnorm_weight, None, z=z.reshape(bsz, length, dim), eps=rmsnorm_eps,
            group_size=dim // ngroups, norm_before_gate=norm_before_gate,
        )  # fmt: skip
    if outproj_weight is not None:
        out = F.linear(out, outproj_weight, outproj_bias)
    return (out, final) if return_final_states else out


#: stand-in module name -> its attributes
_MODULES: dict[str, dict[str, Any]] = {
    "mamba_ssm": {},
    "mamba_ssm.ops": {},
    "mamba_ssm.ops.triton": {},
    "mamba_ssm.ops.triton.layernorm_gated": {"RMSNorm": RMSNorm, "rms_norm_ref": rms_norm_ref},
    "mamba_ssm.ops.triton.ssd_combined": {
        "mamba_chunk_scan_combined": mamba_chunk_scan_combined,
        "mamba_split_conv1d_scan_combined": mamba_split_conv1d_scan_combined,
    },
}


class _StandInFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Serves `_MODULES` on import. It sits at the END of ``sys.meta_path``, so an installed
    ``mamba_ssm`` is found by the regular path finder first and this one never answers."""

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname not in _MODULES:
            return None
        return importlib.machinery.ModuleSpec(fullname, self, is_package=True)

    def create_module(self, spec: Any) -> types.ModuleType:
        mod = types.ModuleType(spec.name, STAND_IN_NOTE)
        mod.__dcr_stand_in__ = STAND_IN_NOTE  # type: ignore[attr-defined]
        for key, value in _MODULES[spec.name].items():
            setattr(mod, key, value)
        return mod

    def exec_module(self, module: types.ModuleType) -> None:
        return None


def is_stand_in(module: Any) -> bool:
    """True when `module` (e.g. ``sys.modules["mamba_ssm"]``) is this stand-in."""
    return getattr(module, "__dcr_stand_in__", None) is not None


def install() -> None:
    """Put the stand-in finder at the end of ``sys.meta_path`` (idempotent). From then on an
    import of ``mamba_ssm.ops.triton.*`` gets the stand-in when no real ``mamba_ssm`` is
    installed. It must be in place before megatron-core's ``megatron.core.ssm.mamba_mixer`` is
    first imported (that module binds the names at import; importing a megatron-bridge hybrid
    provider imports it)."""
    if not any(isinstance(f, _StandInFinder) for f in sys.meta_path):
        sys.meta_path.append(_StandInFinder())


def check_mixer() -> None:
    """RuntimeError unless megatron-core's Mamba mixer has kernels (real or stand-in): it was
    imported before `install` without ``mamba_ssm``."""
    import megatron.core.ssm.mamba_mixer as mixer

    if not getattr(mixer, "HAVE_MAMBA_SSM", False):
        raise RuntimeError(
            "megatron.core.ssm.mamba_mixer was imported without mamba_ssm before the CPU "
            "stand-in was installed (dcr_tools.trainers.mamba_reference.install)"
        )
