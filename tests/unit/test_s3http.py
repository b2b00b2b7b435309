"""The hand-written SigV4 signer must agree with botocore's byte for byte."""

from __future__ import annotations

import datetime

import botocore.auth
import botocore.awsrequest
import botocore.credentials
import pytest

from ucfs.s3http import Credentials, Signer, canonical_query, parse_error, parse_list, uri_encode_path


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
