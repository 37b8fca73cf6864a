"""`dcr bench fanout`'s pure parts (no timing): the synthetic lineage changes the asked share of
elements; the table says whether the goal was met (synthetic summaries, labelled). The counting
boundary proxy runs against a real S3 endpoint in tests/integration/shared_codec."""

from __future__ import annotations

import numpy as np

from dcr_tools.bench.fanout import evolve, render, write_initial
from shared_codec.dtypes import tensor_bits


def test_lineage_changes_the_asked_share_of_elements(tmp_path) -> None:
    v0 = write_initial(tmp_path / "ckpt", elements=1 << 16, tensors=2, seed=1)
    v1 = evolve(v0, seed=2, rate=0.01)
    for name in v0:
        changed = np.count_nonzero(tensor_bits(v0[name]) != tensor_bits(v1[name]))
        assert 0.008 < changed / v0[name].numel() < 0.012
    assert (tmp_path / "ckpt" / "model.safetensors").exists()


def test_render_says_whether_the_goal_was_met() -> None:
    # synthetic summaries (not measured): replica 1.0x at both sizes, engines 2.0x at 2
    def cell(x: float) -> dict[str, float]:
        return {"median": x, "min": x, "max": x}

    def summary(ratio: float) -> dict[str, dict[str, float]]:
        return {"payload_ratio": cell(ratio), "total_ratio": cell(ratio + 0.1),
                "payload_set_bytes": cell(1000.0), "seconds": cell(0.5)}  # fmt: skip

    res = {
        "summary": {
            "engines-2": summary(2.0),
            "replica-1": summary(1.0),
            "replica-2": summary(1.0),
        },
        "goal_payload_ratio_1x": {"replica-1": True, "replica-2": True},
    }
    text = render(res)
    assert text.splitlines()[-1].endswith(": met")
    assert [ln.split()[0] for ln in text.splitlines()[2:5]] == ["engines", "replica", "replica"]
    res["goal_payload_ratio_1x"]["replica-2"] = False
    assert render(res).splitlines()[-1].endswith("NOT met")


def test_bench_fanout_is_registered() -> None:
    from dcr_tools import cli

    args = cli.build_parser().parse_args(
        ["bench", "fanout", "--receivers", "1,3", "--repeats", "2"]
    )
    assert args.func is cli.cmd_bench_fanout
    assert (args.receivers, args.repeats, args.json) == ("1,3", 2, None)
