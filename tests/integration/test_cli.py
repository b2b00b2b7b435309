"""The command line around a mount's life (README "Using it"): `ucfs mount`, `status` and `unmount`
as a user runs them, including after a crash. Each problem a user can fix is one clear message and a
non-zero exit, never a traceback.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys

from tests.support import REPO


def ucfs(m, *args, timeout=60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ucfs", *args], env=m.env(), cwd=REPO, capture_output=True,
                          text=True, timeout=timeout)


@contextlib.contextmanager
def daemon_mount(m, mountpoint, *args):
    """`ucfs mount` as a daemon (it returns once the mount is ready); cleared afterwards whatever
    the test left."""
    m.root.mkdir(parents=True, exist_ok=True)
    cat = m.root / "catalog.toml"
    cat.write_text(m.catalog_text)
    r = ucfs(m, "mount", str(mountpoint), "--config", str(cat), "--cache-dir", str(m.state_dir), *args)
    try:
        assert r.returncode == 0, r.stderr
        yield r
    finally:
        real = os.path.realpath(mountpoint)
        if os.path.ismount(real):
            subprocess.run(["fusermount3", "-u", "-z", real], capture_output=True)


def test_a_mountpoint_given_through_a_symlink_is_the_same_mount_by_either_name(mount_factory, s3, bucket, prefix):
    """The kernel mounts at the link's target; status and unmount found nothing by the link's name
    (or by the target's, when the mount had been given the link)."""
    m = mount_factory(start=False)
    real = m.root / "real"
    real.mkdir(parents=True)
    link = m.root / "link"
    link.symlink_to(real)
    s3.put_object(Bucket=bucket, Key=f"{prefix}/vol/hello.txt", Body=b"hello")
    with daemon_mount(m, link) as mounted:
        assert os.path.ismount(real)
        assert (link / "test" / "s" / "vol" / "hello.txt").read_bytes() == b"hello"
        for name in (link, real):
            st = ucfs(m, "status", str(name))
            assert st.returncode == 0 and st.stdout.startswith(f"{real}\n"), (name, st.stdout, st.stderr)
        r = ucfs(m, "unmount", str(link))
        assert r.returncode == 0, r.stderr
        assert not os.path.ismount(real)
        assert f"at {real} " in mounted.stdout, mounted.stdout  # the name the kernel and status use
