"""`dcr bench quantized`'s pure parts (no engine, no timing): the two deltas it times on small
synthetic checkpoints (labelled as such): the BF16 path is the codec's own diff, the
quantized path takes the library's quantized v0 to its quantized v1 bit for bit, and its counts
(silent elements, touched groups) are those of the changed elements; the table renders."""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("compressed_tensors", reason="compressed-tensors is needed to quantize")

from dcr_tools.bench.quantized import build_delta, render  # noqa: E402
from shared_codec.dtypes import tensor_bits  # noqa: E402
from shared_codec.quantized import FORMATS, quantize_checkpoint  # noqa: E402
from shared_codec.records import apply_items, diff_checkpoints  # noqa: E402


def _checkpoints() -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Synthetic v0 / v1: one quantized projection, one norm; 2% of elements scaled."""
    g = torch.Generator().manual_seed(0)
    old = {
        "model.layers.0.mlp.down_proj.weight": (torch.randn(64, 128, generator=g) * 0.02).to(
            torch.bfloat16
        ),
        "model.norm.weight": torch.ones(128, dtype=torch.bfloat16),
    }
    new = {n: t.clone() for n, t in old.items()}
    w = new["model.layers.0.mlp.down_proj.weight"].view(-1)
    pick = torch.randperm(w.numel(), generator=g)[: w.numel() // 50]
    w[pick] = (w[pick].float() * 1.5).to(torch.bfloat16)
    new["model.norm.weight"][3] = 2.0
    return old, new


@pytest.mark.parametrize("fmt", ["int8-channel", "fp8-block"])
def test_the_quantized_delta_takes_the_library_v0_to_its_v1(fmt: str) -> None:
    old, new = _checkpoints()
    f = FORMATS[fmt]
    q0, q1 = quantize_checkpoint(old, f), quantize_checkpoint(new, f)
    counts = {"bf16_changed": 0, "silent": 0, "groups": 0, "groups_total": 0}
    items = build_delta(old, new, q0, f, set(), counts)
    state = {n: t.clone() for n, t in q0.items()}
    apply_items(state, items)
    assert all(np.array_equal(tensor_bits(state[n]), tensor_bits(q1[n])) for n in q1)
    name = "model.layers.0.mlp.down_proj.weight"
    changed = int((tensor_bits(old[name]) != tensor_bits(new[name])).sum())
    assert counts["bf16_changed"] == changed > 0
    assert 0 <= counts["silent"] < changed
    assert counts["groups_total"] == (64 if fmt == "int8-channel" else 1)
    assert 0 < counts["groups"] <= counts["groups_total"]


def test_the_bf16_delta_is_the_codec_diff() -> None:
    old, new = _checkpoints()
    got = build_delta(old, new, None, FORMATS["int8-channel"], {"model.norm.weight"})
    want = diff_checkpoints(old, new, overwrite={"model.norm.weight"})
    assert len(got) == len(want) == 2 and all(a.same_as(b) for a, b in zip(got, want, strict=True))


def test_render_prints_one_row_per_rate() -> None:
    s = {"median": 0.2, "min": 0.1, "max": 0.3, "runs": [0.1, 0.2, 0.3]}  # synthetic figures
    row = {
        "rate": "1%", "silent_share": 0.4, "groups": 10, "groups_share": 0.5,
        "quantized_payload_bytes": 900, "bf16_payload_bytes": 1000, "payload_vs_bf16": 0.9,
        "payload_vs_quantized_checkpoint": 0.01, "quantized_construct_s": s,
        "bf16_construct_s": s, "construct_vs_bf16": 1.0, "apply_s": s, "apply_vs_dense": 0.3,
        "bit_exact": True,
    }  # fmt: skip
    res = {
        "format": "int8-channel", "model": {"parameters": 1e6},
        "quantized_checkpoint_bytes": 1e6, "repeats": 3, "dense_load_s": s, "rows": [row],
    }  # fmt: skip
    lines = render(res).splitlines()
    assert len(lines) == 4 and lines[-1].startswith("  1% |") and lines[-1].endswith("yes")
