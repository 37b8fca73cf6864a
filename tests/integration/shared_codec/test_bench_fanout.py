"""`dcr bench fanout`'s counting boundary (dcr_tools/bench/fanout.py `Boundary`) in front of a
real S3 endpoint (moto_server): it passes reads through unchanged and counts exactly the
payload-object bodies read through it, listings and other objects apart."""

from __future__ import annotations

import uuid

import pytest

from dcr_tools.bench.fanout import Boundary


@pytest.mark.s3
def test_boundary_counts_payload_bodies_apart_from_listings(moto_endpoint) -> None:
    import boto3

    endpoint = moto_endpoint
    bucket = f"b-{uuid.uuid4().hex[:8]}"
    direct = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1")
    direct.create_bucket(Bucket=bucket)
    direct.put_object(Bucket=bucket, Key="v1/a0/p.dcrp", Body=b"x" * 1000)
    direct.put_object(Bucket=bucket, Key="v1/a0/manifest.json", Body=b"{}" * 10)
    boundary = Boundary(endpoint)
    try:
        inside = boto3.client("s3", endpoint_url=boundary.url, region_name="us-east-1")
        assert inside.get_object(Bucket=bucket, Key="v1/a0/p.dcrp")["Body"].read() == (b"x" * 1000)
        assert boundary.read()[0] == 1000
        inside.get_object(Bucket=bucket, Key="v1/a0/manifest.json")["Body"].read()
        inside.list_objects_v2(Bucket=bucket, Prefix="v1/")
        payload, other = boundary.read()
        assert payload == 1000 and other > 20
    finally:
        boundary.stop()
