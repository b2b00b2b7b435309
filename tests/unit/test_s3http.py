"""The hand-written SigV4 signer must agree with botocore's byte for byte."""

from __future__ import annotations

import datetime
import http.server
import os
import socket
import threading
import time

import botocore.auth
import botocore.awsrequest
import botocore.credentials
import pytest

from ucfs import errors
from ucfs.s3http import (Credentials, FileBody, LeanClient, Signer, SourceShort, canonical_query, embedded_error,
                         parse_error, parse_list, proxy_for, uri_encode_path, xml_text)
from ucfs.store import S3Store


@pytest.mark.parametrize("key", ["plain.bin", "dir/sub dir/naïve+file (1).txt", "a%2Fb~c", "日本/データ"])
@pytest.mark.parametrize("token", [None, "FwoGZXIvYXdzEJr//////////session"])
def test_signature_matches_botocore(key, token, monkeypatch):
    now = datetime.datetime(2026, 11, 29, 12, 0, 0, tzinfo=datetime.timezone.utc)
    creds = Credentials("AKIDEXAMPLE", "wJalrXUtnFEMI/K7MDENG+bPxRfiCYEXAMPLEKEY", token)
    host = "127.0.0.1:9000"
    path = uri_encode_path(f"/bucket/{key}")
    ours = Signer("us-east-1").headers("GET", host, path, "", creds, now=now)

    req = botocore.awsrequest.AWSRequest(method="GET", url=f"http://{host}{path}")
    bc = botocore.credentials.Credentials(creds.access_key, creds.secret_key, token)
    signer = botocore.auth.S3SigV4Auth(bc, "s3", "us-east-1")
    monkeypatch.setattr(botocore.auth, "get_current_datetime", lambda *a, **k: now.replace(tzinfo=None))
    signer.add_auth(req)
    assert ours["authorization"] == req.headers["Authorization"]


def test_parse_error_document():
    body = (b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>NoSuchKey</Code>'
            b"<Message>The specified key does not exist.</Message><RequestId>tx0001</RequestId></Error>")
    assert parse_error(body) == ("NoSuchKey", "The specified key does not exist.", "tx0001")
    assert parse_error(b"not xml") == ("", "", "")


def test_signature_with_query_matches_botocore(monkeypatch):
    """ListObjectsV2 goes through the lean client too: its canonical query must match."""
    now = datetime.datetime(2026, 11, 29, 12, 0, 0, tzinfo=datetime.timezone.utc)
    creds = Credentials("AKIDEXAMPLE", "wJalrXUtnFEMI/K7MDENG+bPxRfiCYEXAMPLEKEY")
    query = {"list-type": "2", "prefix": "dir/sub dir/ü+x", "delimiter": "/", "max-keys": "1000",
             "continuation-token": "1/a+b=="}
    qs = canonical_query(query)
    host = "127.0.0.1:9000"
    ours = Signer("us-east-1").headers("GET", host, "/bucket", qs, creds, now=now)
    req = botocore.awsrequest.AWSRequest(method="GET", url=f"http://{host}/bucket?{qs}")
    signer = botocore.auth.S3SigV4Auth(botocore.credentials.Credentials(creds.access_key, creds.secret_key),
                                       "s3", "us-east-1")
    monkeypatch.setattr(botocore.auth, "get_current_datetime", lambda *a, **k: now.replace(tzinfo=None))
    signer.add_auth(req)
    assert ours["authorization"] == req.headers["Authorization"]


