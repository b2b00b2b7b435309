"""How the mount asks the kernel for large read requests (mount.allow_read_requests)."""

from __future__ import annotations

import errno

from ucfs.config import MiB
from ucfs.mount import allow_read_requests


def test_a_lower_limit_is_raised_to_what_is_asked(tmp_path):
    limit = tmp_path / "max_pages_limit"
    limit.write_text("256\n")
    assert allow_read_requests(8 * MiB, limit) == 8 * MiB
    assert limit.read_text() == "2048"


def test_a_higher_limit_is_left_alone(tmp_path):
    limit = tmp_path / "max_pages_limit"
    limit.write_text("65535\n")
    assert allow_read_requests(8 * MiB, limit) == 8 * MiB
    assert limit.read_text() == "65535\n"


def test_a_limit_that_cannot_be_raised_is_what_requests_get(tmp_path, monkeypatch):
    limit = tmp_path / "max_pages_limit"
    limit.write_text("512\n")

    def refuse(self, *args, **kwargs):
        raise PermissionError(errno.EACCES, "Permission denied", str(self))

    monkeypatch.setattr(type(limit), "write_text", refuse)  # not root
    assert allow_read_requests(8 * MiB, limit) == 2 * MiB


def test_a_kernel_without_the_setting_gets_its_fixed_cap(tmp_path):
    limit = tmp_path / "no-such-dir" / "max_pages_limit"  # as before Linux 6.13
    assert allow_read_requests(8 * MiB, limit) == 1 * MiB  # 256 pages


def test_without_the_hook_that_asks_for_more_the_limit_is_not_touched(tmp_path):
    # ucfs._fusewire not built: libfuse's INIT reply asks for 1 MiB whatever the limit says, so the
    # host-wide setting is left as the administrator set it.
    limit = tmp_path / "max_pages_limit"
    limit.write_text("256\n")
    assert allow_read_requests(8 * MiB, limit, can_ask=False) == 1 * MiB
    assert limit.read_text() == "256\n"
