"""The hand-written SigV4 signer must agree with botocore's byte for byte."""

from __future__ import annotations

import datetime

import botocore.auth
import botocore.awsrequest
import botocore.credentials
import pytest

from ucfs.s3http import Credentials, Signer, parse_error, uri_encode_path


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
