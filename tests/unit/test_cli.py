"""The command line without a mount: option checks and set-up that must fail with one clear message."""

from __future__ import annotations

import logging
import os

import pytest

from ucfs import cli


@pytest.fixture
def logging_restored(monkeypatch):
    """`_setup_logging` changes the process's logging; put it back afterwards."""
    root = logging.getLogger()
    monkeypatch.setattr(root, "handlers", list(root.handlers))
    monkeypatch.setattr(root, "level", root.level)
    monkeypatch.setattr(logging, "logThreads", logging.logThreads)
    for noisy in ("botocore", "boto3", "urllib3", "s3transfer"):
        monkeypatch.setattr(logging.getLogger(noisy), "level", logging.getLogger(noisy).level)
    yield root
    for handler in root.handlers:
        handler.close()


@pytest.mark.parametrize("given, ours, botocore", [
    ("trace", logging.DEBUG, logging.DEBUG),  # was INFO: asking for the most gave less than debug
    ("debug", logging.DEBUG, logging.WARNING),
    ("info", logging.INFO, logging.WARNING),
    ("warning", logging.WARNING, logging.WARNING),
    ("error", logging.ERROR, logging.WARNING),
])
def test_each_log_level_sets_what_it_names(logging_restored, tmp_path, given, ours, botocore):
    level = cli.build_parser().parse_args(["mount", "--log-level", given.upper()]).log_level
    cli._setup_logging(level, tmp_path / "ucfs.log")
    assert logging_restored.level == ours
    assert logging.getLogger("botocore").level == botocore


def test_an_unknown_log_level_is_refused_not_taken_for_info(logging_restored, tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        cli.build_parser().parse_args(["mount", "--log-level", "verbose"])
    assert e.value.code == 2
    assert "--log-level" in capsys.readouterr().err
    with pytest.raises(ValueError, match="verbose"):
        cli._setup_logging("verbose", tmp_path / "ucfs.log")


def test_a_sample_volume_that_cannot_be_made_is_one_message(tmp_path, monkeypatch, capsys):
    """Without a catalog, `ucfs mount` fills a sample volume under the user's data directory; where
    that cannot be made (here a file is in the way), say so instead of a traceback."""
    blocker = tmp_path / "data"
    blocker.write_text("a file where the data directory would be")
    monkeypatch.setattr(cli, "demo_store_dir", lambda: blocker / "ucfs" / "samples")
    monkeypatch.setattr(cli, "SYSTEM_CATALOG", tmp_path / "no-such-catalog.toml")
    monkeypatch.delenv("UCFS_CONFIG", raising=False)
    mnt = tmp_path / "mnt"
    assert cli.main(["mount", str(mnt), "--cache-dir", str(tmp_path / "state"), "--foreground"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("ucfs: "), err
    assert "sample volume" in err[0] and str(blocker) in err[0] and "--config" in err[0], err[0]
    assert not mnt.exists() and not (tmp_path / "state").exists()  # refused before anything was made


def test_a_mountpoint_is_named_with_its_links_resolved(tmp_path, monkeypatch):
    from ucfs.config import resolve_mountpoint

    real = tmp_path / "real"
    real.mkdir()
    (tmp_path / "link").symlink_to(real)
    (tmp_path / "relative").symlink_to("link")  # a link to a link, relative
    (tmp_path / "dirlink").symlink_to(tmp_path)
    (tmp_path / "dangling").symlink_to(tmp_path / "not-yet")  # made by `ucfs mount`
    assert resolve_mountpoint(tmp_path / "relative") == real
    assert resolve_mountpoint(tmp_path / "dirlink" / "link") == real
    assert resolve_mountpoint(tmp_path / "dangling") == tmp_path / "not-yet"
    monkeypatch.chdir(tmp_path)
    assert resolve_mountpoint("link/") == real


def test_a_mountpoint_link_whose_target_goes_up_from_a_link_is_resolved_as_the_kernel_does(tmp_path):
    """A link's target was joined with `..` taken away by the letter (normpath): for `a/../m` with
    `a` itself a link, that names the wrong directory, and `ucfs mount` made and mounted it there
    instead of where the link points, while status and unmount by the link's name found nothing."""
    from ucfs.config import resolve_mountpoint

    (tmp_path / "elsewhere" / "sub").mkdir(parents=True)
    (tmp_path / "elsewhere" / "m").mkdir()
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "a").symlink_to(tmp_path / "elsewhere" / "sub")
    (tmp_path / "d" / "link").symlink_to("a/../m")  # the kernel: elsewhere/sub/.. /m
    assert os.path.realpath(tmp_path / "d" / "link") == str(tmp_path / "elsewhere" / "m")
    assert resolve_mountpoint(tmp_path / "d" / "link") == tmp_path / "elsewhere" / "m"
    (tmp_path / "d" / "up").symlink_to("a/..")  # a link to a directory above a link's target
    assert resolve_mountpoint(tmp_path / "d" / "up") == tmp_path / "elsewhere"


def test_status_names_the_store_requests_in_words():
    """The line printed a Python dict ("{'list': 37, 'head': 30, ...}"), zero counts included."""
    st = {"stores": {"rgw": {"list": 37, "head": 30, "get": 0, "upload_part": 32, "create_multipart": 2,
                             "attempts": 37 + 30 + 32 + 2 + 3, "get_bytes": 0, "put_bytes": 3 * 2**20,
                             "errors": 1}}}
    text = cli.format_status("/Volumes", st)
    assert ("  store rgw: requests head 30, list 37, upload part 32; 0.0 MiB read, 3.0 MiB written, "
            "retries 3, errors 1") in text.splitlines(), text
    idle = cli.format_status("/Volumes", {"stores": {"rgw": {"attempts": 0}}})
    assert "  store rgw: requests none yet; 0.0 MiB read, 0.0 MiB written, retries 0, errors 0" in idle


def test_status_says_what_the_latest_long_stall_was_made_of():
    st = {"loop_max_stall_ms": 316.1, "loop_stalls_over_100ms": 1,
          "loop_stall_samples": [{"stall_ms": 316.1, "on_cpu_ms": 20.0, "waiting_for_cpu_ms": 185.1,
                                  "cpu_stolen_by_host_ms": 60.0, "blocked_while_others_waited_for_cpu_ms": 50.0,
                                  "blocked_ms": 51.0, "stack": ["ucfs/fs.py:147 readdir"], "at": 0.0}]}
    lines = cli.format_status("/Volumes", st).splitlines()
    assert ("    latest: 316 ms, loop thread on a CPU 20 ms, waiting for a CPU 185 ms, CPU taken by the host "
            "60 ms, blocked while other threads waited for a CPU 50 ms, blocked 51 ms, "
            "at ucfs/fs.py:147 readdir") in lines, lines
