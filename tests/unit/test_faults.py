"""The fault-injection tooling itself: FaultProxy against a tiny HTTP server, FaultyStore against the
in-memory store. The mount's behaviour under these faults is tested in tests/integration/test_faults.py;
here we make sure each fault is what it says it is, so those tests mean something.
"""

from __future__ import annotations

import errno
import http.client
import http.server
import os
import threading
import time

import pytest
import trio

from ucfs import commit as commit_mod
from ucfs import errors
from ucfs.aiostore import AsyncStore
from ucfs.cache import BlockCache, ObjectVersion
from ucfs.config import MiB, MountConfig
from ucfs.prefetch import MemoryBudget, ObjectReader
from ucfs.store import MemoryStore
from ucfs.testing.faults import (FaultProxy, FaultyStore, access_denied, connection_reset, internal_error,
                                 slow_down)

from tests.support import open_core

BODY = bytes(range(256)) * 4096  # 1 MiB, as the test server's only object


class _Handler(http.server.BaseHTTPRequestHandler):
    """GET/HEAD /obj -> BODY; PUT stores the body and echoes its length; every request is counted."""

    protocol_version = "HTTP/1.1"  # keep-alive, as S3 servers do

    def log_message(self, *args) -> None:
        pass

    def _count(self) -> None:
        with self.server.lock:
            self.server.seen.append((self.command, self.path))

    def do_GET(self) -> None:
        self._count()
        self.send_response(200)
        self.send_header("Content-Length", str(len(BODY)))
        self.send_header("ETag", '"abc"')
        self.end_headers()
        self.wfile.write(BODY)

    def do_HEAD(self) -> None:
        self._count()
        self.send_response(200)
        self.send_header("Content-Length", str(len(BODY)))
        self.end_headers()

    def do_PUT(self) -> None:
        n = int(self.headers["Content-Length"])
        data = self.rfile.read(n)
        self._count()
        self.server.stored[self.path] = data
        reply = str(len(data)).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(reply)))
        self.end_headers()
        self.wfile.write(reply)


@pytest.fixture
def upstream():
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    srv.daemon_threads = True
    srv.handle_error = lambda *args: None  # resets are the point here, not worth a traceback
    srv.lock = threading.Lock()
    srv.seen = []
    srv.stored = {}
    t = threading.Thread(target=srv.serve_forever, args=(0.05,), daemon=True)
    t.start()
    yield srv
    srv.shutdown()
    srv.server_close()


@pytest.fixture
def proxy(upstream):
    with FaultProxy("127.0.0.1", upstream.server_address[1], seed=1) as p:
        yield p


def conn(proxy, timeout=10.0) -> http.client.HTTPConnection:
    return http.client.HTTPConnection("127.0.0.1", proxy.port, timeout=timeout)


def get(c, path="/obj") -> tuple[int, bytes]:
    c.request("GET", path)
    r = c.getresponse()
    return r.status, r.read()


def test_requests_pass_through_on_one_keep_alive_connection(proxy, upstream):
    c = conn(proxy)
    for _ in range(3):
        assert get(c) == (200, BODY)
    c.request("HEAD", "/obj")
    r = c.getresponse()
    assert r.status == 200 and r.read() == b"" and r.getheader("Content-Length") == str(len(BODY))
    c.request("PUT", "/k", body=b"x" * 100_000)
    assert c.getresponse().read() == b"100000"
    assert upstream.stored["/k"] == b"x" * 100_000
    assert proxy.statistics()["connections"] == 1
    assert proxy.statistics()["requests"] == 5


def test_a_forwarded_request_is_in_the_log_before_its_answer_reaches_the_client(proxy):
    """Tests count requests in `proxy.log` as soon as their own call returned (a HEAD last of all)."""
    c = conn(proxy)
    for i in range(200):
        c.request("HEAD", f"/obj?{i}")
        c.getresponse().read()
        assert len(proxy.log) == i + 1 and proxy.log[-1] == ("HEAD", f"/obj?{i}", "200"), i


