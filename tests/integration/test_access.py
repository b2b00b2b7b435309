"""Grants, allow_other, credentials and private state (README "Semantics": Access; issue 5 "Grants").

Other users are real: the tests run as root and start small programs under other uids and groups
(`setpriv`), which reach the mount through the kernel like any user would; the daemon sees their uid,
gid and groups in each FUSE request. The program is the system Python with only the standard library,
so it runs for any user.
"""

from __future__ import annotations

import dataclasses
import errno
import json
import os
import shutil
import socket
import stat
import subprocess
import sys
import tempfile
import urllib.request
from pathlib import Path

import pytest

from tests.support import REPO

# Users and groups that need not exist: grants may name ids. 65534 is nobody/nogroup, which do exist,
# for grants by name.
ALICE, BOB, CAROL = 4101, 4102, 4103
TEAM = 4200
NOBODY, NOGROUP = 65534, 65534

# Runs as another user: performs a list of operations, prints what each one gave (a value or an errno).
_AS_USER = r"""
import errno, json, os, sys
out = []
for op, *args in json.loads(sys.argv[1]):
    try:
        if op == "listdir":
            r = sorted(os.listdir(args[0]))
        elif op == "stat":
            r = os.stat(args[0]).st_size
        elif op == "read":
            with open(args[0], "rb") as f:
                r = f.read().decode()
        elif op == "write":
            with open(args[0], "wb") as f:
                f.write(args[1].encode())
            r = "ok"
        elif op == "append":
            with open(args[0], "ab") as f:
                f.write(args[1].encode())
            r = "ok"
        elif op == "mkdir":
            os.mkdir(args[0]); r = "ok"
        elif op == "unlink":
            os.unlink(args[0]); r = "ok"
        elif op == "rename":
            os.rename(args[0], args[1]); r = "ok"
        elif op == "truncate":
            os.truncate(args[0], 0); r = "ok"
        elif op == "chmod":
            os.chmod(args[0], 0o600); r = "ok"
        elif op == "utime":
            os.utime(args[0], (1, 1)); r = "ok"
        elif op == "may_write":  # access(2) with W_OK, as `test -w` asks
            import ctypes
            libc = ctypes.CDLL(None, use_errno=True)
            if libc.access(args[0].encode(), os.W_OK) != 0:
                raise OSError(ctypes.get_errno(), "access")
            r = "ok"
        else:
            r = "unknown op"
    except OSError as e:
        r = errno.errorcode.get(e.errno, str(e.errno))
    out.append(r)
print(json.dumps(out))
"""

SYSTEM_PYTHON = shutil.which("python3", path="/usr/bin:/bin") or "/usr/bin/python3"


def as_user(uid: int, gid: int, ops: list[list], groups: tuple[int, ...] = ()) -> list:
    """Run `ops` as uid/gid (with supplementary `groups`) and return each one's result."""
    cmd = ["setpriv", f"--reuid={uid}", f"--regid={gid}"]
    cmd += [f"--groups={','.join(map(str, groups))}"] if groups else ["--clear-groups"]
    cmd += [SYSTEM_PYTHON, "-I", "-c", _AS_USER, json.dumps(ops)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=60, cwd="/")
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


@pytest.fixture
def open_root():
    """A directory other users may pass through (pytest's own are 0700): mountpoints go here.

    Ask for it before mount_factory, so that it is removed after the mounts in it are gone."""
    d = Path(tempfile.mkdtemp(prefix="ucfs-access-", dir="/tmp"))
    os.chmod(d, 0o755)
    yield d
    if not any(os.path.ismount(p) for p in d.glob("*/mnt")):  # never walk into a live mount
        shutil.rmtree(d, ignore_errors=True)


VOLUMES = {
    "g.s.public": {"readers": ["*"], "writers": ["*"]},
    "g.s.readonly_grant": {"readers": ["*"], "writers": [str(ALICE)]},
    "g.s.private": {"readers": [str(ALICE)], "writers": [str(ALICE)]},
    "g.s.team": {"readers": [f"@{TEAM}"], "writers": [f"@{TEAM}"]},
    "g.s.named": {"readers": ["nobody"], "writers": ["@nogroup"]},
    "g.s.frozen": {"read_only": True, "readers": ["*"]},
    "h.x.hidden": {"readers": [str(ALICE)], "writers": []},
}


@pytest.fixture
def granted(open_root, mount_factory, prefix, s3, bucket):
    vols = {name: {"prefix": f"{prefix}/{name}", **v} for name, v in VOLUMES.items()}
    for name in vols:
        s3.put_object(Bucket=bucket, Key=f"{prefix}/{name}/hello.txt", Body=f"hello from {name}".encode())
    m = mount_factory(vols, args=("--allow-other",), root=open_root / "m")
    os.chmod(m.root, 0o755)
    return m