def test_signature_covers_amz_headers_like_botocore(monkeypatch):
    """CopyObject's x-amz-copy-source headers must be signed: S3 refuses unsigned x-amz-* headers."""
    now = datetime.datetime(2026, 11, 29, 12, 0, 0, tzinfo=datetime.timezone.utc)
    creds = Credentials("AKIDEXAMPLE", "wJalrXUtnFEMI/K7MDENG+bPxRfiCYEXAMPLEKEY")
    amz = {"x-amz-copy-source": uri_encode_path("/bucket/dir/naïve (1).txt"),
           "x-amz-copy-source-if-match": '"abc"'}
    host = "127.0.0.1:9000"
    path = uri_encode_path("/bucket/dst key")
    ours = Signer("us-east-1").headers("PUT", host, path, "", creds, now=now, amz=amz)  # empty body
    req = botocore.awsrequest.AWSRequest(method="PUT", url=f"http://{host}{path}", headers=dict(amz))
    signer = botocore.auth.S3SigV4Auth(botocore.credentials.Credentials(creds.access_key, creds.secret_key),
                                       "s3", "us-east-1")
    monkeypatch.setattr(botocore.auth, "get_current_datetime", lambda *a, **k: now.replace(tzinfo=None))
    signer.add_auth(req)
    assert "x-amz-copy-source;x-amz-copy-source-if-match" in ours["authorization"]
    assert ours["authorization"] == req.headers["Authorization"]


def test_xml_answers_and_errors_sent_after_a_200():
    done = (b'<?xml version="1.0" encoding="UTF-8"?>\n<CompleteMultipartUploadResult '
            b'xmlns="http://s3.amazonaws.com/doc/2006-03-01/"><Key>k</Key><ETag>&quot;e-2&quot;</ETag>'
            b"</CompleteMultipartUploadResult>")
    failed = b'<?xml version="1.0" encoding="UTF-8"?>\n\n<Error><Code>InternalError</Code></Error>'
    assert xml_text(done, "ETag") == '"e-2"' and xml_text(done, "UploadId") is None
    assert not embedded_error(done) and embedded_error(failed)
    assert xml_text(b"not xml", "ETag") is None


class _CompleteServer(http.server.BaseHTTPRequestHandler):
    """Answers POSTs (CompleteMultipartUpload) from a script: each entry a 200 with that body."""
    protocol_version = "HTTP/1.1"
    script: list[bytes] = []
    seen: list[bytes] = []

    def do_POST(self):
        type(self).seen.append(self.rfile.read(int(self.headers["content-length"])))
        body = type(self).script.pop(0)
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.mark.parametrize("attempts_failing", [1, 5])
def test_complete_multipart_error_after_200_is_retried_then_reported(attempts_failing):
    failed = b"<Error><Code>InternalError</Code><Message>try again</Message></Error>"
    done = b"<CompleteMultipartUploadResult><ETag>&quot;abc-2&quot;</ETag></CompleteMultipartUploadResult>"
    _CompleteServer.script = [failed] * attempts_failing + [done]
    _CompleteServer.seen = []
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _CompleteServer)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        store = S3Store(endpoint_url=f"http://127.0.0.1:{server.server_address[1]}", region="us-east-1",
                        access_key="AK", secret_key="SK", concurrency=2, max_attempts=5)
        if attempts_failing < 5:
            info = store.complete_multipart("b", "k", "up1", [(1, "e1"), (2, "e2")])
            assert info.etag == "abc-2"
        else:
            with pytest.raises(errors.StoreError) as e:
                store.complete_multipart("b", "k", "up1", [(1, "e1"), (2, "e2")])
            assert e.value.code == "InternalError" and e.value.errno == errors.EIO
        assert len(_CompleteServer.seen) == min(attempts_failing + 1, 5)
        assert _CompleteServer.seen[0] == (b"<CompleteMultipartUpload><Part><PartNumber>1</PartNumber>"
                                           b"<ETag>\"e1\"</ETag></Part><Part><PartNumber>2</PartNumber>"
                                           b"<ETag>\"e2\"</ETag></Part></CompleteMultipartUpload>")
    finally:
        server.shutdown()
        server.server_close()


def test_parse_list_page():
    body = b"""<?xml version="1.0" encoding="UTF-8"?>
<ListBucketResult xmlns="http://s3.amazonaws.com/doc/2006-03-01/"><Name>b</Name><Prefix>d/</Prefix>
<IsTruncated>true</IsTruncated><NextContinuationToken>tok</NextContinuationToken>
<Contents><Key>d/a.txt</Key><LastModified>2026-11-29T12:00:01.500Z</LastModified>
<ETag>&quot;abc&quot;</ETag><Size>42</Size></Contents>
<CommonPrefixes><Prefix>d/sub/</Prefix></CommonPrefixes></ListBucketResult>"""
    res = parse_list(body)
    # Cut to the second, as HEAD and GET report it (an HTTP date has no fractions).
    assert res.objects == [("d/a.txt", 42, "abc", 1795953601000000000)]
    assert res.prefixes == ["d/sub/"] and res.next_token == "tok"


