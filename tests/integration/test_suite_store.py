"""The suite's own store helpers, against whichever S3 server the suite runs on (its RGW, or the
endpoint UCFS_TEST_ENDPOINT names): what a test leaves behind is removed, and request counts that
tests compare with the mount's own figures count what reached the server (RGW's own counters, or a
loopback proxy in front of an endpoint from the environment)."""

from __future__ import annotations

import dataclasses
import shutil
import subprocess
import urllib.parse

import boto3
import botocore.config
import pytest

from tests.support import ProxyStoreRequests, delete_prefix, ensure_bucket, keys, proxy_unusable, wait_until
from ucfs.testing.rgw import RGWServer, S3Endpoint
from ucfs.testing.faults import FaultProxy


def client(endpoint):
    return boto3.client("s3", endpoint_url=endpoint.url, aws_access_key_id=endpoint.access_key,
                        aws_secret_access_key=endpoint.secret_key, region_name=endpoint.region,
                        config=botocore.config.Config(s3={"addressing_style": "path"},
                                                      request_checksum_calculation="when_required",
                                                      response_checksum_validation="when_required"))


def open_uploads(s3, bucket, prefix) -> list[str]:
    return [u["UploadId"] for page in s3.get_paginator("list_multipart_uploads").paginate(Bucket=bucket, Prefix=prefix)
            for u in page.get("Uploads", ())]


def test_delete_prefix_removes_objects_and_open_uploads_under_it_only(s3, bucket, prefix):
    s3.put_object(Bucket=bucket, Key=f"{prefix}/a/x", Body=b"x")
    big = f"{prefix}/a/big"
    left = s3.create_multipart_upload(Bucket=bucket, Key=big)["UploadId"]
    s3.upload_part(Bucket=bucket, Key=big, UploadId=left, PartNumber=1, Body=b"p" * 4096)
    kept = s3.create_multipart_upload(Bucket=bucket, Key=f"{prefix}/b/big")["UploadId"]
    s3.put_object(Bucket=bucket, Key=f"{prefix}/b/y", Body=b"y")
    delete_prefix(s3, bucket, f"{prefix}/a/")
    assert keys(s3, bucket, f"{prefix}/") == [f"{prefix}/b/y"]
    assert open_uploads(s3, bucket, f"{prefix}/") == [kept]
    delete_prefix(s3, bucket, f"{prefix}/")  # what the `prefix` fixture does when a test ends
    assert keys(s3, bucket, f"{prefix}/") == [] and open_uploads(s3, bucket, f"{prefix}/") == []


def test_an_https_endpoint_has_no_loopback_proxy_and_says_why():
    # The proxy would send plain HTTP to port 80 (or to the TLS port) of a server that wants TLS.
    assert "https" in proxy_unusable(S3Endpoint("https://s3.eu-west-1.amazonaws.com", "k", "s", "eu-west-1"))
    assert proxy_unusable(S3Endpoint("http://127.0.0.1:9000", "k", "s")) is None


def test_a_counting_proxy_counts_object_gets_and_heads(s3_endpoint, s3, bucket, prefix):
    if (why := proxy_unusable(s3_endpoint)) is not None:
        pytest.skip(why)
    u = urllib.parse.urlsplit(s3_endpoint.url)
    s3.put_object(Bucket=bucket, Key=f"{prefix}/vol/a", Body=b"a")
    s3.put_object(Bucket=bucket, Key=f"{prefix}/other", Body=b"o")
    with FaultProxy(u.hostname, u.port or 80) as proxy:
        ep = dataclasses.replace(s3_endpoint, url=proxy.url)
        counted = ProxyStoreRequests(proxy, ep, bucket, f"{prefix}/vol/")
        c = client(ep)
        assert (counted.object_gets(), counted.gets_and_heads()) == (0, 0)
        assert c.get_object(Bucket=bucket, Key=f"{prefix}/vol/a")["Body"].read() == b"a"
        c.head_object(Bucket=bucket, Key=f"{prefix}/vol/a")
        with pytest.raises(c.exceptions.ClientError):
            c.head_object(Bucket=bucket, Key=f"{prefix}/vol/missing")  # found nothing: not a HEAD served
        c.get_object(Bucket=bucket, Key=f"{prefix}/other")["Body"].read()  # not under the prefix
        c.list_objects_v2(Bucket=bucket, Prefix=f"{prefix}/vol/")  # a listing, not an object
        assert counted.object_gets() == 1
        assert counted.gets_and_heads() == 3