def test_error_responses_are_answered_without_the_server(proxy, upstream):
    rule = proxy.fail(503, method="GET", path=r"^/obj", times=2)
    c = conn(proxy)
    for _ in range(2):
        c.request("GET", "/obj")
        r = c.getresponse()
        body = r.read()
        assert r.status == 503 and b"<Code>SlowDown</Code>" in body
    assert get(c) == (200, BODY)  # the same connection carries on
    assert rule.fired == 2 and len(upstream.seen) == 1
    # A PUT answered with 500 has its body read away, so the connection stays usable.
    proxy.fail(500, method="PUT", times=1)
    c.request("PUT", "/k", body=b"y" * 300_000)
    r = c.getresponse()
    assert r.status == 500 and b"InternalError" in r.read()
    assert "/k" not in upstream.stored
    assert get(c) == (200, BODY)
    assert proxy.faults["status_503"] == 2 and proxy.faults["status_500"] == 1


def test_reset_before_and_after_the_server_answers(proxy, upstream):
    proxy.reset(method="PUT", path="/before", times=1)
    proxy.reset(method="PUT", path="/after", times=1, after_response=True)
    c = conn(proxy)
    with pytest.raises((ConnectionError, http.client.HTTPException)):
        c.request("PUT", "/before", body=b"1")
        c.getresponse().read()
    assert "/before" not in upstream.stored  # never reached the server
    c = conn(proxy)
    with pytest.raises((ConnectionError, http.client.HTTPException)):
        c.request("PUT", "/after", body=b"2")
        c.getresponse().read()
    assert upstream.stored["/after"] == b"2"  # done, but the client cannot know


def test_stall_holds_the_response_back(proxy):
    proxy.stall(1.0, method="GET", times=1)
    c = conn(proxy)
    t0 = time.monotonic()
    assert get(c) == (200, BODY)
    assert time.monotonic() - t0 >= 0.9
    # A client with a shorter timeout gives up, as the mount does with --store-timeout.
    proxy.stall(3.0, method="GET", times=1, after_bytes=1000)
    c = conn(proxy, timeout=0.5)
    c.request("GET", "/obj")
    r = c.getresponse()
    with pytest.raises(TimeoutError):
        r.read()


@pytest.mark.parametrize("end", ["close", "reset"])
def test_truncated_body_is_shorter_than_its_content_length(proxy, end):
    proxy.truncate(12345, method="GET", times=1, end=end)
    c = conn(proxy)
    c.request("GET", "/obj")
    r = c.getresponse()
    assert r.getheader("Content-Length") == str(len(BODY))
    with pytest.raises((http.client.IncompleteRead, ConnectionError)) as e:
        r.read()
    if isinstance(e.value, http.client.IncompleteRead):
        assert len(e.value.partial) == 12345
    assert get(conn(proxy)) == (200, BODY)  # only one was hit


def test_outage_resets_open_and_new_connections_until_it_ends(proxy):
    idle = conn(proxy)
    assert get(idle) == (200, BODY)  # a pooled keep-alive connection
    proxy.outage(1.0)
    for c in (idle, conn(proxy)):
        with pytest.raises((ConnectionError, http.client.HTTPException)):
            get(c)
    time.sleep(1.1)
    assert get(conn(proxy)) == (200, BODY)
    assert proxy.faults["outages"] == 1 and proxy.faults["outage_resets"] >= 2


def test_probability_and_switching_rules_off(proxy):
    rule = proxy.fail(500, method="GET", probability=0.5)
    c = conn(proxy)
    statuses = [get(c)[0] for _ in range(60)]
    assert 10 <= statuses.count(500) <= 50 and rule.fired == statuses.count(500)
    rule.disable()
    assert all(get(c)[0] == 200 for _ in range(10))


def test_faulty_store_errors_and_short_reads():
    inner = MemoryStore()
    inner.put_bytes("b", "k", b"0123456789")
    s = FaultyStore(inner)
    s.fail("get", slow_down, times=2)
    for _ in range(2):
        with pytest.raises(errors.StoreError) as e:
            s.get("b", "k")
        assert e.value.transient and e.value.code == "SlowDown"
    assert s.get("b", "k")[0] == b"0123456789"
    s.short(4, times=1)
    assert s.get("b", "k", 2, 6)[0] == b"2345"
    s.fail(("put", "upload_part"), access_denied, key=r"^secret/")
    with pytest.raises(errors.StoreError) as e:
        s.put("b", "secret/x", b"1", 1)
    assert e.value.errno == errno.EACCES and not e.value.transient
    s.put("b", "public/x", b"1", 1)
    assert s.statistics()["injected_get"] == 2 and s.statistics()["injected_short"] == 1


