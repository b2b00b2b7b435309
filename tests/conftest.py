"""Shared fixtures: a real S3 server, a separate boto3 client, and real ucfs mounts.

The S3 server is Ceph's RADOS Gateway started on loopback for the session (ucfs.testing.rgw), unless
UCFS_TEST_ENDPOINT names one (MinIO from docker/, or AWS); then the same tests run against that:

    UCFS_TEST_ENDPOINT=http://127.0.0.1:9000 UCFS_TEST_ACCESS_KEY=... UCFS_TEST_SECRET_KEY=... pytest

Each test gets its own key prefix and its own mountpoint and cache directory, and cleans up.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import urllib.parse
import uuid

import pytest

from tests.support import (Mount, ProxyStoreRequests, StoreRequests, delete_prefix, ensure_bucket, make_catalog,
                           proxy_unusable)
from ucfs.testing.faults import FaultProxy
from ucfs.testing.rgw import RGWServer, S3Endpoint


def pytest_collection_modifyitems(config, items):
    for item in items:
        path = str(item.fspath)
        if "/integration/" in path or "/torch/" in path:
            item.add_marker(pytest.mark.integration)


def _fuse_available() -> str | None:
    if not os.path.exists("/dev/fuse"):
        return "/dev/fuse is missing"
    if not (shutil.which("fusermount3") or shutil.which("fusermount")):
        return "fusermount3 is not installed (apt-get install fuse3)"
    return None


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory):
    """(endpoint, RGWServer or None): the server is None when the endpoint came from the environment."""
    url = os.environ.get("UCFS_TEST_ENDPOINT")
    if url:
        yield S3Endpoint(url, os.environ.get("UCFS_TEST_ACCESS_KEY") or os.environ["AWS_ACCESS_KEY_ID"],
                         os.environ.get("UCFS_TEST_SECRET_KEY") or os.environ["AWS_SECRET_ACCESS_KEY"],
                         os.environ.get("UCFS_TEST_REGION", "us-east-1")), None
        return
    # The ops log lets tests count requests by kind (a GET, not a HEAD) on the server itself.
    server = RGWServer(str(tmp_path_factory.mktemp("rgw")), ops_log=True)
    endpoint = server.start()
    try:
        yield endpoint, server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def s3_endpoint(s3_server) -> S3Endpoint:
    return s3_server[0]


@pytest.fixture(scope="session")
def rgw(s3_server) -> RGWServer | None:
    """The test RGW (for server-side request counters), or None against an external endpoint."""
    return s3_server[1]


@pytest.fixture(scope="session")
def s3(s3_endpoint):
    """A boto3 client of our own, to check what reached the store (not the one ucfs uses)."""
    import boto3
    import botocore.config

    return boto3.client("s3", endpoint_url=s3_endpoint.url, aws_access_key_id=s3_endpoint.access_key,
                        aws_secret_access_key=s3_endpoint.secret_key, region_name=s3_endpoint.region,
                        config=botocore.config.Config(
                            s3={"addressing_style": "path"}, max_pool_connections=32,
                            request_checksum_calculation="when_required",
                            response_checksum_validation="when_required"))


@pytest.fixture(scope="session")
def bucket(s3, s3_endpoint) -> str:
    name = os.environ.get("UCFS_TEST_BUCKET", "ucfs-test")
    ensure_bucket(s3, name, s3_endpoint.region)
    return name


@pytest.fixture
def prefix(s3, bucket, request) -> str:
    """A key prefix of this test's own, removed afterwards."""
    p = f"t-{uuid.uuid4().hex[:10]}"
    yield p
    delete_prefix(s3, bucket, p + "/")


@pytest.fixture
def store_requests(rgw, s3_endpoint, bucket, prefix):
    """Counts what reached the S3 server (tests.support.StoreRequests): the suite's RGW itself, or a
    counting loopback proxy in front of an endpoint from the environment. A test that asks for it
    mounts through `store_requests.endpoint` (mount_factory's default then)."""
    if rgw is not None:
        yield StoreRequests(rgw, s3_endpoint, bucket, prefix)
        return
    if (why := proxy_unusable(s3_endpoint)) is not None:
        pytest.skip(f"counts requests at the server: {why}")
    u = urllib.parse.urlsplit(s3_endpoint.url)
    with FaultProxy(u.hostname, u.port or 80) as proxy:
        yield ProxyStoreRequests(proxy, dataclasses.replace(s3_endpoint, url=proxy.url), bucket, prefix)


@pytest.fixture
def mount_factory(tmp_path, s3_endpoint, bucket, prefix, request):
    """Start mounts of this test's prefix: mount_factory(volumes=None, args=(), name='m').
    `open_files`: the soft limit on open files the daemon starts with.

    `endpoint` puts something else in the catalog (a fault-injecting proxy in front of the server).
    In a test that asks for `store_requests`, the default is that fixture's endpoint, so that what
    the mount asks of the store is counted."""
    if (why := _fuse_available()) is not None:
        pytest.fail(f"FUSE is required for integration tests: {why}")
    if "store_requests" in request.fixturenames:
        s3_endpoint = request.getfixturevalue("store_requests").endpoint
    mounts: list[Mount] = []

    def factory(volumes: dict[str, dict] | None = None, args: tuple[str, ...] = (), name: str = "m",
                start: bool = True, endpoint: S3Endpoint | None = None, root=None,
                open_files: int | None = None) -> Mount:
        volumes = volumes or {"test.s.vol": {"prefix": f"{prefix}/vol"}}
        ep = endpoint or s3_endpoint
        m = Mount(root or tmp_path / name, ep, make_catalog(ep, bucket, volumes), tuple(args),
                  open_files=open_files)
        mounts.append(m)
        return m.start() if start else m

    yield factory
    for m in mounts:
        try:
            m.stop(wait=True, timeout=60)
        except Exception:
            m.kill()


@pytest.fixture
def mount(mount_factory) -> Mount:
    return mount_factory()


@pytest.fixture
def fault_proxy(s3_endpoint):
    """A FaultProxy in front of the S3 server; `fault_proxy.endpoint` is the endpoint to mount through
    (mount_factory(endpoint=fault_proxy.endpoint)). Rules are removed when the test ends."""
    if (why := proxy_unusable(s3_endpoint)) is not None:
        pytest.skip(f"injects faults through a proxy: {why}")
    u = urllib.parse.urlsplit(s3_endpoint.url)
    with FaultProxy(u.hostname, u.port or 80, seed=5) as proxy:
        proxy.endpoint = dataclasses.replace(s3_endpoint, url=proxy.url)
        yield proxy
