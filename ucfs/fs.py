"""pyfuse3 Operations: translate kernel requests to `Core` calls and back. No logic lives here.

Every handler goes through `_translate`: an `OSError` becomes `FUSEError(errno)`; anything else is
logged with its traceback and becomes `EIO`, because an exception escaping a handler would end
`pyfuse3.main()` and with it the mount.
"""

from __future__ import annotations

import functools
import logging
import os
import stat
from typing import Any, Callable

import pyfuse3
import trio

from . import errors
from .core import Attributes, Caller, Core

log = logging.getLogger(__name__)

def _translate(fn: Callable) -> Callable:
    @functools.wraps(fn)
    async def wrapper(self, *args: Any) -> Any:
        try:
            return await fn(self, *args)
        except pyfuse3.FUSEError:
            raise
        except OSError as e:
            raise pyfuse3.FUSEError(_errno_of(fn.__name__, e)) from None
        except BaseExceptionGroup as group:
            # Parallel store calls (trio nurseries) fail as a group: answer with the first OSError.
            oserrors, rest = group.split(OSError)
            if rest is not None and not rest.subgroup(lambda e: isinstance(e, (trio.Cancelled, KeyboardInterrupt))):
                log.error("%s failed unexpectedly; returning EIO", fn.__name__, exc_info=rest)
                raise pyfuse3.FUSEError(errors.EIO) from None
            if oserrors is None:
                raise
            first = next(errors.leaves(oserrors))
            raise pyfuse3.FUSEError(_errno_of(fn.__name__, first)) from None
        except (trio.Cancelled, KeyboardInterrupt):
            raise
        except Exception:
            log.exception("%s failed unexpectedly; returning EIO", fn.__name__)
            raise pyfuse3.FUSEError(errors.EIO) from None

    return wrapper


def _errno_of(op: str, e: OSError) -> int:
    err = e.errno or errors.EIO
    if op == "read" and isinstance(e, errors.StoreError) and err != errors.ESTALE:
        # read(2) has no EACCES or ENXIO (a reader of a file it opened is not asked for rights
        # again): a read the store refuses is an I/O error, as one it cannot serve (README "Reads").
        err = errors.EIO
    if err == errors.EIO:
        log.error("%s: I/O error: %s", op, e)  # the log line that says why
    elif isinstance(e, errors.StoreError) and err not in (errors.ENOENT, errors.ESTALE):
        # The store refused (access denied, its bucket gone, a key it will not take): the caller
        # sees only EACCES or ENXIO, and nothing of ours decided it, so the log says what the store did.
        log.warning("%s: %s from the store: %s", op, os.strerror(err), e)
    elif err in (errors.ENOENT, errors.ESTALE) and log.isEnabledFor(logging.DEBUG):
        # Why something vanished or changed under a handle, for races a soak finds.
        log.debug("%s: %s: %s", op, "ENOENT" if err == errors.ENOENT else "ESTALE", e)
    return err


def _caller(ctx: pyfuse3.RequestContext | None) -> Caller | None:
    if ctx is None:
        return None
    pid = ctx.pid
    return Caller(ctx.uid, ctx.gid, pid, lambda: pyfuse3.get_sup_groups(pid))


def _entry(a: Attributes) -> pyfuse3.EntryAttributes:
    e = pyfuse3.EntryAttributes()
    e.st_ino = a.ino
    e.generation = 0
    e.entry_timeout = a.entry_timeout_s
    e.attr_timeout = a.attr_timeout_s
    e.st_mode = a.mode
    e.st_nlink = a.nlink
    e.st_uid = a.uid
    e.st_gid = a.gid
    e.st_rdev = 0
    e.st_size = a.size
    e.st_blksize = a.blksize
    e.st_blocks = (a.size + 511) // 512
    e.st_atime_ns = a.mtime_ns
    e.st_mtime_ns = a.mtime_ns
    e.st_ctime_ns = a.mtime_ns
    return e


def _negative_entry(timeout_s: float) -> pyfuse3.EntryAttributes:
    """"No such name", cacheable by the kernel for `timeout_s` (inode 0 means a negative entry)."""
    e = pyfuse3.EntryAttributes()
    e.st_ino = 0
    e.entry_timeout = timeout_s
    return e


