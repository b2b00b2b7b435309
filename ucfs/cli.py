"""`ucfs mount | unmount | status | bench`: the only reader of argv and the environment.

Errors a user can fix (bad config, unreachable store, bad mountpoint) print one line and exit 1;
tracebacks are for bugs.
"""

from __future__ import annotations

import argparse
import errno
import json
import logging
import logging.handlers
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from . import __version__
from .cache import ensure_private_dir
from .catalog import Catalog
from .config import MountConfig, default_state_dir, parse_size, resolve_mountpoint
from .errors import UcfsError

log = logging.getLogger("ucfs")

DEFAULT_MOUNTPOINT = "/Volumes"
SYSTEM_CATALOG = Path("/etc/ucfs/catalog.toml")


def demo_store_dir() -> Path:
    if os.geteuid() == 0:
        return Path("/var/lib/ucfs/samples")
    base = os.environ.get("XDG_DATA_HOME") or os.path.join(os.path.expanduser("~"), ".local", "share")
    return Path(base) / "ucfs" / "samples"


def seed_demo_store(root: Path) -> None:
    """Fill the embedded sample volume with a few files the first time, so there is something to see."""
    if root.exists() and any(root.iterdir()):
        return
    (root / "tables" / "iris").mkdir(parents=True, exist_ok=True)
    (root / "README.txt").write_text(
        "This is the sample volume main.default.samples of ucfs's embedded default catalog.\n"
        "Its objects are files under " + str(root) + ".\n"
        "Point ucfs at S3 or MinIO with a catalog file: ucfs mount --config catalog.toml\n")
    rows = ["sepal_length,sepal_width,petal_length,petal_width,species"]
    for i in range(150):
        sp = ("setosa", "versicolor", "virginica")[i // 50]
        rows.append(f"{4.3 + (i % 35) / 10:.1f},{2.0 + (i % 24) / 10:.1f},{1.0 + (i % 59) / 10:.1f},"
                    f"{0.1 + (i % 25) / 10:.1f},{sp}")
    (root / "tables" / "iris" / "iris.csv").write_text("\n".join(rows) + "\n")
    (root / "checkpoints").mkdir(exist_ok=True)


# --log-level: "trace" is "debug" with the S3 client library's own debug records (botocore's
# requests and retries) added; those are quiet otherwise.
LOG_LEVELS = {"trace": logging.DEBUG, "debug": logging.DEBUG, "info": logging.INFO,
              "warning": logging.WARNING, "error": logging.ERROR}


def _setup_logging(level: str, logfile: Path | None) -> None:
    name = level.lower()
    if name not in LOG_LEVELS:  # never quietly INFO: a user asking for more would get less
        raise ValueError(f"log level {level!r}: give one of {', '.join(LOG_LEVELS)}")
    handler: logging.Handler
    if logfile is not None:
        handler = logging.handlers.RotatingFileHandler(logfile, maxBytes=10 << 20, backupCount=3)
    else:
        handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(LOG_LEVELS[name])
    # The format has no thread name, and asking for one costs: a record made in a worker thread of
    # ucfs.threads (started with _thread) would give that thread a threading._DummyThread that is
    # never removed. 2,000 short-lived logging threads left 101 of them; none with this off.
    logging.logThreads = False
    # botocore logs request details (never credentials) at DEBUG; keep it quiet unless asked.
    for noisy in ("botocore", "boto3", "urllib3", "s3transfer"):
        logging.getLogger(noisy).setLevel(logging.DEBUG if name == "trace" else logging.WARNING)


def _load_catalog(args) -> Catalog:
    path = args.config or os.environ.get("UCFS_CONFIG")
    if path:
        return Catalog.load(path)
    if SYSTEM_CATALOG.exists():
        return Catalog.load(SYSTEM_CATALOG)
    demo = demo_store_dir()
    try:
        seed_demo_store(demo)
    except OSError as e:  # a home that is read-only or full, a file where a directory should be
        where = f"{e.filename}: " if e.filename else ""
        raise UcfsError(f"cannot set up the embedded sample volume in {demo} ({where}{e.strerror or e}); "
                        "give a catalog with --config or $UCFS_CONFIG") from None
    return Catalog.embedded(demo)


def _seconds(flag: str, value: float, *, zero_ok: bool) -> float:
    """A duration given on the command line: finite, not negative (and not zero unless allowed)."""
    if not math.isfinite(value) or value < 0 or (value == 0 and not zero_ok):
        least = "0 or more" if zero_ok else "more than 0"
        raise UcfsError(f"{flag} {value:g}: give a number of seconds, {least}")
    return value


def _mount_config(args) -> MountConfig:
    kw = {}
    if args.cache_dir:
        kw["cache_dir"] = Path(args.cache_dir) / "cache"
    if args.cache_size:
        kw["cache_size_bytes"] = parse_size(args.cache_size)
    if args.metadata_ttl is not None:
        kw["metadata_ttl_s"] = _seconds("--metadata-ttl", args.metadata_ttl, zero_ok=True)
    if args.allow_other:
        kw["allow_other"] = True
    if args.min_free:
        kw["cache_free_floor_bytes"] = parse_size(args.min_free)
    if args.memory_budget:
        kw["readahead_budget_bytes"] = parse_size(args.memory_budget)
    if args.store_timeout is not None:
        kw["store_read_timeout_s"] = _seconds("--store-timeout", args.store_timeout, zero_ok=False)
    if args.stale_if_error is not None:
        kw["stale_if_error_s"] = _seconds("--stale-if-error", args.stale_if_error, zero_ok=True)
    if args.metrics_port:
        if not 0 < args.metrics_port < 65536:
            raise UcfsError(f"--metrics-port {args.metrics_port}: a TCP port is 1 to 65535")
        kw["metrics_port"] = args.metrics_port
    if args.no_passthrough:
        kw["passthrough"] = False
    return MountConfig(**kw)


def cmd_mount(args) -> int:
    from .mount import MountOptions, check_mountpoint, hidden_entries

    catalog = _load_catalog(args)
    cfg = _mount_config(args)
    state_dir = Path(args.cache_dir) if args.cache_dir else default_state_dir()
    mnt = str(resolve_mountpoint(args.mountpoint))
    state = Path(os.path.realpath(state_dir))
    if state == Path(mnt) or Path(mnt) in state.parents:
        # The daemon would keep its cache, staging files, journal and log on its own file system,
        # and the first of them it touched after mounting would wait for itself: a hang.
        raise UcfsError(f"cache directory {state_dir} is inside the mountpoint {mnt}; give a "
                        "--cache-dir outside it")
    if mnt in _ucfs_mounts() and _is_dead_mount(mnt):
        # A ucfs daemon that was killed (or crashed) left its mount behind. Nothing can be served
        # from it any more, and the commits it left pending are in its cache directory's journal, not
        # in the mount: detaching it loses nothing, and mounting again is what finishes them.
        _lazy_unmount(mnt)
        print(f"ucfs: {mnt} was a dead ucfs mount (its daemon had exited); unmounted it", file=sys.stderr)
    opts = MountOptions(mountpoint=check_mountpoint(Path(mnt)), state_dir=state_dir,
                        drain_on_exit=not args.no_drain)
    if not os.path.exists("/dev/fuse"):
        raise UcfsError("/dev/fuse is missing: load the fuse module (modprobe fuse) or run where FUSE works")
    hidden = hidden_entries(opts.mountpoint)
    warning = (f"{opts.mountpoint} is not empty: its {hidden} {'entry is' if hidden == 1 else 'entries are'} "
               "hidden while ucfs is mounted over it, and back after ucfs unmount") if hidden else ""
    if args.foreground:
        _setup_logging(args.log_level, None)
        if warning:
            log.warning("%s", warning)  # on stderr: the one line
        try:
            _run_mount(catalog, cfg, opts, ready=lambda: log.info("ready"))
        except BaseExceptionGroup as group:
            if len(group.exceptions) == 1:
                raise group.exceptions[0] from None
            raise
        return 0
    return _daemonize(catalog, cfg, opts, args.log_level, warning)


def _run_mount(catalog, cfg, opts, ready) -> None:
    import trio

    from .mount import serve

    trio.run(serve, catalog, cfg, opts, ready)


def _daemonize(catalog, cfg, opts, log_level: str, warning: str = "") -> int:
    """Fork; the child mounts and tells the parent over a pipe once the mount is ready (or why not).
    A `warning` is printed by the parent and logged by the child."""
    ensure_private_dir(opts.state_dir)  # here, in the parent: a bad --cache-dir is its message
    logfile = opts.state_dir / "ucfs.log"
    r, w = os.pipe()
    pid = os.fork()
    if pid > 0:
        os.close(w)
        if warning:
            print(f"ucfs: warning: {warning}", file=sys.stderr)
        chunks = []
        try:
            while True:
                b = os.read(r, 4096)
                if not b:
                    break
                chunks.append(b)
        except KeyboardInterrupt:
            # The daemon has a session of its own, out of the terminal's reach: pass Ctrl-C on, or
            # it would go on to mount after the command that started it gave up. SIGTERM ends it at
            # once before it mounts, and unmounts cleanly after.
            os.kill(pid, signal.SIGTERM)
            print(f"ucfs: interrupted: stopping the mount daemon (pid {pid})", file=sys.stderr)
            return 130
        os.close(r)
        msg = b"".join(chunks).decode(errors="replace").strip()
        if msg == "ok":
            print(f"ucfs: mounted {len(catalog.volumes)} volume(s) at {opts.mountpoint} "
                  f"(pid {pid}, log {logfile})")
            return 0
        print(msg or f"ucfs: the mount daemon exited before it was ready; see {logfile}", file=sys.stderr)
        return 1
    # Child: detach from the terminal, log to a file.
    os.close(r)
    os.setsid()
    devnull = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(devnull, fd)
    _setup_logging(log_level, logfile)
    if warning:
        log.warning("%s", warning)
    code = 0

    def ready() -> None:
        os.write(w, b"ok")
        os.close(w)

    try:
        try:
            _run_mount(catalog, cfg, opts, ready)
        except BaseExceptionGroup as group:  # trio nurseries wrap errors; a single one speaks for itself
            if len(group.exceptions) == 1:
                raise group.exceptions[0] from None
            raise
    except UcfsError as e:
        log.error("%s", e)
        _try_write(w, f"ucfs: {e}")
        code = 1
    except BaseException as e:  # noqa: BLE001 - report anything to the waiting parent
        log.exception("mount failed")
        _try_write(w, f"ucfs: mount failed: {e!r} (see {logfile})")
        code = 1
    os._exit(code)


def _try_write(fd: int, msg: str) -> None:
    try:
        os.write(fd, msg.encode())
        os.close(fd)
    except OSError:
        pass


def _ucfs_mounts() -> list[str]:
    """The mountpoints of ucfs mounts, as the kernel names them (see `resolve_mountpoint`)."""
    out = []
    with open("/proc/self/mounts") as f:
        for line in f:
            dev, mnt, fstype, *_ = line.split()
            if fstype == "fuse.ucfs" or (fstype.startswith("fuse") and dev == "ucfs"):
                # The kernel writes space, tab, newline and backslash in a path as octal escapes.
                out.append(re.sub(r"\\([0-7]{3})", lambda m: chr(int(m[1], 8)), mnt))
    return out


def _is_dead_mount(mnt: str) -> bool:
    """Whether mnt is a FUSE mount whose daemon is gone: the kernel then fails every request to it
    with ENOTCONN ("Transport endpoint is not connected") until it is unmounted.

    statvfs, not stat: the kernel answers a stat from the attributes it cached (for the metadata
    TTL) without asking anyone, so a mount that has just died still stats fine; statfs is always
    a request."""
    from .mount import statvfs_answered

    try:
        statvfs_answered(mnt)
    except OSError as e:
        return e.errno == errno.ENOTCONN
    return False


def _lazy_unmount(mnt: str) -> None:
    """Detach a (dead) mount: -z / -l, because a process still inside it would make a plain
    unmount fail with EBUSY, and there is nothing left to wait for."""
    tool = shutil.which("fusermount3") or shutil.which("fusermount")
    cmd = [tool, "-u", "-z", mnt] if tool else ["umount", "-l", mnt]
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode != 0:
        raise UcfsError(f"{mnt} is a dead ucfs mount (its daemon has exited) and unmounting it failed: "
                        f"{res.stderr.strip() or res.stdout.strip()}")


def read_status(mountpoint: str) -> dict:
    from .control import NoDaemonError, query

    try:
        return query(mountpoint, "status")
    except NoDaemonError:
        if _is_dead_mount(mountpoint):
            if mountpoint not in _ucfs_mounts():  # another file system's: ucfs unmount refuses it
                raise NoDaemonError(f"{mountpoint} is a dead FUSE mount, not of ucfs (its daemon has "
                                    f"exited); clear it with: fusermount3 -u -z {mountpoint}") from None
            raise NoDaemonError(f"{mountpoint} is a dead ucfs mount (its daemon has exited); clear it "
                                f"with: ucfs unmount {mountpoint}") from None
        if mountpoint not in _ucfs_mounts():  # a plain directory, a typo: nothing there to answer
            raise NoDaemonError(f"{mountpoint} is not a ucfs mount") from None
        raise


def cmd_unmount(args) -> int:
    mnt = str(resolve_mountpoint(args.mountpoint))
    if mnt not in _ucfs_mounts():
        raise UcfsError(f"{mnt} is not a ucfs mount")
    from .control import NoDaemonError, query

    try:
        if args.no_wait:
            query(mnt, "no-drain")  # else the daemon would drain after the unmount, holding the cache dir
        else:
            _wait_drained(mnt)
    except NoDaemonError:
        if not _is_dead_mount(mnt):
            raise
        _lazy_unmount(mnt)
        print(f"ucfs: unmounted {mnt}, a dead mount (its daemon had exited); what it left to commit is "
              "committed by the next mount of its cache directory")
        return 0
    tool = shutil.which("fusermount3") or shutil.which("fusermount")
    cmd = [tool, "-u", mnt] if tool else ["umount", mnt]
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode != 0:
        raise UcfsError(f"unmount of {mnt} failed: {res.stderr.strip() or res.stdout.strip()}")
    print(f"ucfs: unmounted {mnt}")
    return 0


def _wait_drained(mnt: str) -> None:
    """Show commit progress until nothing is pending, so unmount loses no time and no data."""
    last = None
    while True:
        st = read_status(mnt).get("commits") or {}
        pending, failed, writing = st.get("pending", 0), st.get("failed", 0), st.get("writing", 0)
        if pending - failed - writing <= 0:
            if failed:
                print(f"ucfs: {failed} commit(s) failed permanently; their data stays staged and is "
                      "retried at the next mount (see ucfs status)", file=sys.stderr)
            if writing:
                # Their commits wait for their last close, which waiting here cannot bring about.
                print(f"ucfs: {writing} file(s) still open for writing; each is committed when it is "
                      "closed", file=sys.stderr)
            return
        line = f"ucfs: waiting for {pending} pending commit(s), {st.get('pending_bytes', 0) / 2**20:.1f} MiB"
        if line != last:
            print(line, file=sys.stderr)
            last = line
        time.sleep(0.5)


def cmd_status(args) -> int:
    mounts = [str(resolve_mountpoint(args.mountpoint))] if args.mountpoint else _ucfs_mounts()
    if not mounts and not args.json:
        print("no ucfs mounts")
        return 0
    failed = 0
    # --json: one document, an object keyed by mountpoint, however many mounts there are (one
    # document per mount, printed one after the other, was not JSON any more with two).
    docs: dict[str, dict] = {}
    for mnt in mounts:
        try:
            st = read_status(mnt)
        except UcfsError as e:
            print(f"ucfs: {e}", file=sys.stderr)
            failed += 1
            docs[mnt] = {"error": str(e)}
            continue
        if args.json:
            docs[mnt] = st
            continue
        print(format_status(mnt, st))
    if args.json:
        print(json.dumps(docs, indent=2))
    return 1 if failed else 0


# The store requests `ucfs status` counts by name, in this order (the rest only count as attempts).
_SHOWN_REQUESTS = ("get", "head", "list", "put", "upload_part", "copy", "delete")


def format_status(mnt: str, st: dict) -> str:
    lines = [f"{mnt}"]
    rates = st.get("throughput_bytes_per_s") or {}
    if rates:
        lines.append(f"  throughput (last 10 s): read {rates.get('read', 0) / 2**20:.1f} MiB/s, "
                     f"written {rates.get('written', 0) / 2**20:.1f} MiB/s")
    if "loop_max_stall_ms" in st:
        lines.append(f"  event loop: longest stall {st['loop_max_stall_ms']} ms, "
                     f"{st.get('loop_stalls_over_100ms', 0)} over 100 ms")
        samples = st.get("loop_stall_samples") or []
        if samples:
            # Why the latest long stall happened: our code on the CPU, a busy machine, a busy host
            # (its hypervisor took the CPUs), blocked while the machine was busy, or blocked.
            s = samples[-1]
            lines.append(f"    latest: {s['stall_ms']:.0f} ms, loop thread on a CPU {s['on_cpu_ms']:.0f} ms, "
                         f"waiting for a CPU {s['waiting_for_cpu_ms']:.0f} ms, "
                         f"CPU taken by the host {s.get('cpu_stolen_by_host_ms', 0):.0f} ms, "
                         f"blocked while other threads waited for a CPU "
                         f"{s.get('blocked_while_others_waited_for_cpu_ms', 0):.0f} ms, "
                         f"blocked {s['blocked_ms']:.0f} ms"
                         + (f", at {s['stack'][-1]}" if s.get("stack") else ""))
    c = st.get("cache") or {}
    if c:
        hits, misses = c.get("hits", 0), c.get("misses", 0)
        lines.append(f"  cache: {c.get('used_bytes', 0) / 2**20:.1f} MiB of {c.get('limit_bytes', 0) / 2**20:.0f} MiB, "
                     f"{c.get('blocks', 0)} blocks, hit rate {hits / max(1, hits + misses):.0%}")
    lines.append(f"  read-ahead in memory: {st.get('readahead_bytes', 0) / 2**20:.1f} MiB "
                 f"(peak {st.get('readahead_peak_bytes', 0) / 2**20:.1f} MiB, budget "
                 f"{st.get('readahead_budget_bytes', 0) / 2**20:.0f} MiB)")
    for name, s in (st.get("stores") or {}).items():
        reqs = ", ".join(f"{k.replace('_', ' ')} {s[k]}" for k in _SHOWN_REQUESTS if s.get(k))
        retries = max(0, s.get("attempts", 0) - sum(v for k, v in s.items() if k in _SHOWN_REQUESTS + (
            "head_bucket", "create_multipart", "complete_multipart", "abort_multipart", "list_multipart")))
        lines.append(f"  store {name}: requests {reqs or 'none yet'}; {s.get('get_bytes', 0) / 2**20:.1f} MiB read, "
                     f"{s.get('put_bytes', 0) / 2**20:.1f} MiB written, retries {retries}, errors {s.get('errors', 0)}")
        down = (st.get("unreachable") or {}).get(name)
        if down:
            lines.append(f"    unreachable for {down['for_s']:.0f} s; {down['answered_from_known']} lookups "
                         "and stats answered from what was known meanwhile")
    pt = st.get("passthrough")
    if pt:
        if pt.get("active"):
            how = f"on (opens in this mode so far: {(st.get('core') or {}).get('passthrough_opens', 0)})"
        elif pt.get("broken"):
            how = f"given up: {pt['broken']}"
        elif not pt.get("wanted"):
            how = "off"
        else:
            how = "not offered by this kernel"
        lines.append(f"  passthrough writes: {how}")
    cm = st.get("commits")
    if cm:
        lines.append(f"  commits: {cm.get('pending', 0)} pending ({cm.get('pending_bytes', 0) / 2**20:.1f} MiB), "
                     f"{cm.get('failed', 0)} failed, {cm.get('committed', 0)} committed, "
                     f"{cm.get('retries', 0)} retried")
        free, reserve = cm.get("staging_free_bytes"), cm.get("staging_reserve_bytes")
        # The cache shares the disk and gives up its blocks for new writes first.
        if free is not None and reserve is not None and free + c.get("used_bytes", 0) < reserve:
            lines.append(f"  staging disk full: {free / 2**20:.1f} MiB free of the {reserve / 2**20:.0f} MiB kept "
                         f"free ({cm.get('staging_dir', '')}): new writes fail with ENOSPC until there is room")
        for item in cm.get("items", []):
            lines.append(f"    {item['state']:<9} {item['path']}  {item['size']} bytes, age {item['age_s']:.0f} s, "
                         f"attempts {item['attempts']}" + (f", error: {item['error']}" if item.get("error") else "")
                         + (f", retrying after: {item['retrying']}" if item.get("retrying") else ""))
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ucfs", description="Mount S3-compatible object storage at /Volumes.")
    p.add_argument("--version", action="version", version=f"ucfs {__version__}")
    sub = p.add_subparsers(dest="cmd", required=True)

    m = sub.add_parser("mount", help="mount the volumes of a catalog")
    m.add_argument("mountpoint", nargs="?", default=DEFAULT_MOUNTPOINT,
                   help=f"where to mount (default {DEFAULT_MOUNTPOINT})")
    m.add_argument("--config", help="catalog file (default: $UCFS_CONFIG, /etc/ucfs/catalog.toml, "
                   "else an embedded sample volume)")
    m.add_argument("--cache-dir", help=f"local cache, staging and journal (default {default_state_dir()})")
    m.add_argument("--cache-size", help="largest size of the block cache, e.g. 20G (default 10G)")
    m.add_argument("--metadata-ttl", type=float, help="seconds metadata is trusted (default 1)")
    m.add_argument("--allow-other", action="store_true", help="let other users in (grants still apply)")
    m.add_argument("--min-free", help="keep at least this much free on the cache disk (default 1G)")
    m.add_argument("--memory-budget", help="file data held in memory, read-ahead and uploads (default 512M)")
    m.add_argument("--store-timeout", type=float, help="seconds before a silent store request is retried "
                   "(default 30)")
    m.add_argument("--stale-if-error", type=float, metavar="SECONDS",
                   help="while the store cannot be reached, answer lookups, stat and listings from what "
                        "was last known, for up to this long (default 600; 0: fail with EIO)")
    m.add_argument("--metrics-port", type=int, help="serve Prometheus metrics on 127.0.0.1:PORT")
    m.add_argument("--no-passthrough", action="store_true",
                   help="send every write through the daemon, even where the kernel could write files "
                        "being written straight to their staging files (FUSE passthrough)")
    m.add_argument("--foreground", "-f", action="store_true", help="stay in the foreground, log to stderr")
    m.add_argument("--log-level", default="info", type=str.lower, choices=list(LOG_LEVELS),
                   help="default info; trace is debug with the S3 client library's records")
    m.add_argument("--no-drain", action="store_true",
                   help="on exit, leave pending commits for the next mount instead of waiting")
    m.set_defaults(fn=cmd_mount)

    u = sub.add_parser("unmount", help="unmount, after pending commits are in the store")
    u.add_argument("mountpoint")
    u.add_argument("--no-wait", action="store_true", help="do not wait for pending commits "
                   "(they are finished at the next mount)")
    u.set_defaults(fn=cmd_unmount)

    s = sub.add_parser("status", help="cache, read-ahead, store requests and pending commits")
    s.add_argument("mountpoint", nargs="?")
    s.add_argument("--json", action="store_true", help="one JSON object keyed by mountpoint")
    s.set_defaults(fn=cmd_status)

    from . import bench  # light: boto3 is imported only when the bench runs

    b = sub.add_parser("bench", help="measure the mount against direct store access (ceilings)",
                       description="Compare a ucfs mount with direct boto3 access to the same store, in "
                                   "one run, and print figures, ratios and targets.")
    bench.add_arguments(b)
    b.set_defaults(fn=bench.run)

    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.fn(args)
    except UcfsError as e:
        print(f"ucfs: {e}", file=sys.stderr)
        return 1
    except ValueError as e:
        print(f"ucfs: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