def test_parse_list_page_with_url_encoded_names():
    # encoding-type=url: names percent-encoded, '+' for a space. RGW sends the continuation token
    # as the next key itself, not encoded: a control character there is a character reference that
    # XML 1.0 refuses, so the token is taken out before the page is parsed.
    body = b"""<?xml version="1.0" encoding="UTF-8"?>
<ListBucketResult xmlns="http://s3.amazonaws.com/doc/2006-03-01/"><Name>b</Name><Prefix>d%2F</Prefix>
<ContinuationToken>d/ctl&#1;prev</ContinuationToken><EncodingType>url</EncodingType>
<IsTruncated>true</IsTruncated><NextContinuationToken>d/ctl&#1;name&amp;x</NextContinuationToken>
<Contents><Key>d/with+space%01%25.txt</Key><LastModified>2026-11-29T12:00:01.500Z</LastModified>
<ETag>&quot;abc&quot;</ETag><Size>42</Size></Contents>
<CommonPrefixes><Prefix>d/sub%02+dir/</Prefix></CommonPrefixes></ListBucketResult>"""
    res = parse_list(body)
    assert res.objects == [("d/with space\x01%.txt", 42, "abc", 1795953601000000000)]
    assert res.prefixes == ["d/sub\x02 dir/"]
    assert res.next_token == "d/ctl\x01name&x"


class _PutSink(http.server.BaseHTTPRequestHandler):
    """Answers every PUT with 200 after reading exactly Content-Length bytes, and keeps them."""
    protocol_version = "HTTP/1.1"
    bodies: list[bytes] = []

    def do_PUT(self):
        n = int(self.headers["content-length"])
        body = self.rfile.read(n)
        if len(body) < n:  # the client gave up mid-body
            self.close_connection = True
            return
        type(self).bodies.append(body)
        self.send_response(200)
        self.send_header("ETag", '"e"')
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args):
        pass


@pytest.fixture
def put_sink():
    _PutSink.bodies = []
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _PutSink)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    client = LeanClient(f"http://127.0.0.1:{server.server_address[1]}", region="us-east-1", path_style=True,
                        credentials=lambda: Credentials("AK", "SK"), pool_size=2, timeout_s=10)
    yield client, _PutSink.bodies
    client.close()
    server.shutdown()
    server.server_close()


def test_file_body_sends_exactly_its_range(put_sink, tmp_path):
    """Upload parts go out with sendfile(2): the server must get the range's bytes, no more, no less,
    also when the range is far larger than a socket buffer (the send waits for room)."""
    client, bodies = put_sink
    data = os.urandom(9 << 20)
    path = tmp_path / "staged"
    path.write_bytes(data)
    fd = os.open(path, os.O_RDONLY)
    try:
        r = client.request("PUT", "b", "k", body=FileBody(fd, 12345, 8 << 20),
                           query={"partNumber": "1", "uploadId": "u"})
        r2 = client.request("PUT", "b", "k2", body=FileBody(fd, 0, 10))
    finally:
        os.close(fd)
    assert (r.status, r.headers["etag"], r2.status) == (200, '"e"', 200)
    assert bodies == [data[12345:12345 + (8 << 20)], data[:10]]


def test_file_body_of_a_shrunk_file_fails_and_spoils_no_connection(put_sink, tmp_path):
    client, bodies = put_sink
    path = tmp_path / "staged"
    path.write_bytes(b"x" * 1000)
    fd = os.open(path, os.O_RDONLY)
    try:
        with pytest.raises(SourceShort):
            client.request("PUT", "b", "k", body=FileBody(fd, 0, 5000))
        r = client.request("PUT", "b", "k", body=FileBody(fd, 500, 500))
    finally:
        os.close(fd)
    assert r.status == 200
    assert bodies == [b"x" * 500]


