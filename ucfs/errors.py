"""Every errno ucfs returns is chosen here.

Errors are builtin `OSError` subclasses carrying an errno, so callers (the FUSE layer, torchio, tests)
catch them without importing anything of ours. Store failures keep the S3 error code, HTTP status and
request id in the message, because those are what an operator needs to ask the store's owner about.
"""

from __future__ import annotations

import errno as _errno


class UcfsError(Exception):
    """A problem with how ucfs was set up (bad config, bad mountpoint...): one clear line for the user."""


class ConfigError(UcfsError):
    """A catalog or config file that cannot be used. The message names the file (and line when known)."""


class StoreError(OSError):
    """A store request that failed. `errno` says what it means for a file system caller."""

    def __init__(self, err: int, message: str, *, code: str = "", status: int = 0,
                 request_id: str = "", key: str = "", transient: bool = False):
        super().__init__(err, message)
        self.code = code
        self.status = status
        self.request_id = request_id
        self.key = key
        # True when retrying later may succeed (5xx, throttling, a dropped connection).
        self.transient = transient

    def __str__(self) -> str:
        parts = [self.strerror or ""]
        if self.key:
            parts.append(f"key={self.key!r}")
        if self.code:
            parts.append(f"code={self.code}")
        if self.status:
            parts.append(f"status={self.status}")
        if self.request_id:
            parts.append(f"request_id={self.request_id}")
        return " ".join(p for p in parts if p)


class StaleError(StoreError):
    """The object changed under an open handle (its ETag no longer matches what the handle opened)."""

    def __init__(self, key: str):
        super().__init__(_errno.ESTALE, "object was changed in the store while open", key=key,
                         code="PreconditionFailed", status=412)


# S3 error codes -> errno. Codes not listed map by HTTP status class below.
_S3_CODE_ERRNO = {
    "NoSuchKey": _errno.ENOENT,
    "NotFound": _errno.ENOENT,
    "404": _errno.ENOENT,
    "NoSuchUpload": _errno.ENOENT,
    "NoSuchBucket": _errno.ENXIO,  # the volume's location is gone: not "no such file"
    "AccessDenied": _errno.EACCES,
    "AllAccessDisabled": _errno.EACCES,
    "InvalidAccessKeyId": _errno.EACCES,
    "SignatureDoesNotMatch": _errno.EACCES,
    "ExpiredToken": _errno.EACCES,
    "403": _errno.EACCES,
    "KeyTooLongError": _errno.ENAMETOOLONG,
    "EntityTooLarge": _errno.EFBIG,
    "InvalidRange": _errno.EINVAL,
    "InvalidArgument": _errno.EINVAL,
    "InvalidObjectName": _errno.EINVAL,
    "PreconditionFailed": _errno.ESTALE,
    "412": _errno.ESTALE,
    "QuotaExceeded": _errno.EDQUOT,
    # Throttling that outlasts the retry budget is an I/O error to the caller, not EAGAIN: on a
    # blocking file EAGAIN reads as "no data yet" (Python's read() returns None, buffered readers
    # return what they have), so a reader could take a short read for the whole file.
    "SlowDown": _errno.EIO,
    "Throttling": _errno.EIO,
    "ThrottlingException": _errno.EIO,
    "RequestTimeout": _errno.ETIMEDOUT,
    "ServiceUnavailable": _errno.EIO,
    "InternalError": _errno.EIO,
}

_TRANSIENT_CODES = {"SlowDown", "Throttling", "ThrottlingException", "RequestTimeout",
                    "ServiceUnavailable", "InternalError", "RequestTimeTooSkewed"}


def errno_for_s3(code: str, status: int) -> int:
    if code in _S3_CODE_ERRNO:
        return _S3_CODE_ERRNO[code]
    if status == 404:
        return _errno.ENOENT
    if status in (401, 403):
        return _errno.EACCES
    if status == 412:
        return _errno.ESTALE
    return _errno.EIO  # 429 and 503 included: see SlowDown above


def is_transient_s3(code: str, status: int) -> bool:
    return code in _TRANSIENT_CODES or status >= 500 or status == 429


def from_s3(code: str, status: int, message: str, *, request_id: str = "", key: str = "") -> StoreError:
    return StoreError(errno_for_s3(code, status), message or code or f"HTTP {status}", code=code,
                      status=status, request_id=request_id, key=key,
                      transient=is_transient_s3(code, status))


def connection_error(message: str, *, key: str = "") -> StoreError:
    """The store could not be reached or the connection broke: EIO for the caller, retry later."""
    return StoreError(_errno.EIO, message, key=key, transient=True)


def leaves(group: BaseExceptionGroup):
    """The exceptions in a (nested) exception group, as trio nurseries raise them."""
    for e in group.exceptions:
        if isinstance(e, BaseExceptionGroup):
            yield from leaves(e)
        else:
            yield e


def fs_error(err: int, message: str = "") -> OSError:
    """An errno decided by file system semantics (ENOTEMPTY, EROFS, ...) with a readable message."""
    return OSError(err, message or _errno.errorcode.get(err, str(err)))


# Names the FUSE layer uses; decided here so the choice is visible in one place.
ENOENT = _errno.ENOENT
EROFS = _errno.EROFS
EACCES = _errno.EACCES
EPERM = _errno.EPERM
EISDIR = _errno.EISDIR
ENOTDIR = _errno.ENOTDIR
ENOTEMPTY = _errno.ENOTEMPTY
EEXIST = _errno.EEXIST
EINVAL = _errno.EINVAL
EIO = _errno.EIO
ENAMETOOLONG = _errno.ENAMETOOLONG
ENOSPC = _errno.ENOSPC
EFBIG = _errno.EFBIG
ESTALE = _errno.ESTALE
ENOSYS = _errno.ENOSYS
ENOTSUP = _errno.ENOTSUP
EXDEV = _errno.EXDEV
EBADF = _errno.EBADF
ENODATA = _errno.ENODATA
EBUSY = _errno.EBUSY
ENXIO = _errno.ENXIO
EAGAIN = _errno.EAGAIN
EDQUOT = _errno.EDQUOT