def test_without_a_read_grant_a_volume_is_invisible(granted):
    mnt = granted.mountpoint
    schema = mnt / "g" / "s"
    bob = as_user(BOB, BOB, [["listdir", str(mnt)], ["listdir", str(schema)],
                             ["stat", str(schema / "private")], ["read", str(schema / "private" / "hello.txt")],
                             ["stat", str(mnt / "h")], ["listdir", str(schema / "team")],
                             ["read", str(schema / "public" / "hello.txt")]])
    assert bob[0] == ["g"]  # catalog h has nothing bob may read: not listed at all
    assert bob[1] == ["frozen", "public", "readonly_grant"]
    assert bob[2:6] == ["ENOENT"] * 4
    assert bob[6] == "hello from g.s.public"
    alice = as_user(ALICE, ALICE, [["listdir", str(mnt)], ["listdir", str(schema)],
                                   ["read", str(schema / "private" / "hello.txt")]])
    assert alice[0] == ["g", "h"]
    assert alice[1] == ["frozen", "private", "public", "readonly_grant"]
    assert alice[2] == "hello from g.s.private"
    # Groups count, supplementary ones too, and grants may name users and groups.
    carol = as_user(CAROL, CAROL, [["listdir", str(schema)], ["read", str(schema / "team" / "hello.txt")]],
                    groups=(TEAM,))
    assert "team" in carol[0] and carol[1] == "hello from g.s.team"
    nobody = as_user(NOBODY, NOGROUP, [["read", str(schema / "named" / "hello.txt")],
                                       ["write", str(schema / "named" / "n.txt"), "by nobody"]],
                     groups=(NOGROUP,))
    assert nobody == ["hello from g.s.named", "ok"]
    # Right after alice looked, bob still cannot get in (visibility is asked per caller, never cached).
    assert as_user(BOB, BOB, [["stat", str(schema / "private")]]) == ["ENOENT"]


def test_read_only_grant_refuses_writes_with_eacces(granted, s3, bucket, prefix):
    vol = granted.mountpoint / "g" / "s" / "readonly_grant"
    f = str(vol / "hello.txt")
    bob = as_user(BOB, BOB, [["read", f], ["write", str(vol / "new.txt"), "x"], ["append", f, "x"],
                             ["truncate", f], ["mkdir", str(vol / "d")], ["unlink", f],
                             ["rename", f, str(vol / "moved.txt")], ["chmod", f], ["utime", f],
                             ["may_write", f], ["may_write", str(vol)]])
    assert bob[0] == "hello from g.s.readonly_grant"
    assert bob[1:] == ["EACCES"] * 10  # access(2) says so too, not "writable" for every file
    alice = as_user(ALICE, ALICE, [["write", str(vol / "by-alice.txt"), "mine"],
                                   ["read", str(vol / "by-alice.txt")], ["may_write", f]])
    assert alice == ["ok", "mine", "ok"]
    # Team members write in their volume; others do not even see it.
    team = granted.mountpoint / "g" / "s" / "team"
    assert as_user(CAROL, CAROL, [["write", str(team / "t.txt"), "team work"]], groups=(TEAM,)) == ["ok"]
    assert as_user(CAROL, CAROL, [["write", str(team / "t2.txt"), "x"]]) == ["ENOENT"]
    granted.stop()  # drains commits
    stored = sorted(o["Key"].split("/", 1)[1] for o in
                    s3.list_objects_v2(Bucket=bucket, Prefix=f"{prefix}/").get("Contents", []))
    assert "g.s.readonly_grant/by-alice.txt" in stored and "g.s.team/t.txt" in stored
    assert not any(k.startswith("g.s.readonly_grant/") and k.endswith(("new.txt", "moved.txt")) for k in stored)


def test_read_only_volume_is_erofs_for_everyone(granted):
    vol = granted.mountpoint / "g" / "s" / "frozen"
    ops = [["read", str(vol / "hello.txt")], ["write", str(vol / "new.txt"), "x"], ["mkdir", str(vol / "d")],
           ["unlink", str(vol / "hello.txt")], ["chmod", str(vol / "hello.txt")], ["utime", str(vol / "hello.txt")],
           ["may_write", str(vol / "hello.txt")]]
    assert as_user(ALICE, ALICE, ops) == ["hello from g.s.frozen"] + ["EROFS"] * 6
    # access(2) as root: `test -w` says no, with the reason
    for p in (vol / "hello.txt", vol, granted.mountpoint / "g"):
        assert as_user(0, 0, [["may_write", str(p)]]) == ["EROFS"], p
    # root too: the volume itself is read-only, and so are the synthetic levels above volumes
    for change in (lambda: (vol / "root.txt").write_bytes(b"x"), lambda: os.chmod(vol / "hello.txt", 0o600),
                   lambda: os.chown(vol / "hello.txt", 0, 0), lambda: os.utime(vol / "hello.txt", (1, 1)),
                   lambda: os.chmod(granted.mountpoint / "g", 0o700),
                   # what no volume can hold (EPERM elsewhere) is EROFS here first, as on a read-only mount
                   lambda: os.symlink("hello.txt", vol / "s"), lambda: os.link(vol / "hello.txt", vol / "l"),
                   lambda: os.mkfifo(vol / "f"), lambda: os.symlink("x", granted.mountpoint / "g" / "sym")):
        with pytest.raises(OSError) as e:
            change()
        assert e.value.errno == errno.EROFS


