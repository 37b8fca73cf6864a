"""The `dcr` console script: help, versions, fixture writing, clear errors."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from dcr_tools.fixtures import canonical_shapes, spec_for
from dcr_tools.procs import PYTHON, base_env
from shared_codec.checkpoint import load_checkpoint

DCR = str(Path(PYTHON).with_name("dcr"))


def _dcr(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    # base_env puts this checkout first on PYTHONPATH (the console script's editable install
    # may point at another checkout)
    return subprocess.run(
        [DCR, *args], capture_output=True, text=True, timeout=timeout, env=base_env()
    )


def test_help_lists_commands() -> None:
    r = _dcr("--help")
    assert r.returncode == 0 and "version" in r.stdout and "fixture" in r.stdout
    assert _dcr().returncode == 2


def test_version_json() -> None:
    r = _dcr("version", "--json")
    assert r.returncode == 0, r.stderr
    info = json.loads(r.stdout)
    assert info["format_version"] == 2 and info["megatron-core"] == "0.16.1"
    assert info["vllm"].startswith("0.32.0")


def test_fixture_writes_checkpoint(tmp_path: Path) -> None:
    r = _dcr("fixture", "qwen3-moe", str(tmp_path / "m"), "--seed", "5")
    assert r.returncode == 0, r.stderr
    weights = load_checkpoint(tmp_path / "m")
    assert {n: tuple(t.shape) for n, t in weights.items()} == canonical_shapes(
        spec_for("qwen3-moe")
    )


def test_fixture_unknown_kind_is_rejected(tmp_path: Path) -> None:
    r = _dcr("fixture", "gpt2", str(tmp_path / "x"))
    assert r.returncode == 2 and "invalid choice" in r.stderr


def test_bench_codec_small_run_writes_json(tmp_path: Path) -> None:
    out = tmp_path / "codec.json"
    r = _dcr(
        "bench",
        "codec",
        "--json",
        str(out),
        "--table2-elements",
        "200000",
        "--payload-elements",
        "400000",
    )
    assert r.returncode == 0, r.stderr
    assert "Table 2" in r.stdout and "Full payload" in r.stdout and "Throughput" in r.stdout
    res = json.loads(out.read_text())
    assert [row["a"] for row in res["table2"]] == ["1e-4", "1e-3", "1e-2"]
    for row in res["table2"]:
        # XOR masks compress better than overwrites in both codings; byte planes beat plain words
        assert row["xor_mb"] < row["overwrite_mb"] and row["planes_xor_mb"] < row["xor_mb"]
    assert [row["rate"] for row in res["payload"]] == ["1%", "3%", "5%"]
    for row in res["payload"]:
        assert 0 < row["dcr_payload_bytes"] < row["paper_payload_bytes"] < row["checkpoint_bytes"]
    assert res["throughput"]["encode_mb_s"] > 0 and res["throughput"]["decode_mb_s"] > 0


def test_bench_construct_small_run_writes_json(tmp_path: Path) -> None:
    out = tmp_path / "construct.json"
    r = _dcr("bench", "construct", "--size", "small", "--json", str(out))
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(out.read_text())
    modes = {(row["rate"], row["mode"]) for row in res["rows"]}
    assert modes == {(rate, m) for rate in ("3%", "5%") for m in ("X", "P", "F")}
    by = {(row["rate"], row["mode"]): row for row in res["rows"]}
    for rate in ("3%", "5%"):
        # XOR masks compress better than overwrites of the same changed set
        assert by[(rate, "X")]["payload_bytes"] < by[(rate, "P")]["payload_bytes"]
        for m in ("X", "P"):  # against the run's read floor, and paired build by build
            row = by[(rate, m)]
            assert 0 < row["scan_efficiency"] and 0 < row["scan_efficiency_paired"]
            assert 0 < row["read_floor_s"] <= row["read_min_s"] <= row["read_max_s"]
    assert res["affine_share"] == 1.0


@pytest.mark.slow
@pytest.mark.megatron
def test_bench_affine_classifies_every_verified_family(tmp_path: Path) -> None:
    out = tmp_path / "affine.json"
    r = _dcr("bench", "affine", "--json", str(out), timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = {row["family"]: row for row in json.loads(out.read_text())["families"]}
    assert set(rows) == {
        "llama", "qwen2", "qwen3", "qwen3-moe", "gemma3", "deepseek-v3", "gpt-oss", "nemotron-h"
    }  # fmt: skip
    for fam, row in rows.items():
        assert row["dcr"]["tiny"]["affine_share"] == 1.0, fam
        assert row["dcr"]["published"]["affine_share"] == 1.0, fam
        residual = row["qkv_residual"]["residual_tensors"]
        if fam == "deepseek-v3":  # MLA has no fused QKV: nothing to force residual
            assert residual == [] and row["qkv_residual"]["published"]["affine_share"] == 1.0
            continue
        # Nemotron-H's attention lives under ``mixer`` (backbone.layers.N.mixer.q_proj)
        attn = (".self_attn.", ".mixer.")
        assert residual and all(any(a in n for a in attn) and "_proj." in n for n in residual)
        assert 0.8 < row["qkv_residual"]["published"]["affine_share"] < 1.0, fam
    assert any(n.endswith("q_proj.bias") for n in rows["qwen2"]["qkv_residual"]["residual_tensors"])


def _payload(tmp: Path, key: bytes | None = None) -> tuple[Path, list]:
    import torch

    from shared_codec.buckets import BucketConfig, encode_items
    from shared_codec.format import PayloadMeta
    from shared_codec.records import Kind, diff_tensors

    g = torch.Generator().manual_seed(3)
    old = torch.randn(64, 32, generator=g).to(torch.bfloat16)
    new = old.clone()
    new.view(-1)[::9] += 1
    items = [
        diff_tensors("a.weight", old, new, owner=1, kind=Kind.XOR),
        diff_tensors("b.weight", old, new, owner=1, kind=Kind.OVERWRITE),
    ]
    meta = PayloadMeta(version=4, base_version=3, attempt=2, owner=1, sequence=0)
    (data,) = encode_items(items, meta, BucketConfig(key=key))
    path = tmp / "p.dcrp"
    path.write_bytes(data)
    return path, items


def test_inspect_shows_header_items_and_checks_digest(tmp_path: Path) -> None:
    path, items = _payload(tmp_path)
    r = _dcr("inspect", str(path), "--json")
    assert r.returncode == 0, r.stderr
    info = json.loads(r.stdout)
    assert (info["base_version"], info["version"], info["attempt"], info["owner"]) == (3, 4, 2, 1)
    assert info["digest_check"] == "ok" and info["bytes"] == path.stat().st_size
    assert [(i["name"], i["kind"], i["count"]) for i in info["items"]] == [
        ("a.weight", "XOR", items[0].count),
        ("b.weight", "OVERWRITE", items[1].count),
    ]
    assert info["entries"] == items[0].count + items[1].count
    table = _dcr("inspect", str(path))
    assert table.returncode == 0 and "a.weight" in table.stdout and "digest ok" in table.stdout
    # a flipped byte: the header still shows, the digest check fails, exit status 1
    data = bytearray(path.read_bytes())
    data[-5] ^= 0x40
    path.write_bytes(bytes(data))
    bad = _dcr("inspect", str(path))
    assert bad.returncode == 1 and "digest FAILED" in bad.stdout and "mismatch" in bad.stdout


def test_inspect_keyed_payload_and_errors(tmp_path: Path) -> None:
    key = bytes(range(32))
    path, _ = _payload(tmp_path, key=key)
    assert _dcr("inspect", str(path), "--key", key.hex()).returncode == 0
    wrong = _dcr("inspect", str(path), "--key", "00" * 32)
    assert wrong.returncode == 1 and "digest FAILED" in wrong.stdout
    junk = tmp_path / "junk"
    junk.write_bytes(b"not a payload")
    r = _dcr("inspect", str(junk))
    assert r.returncode == 1 and "is not a DCR payload" in r.stderr
    missing = _dcr("inspect", str(tmp_path / "nope.dcrp"))
    assert missing.returncode == 2 and "cannot read" in missing.stderr


def test_demo_help() -> None:
    r = _dcr("demo", "--help")
    assert r.returncode == 0 and "--kill-every" in r.stdout and "--transport" in r.stdout