class Operations(pyfuse3.Operations):
    supports_dot_lookup = False
    enable_writeback_cache = False
    enable_acl = False

    def __init__(self, core: Core):
        super().__init__()
        self.core = core

    # -- names ----------------------------------------------------------------------------------
    @_translate
    async def lookup(self, parent_inode, name, ctx=None):
        attrs = await self.core.lookup(parent_inode, os.fsdecode(name), _caller(ctx))
        if attrs is None:
            return _negative_entry(self.core.cfg.metadata_ttl_s)
        return _entry(attrs)

    async def forget(self, inode_list):
        for ino, n in inode_list:
            self.core.forget(ino, n)

    @_translate
    async def getattr(self, inode, ctx=None):
        return _entry(await self.core.getattr(inode, _caller(ctx)))

    @_translate
    async def access(self, inode, mode, ctx):
        self.core.access(inode, mode, _caller(ctx))
        return True

    # -- directories ----------------------------------------------------------------------------
    @_translate
    async def opendir(self, inode, ctx):
        return await self.core.opendir(inode, _caller(ctx))

    @_translate
    async def readdir(self, fh, start_id, token):
        # "." and ".." first (offsets 1 and 2), as `ls -a` expects of any directory. The kernel takes
        # no lookup reference for them, even in readdirplus, so none is counted.
        dots = self.core.dot_entries(fh)
        for i in range(start_id, len(dots)):
            if not pyfuse3.readdir_reply(token, dots[i][0], _entry(dots[i][1]), i + 1):
                return
        for idx, name, attrs in self.core.readdir(fh, max(0, start_id - len(dots))):
            accepted = pyfuse3.readdir_reply(token, os.fsencode(name), _entry(attrs), idx + 1 + len(dots))
            self.core.entry_accepted(attrs.ino, accepted)
            if not accepted:
                break

    @_translate
    async def releasedir(self, fh):
        self.core.releasedir(fh)

    # -- files ----------------------------------------------------------------------------------
    @_translate
    async def open(self, inode, flags, ctx):
        fh, keep_cache = await self.core.open(inode, flags, _caller(ctx))
        return pyfuse3.FileInfo(fh=fh, keep_cache=keep_cache, direct_io=self.core.reads_direct(fh))

    @_translate
    async def read(self, fh, off, size):
        data = await self.core.read(fh, off, size)
        if isinstance(data, tuple):  # pieces of several buffers: sent as they are, not joined
            try:
                return self.core.passthrough.vector_reply(data)
            except ValueError:  # more pieces or bytes than one reply's stand-in covers
                return b"".join(data)
        return data

    @_translate
    async def release(self, fh):
        await self.core.release(fh)

    @_translate
    async def create(self, parent_inode, name, mode, flags, ctx):
        if not stat.S_ISREG(mode):
            raise pyfuse3.FUSEError(errors.EPERM)
        fh, attrs = await self.core.create(parent_inode, os.fsdecode(name), flags, _caller(ctx))
        return pyfuse3.FileInfo(fh=fh, keep_cache=False), _entry(attrs)

    @_translate
    async def write(self, fh, off, buf):
        return await self.core.write(fh, off, buf)

    @_translate
    async def flush(self, fh):
        await self.core.flush(fh)

    @_translate
    async def fsync(self, fh, datasync):
        await self.core.fsync(fh)

    @_translate
    async def fsyncdir(self, fh, datasync):
        await self.core.fsyncdir(fh)

    @_translate
    async def setattr(self, inode, attr, fields, fh, ctx):
        size = attr.st_size if fields.update_size else None
        mtime = attr.st_mtime_ns if fields.update_mtime else None
        changes = any((fields.update_size, fields.update_mtime, fields.update_atime, fields.update_ctime,
                       fields.update_mode, fields.update_uid, fields.update_gid))
        return _entry(await self.core.setattr(inode, size=size, mtime_ns=mtime, fh=fh, caller=_caller(ctx),
                                              changes=changes))

    @_translate
    async def mkdir(self, parent_inode, name, mode, ctx):
        return _entry(await self.core.mkdir(parent_inode, os.fsdecode(name), _caller(ctx)))

    @_translate
    async def unlink(self, parent_inode, name, ctx):
        await self.core.unlink(parent_inode, os.fsdecode(name), _caller(ctx))

    @_translate
    async def rmdir(self, parent_inode, name, ctx):
        await self.core.rmdir(parent_inode, os.fsdecode(name), _caller(ctx))

    @_translate
    async def rename(self, parent_inode_old, name_old, parent_inode_new, name_new, flags, ctx):
        await self.core.rename(parent_inode_old, os.fsdecode(name_old), parent_inode_new,
                               os.fsdecode(name_new), flags, _caller(ctx))

    def _refuse_unstorable(self, parent_inode, ctx) -> None:
        """EPERM for what an object store cannot hold, after EROFS and EACCES: as on a read-only
        mount, a change where none may be made says that first."""
        self.core.check_write(self.core.node(parent_inode), _caller(ctx))
        raise pyfuse3.FUSEError(errors.EPERM)

    @_translate
    async def mknod(self, parent_inode, name, mode, rdev, ctx):
        if not stat.S_ISREG(mode):
            self._refuse_unstorable(parent_inode, ctx)  # devices, fifos and sockets cannot live in an object store
        # An empty regular file, as creat() and close() make (the kernel sends creat() here too when
        # a file system has no atomic create; ours has, so this is mknod(2) itself).
        fh, attrs = await self.core.create(parent_inode, os.fsdecode(name), os.O_WRONLY | os.O_CREAT | os.O_EXCL,
                                           _caller(ctx))
        try:
            await self.core.flush(fh)
        finally:
            await self.core.release(fh)
        return _entry(attrs)

    @_translate
    async def symlink(self, parent_inode, name, target, ctx):
        self._refuse_unstorable(parent_inode, ctx)  # no symlinks in an object store (git copes: core.symlinks)

    @_translate
    async def link(self, inode, new_parent_inode, new_name, ctx):
        self._refuse_unstorable(new_parent_inode, ctx)  # no hard links (git falls back to rename)

    # -- file system ----------------------------------------------------------------------------
    @_translate
    async def statfs(self, ctx):
        s = pyfuse3.StatvfsData()
        # It asks the staging disk (a statfs of its own), which may block: a thread of its own does,
        # not a disk thread (those may all be busy with fsyncs and cache writes).
        for k, v in (await trio.to_thread.run_sync(self.core.statfs)).items():
            setattr(s, k, v)
        return s

    # No extended attributes: refusing getxattr with ENOSYS once makes the kernel stop asking, which
    # spares `ls -l` two round trips per entry (security.selinux, system.posix_acl_access).
    async def getxattr(self, inode, name, ctx):
        raise pyfuse3.FUSEError(errors.ENOSYS)

    async def listxattr(self, inode, ctx):
        raise pyfuse3.FUSEError(errors.ENOSYS)

    async def setxattr(self, inode, name, value, ctx):
        raise pyfuse3.FUSEError(errors.ENOSYS)

    async def removexattr(self, inode, name, ctx):
        raise pyfuse3.FUSEError(errors.ENOSYS)
