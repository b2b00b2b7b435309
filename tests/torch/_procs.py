"""Run test functions as separate processes ("ranks"), the way a distributed job does.

Processes come from a fork server that imported torch once (importing it takes seconds here, and
every test starts several processes). Unlike forking the test process itself, forking a fresh,
single-threaded server is safe. Each process gets its rank, the world size and a free port for
gloo's rendezvous on 127.0.0.1; a failure comes back as the process's traceback.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import socket
import tempfile
import time
import traceback
from dataclasses import dataclass

_PRELOAD = ["torch", "torch.distributed", "torch.distributed.checkpoint", "torchio.dataset", "torchio.loader",
            "torchio.dcp", "tests.torch.ranks"]


def _context():
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    return ctx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(fn, rank: int, world: int, port: int, args: tuple, err_path: str) -> None:
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"  # gloo talks over loopback, whatever the host's network
    # A child of the fork server would start its DataLoader workers through a fork server of its own
    # (the start method is inherited), paying a torch import per worker. Ranks started by torchrun
    # are fresh processes whose workers fork; so are ours.
    multiprocessing.set_start_method("fork", force=True)
    try:
        fn(rank, world, port, *args)
    except BaseException:
        with open(err_path, "w") as f:
            f.write(traceback.format_exc())
        raise SystemExit(1)


@dataclass
class Finished:
    exitcodes: list[int]
    errors: list[str]

    def check(self) -> None:
        bad = [(r, c, e) for r, (c, e) in enumerate(zip(self.exitcodes, self.errors)) if c != 0]
        if bad:
            raise AssertionError("\n".join(f"rank {r} exited with {c}:\n{e}" for r, c, e in bad))


def run_ranks(fn, world: int, *args, timeout_s: float = 120.0, check: bool = True) -> Finished:
    """Run fn(rank, world, port, *args) in `world` processes; wait for all (kill them at the deadline)."""
    ctx = _context()
    port = free_port()
    errdir = tempfile.mkdtemp(prefix="torchio-test-")
    errs = [os.path.join(errdir, f"rank{r}.err") for r in range(world)]
    procs = [ctx.Process(target=_entry, args=(fn, r, world, port, args, errs[r])) for r in range(world)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout_s
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    hung = set()
    for r, p in enumerate(procs):
        if p.is_alive():
            os.kill(p.pid, signal.SIGKILL)
            p.join()
            hung.add(r)
    errors = []
    for r, path in enumerate(errs):
        try:
            with open(path) as f:
                errors.append(f.read())
            os.unlink(path)
        except FileNotFoundError:
            errors.append(f"(killed: still running after {timeout_s:.0f} s)" if r in hung else "")
    os.rmdir(errdir)
    done = Finished([p.exitcode for p in procs], errors)
    if check:
        done.check()
    return done


def kill_pids(pids) -> None:
    """SIGKILL processes a test's child left behind (DataLoader workers of a process killed on purpose)."""
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