def test_without_allow_other_only_the_mounting_user_gets_in(open_root, mount_factory, prefix, s3, bucket):
    s3.put_object(Bucket=bucket, Key=f"{prefix}/vol/hello.txt", Body=b"hi")
    m = mount_factory(root=open_root / "m")
    os.chmod(m.root, 0o755)
    assert (m.path() / "hello.txt").read_bytes() == b"hi"  # root mounted it
    # The kernel turns everyone else away before any grant is looked at.
    assert as_user(ALICE, ALICE, [["stat", str(m.mountpoint)], ["listdir", str(m.mountpoint)],
                                  ["read", str(m.path() / "hello.txt")]]) == ["EACCES"] * 3


# --------------------------------------------------------------------------------------------------
# Credentials and private state


def test_credentials_never_appear_in_logs_errors_or_status(fault_proxy, mount_factory, s3_endpoint, s3, bucket,
                                                           prefix):
    secret, access = s3_endpoint.secret_key, s3_endpoint.access_key
    port = _free_port()
    m = mount_factory(args=("--metrics-port", str(port)), endpoint=fault_proxy.endpoint)
    v = m.path()
    s3.put_object(Bucket=bucket, Key=f"{prefix}/vol/r.bin", Body=os.urandom(3 << 20))
    (v / "r.bin").read_bytes()
    (v / "w.txt").write_bytes(b"w")
    # Failures are where credentials tend to leak: a refused commit (permanent), retried reads.
    fault_proxy.fail(403, method="PUT", path="denied", times=100)
    fault_proxy.fail(503, method="GET", path="r2", times=2)
    s3.put_object(Bucket=bucket, Key=f"{prefix}/vol/r2.bin", Body=b"r2")
    (v / "r2.bin").read_bytes()
    (v / "denied.txt").write_bytes(b"d")
    with pytest.raises(OSError):
        with open(v / "denied.txt", "rb") as f:
            os.fsync(f.fileno())
    status_text = subprocess.run([sys.executable, "-m", "ucfs", "status", str(m.mountpoint)], capture_output=True,
                                 text=True, cwd=REPO).stdout
    status_json = json.dumps(m.status())
    metrics = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    assert "AccessDenied" in status_text  # the failure is reported...
    for where, text in (("log", m.log_path.read_text()), ("status", status_text), ("status --json", status_json),
                        ("metrics", metrics)):
        assert secret not in text, f"secret key in {where}"  # ...without the secret
        assert access not in text, f"access key id in {where}"
    # A mount that cannot authenticate says so without echoing what it was given.
    wrong = dataclasses.replace(s3_endpoint, secret_key="WRONG-secret-" + secret[::-1])
    bad = mount_factory(endpoint=wrong, name="bad", start=False)
    with pytest.raises(RuntimeError) as e:
        bad.start()
    assert "denied" in str(e.value).lower()
    assert wrong.secret_key not in bad.log_path.read_text() and secret[::-1] not in bad.log_path.read_text()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_cache_and_staging_directories_are_private(mount):
    state = mount.state_dir
    (mount.path() / "f.txt").write_bytes(b"x")
    for d in (state, state / "cache", state / "cache" / "v3", state / "staging"):
        mode = stat.S_IMODE(d.stat().st_mode)
        assert mode & 0o077 == 0, f"{d} is {oct(mode)}"
    for f in [state / "journal.sqlite3", *(state / "staging").iterdir()]:
        assert stat.S_IMODE(f.stat().st_mode) & 0o077 == 0 or stat.S_IMODE(state.stat().st_mode) == 0o700


@pytest.mark.parametrize("where,mode", [("state", 0o777), ("state", 0o770), ("state/cache", 0o757),
                                        ("state/staging", 0o722)])
def test_a_cache_directory_others_can_write_is_refused(mount_factory, where, mode):
    m = mount_factory(start=False)
    d = m.root / where
    d.mkdir(parents=True)
    os.chmod(d, mode)
    with pytest.raises(RuntimeError) as e:
        m.start()
    assert "other users can write" in str(e.value) and str(d) in str(e.value)
    assert m.proc.returncode == 1
    assert "Traceback" not in m.log_path.read_text()
    m.proc = None
