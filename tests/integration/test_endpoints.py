"""Endpoints other than plain HTTP on an IPv4 address: https with a certificate the host trusts
through AWS_CA_BUNDLE (as for AWS, or MinIO with TLS), an IPv6 address, and an egress proxy named
by HTTPS_PROXY / HTTP_PROXY. Each is put in front of the suite's S3 server on loopback, and the
mount reads and writes through it."""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import hashlib
import os
import socket
import subprocess
import urllib.parse

import pytest

from tests.support import ForwardProxy, TLSFront, make_catalog, mount_refused, obj, proxy_unusable
from ucfs.testing.proxy import LatencyProxy

MiB = 1 << 20


def _front_of(s3_endpoint) -> tuple[str, int]:
    if (why := proxy_unusable(s3_endpoint)) is not None:
        pytest.skip(why)
    u = urllib.parse.urlsplit(s3_endpoint.url)
    return u.hostname, u.port or 80


def test_an_https_endpoint_reads_and_writes(mount_factory, s3_endpoint, s3, bucket, prefix, tmp_path, monkeypatch):
    """Every request goes over TLS: listing, ranged GETs into pooled buffers (no MSG_WAITALL on a TLS
    socket), a multipart upload read from the staging file (no sendfile), small PUTs."""
    with TLSFront(*_front_of(s3_endpoint), tmp_path) as tls:
        monkeypatch.setenv("AWS_CA_BUNDLE", str(tls.ca))  # the mount's environment trusts it
        big = os.urandom(40 * MiB + 5)
        s3.put_object(Bucket=bucket, Key=f"{prefix}/vol/d/big.bin", Body=big)
        s3.put_object(Bucket=bucket, Key=f"{prefix}/vol/d/small.txt", Body=b"small")
        m = mount_factory(endpoint=dataclasses.replace(s3_endpoint, url=tls.url))
        v = m.path()
        assert sorted(os.listdir(v / "d")) == ["big.bin", "small.txt"]
        out = subprocess.run(["sha256sum", str(v / "d" / "big.bin")], capture_output=True, text=True, check=True)
        assert out.stdout.split()[0] == hashlib.sha256(big).hexdigest()
        assert (v / "d" / "small.txt").read_bytes() == b"small"
        written = os.urandom(24 * MiB + 7)
        for name, data in (("up.bin", written), ("note.txt", b"over tls")):
            with open(v / name, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
        assert obj(s3, bucket, f"{prefix}/vol/up.bin") == written
        assert obj(s3, bucket, f"{prefix}/vol/note.txt") == b"over tls"
        st = m.store_stats()
        assert st.get("upload_part", 0) >= 2 and st.get("get", 0) >= 2, st
        assert st.get("errors", 0) == 0, st
        m.stop()


def test_an_https_endpoint_with_an_untrusted_certificate_is_one_message(s3_endpoint, bucket, tmp_path):
    """It was taken for a broken connection: retried four times, a log line each, then "store at
    <url> unreachable: ... cannot connect ... CERTIFICATE_VERIFY_FAILED"."""
    with TLSFront(*_front_of(s3_endpoint), tmp_path) as tls:
        cat = tmp_path / "catalog.toml"
        cat.write_text(make_catalog(dataclasses.replace(s3_endpoint, url=tls.url), bucket,
                                    {"a.b.c": {"prefix": "x"}}))
        env = dict(os.environ, AWS_ACCESS_KEY_ID=s3_endpoint.access_key,
                   AWS_SECRET_ACCESS_KEY=s3_endpoint.secret_key, AWS_EC2_METADATA_DISABLED="true")
        env.pop("AWS_CA_BUNDLE", None)  # the system's authorities only: the throw-away one is not among them
        r = mount_refused(tmp_path, cat, env=env)
    assert r.returncode == 1, (r.returncode, r.stderr[-800:])
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ucfs: volume a.b.c: "), r.stderr[-800:]
    # Said once, at once: no retries (nothing else on stderr), since no retry can change it.
    assert f"TLS certificate of 127.0.0.1:{tls.port} not trusted" in lines[0], lines[0]
    assert "AWS_CA_BUNDLE" in lines[0], lines[0]
    assert not os.path.ismount(tmp_path / "mnt")


def test_an_endpoint_given_by_ipv6_address_works(mount_factory, s3_endpoint, s3, bucket, prefix):
    """A catalog endpoint written http://[::1]:port: reads and writes through a loopback proxy that
    listens on IPv6 only. (RGW also took the unbracketed "Host: ::1:port" the lean client sent
    before; the bracketing itself is checked in tests/unit/test_s3http.py.)"""
    host, port = _front_of(s3_endpoint)
    try:
        socket.socket(socket.AF_INET6).close()
        socket.getaddrinfo("::1", 0, socket.AF_INET6)
    except OSError as e:
        pytest.skip(f"no IPv6 loopback here: {e}")
    proxy = LatencyProxy(host, port, delay_ms=0, listen_host="::1").start()
    try:
        assert proxy.url.startswith("http://[::1]:")
        s3.put_object(Bucket=bucket, Key=f"{prefix}/vol/there.bin", Body=b"from the store")
        m = mount_factory(endpoint=dataclasses.replace(s3_endpoint, url=proxy.url))
        assert (m.path() / "there.bin").read_bytes() == b"from the store"
        with open(m.path() / "here.bin", "wb") as f:
            f.write(b"from the mount")
            f.flush()
            os.fsync(f.fileno())
        assert obj(s3, bucket, f"{prefix}/vol/here.bin") == b"from the mount"
        assert m.store_stats().get("errors", 0) == 0
        m.stop()
    finally:
        proxy.stop()


@pytest.mark.parametrize("scheme", ["https", "http"])
def test_requests_go_through_the_proxy_the_environment_names(mount_factory, s3_endpoint, s3, bucket, prefix,
                                                            tmp_path, scheme):
    """Hosts whose only way out is an egress proxy name it in HTTPS_PROXY / HTTP_PROXY, and boto3
    follows it; ucfs's own S3 client ignored it and connected directly (to time out, on such a host).
    https goes through a CONNECT tunnel, http as requests naming the whole URL; the proxy's
    credentials come from its URL."""
    host, port = _front_of(s3_endpoint)
    with contextlib.ExitStack() as stack:
        env = {"NO_PROXY": "", "no_proxy": ""}
        if scheme == "https":
            tls = stack.enter_context(TLSFront(host, port, tmp_path))
            endpoint, authority = dataclasses.replace(s3_endpoint, url=tls.url), f"127.0.0.1:{tls.port}"
            env["AWS_CA_BUNDLE"] = str(tls.ca)
        else:
            endpoint, authority = s3_endpoint, f"{host}:{port}"
        proxy = stack.enter_context(ForwardProxy())
        env["HTTPS_PROXY" if scheme == "https" else "HTTP_PROXY"] = (
            proxy.url.replace("http://", "http://ml-job:p%40ss@"))
        s3.put_object(Bucket=bucket, Key=f"{prefix}/vol/in.bin", Body=b"through the proxy")
        m = mount_factory(endpoint=endpoint, start=False)
        m.extra_env = env
        m.start()
        assert (m.path() / "in.bin").read_bytes() == b"through the proxy"
        with open(m.path() / "out.bin", "wb") as f:
            f.write(b"out through the proxy")
            f.flush()
            os.fsync(f.fileno())
        m.stop()
        assert obj(s3, bucket, f"{prefix}/vol/out.bin") == b"out through the proxy"
    assert proxy.requests, "nothing went through the proxy"
    if scheme == "https":
        assert all(r == f"CONNECT {authority} HTTP/1.1" for r in proxy.requests), proxy.requests
    else:
        assert all(r.split(" ")[1].startswith(f"http://{authority}/") for r in proxy.requests), proxy.requests
    assert set(proxy.auth) == {"Basic " + base64.b64encode(b"ml-job:p@ss").decode()}, proxy.auth