# --------------------------------------------------------------------------------------------------
# The file system's own layers under FaultyStore: reads and commits, without a kernel or a network.


def test_reads_through_faults_are_right_or_eio_and_a_failure_is_not_remembered(tmp_path):
    inner = MemoryStore()
    data = os.urandom(3 * MiB + 5)
    info = inner.put_bytes("b", "k", data)
    store = FaultyStore(inner)
    cfg = MountConfig(cache_dir=tmp_path / "cache")
    cache = BlockCache(tmp_path / "cache", size_bytes=1 << 30, free_floor_bytes=0, block_bytes=cfg.block_bytes)

    async def main():
        async with trio.open_nursery() as n:
            def reader():
                return ObjectReader(store=AsyncStore(store, 4), bucket="b", key="k",
                                    version=ObjectVersion("mem", "b", "k", info.etag), size=len(data),
                                    cache=cache, budget=MemoryBudget(cfg.readahead_budget_bytes), cfg=cfg,
                                    nursery=n)
            # A store error reaches the reader as EIO (the store's own retries are spent by then).
            store.fail("get", internal_error, times=1)
            r = reader()
            with pytest.raises(OSError) as e:
                await r.read(0, MiB)
            assert e.value.errno == errno.EIO
            assert bytes(await r.read(0, MiB)) == data[:MiB]  # tried again, not remembered
            r.close()
            # A GET that comes back short is an error, never a short read or other bytes.
            store.short(1000, times=1)
            r = reader()
            with pytest.raises(OSError) as e:
                await r.read(2 * MiB, MiB)
            assert e.value.errno == errno.EIO
            assert bytes(await r.read(2 * MiB, 2 * MiB)) == data[2 * MiB:]
            r.close()
            n.cancel_scope.cancel()

    trio.run(main)
    assert store.injected["get"] == 1 and store.injected["short"] == 1


def test_commits_retry_transient_faults_and_report_permanent_ones(tmp_path, monkeypatch):
    monkeypatch.setattr(commit_mod, "RETRY_FIRST_S", 0.01)  # keep the backoff short for the test
    inner = MemoryStore()
    inner.buckets["bucket"] = {}
    store = FaultyStore(inner)
    (tmp_path / "state").mkdir(mode=0o700)
    cfg = MountConfig(cache_dir=tmp_path / "state" / "cache")

    async def write(core, vol, name, data):
        fh, _ = await core.create(vol, name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        await core.write(fh, 0, data)
        await core.flush(fh)
        return fh

    async def main():
        async with trio.open_nursery() as n:
            core, committer, vol = await open_core(tmp_path, store, n, cfg)
            # Transient: slow-downs, resets and 500s, several in a row; fsync waits them out.
            store.fail("put", slow_down, times=2)
            store.fail("put", connection_reset, times=1)
            store.fail("put", internal_error, times=1)
            fh = await write(core, vol, "t.bin", b"transient")
            await core.fsync(fh)
            await core.release(fh)
            assert inner.get("bucket", "pfx/t.bin")[0] == b"transient"
            # fsync tries to commit at once; that first failure sends the file to the workers' retries.
            st = committer.statistics()
            assert st["in_place_fallbacks"] == 1 and st["retries"] == 3
            # Permanent: reported by fsync (and status), the data kept; fixed, the next fsync commits.
            rule = store.fail("put", access_denied, key="p.bin")
            fh = await write(core, vol, "p.bin", b"permanent")
            with pytest.raises(OSError) as e:
                await core.fsync(fh)
            assert e.value.errno == errno.EACCES
            st = committer.statistics()
            assert st["failed"] == 1 and st["items"][0]["state"] == "failed"
            assert "AccessDenied" in st["items"][0]["error"]
            rule.disable()
            await core.fsync(fh)
            await core.release(fh)
            assert inner.get("bucket", "pfx/p.bin")[0] == b"permanent"
            assert committer.statistics()["pending"] == 0
            await committer.shutdown(drain=True)
            n.cancel_scope.cancel()

    trio.run(main)
