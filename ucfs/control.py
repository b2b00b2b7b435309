"""The daemon's control socket: how `ucfs status` and `ucfs unmount` talk to a running mount.

One Unix socket per mount, named after the mountpoint in the user's runtime directory, so the CLI
finds it from the mountpoint alone and only the daemon's user can connect. A request is one line
(a command); the answer is one JSON document, then the connection closes.

Why not an extended attribute on the mount: answering getxattr at all makes the kernel ask about
every file that `ls -l` lists (security.selinux, system.posix_acl_access), two round trips per entry.
Refusing getxattr once (ENOSYS) switches those questions off for the whole mount.
"""

from __future__ import annotations

import inspect
import json
import logging
import os
import socket
from pathlib import Path
from typing import Awaitable, Callable

import trio

from .config import mount_runtime_name, runtime_dir
from .errors import UcfsError

log = logging.getLogger(__name__)


class NoDaemonError(UcfsError):
    """No daemon listens on the mount's socket: none runs for it, or it died (a dead mount)."""


def socket_path(mountpoint: str | os.PathLike) -> Path:
    return runtime_dir() / f"{mount_runtime_name(mountpoint)}.sock"


async def serve(mountpoint: Path, handlers: dict[str, Callable[[], dict | Awaitable[dict]]], *,
                task_status=trio.TASK_STATUS_IGNORED) -> None:
    """Answer control requests until cancelled."""
    path = socket_path(mountpoint)
    try:
        path.unlink()
    except FileNotFoundError:
        pass
    sock = trio.socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    await sock.bind(str(path))
    os.chmod(path, 0o600)
    sock.listen(16)
    listener = trio.SocketListener(sock)
    task_status.started(path)

    async def handle(stream: trio.SocketStream) -> None:
        async with stream:
            data = b""
            with trio.move_on_after(5):
                while b"\n" not in data and len(data) < 1024:
                    chunk = await stream.receive_some(1024)
                    if not chunk:
                        break
                    data += chunk
            command = data.split(b"\n", 1)[0].decode(errors="replace").strip()
            fn = handlers.get(command)
            try:
                reply = fn() if fn is not None else {"error": f"unknown command {command!r}"}
                if inspect.isawaitable(reply):  # a handler that needs a thread's help (a statfs, say)
                    reply = await reply
            except Exception as e:  # noqa: BLE001 - a bad request must not end the daemon
                log.exception("control command %r failed", command)
                reply = {"error": repr(e)}
            try:
                await stream.send_all(json.dumps(reply, default=str).encode())
            except trio.BrokenResourceError:
                pass

    try:
        await trio.serve_listeners(handle, [listener])
    finally:
        try:
            path.unlink()
        except FileNotFoundError:
            pass


def query(mountpoint: str | os.PathLike, command: str = "status", timeout_s: float = 10.0) -> dict:
    """Ask the daemon serving `mountpoint`; raises UcfsError with a clear message if none answers."""
    path = socket_path(mountpoint)
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(timeout_s)
    try:
        s.connect(str(path))
        s.sendall(command.encode() + b"\n")
        chunks = []
        while True:
            b = s.recv(65536)
            if not b:
                break
            chunks.append(b)
    except (FileNotFoundError, ConnectionRefusedError):
        raise NoDaemonError(f"{os.path.abspath(mountpoint)}: no ucfs daemon answers for this mountpoint") from None
    except OSError as e:
        raise UcfsError(f"{os.path.abspath(mountpoint)}: ucfs daemon did not answer ({e})") from None
    finally:
        s.close()
    return json.loads(b"".join(chunks))