def test_store_requests_counts_what_reaches_the_server_and_mounts_go_through_it(store_requests, mount_factory,
                                                                               s3, bucket, prefix):
    m = mount_factory(start=False)
    assert m.endpoint == store_requests.endpoint  # what the test mounts is counted
    s3.put_object(Bucket=bucket, Key=f"{prefix}/vol/a", Body=b"a")
    c = client(store_requests.endpoint)
    gets, both = store_requests.object_gets(), store_requests.gets_and_heads()
    c.get_object(Bucket=bucket, Key=f"{prefix}/vol/a")["Body"].read()
    c.get_object(Bucket=bucket, Key=f"{prefix}/vol/a")["Body"].read()
    c.head_object(Bucket=bucket, Key=f"{prefix}/vol/a")
    with pytest.raises(c.exceptions.ClientError):
        c.head_object(Bucket=bucket, Key=f"{prefix}/vol/missing")  # as a mount's lookup of a directory
    # RGW writes an ops-log line a few ms after its answer.
    assert wait_until(lambda: store_requests.object_gets() - gets == 2, 5), store_requests.object_gets() - gets
    assert store_requests.gets_and_heads() - both == 3


def stubbed_client(region):
    from botocore.stub import Stubber

    c = boto3.client("s3", region_name=region, aws_access_key_id="k", aws_secret_access_key="s")
    return c, Stubber(c)


def test_the_test_bucket_is_made_in_the_endpoints_region_and_a_foreign_one_is_named():
    # Outside us-east-1 AWS refuses a CreateBucket that names no region.
    c, stub = stubbed_client("eu-west-1")
    stub.add_client_error("head_bucket", http_status_code=404, expected_params={"Bucket": "b"})
    stub.add_response("create_bucket", {}, {"Bucket": "b",
                                            "CreateBucketConfiguration": {"LocationConstraint": "eu-west-1"}})
    with stub:
        ensure_bucket(c, "b", "eu-west-1")
    stub.assert_no_pending_responses()
    c, stub = stubbed_client("us-east-1")
    stub.add_client_error("head_bucket", http_status_code=404, expected_params={"Bucket": "b"})
    stub.add_response("create_bucket", {}, {"Bucket": "b"})
    with stub:
        ensure_bucket(c, "b", "us-east-1")
    stub.assert_no_pending_responses()
    # A name someone else owns: one message that says what to do, not AccessDenied in every test.
    c, stub = stubbed_client("us-east-1")
    stub.add_client_error("head_bucket", http_status_code=403, expected_params={"Bucket": "ucfs-test"})
    with stub, pytest.raises(RuntimeError, match="UCFS_TEST_BUCKET"):
        ensure_bucket(c, "ucfs-test", "us-east-1")


def test_the_test_server_starts_on_a_disk_with_under_one_percent_free(tmp_path):
    """The RGW fixture's cluster lives on the test host's disk. Its monitor judged free space in whole
    percent, and with under 1 % free (a nearly full shared disk) it refused to start, and with it
    every integration test. A sparse 200 GiB ext4 on a loop device, filled by fallocate to leave
    about 600 MiB (0.3 %), stands in for such a disk."""
    if shutil.which("radosgw") is None or shutil.which("mkfs.ext4") is None:
        pytest.skip("radosgw or mkfs.ext4 is not installed (the suite runs on an endpoint it was given)")
    image, disk = tmp_path / "disk.img", tmp_path / "disk"
    disk.mkdir()
    with open(image, "wb") as f:
        f.truncate(200 << 30)
    subprocess.run(["mkfs.ext4", "-q", "-F", "-m", "0", "-E", "lazy_itable_init=1,lazy_journal_init=1",
                    str(image)], check=True, capture_output=True)
    r = subprocess.run(["mount", "-o", "loop", str(image), str(disk)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a loop device here: {r.stderr.strip()}")
    try:
        free = shutil.disk_usage(disk).free
        subprocess.run(["fallocate", "-l", str(free - (600 << 20)), str(disk / "filler")], check=True)
        usage = shutil.disk_usage(disk)
        assert usage.free * 100 // usage.total == 0, usage
        server = RGWServer(str(disk / "rgw"), memstore_bytes=256 << 20)
        endpoint = server.start()
        try:
            s3 = client(endpoint)
            s3.create_bucket(Bucket="nearly-full")
            s3.put_object(Bucket="nearly-full", Key="k", Body=b"still served")
            assert s3.get_object(Bucket="nearly-full", Key="k")["Body"].read() == b"still served"
        finally:
            server.stop()
    finally:
        subprocess.run(["umount", "-l", str(disk)], capture_output=True)