class _Scripted:
    """A raw HTTP server on loopback that answers each request with the next canned response (bytes
    sent as they are, in the pieces given), and notes which connection each request came on."""

    def __init__(self, responses: list[list[bytes] | bytes], host: str = "127.0.0.1"):

        self.responses = list(responses)
        self.requests: list[tuple[int, bytes]] = []  # (connection number, request head + body)
        self.sock = socket.create_server((host, 0), family=socket.AF_INET6 if ":" in host else socket.AF_INET)
        self.host = f"[{host}]" if ":" in host else host
        self.port = self.sock.getsockname()[1]
        self.connections = 0
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self):
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.connections += 1
            threading.Thread(target=self._one, args=(conn, self.connections), daemon=True).start()

    def _one(self, conn, number):
        buf = b""
        with conn:
            while self.responses:
                while b"\r\n\r\n" not in buf:
                    chunk = conn.recv(65536)
                    if not chunk:
                        return
                    buf += chunk
                head, _, buf = buf.partition(b"\r\n\r\n")
                length = 0
                for line in head.split(b"\r\n")[1:]:
                    name, _, value = line.partition(b":")
                    if name.strip().lower() == b"content-length":
                        length = int(value)
                while len(buf) < length:
                    buf += conn.recv(65536)
                body, buf = buf[:length], buf[length:]
                self.requests.append((number, head + b"\r\n\r\n" + body))
                answer = self.responses.pop(0)
                for piece in [answer] if isinstance(answer, bytes) else answer:
                    conn.sendall(piece)
                    time.sleep(0.01)  # separate segments: the client must put them together
                if answer == b"" or b"Connection: close" in b"".join(
                        [answer] if isinstance(answer, bytes) else answer):
                    return

    def client(self, timeout_s: float = 5) -> LeanClient:
        return LeanClient(f"http://{self.host}:{self.port}", region="us-east-1", path_style=True,
                          credentials=lambda: Credentials("AK", "SK"), pool_size=2, timeout_s=timeout_s)

    def close(self):
        self.sock.close()


def _ok(body: bytes, extra: bytes = b"") -> bytes:
    return b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n%s\r\n%s" % (len(body), extra, body)


def test_responses_in_pieces_and_keep_alive():
    """Heads and bodies split across segments are put together; answers framed by Content-Length
    keep the connection for the next request, a HEAD's Content-Length frames no body."""
    body = os.urandom(200_000)
    srv = _Scripted([
        [b"HTTP/1.1 200 OK\r\nETag: \"e1\"\r\nContent-Le", b"ngth: 200000\r\n\r\n" + body[:10], body[10:150_000],
         body[150_000:]],
        b"HTTP/1.1 200 OK\r\nContent-Length: 123\r\nETag: \"e2\"\r\n\r\n",  # HEAD: no body follows
        _ok(b"tail"),
    ])
    c = srv.client()
    into = bytearray(300_000)
    r = c.request("GET", "b", "k", into=into)
    assert (r.status, r.headers["etag"], bytes(r.body)) == (200, '"e1"', body)
    assert r.body.obj is into  # read straight into the caller's buffer
    h = c.request("HEAD", "b", "k")
    assert (h.status, h.headers["content-length"], h.body) == (200, "123", b"")
    assert bytes(c.request("GET", "b", "k2").body) == b"tail"
    assert [n for n, _ in srv.requests] == [1, 1, 1] and srv.connections == 1
    assert srv.requests[0][1].startswith(b"GET /b/k HTTP/1.1\r\n")
    c.close()
    srv.close()


def test_chunked_body_interim_answer_and_close():
    """A chunked body (with a chunk extension and a trailer) after a 100 Continue; an answer that says
    Connection: close is not reused; an error body never lands in the caller's buffer."""
    srv = _Scripted([
        [b"HTTP/1.1 100 Continue\r\n\r\n", b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n",
         b"5;ext=1\r\nhello\r\n", b"6\r\n world\r\n0\r\nX-Trailer: t\r\n\r\n"],
        b"HTTP/1.1 404 Not Found\r\nContent-Length: 9\r\nConnection: close\r\n\r\n<Error/>\n",
        _ok(b"again"),
    ])
    c = srv.client()
    r = c.request("GET", "b", "k")
    assert (r.status, bytes(r.body)) == (200, b"hello world")
    into = bytearray(100)
    e = c.request("GET", "b", "missing", into=into)
    assert (e.status, bytes(e.body)) == (404, b"<Error/>\n") and into == bytearray(100)
    assert bytes(c.request("GET", "b", "k").body) == b"again"
    assert [n for n, _ in srv.requests] == [1, 1, 2]
    c.close()
    srv.close()


