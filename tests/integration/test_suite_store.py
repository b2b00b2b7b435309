"""The suite's own store helpers, against whichever S3 server the suite runs on (its RGW, or the
endpoint UCFS_TEST_ENDPOINT names): what a test leaves behind is removed."""

from __future__ import annotations

from tests.support import delete_prefix, keys


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