@pytest.mark.parametrize("answer", [
    [b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n" + b"x" * 40],  # cut short, then closed
    [b"SPDY/9 200 OK\r\n\r\n"],
    [b"HTTP/1.1 200 OK\r\nno colon here\r\n\r\n"],
    [b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n"],
])
def test_broken_responses_fail_the_request(answer):
    from ucfs.s3http import HTTPFailure

    srv = _Scripted([answer + [b""]])
    c = srv.client(timeout_s=2)
    with pytest.raises(HTTPFailure):
        c.request("GET", "b", "k")
    c.close()
    srv.close()


def test_body_read_to_close_and_header_injection_refused():
    srv = _Scripted([[b"HTTP/1.0 200 OK\r\n\r\nsome ", b"bytes", b""]])
    c = srv.client()
    assert bytes(c.request("GET", "b", "k").body) == b"some bytes"
    with pytest.raises(ValueError):
        c.request("GET", "b", "k", headers={"range": "bytes=0-1\r\nx-evil: 1"})
    c.close()
    srv.close()


def test_idle_connections_are_checked_past_descriptor_1024(put_sink, tmp_path, monkeypatch):
    """A daemon with many files open hands out socket numbers above 1024, where select() cannot
    look: reusing a pooled connection must still work there."""
    import resource

    monkeypatch.setattr("ucfs.s3http._FRESH_IDLE_S", -1.0)  # check every pooled connection

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard < 1200:
        pytest.skip("the descriptor limit is below 1200 here")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 1200), hard))
    held = []
    try:
        while True:
            held.append(os.open(os.devnull, os.O_RDONLY))
            if held[-1] >= 1100:
                break
        client, bodies = put_sink
        assert client.request("PUT", "b", "k", body=b"one").status == 200
        assert client.request("PUT", "b", "k", body=b"two").status == 200  # a reused connection
        assert bodies == [b"one", b"two"]
    finally:
        for fd in held:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


@pytest.mark.parametrize("sent", [b"", b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n" + b"x" * 40])
def test_a_server_that_goes_silent_times_the_request_out(sent):
    """Plain sockets block with the timeout kept by the kernel (SO_RCVTIMEO), and take a body in
    one recv: silence before the head or in the middle of the body must still end the request."""
    from ucfs.s3http import HTTPFailure

    srv = socket.create_server(("127.0.0.1", 0))
    held = []

    def serve():
        conn, _ = srv.accept()
        held.append(conn)
        conn.recv(65536)
        conn.sendall(sent)  # and then nothing, with the connection left open

    threading.Thread(target=serve, daemon=True).start()
    c = LeanClient(f"http://127.0.0.1:{srv.getsockname()[1]}", region="us-east-1", path_style=True,
                   credentials=lambda: Credentials("AK", "SK"), pool_size=2, timeout_s=0.5)
    t0 = time.monotonic()
    with pytest.raises(HTTPFailure) as info:
        c.request("GET", "b", "k")
    assert info.value.timed_out and 0.4 < time.monotonic() - t0 < 5
    c.close()
    for conn in held:
        conn.close()
    srv.close()


def test_a_large_body_in_memory_arrives_whole(put_sink):
    """A body in memory goes out with its head in one sendmsg on a plain socket; far larger than a
    socket buffer, it is sent in several calls, every byte once."""
    client, bodies = put_sink
    data = os.urandom(9 << 20)
    assert client.request("PUT", "b", "k", body=memoryview(data)[7:]).status == 200
    assert client.request("PUT", "b", "k2", body=bytearray(data[:70_000])).status == 200
    assert bodies == [data[7:], data[:70_000]]


def test_a_connection_closed_just_after_its_answer_is_replaced_unnoticed():
    """A pooled connection that answered a moment ago is reused without asking the kernel whether
    the server has closed it since. If it has, the request goes again on a new connection."""
    server = socket.create_server(("127.0.0.1", 0))
    seen: list[int] = []

    def serve():  # each connection answers one request, keeping it alive, and is then closed
        while True:
            try:
                conn, _ = server.accept()
            except OSError:
                return
            with conn:
                buf = b""
                while b"\r\n\r\n" not in buf:
                    buf += conn.recv(65536)
                seen.append(len(seen) + 1)
                conn.sendall(_ok(b"hi"))

    threading.Thread(target=serve, daemon=True).start()
    c = LeanClient(f"http://127.0.0.1:{server.getsockname()[1]}", region="us-east-1", path_style=True,
                   credentials=lambda: Credentials("AK", "SK"), pool_size=2, timeout_s=5)
    try:
        assert bytes(c.request("GET", "b", "k").body) == b"hi"
        time.sleep(0.05)  # the server has closed it by now; the client has not looked
        assert bytes(c.request("GET", "b", "k").body) == b"hi"
        assert seen == [1, 2]
    finally:
        c.close()
        server.close()


def _store_at(srv, attempts=2):
    from ucfs.store import S3Store

    return S3Store(endpoint_url=f"http://127.0.0.1:{srv.port}", region="us-east-1",
                   access_key="AK", secret_key="SK", concurrency=2, max_attempts=attempts)


@pytest.mark.parametrize("answer", [
    # asked for bytes 100-199; a broken server or proxy answers bytes 0-99, and says so
    b"HTTP/1.1 206 Partial Content\r\nContent-Length: 100\r\nContent-Range: bytes 0-99/1024\r\n"
    b"ETag: \"e\"\r\n\r\n" + (bytes(range(256)) * 4)[:100],
    # ... or the whole object with a 200
    b"HTTP/1.1 200 OK\r\nContent-Length: 1024\r\nETag: \"e\"\r\n\r\n" + bytes(range(256)) * 4,
], ids=["206-other-range", "200-whole-object"])
def test_a_ranged_get_never_takes_other_bytes_for_the_ones_asked(answer):
    """Before, the store returned them as bytes 100-199. Now it asks again (and then gives up)."""
    from ucfs import errors

    srv = _Scripted([answer, answer])
    try:
        with pytest.raises(errors.StoreError):
            _store_at(srv).get("b", "k", 100, 100, etag="e")
    finally:
        srv.close()


def test_a_ranged_get_from_zero_may_be_answered_with_the_whole_object():
    obj = bytes(range(256)) * 4
    srv = _Scripted([b"HTTP/1.1 200 OK\r\nContent-Length: 1024\r\nETag: \"e\"\r\n\r\n" + obj])
    try:
        data, info = _store_at(srv).get("b", "k", 0, 100, etag="e")
        assert bytes(data) == obj[:100] and info.size == 1024
    finally:
        srv.close()


def test_a_get_answered_with_another_version_is_stale_not_data():
    """A server (or proxy) that ignores If-Match answers a GET of version "v1" with the bytes of
    the version that replaced it. The answer's ETag says so, and the store raises StaleError, as
    for the 412 a server that honours If-Match sends, instead of returning those bytes as v1's
    (the block cache would keep them under v1's name). Without If-Match, any version will do."""
    from ucfs import errors

    answer = b"HTTP/1.1 206 Partial Content\r\nContent-Length: 4\r\nContent-Range: bytes 0-3/8\r\n" \
             b"ETag: \"v2\"\r\n\r\nnew!"
    head = b"HTTP/1.1 200 OK\r\nContent-Length: 8\r\nETag: \"v2\"\r\n\r\n"  # the HEAD that confirms it
    srv = _Scripted([answer, head, answer, answer])
    try:
        store = _store_at(srv)
        with pytest.raises(errors.StaleError):
            store.get("b", "k", 0, 4, etag="v1")
        data, info = store.get("b", "k", 0, 4, etag="v2")
        assert bytes(data) == b"new!" and info.etag == "v2"
        data, info = store.get("b", "k", 0, 4)
        assert bytes(data) == b"new!"
    finally:
        srv.close()


def test_a_get_whose_etag_is_only_written_differently_is_the_version_asked_for():
    """A server that honours If-Match but writes the ETag of its GET answers differently from its
    HEAD's and LIST's (MinIO did so for some encrypted objects): the HEAD says the object is still
    the version asked for, and the bytes are taken. Refused, every read of the file would be ESTALE,
    and so would every open after it looked the name up again."""
    answer = b"HTTP/1.1 206 Partial Content\r\nContent-Length: 4\r\nContent-Range: bytes 0-3/8\r\n" \
             b"ETag: \"20000f00e627-encrypted-form\"\r\n\r\nold!"
    head = b"HTTP/1.1 200 OK\r\nContent-Length: 8\r\nETag: \"v1\"\r\n\r\n"
    srv = _Scripted([answer, head])
    try:
        store = _store_at(srv)
        data, _ = store.get("b", "k", 0, 4, etag="v1")
        assert bytes(data) == b"old!"
        assert [r.split(b" ", 1)[0] for _, r in srv.requests] == [b"GET", b"HEAD"]
    finally:
        srv.close()


def test_an_ipv6_endpoint_is_named_in_brackets_in_the_host_header(monkeypatch):
    """http://[::1]:port went out as "Host: ::1:port", which is no host and port (RFC 9110 writes an
    IPv6 address in brackets there, as in the URL), and signed as such: botocore signs "[::1]:port"."""
    try:
        srv = _Scripted([_ok(b"x")], host="::1")
    except OSError as e:
        pytest.skip(f"no IPv6 loopback here: {e}")
    try:
        r = srv.client().request("GET", "b", "k")
    finally:
        srv.close()
    assert r.status == 200
    head = srv.requests[0][1].split(b"\r\n\r\n")[0].decode()
    headers = {name.lower(): value for name, value in (line.split(": ", 1) for line in head.split("\r\n")[1:])}
    assert headers["host"] == f"[::1]:{srv.port}", head
    # botocore, given the same URL and moment, signs the same request alike.
    req = botocore.awsrequest.AWSRequest(method="GET", url=f"http://[::1]:{srv.port}/b/k",
                                         headers={"x-amz-content-sha256": headers["x-amz-content-sha256"]})
    now = datetime.datetime.strptime(headers["x-amz-date"], "%Y%m%dT%H%M%SZ")
    monkeypatch.setattr(botocore.auth, "get_current_datetime", lambda *a, **k: now)
    botocore.auth.S3SigV4Auth(botocore.credentials.Credentials("AK", "SK"), "s3", "us-east-1").add_auth(req)
    assert headers["authorization"] == req.headers["Authorization"]


def test_the_proxy_is_the_environments_unless_no_proxy_covers_the_host(monkeypatch):
    for name in ("HTTP_PROXY", "http_proxy", "HTTPS_PROXY", "https_proxy", "NO_PROXY", "no_proxy"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HTTPS_PROXY", "http://egress:3128")
    monkeypatch.setenv("NO_PROXY", "minio.internal,.lab")
    assert proxy_for("https://s3.eu-west-1.amazonaws.com") == "http://egress:3128"
    assert proxy_for("http://s3.eu-west-1.amazonaws.com") is None  # HTTP_PROXY is not set
    assert proxy_for("https://minio.internal:9000") is None
    assert proxy_for("https://store.lab") is None
    monkeypatch.setenv("HTTPS_PROXY", "egress:3128")  # no scheme: http, as curl and urllib take it
    client = LeanClient("https://s3.amazonaws.com", region="us-east-1", path_style=True,
                        credentials=lambda: Credentials("AK", "SK"), pool_size=1, timeout_s=5)
    assert client.proxy == ("egress", 3128)
    monkeypatch.setenv("HTTPS_PROXY", "socks5://egress:1080")
    with pytest.raises(ValueError, match="only http:// proxies"):
        LeanClient("https://s3.amazonaws.com", region="us-east-1", path_style=True,
                   credentials=lambda: Credentials("AK", "SK"), pool_size=1, timeout_s=5)
