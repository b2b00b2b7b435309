"""File system semantics over the catalog and the stores, without FUSE.

`Core` answers lookups, attribute requests, directory listings, opens and reads with plain
dataclasses and `OSError`s; `fs.py` only translates between it and pyfuse3. Tests drive it directly.

Metadata freshness (README "Semantics"): what the store said about a name is trusted for
`metadata_ttl_s`. A directory's listing answers lookups of its children (and their absence) while it
is fresh; when it has expired, a lookup either refreshes the whole listing (small or busy directories:
one LIST instead of a request per name) or probes the single name (HEAD of the key and a one-key LIST
of "key/" in parallel, since a name may be a file, a directory, or both). An open whose attributes
have expired checks the object again, and tells the kernel to drop cached pages of an older version.
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import logging
import math
import os
import stat as stat_mod
import time
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import trio

from . import errors
from .aiostore import AsyncStore, run_disk
from .cache import BlockCache, ObjectVersion
from .catalog import Catalog, Volume
from .config import MountConfig
from .inodes import Entry, Inode, InodeTable, Kind, Listing
from .prefetch import BufferPool, InFlight, MemoryBudget, ObjectReader
from .store import MAX_KEY_BYTES, ObjectInfo

log = logging.getLogger(__name__)

NAME_MAX_BYTES = 255
# How long a local removal is remembered to screen store answers that were on their way when it
# happened (see `Core._removed_at`): far longer than any store request may take with its retries.
REMOVED_MEMORY_S = 600.0
RENAME_NOREPLACE = 1  # linux/fs.h
# A directory whose listing has answered this many lookups is listed again in the background shortly
# before the listing expires: twice its LIST's own time before, within these shares of the metadata
# TTL (`_maybe_refresh_ahead`).
REFRESH_AHEAD_LOOKUPS = 8
REFRESH_AHEAD_MIN_LEAD = 0.1
REFRESH_AHEAD_MAX_LEAD = 0.5
# At most this many of those refreshes are on their way at once, whatever the number of hot
# directories (a loader touching hundreds of them): each is a LIST (or several pages) taken from the
# store's limiter that foreground reads wait on. A directory that finds no room is not queued; it is
# tried again at its next lookup, and otherwise listed on expiry, as without refreshes ahead. Four
# LISTs of 10-30 ms still refresh a hundred or more directories a second.
REFRESH_AHEAD_MAX_IN_FLIGHT = 4
# Names remembered absent per directory (`Inode.absent`) before the expired ones are cleared out.
ABSENT_NAMES_MAX = 4096
# While a store cannot be reached, what was last known answers lookups, stat and listings (see
# `Core._unreachable`), and the store is asked again after this long, doubling up to the maximum:
# each try costs the caller who makes it the store's whole retry budget (about 1.5 s when
# connections are refused), so a loader walking cached files pays that once in a while, not per file.
RECHECK_FIRST_S = 1.0
RECHECK_MAX_S = 15.0


@dataclass(slots=True)
class _Outage:
    """A store that could not be reached: since when, and when to ask it again."""

    since: float  # time.monotonic() of the first failure
    failed_at: float  # and of the latest
    ask_at: float
    backoff: float
    answered: int = 0  # answers given from what was known meanwhile


@dataclass(frozen=True, slots=True)
class Attributes:
    ino: int
    is_dir: bool
    size: int
    mtime_ns: int
    mode: int
    uid: int
    gid: int
    blksize: int
    entry_timeout_s: float
    attr_timeout_s: float
    nlink: int = 1  # directories too: find(1) must not assume it knows their subdirectory count


@dataclass
class Caller:
    uid: int
    gid: int
    pid: int = 0
    groups_fn: Callable[[], set[int]] | None = None
    _groups: frozenset[int] | None = None

    @property
    def groups(self) -> frozenset[int]:
        if self._groups is None:
            extra: set[int] = set()
            if self.groups_fn is not None:
                try:
                    extra = set(self.groups_fn())
                except Exception:  # the process may be gone already
                    extra = set()
            self._groups = frozenset(extra | {self.gid})
        return self._groups


class _Shared:
    """One store request in flight whose answer several callers wait for."""

    def __init__(self) -> None:
        self.started = time.monotonic()  # what the answer says is true as of (at least) this
        self.done = trio.Event()
        self.ok = False
        self.result: Any = None
        self.error: Exception | None = None


@dataclass(eq=False)
class DirHandle:
    inode: Inode
    entries: list[tuple[str, Entry | Kind]]  # snapshot taken at opendir
    opened_at: float = field(default_factory=time.monotonic)
    as_of: float = 0.0  # when the listing the snapshot came from was asked for


@dataclass(eq=False)
class FileHandle:
    inode: Inode
    version: ObjectVersion | None  # None while the content is local (staged)
    size: int
    reader: ObjectReader | None = None
    writable: bool = False
    staged: Any = None  # the commit.Staged this handle keeps alive, if any
    direct: bool = False  # reads past the kernel's page cache (see `open_version`)
    # When this handle last knew the file's size: its open, or a truncate made through it. Reads
    # short of what it was asked for are ESTALE only if the file shrank since (see `read`).
    sized_at: float = field(default_factory=time.monotonic)
    passthrough: bool = False  # the kernel reads and writes its staging file itself (ucfs.passthrough)
    append_only: bool = False  # opened O_WRONLY | O_APPEND (`_append_only`)


class Core:
    def __init__(self, catalog: Catalog, stores: dict[str, AsyncStore], cache: BlockCache | None,
                 cfg: MountConfig, *, uid: int | None = None, gid: int | None = None):
        self.catalog = catalog
        self.stores = stores
        self.cache = cache
        self.cfg = cfg
        self.uid = os.getuid() if uid is None else uid
        self.gid = os.getgid() if gid is None else gid
        self.inodes = InodeTable()
        self.budget = MemoryBudget(cfg.data_budget_bytes)
        self.pool = BufferPool(cfg.part_bytes, self.budget)
        self.inflight = InFlight()  # blocks open handles are fetching, for the others to share
        self.stats: collections.Counter[str] = collections.Counter()
        self.started_ns = time.time_ns()
        self._handles: dict[int, FileHandle | DirHandle] = {}
        self._next_fh = itertools.count(1)
        self._nursery: trio.Nursery | None = None
        self._probes: dict[tuple[str, str], _Shared] = {}
        self.committer = None  # set by mount when writes are enabled (commit.Committer)
        self.passthrough = None  # set by mount (passthrough.Passthrough)
        # Reads spanning several fetches may come back in pieces (a tuple), which fs answers with
        # Passthrough.vector_reply: set by mount once that is in place.
        self.vectored_replies = False
        # Tell the kernel to forget its dentry of (parent inode, name), so that the next path walk
        # looks the name up again: set by mount (pyfuse3's invalidate_entry_async); None without FUSE.
        self.invalidate_entry: Callable[[int, str], None] | None = None
        # Tell the kernel that the attributes it holds for an inode are stale, so that the next read
        # or stat through it asks for them first: set by mount (pyfuse3's invalidate_inode, attributes
        # only, which takes no lock the kernel may hold for a request); None without FUSE.
        self.invalidate_attrs: Callable[[int], None] | None = None
        # What this mount changed itself, or last learned from a HEAD, and when (time.monotonic();
        # for a HEAD, when it was sent). A store answer obtained before that - a listing, probe or
        # HEAD still on its way when a commit, rename, create or unlink happened, or an opendir's
        # snapshot read later - is older than what we know, and must not undo it (stale attributes
        # would serve an old version from the cache; a stale name would bring a deleted file back).
        self._changed_at: weakref.WeakKeyDictionary[Inode, float] = weakref.WeakKeyDictionary()
        self._removed_at: dict[tuple[int, str], float] = {}  # (parent inode, name) -> when
        # Directories whose background refresh is on its way (REFRESH_AHEAD_MAX_IN_FLIGHT).
        self._refreshing_ahead: set[Inode] = set()
        # Stores whose metadata requests failed for want of an answer (store name -> _Outage).
        self._outages: dict[str, _Outage] = {}

    def attach(self, nursery: trio.Nursery) -> None:
        """Background work (read-ahead, refreshes) runs in the mount's nursery."""
        self._nursery = nursery

    def store_for(self, volume: Volume) -> AsyncStore:
        return self.stores[volume.store.name]

    # -- a store that cannot be reached ----------------------------------------------------------
    def _outage(self, vol: Volume) -> _Outage | None:
        """The outage of vol's store, unless the store has answered any request since its latest
        failure (a read or a commit may be first to get through)."""
        o = self._outages.get(vol.store.name)
        if o is not None and self._answered_since(vol.store.name, o):
            self._reachable(vol)
            return None
        return o

    def _answered_since(self, store: str, o: _Outage) -> bool:
        return getattr(self.stores[store].store, "answered_at", 0.0) > o.failed_at

    def _stale_allowed(self, vol: Volume) -> bool:
        """May what was last known about vol's names stand in for the store's answer? Yes while its
        store has been unreachable for at most `stale_if_error_s` (README "Semantics": Reads)."""
        o = self._outage(vol)
        return o is not None and time.monotonic() - o.since <= self.cfg.stale_if_error_s

    def _skip_asking(self, vol: Volume) -> bool:
        """Answer from what is known without asking? Yes while the store is down and not due to be
        tried again; when it is due, this caller asks and the others go on answering meanwhile."""
        if not self._stale_allowed(vol):
            return False
        o = self._outages[vol.store.name]
        now = time.monotonic()
        if now < o.ask_at:
            return True
        o.backoff = min(o.backoff * 2, RECHECK_MAX_S)
        o.ask_at = now + o.backoff
        return False

    def _unreachable(self, vol: Volume, e: BaseException) -> bool:
        """Note a failed metadata request. True if it failed for want of an answer (connections
        refused or broken, timeouts, 5xx once the retries are spent) and what is known may answer
        instead; a refusal (403) or a missing bucket is an answer, and is passed on."""
        if not (isinstance(e, errors.StoreError) and e.transient and e.errno == errors.EIO):
            return False
        now, name = time.monotonic(), vol.store.name
        o = self._outage(vol)
        if o is None:
            o = self._outages[name] = _Outage(now, now, now + RECHECK_FIRST_S, RECHECK_FIRST_S)
            if self.cfg.stale_if_error_s > 0:
                log.warning("store %r cannot be reached (%s): lookups, stat and listings answer from "
                            "what was known, for up to %g s of outage; data not cached fails with EIO",
                            name, e, self.cfg.stale_if_error_s)
        else:
            o.failed_at = now
            o.ask_at = max(o.ask_at, now + o.backoff)
        return self._stale_allowed(vol)

    def _reachable(self, vol: Volume) -> None:
        o = self._outages.pop(vol.store.name, None)
        if o is not None:
            log.warning("store %r answers again after %.1f s; %d answers were given from what was known "
                        "meanwhile", vol.store.name, time.monotonic() - o.since, o.answered)

    def _answer_stale(self, vol: Volume) -> None:
        self.stats["stale_answers"] += 1
        o = self._outages.get(vol.store.name)
        if o is not None:
            o.answered += 1

    def _knows_child(self, parent: Inode, name: str) -> bool:
        return (name in parent.children_by_name or parent.listing is not None or name in parent.absent
                or self.inodes.kept_entry(parent, name) is not None)

    def _stale_child(self, parent: Inode, name: str) -> Inode | None:
        """parent/name as last known: its inode, its entry in the last listing, or absent."""
        assert parent.volume is not None
        self._answer_stale(parent.volume)
        node = parent.children_by_name.get(name)
        if node is not None:
            return node
        listing = parent.listing
        if listing is None:
            # Its inode was forgotten, not what it was; unless a probe found it gone since.
            kept = self.inodes.kept_entry(parent, name)
            if kept is not None and parent.absent.get(name, -math.inf) < kept[1]:
                return self._apply_entry(parent, name, *kept)
            return None  # known absent (Inode.absent)
        entry = listing.entries.get(name)
        if entry is None:
            return self._pending_local(parent, name, listing.as_of)
        return self._apply_entry(parent, name, entry, listing.as_of)

    # -- local changes versus store answers ------------------------------------------------------
    def note_changed(self, node: Inode) -> None:
        """node's attributes were just set by this mount (a commit, a rename, a create)."""
        self._changed_at[node] = time.monotonic()

    def _note_removed(self, parent: Inode, name: str) -> None:
        now = time.monotonic()
        self._removed_at[(parent.ino, name)] = now
        if len(self._removed_at) > 10_000:
            cutoff = now - REMOVED_MEMORY_S
            self._removed_at = {k: t for k, t in self._removed_at.items() if t > cutoff}

    @contextlib.contextmanager
    def _store_unheard(self, parent: Inode, name: str):
        """While the block runs, nothing the store says of parent/name counts (lookups and
        listings take it for removed): its object there is older than what this mount is removing
        or replacing, until the block's DELETE or rename is done. Afterwards, as for any removal,
        answers sent before then do not count; should the block fail, the object shows again."""
        self._removed_at[(parent.ino, name)] = math.inf
        try:
            yield
        finally:
            self._note_removed(parent, name)

    def _changed_since(self, node: Inode, t: float) -> bool:
        return self._changed_at.get(node, float("-inf")) > t

    def _removed_since(self, parent: Inode, name: str, t: float) -> bool:
        return self._removed_at.get((parent.ino, name), float("-inf")) > t

    def _overlay_local(self, parent: Inode, entries: dict[str, Entry], since: float) -> None:
        """Bring a listing the store gave as of `since` up to date with what we changed since."""
        for name in [n for n in entries if self._removed_since(parent, n, since)]:
            if name not in parent.children_by_name:
                del entries[name]
        for name, child in parent.children_by_name.items():
            if not self._changed_since(child, since):
                continue
            if child.kind is Kind.FILE and child.etag:
                entries[name] = Entry(False, child.size, child.etag, child.mtime_ns)
            elif child.kind is Kind.DIR:
                entries.setdefault(name, Entry(True, mtime_ns=child.mtime_ns))

    # -- attributes -----------------------------------------------------------------------------
    def _ttl(self, node: Inode) -> float:
        if (node.kind.synthetic or node.kind is Kind.VOLUME) and self.cfg.allow_other:
            # Visibility depends on the caller; the kernel must ask every time. The volume's own
            # entry too: grants are checked when its name is looked up, and a dentry the kernel kept
            # from one user's lookup would let the next user walk in without asking.
            return 0.0
        return self.cfg.metadata_ttl_s

    def attributes(self, node: Inode) -> Attributes:
        ttl = self._ttl(node)
        writable = node.volume is not None and not node.volume.read_only
        if node.kind is Kind.FILE:
            st = node.staged
            if st is not None and st.pt_writers:
                self.committer.observe(st)  # written behind our back: the staging file knows
            size = st.size if st is not None else node.size
            mtime = st.mtime_ns if st is not None else node.mtime_ns
            mode = stat_mod.S_IFREG | (0o644 if writable else 0o444)
            return Attributes(node.ino, False, size, mtime, mode, self.uid, self.gid,
                              self.cfg.block_bytes, ttl, ttl)
        if node.kind.synthetic:
            mode, mtime = stat_mod.S_IFDIR | 0o555, self.started_ns
        else:
            mode, mtime = stat_mod.S_IFDIR | (0o755 if writable else 0o555), node.mtime_ns or self.started_ns
        return Attributes(node.ino, True, 0, mtime, mode, self.uid, self.gid, self.cfg.block_bytes, ttl, ttl)

    def node(self, ino: int) -> Inode:
        node = self.inodes.get(ino)
        if node is None:
            raise errors.fs_error(errors.ENOENT, f"unknown inode {ino}")
        return node

    def _visible(self, volume: Volume, caller: Caller | None) -> bool:
        return caller is None or caller.uid == 0 or volume.can_read(caller.uid, caller.groups)

    def check_write(self, node: Inode, caller: Caller | None) -> Volume:
        """The volume node lives in, if the caller may change things there."""
        if node.kind.synthetic:
            raise errors.fs_error(errors.EROFS, "the /Volumes levels above a volume are read-only")
        vol = node.volume
        assert vol is not None
        if vol.read_only:
            raise errors.fs_error(errors.EROFS, f"volume {vol.full_name} is read-only")
        if caller is not None and caller.uid != 0 and not vol.can_write(caller.uid, caller.groups):
            raise errors.fs_error(errors.EACCES, f"no write grant on volume {vol.full_name}")
        return vol

    # -- lookup ---------------------------------------------------------------------------------
    async def lookup(self, parent_ino: int, name: str, caller: Caller | None = None) -> Attributes | None:
        """Attributes of parent/name with one lookup reference counted, or None if it does not exist."""
        parent = self.node(parent_ino)
        node = await self._lookup(parent, name, caller)
        if node is None:
            return None
        node.lookups += 1
        return self.attributes(node)

    async def _lookup(self, parent: Inode, name: str, caller: Caller | None) -> Inode | None:
        if len(name.encode("utf-8", "surrogateescape")) > NAME_MAX_BYTES:
            raise errors.fs_error(errors.ENAMETOOLONG, "name longer than 255 bytes")
        if not parent.kind.is_dir:
            raise errors.fs_error(errors.ENOTDIR)
        if name in (".", ".."):
            raise errors.fs_error(errors.EINVAL, "'.' and '..' are resolved by the kernel")
        self.stats["lookups"] += 1
        if parent.kind is Kind.ROOT:
            if not any(self._visible(v, caller) for (c, _, _), v in self.catalog.volumes.items() if c == name):
                return None
            return self.inodes.add_child(parent, name, Kind.CATALOG, None)
        if parent.kind is Kind.CATALOG:
            if not any(self._visible(v, caller) for (c, s, _), v in self.catalog.volumes.items()
                       if c == parent.name and s == name):
                return None
            return self.inodes.add_child(parent, name, Kind.SCHEMA, None)
        if parent.kind is Kind.SCHEMA:
            assert parent.parent is not None
            vol = self.catalog.volume(parent.parent.name, parent.name, name)
            if vol is None or not self._visible(vol, caller):
                return None
            return self.inodes.add_child(parent, name, Kind.VOLUME, vol)
        return await self._lookup_child(parent, name)

    async def _lookup_child(self, parent: Inode, name: str) -> Inode | None:
        vol = parent.volume
        assert vol is not None
        key = parent.dir_prefix + name
        try:
            key_bytes = key.encode()
        except UnicodeEncodeError:
            return None  # not UTF-8: no object key can have this name (and none can be made: EINVAL)
        if len(key_bytes) > 1024:
            raise errors.fs_error(errors.ENAMETOOLONG, "object key would be longer than 1024 bytes")
        existing = parent.children_by_name.get(name)
        if existing is not None and existing.staged is not None:
            return existing  # local data not yet committed wins over what the store says
        if existing is not None and existing.attrs_fresh():
            return existing
        listing = parent.listing
        if listing is not None and not listing.fresh(self.cfg.metadata_ttl_s) and self._should_relist(parent):
            if self._skip_asking(vol):
                return self._stale_child(parent, name)
            try:
                await self.refresh_listing(parent)
            except errors.StoreError as e:
                if not self._unreachable(vol, e):
                    raise
                return self._stale_child(parent, name)
            listing = parent.listing
        if listing is not None and listing.fresh(self.cfg.metadata_ttl_s):
            self._maybe_refresh_ahead(parent, listing)
            # A listing is kept up to date with our own changes (see refresh_listing and commits).
            entry = listing.entries.get(name)
            if entry is None:
                return self._pending_local(parent, name, listing.as_of)
            return self._apply_entry(parent, name, entry, listing.as_of)
        ttl = self.cfg.metadata_ttl_s
        absent_at = parent.absent.get(name)
        if absent_at is not None:
            if time.monotonic() - absent_at < ttl:
                # Found absent less than a TTL ago, as the kernel's negative entry says: a create
                # or a rename to this name right after the kernel's own lookup (every one of them)
                # asks the store nothing again.
                self.stats["lookups_absent_known"] += 1
                return self._pending_local(parent, name, absent_at)
        if self._skip_asking(vol) and self._knows_child(parent, name):
            return self._stale_child(parent, name)
        try:
            entry, seen_at = await self._probe(vol, key)
        except errors.StoreError as e:
            if not (self._unreachable(vol, e) and self._knows_child(parent, name)):
                raise
            return self._stale_child(parent, name)
        parent.absent.pop(name, None)
        if entry is None or self._removed_since(parent, name, seen_at):
            if entry is None and name not in parent.children_by_name:
                self._note_absent(parent, name, seen_at)
            return self._pending_local(parent, name, seen_at)
        node = self._apply_entry(parent, name, entry, seen_at)
        # As for a revalidating HEAD: what this probe said is newer than any listing sent before
        # it, such as the older listing a directory handle reads (readdir), which must not bring
        # back the version it saw (opens would read it from the cache).
        self._changed_at[node] = max(self._changed_at.get(node, float("-inf")), seen_at)
        return node

    def _note_absent(self, parent: Inode, name: str, seen_at: float) -> None:
        absent = parent.absent
        if len(absent) >= ABSENT_NAMES_MAX:
            # Keep the memory bounded: what has expired goes, and if nothing has, all of it.
            now, ttl = time.monotonic(), self.cfg.metadata_ttl_s
            for n in [n for n, t in absent.items() if now - t >= ttl]:
                del absent[n]
            if len(absent) >= ABSENT_NAMES_MAX:
                absent.clear()
        absent[name] = seen_at

    def _pending_local(self, parent: Inode, name: str, seen_at: float | None = None) -> Inode | None:
        """A name the store does not know may still exist here (created, not yet committed; or
        committed after the store was asked)."""
        node = parent.children_by_name.get(name)
        if node is not None and (node.staged is not None or node.creating):
            return node
        if node is not None and seen_at is not None and self._changed_since(node, seen_at):
            return node
        if log.isEnabledFor(logging.DEBUG):
            log.debug("lookup %s/%s: absent by %s%s", parent.mount_path(), name,
                      "listing" if seen_at is None else f"probe sent at {seen_at:.3f}",
                      "" if node is None else f", forgetting inode {node.ino}")
        if node is not None:
            self.inodes.detach(node)
            if node.kind is Kind.FILE:
                self.retire_version(node.volume, node.key, node.etag)
        return None

    def _should_relist(self, parent: Inode) -> bool:
        """Refresh a whole expired listing rather than probe one name?

        Yes for directories that fit one LIST page, and for larger ones that are being looked up in
        bursts (a parallel copy): one LIST of 1,000 names beats 1,000 probes.
        """
        listing = parent.listing
        assert listing is not None
        n = len(listing.entries)
        if n > self.cfg.relist_max_entries:
            return False
        now = time.monotonic()
        if now - parent.hot_since > self.cfg.metadata_ttl_s:
            parent.hot_since, parent.hot_lookups = now, 0
        parent.hot_lookups += 1
        return parent.hot_lookups >= n // 1000 + 1

    def _maybe_refresh_ahead(self, parent: Inode, listing: Listing) -> None:
        """List a directory again in the background before its listing expires, while it is being
        looked up in a burst (a parallel copy into it, a loader opening its files).

        Otherwise the first lookup after expiry lists it again itself, and holds up everyone: the
        kernel keeps the directory's lock through a lookup, so every create in the directory waits
        for the LIST, once per TTL. That is 2 pages for 2,000 names, 10 pages of 10-30 ms each on
        a real store for 10,000. The refresh starts twice the last LIST's time before expiry (at
        least a tenth of the TTL, at most half), so that the new listing is in before the old one
        expires and a lookup never waits. While lookups go on, the directory is listed about once
        per TTL, a little more often than relisting on expiry (at most twice as often, for a LIST
        that takes a quarter of the TTL or more); it stops when the lookups stop. No more than
        REFRESH_AHEAD_MAX_IN_FLIGHT are on their way at once."""
        listing.lookups += 1
        if (listing.refreshed_ahead or listing.lookups < REFRESH_AHEAD_LOOKUPS or self._nursery is None
                or parent.listing_refresh is not None or len(listing.entries) > self.cfg.relist_max_entries):
            return
        ttl = self.cfg.metadata_ttl_s
        took = max(0.0, listing.fetched_at - listing.as_of)  # the LIST's own time
        lead = min(ttl * REFRESH_AHEAD_MAX_LEAD, max(2 * took, ttl * REFRESH_AHEAD_MIN_LEAD))
        if time.monotonic() - listing.fetched_at < ttl - lead:
            return
        if len(self._refreshing_ahead) >= REFRESH_AHEAD_MAX_IN_FLIGHT:
            self.stats["listings_ahead_skipped"] += 1
            return
        listing.refreshed_ahead = True
        self.stats["listings_ahead"] += 1
        self._refreshing_ahead.add(parent)
        self._nursery.start_soon(self._refresh_ahead, parent)

    async def _refresh_ahead(self, parent: Inode) -> None:
        try:
            await self.refresh_listing(parent)
        except Exception as e:  # noqa: BLE001 - the lookup after expiry lists it again, and reports
            log.debug("listing %s ahead of time failed: %s", parent.mount_path(), e)
        finally:
            self._refreshing_ahead.discard(parent)

    async def _probe(self, vol: Volume, key: str) -> tuple[Entry | None, float]:
        """What `key` is in the store: a directory (anything under key/), a file, or nothing; and
        since when that answer holds (when its requests were sent).

        Concurrent probes of one key share one pair of requests (64 parallel copies that all
        look up the same directory cost one probe, not 64)."""
        ident = (vol.full_name, key)
        while (shared := self._probes.get(ident)) is not None:
            await shared.done.wait()
            if shared.error is not None:
                raise shared.error
            if shared.ok:
                return shared.result, shared.started
            # Its owner was cancelled before an answer came: ask again.
        shared = _Shared()
        self._probes[ident] = shared
        try:
            shared.result = await self._probe_store(vol, key)
            shared.ok = True
            return shared.result, shared.started
        except Exception as e:
            shared.error = e
            raise
        finally:
            del self._probes[ident]
            shared.done.set()

    async def _probe_store(self, vol: Volume, key: str) -> Entry | None:
        store = self.store_for(vol)
        self.stats["probes"] += 1
        result: dict[str, object] = {}

        async def head() -> None:
            try:
                result["head"] = await store.head(vol.bucket, key)
            except errors.StoreError as e:
                if e.errno != errors.ENOENT:
                    raise

        async def list_dir() -> None:
            page = await store.list_page(vol.bucket, key + "/", max_keys=1)
            result["dir"] = bool(page.objects or page.prefixes)

        try:
            async with trio.open_nursery() as n:
                n.start_soon(head)
                n.start_soon(list_dir)
        except BaseExceptionGroup as group:
            # One store error speaks for the probe (a refusal before a lost connection), as a single
            # request's would: callers tell an unreachable store from an answer by it.
            failed, rest = group.split(errors.StoreError)
            if failed is None or rest is not None:
                raise
            leaves = list(errors.leaves(failed))
            raise min(leaves, key=lambda e: e.transient) from None
        self._reachable(vol)
        if result.get("dir"):
            return Entry(True)
        info = result.get("head")
        if info is not None:
            return Entry(False, info.size, info.etag, info.mtime_ns)
        return None

    def _describe(self, node: Inode, size: int, etag: str, mtime_ns: int) -> None:
        """Take the store's description of a file's object. The version this mount committed keeps
        the mtime it had here: Last-Modified (whole seconds) would move it, and tools that compare
        a file's times before and after reading it would see a change that is none (GNU tar exits 1
        with "file changed as we read it"). Another version takes the store's, and the version it
        replaces leaves the cache."""
        if not etag or etag != node.local_mtime_etag:
            node.mtime_ns = mtime_ns
            node.local_mtime_etag = ""
        if node.etag and etag != node.etag:
            self.retire_version(node.volume, node.key, node.etag)
        node.size, node.etag = size, etag

    def retire_version(self, vol: Volume | None, key: str, etag: str) -> None:
        """`key` no longer holds version `etag` in the store: this mount replaced, renamed or deleted
        it, or saw another version there. Its cached blocks are deleted, in a disk thread, unless a
        handle still reads them (then they go when its last handle closes, see `release`). Should
        the version come back (an ETag is the content's, for most uploads), it is fetched again: a
        wrong guess here costs a GET, never a wrong byte."""
        if self.cache is None or vol is None or not key or not etag or self._nursery is None:
            return
        version = ObjectVersion(self.store_for(vol).name, vol.bucket, key, etag)
        if self.cache.may_hold(version):  # (most deleted or changed files never were read here)
            self._nursery.start_soon(self._retire, version)

    def moved_version(self, vol: Volume, old_key: str, old_etag: str, copy: ObjectInfo | None) -> None:
        """A rename took `old_key` away, copying it to `copy.key` in the store where it made a copy.
        The copy holds the version its precondition named (`copy.source_etag`): that version's
        cached blocks become the copy's, in a disk thread. The version of the old key this mount
        knew (`old_etag`) is retired as any gone one is where it is not that one: no copy, a store
        that cannot say what it copied, or a change made elsewhere meanwhile."""
        source = copy.source_etag if copy is not None else ""
        if old_etag and old_etag != source:
            self.retire_version(vol, old_key, old_etag)
        if not source or self.cache is None or self._nursery is None:
            return
        store = self.store_for(vol).name
        old = ObjectVersion(store, vol.bucket, old_key, source)
        if self.cache.may_hold(old):
            self._nursery.start_soon(self._move_cached, old, ObjectVersion(store, vol.bucket, copy.key, copy.etag))

    async def _move_cached(self, old: ObjectVersion, new: ObjectVersion) -> None:
        assert self.cache is not None
        moved = await run_disk(self.cache.rekey, old, new)
        if moved:
            self.stats["cache_bytes_moved"] += moved
        await self._retire(old)  # what is left of it: segments of a handle's (pinned), or written meanwhile

    async def _retire(self, version: ObjectVersion) -> None:
        assert self.cache is not None
        freed = await run_disk(self.cache.retire, version)
        if freed:
            self.stats["cache_bytes_retired"] += freed

    def _apply_entry(self, parent: Inode, name: str, entry: Entry, seen_at: float | None = None) -> Inode:
        """The inode for a store entry, with the entry's attributes unless they are older (as of
        `seen_at`) than what this mount itself set since."""
        kind = Kind.DIR if entry.is_dir else Kind.FILE
        node = parent.children_by_name.get(name)
        if node is not None and node.staged is not None:
            return node
        if (node is not None and node.kind is kind and seen_at is not None
                and self._changed_since(node, seen_at)):
            return node
        if node is not None and kind is Kind.FILE and node.kind is Kind.FILE and self._outlived(node, entry.etag):
            # add_child below makes the name's new inode, which this lookup or readdirplus entry
            # hands the kernel: seeing another node id, it replaces its dentry of the name itself.
            self._supersede(node, tell_kernel=False)
        node = self.inodes.add_child(parent, name, kind, parent.volume)
        if kind is Kind.FILE:
            self._describe(node, entry.size, entry.etag, entry.mtime_ns)
        elif entry.mtime_ns:
            node.mtime_ns = entry.mtime_ns
        node.attr_expires = time.monotonic() + self.cfg.metadata_ttl_s
        return node

    # -- listings -------------------------------------------------------------------------------
    async def refresh_listing(self, parent: Inode) -> Listing:
        """List a directory from the store; concurrent callers share one listing."""
        while parent.listing_refresh is not None:
            before = parent.listing
            await parent.listing_refresh.wait()
            # That refresh may have failed (one started in the background, ahead of expiry, that
            # the caller never saw): the expired listing it was to replace is no answer. Then list
            # it here (or wait for whoever woke first and started listing).
            listing = parent.listing
            if listing is not None and (listing is not before or listing.fresh(self.cfg.metadata_ttl_s)):
                return listing
        done = trio.Event()
        parent.listing_refresh = done
        try:
            while True:
                started, prefix = time.monotonic(), parent.dir_prefix
                entries, marker = await self._list_all(parent)
                if parent.dir_prefix == prefix:
                    break
                # Renamed (itself or a directory above it) while the LIST was on its way: it listed
                # the old name's keys, which the rename deletes. Taken for the new name, it would
                # say the moved files do not exist, for a whole TTL. The new name is listed instead.
            self._overlay_local(parent, entries, started)
            parent.listing = Listing(entries, time.monotonic(), marker, asked_at=started)
            assert parent.volume is not None
            self._reachable(parent.volume)
            self._reconcile(parent, entries, started)
            return parent.listing
        finally:
            parent.listing_refresh = None
            done.set()
            self.inodes.sweep(parent)  # children the kernel forgot meanwhile, kept for the overlay

    async def _list_all(self, parent: Inode) -> tuple[dict[str, Entry], bool]:
        vol = parent.volume
        assert vol is not None
        store = self.store_for(vol)
        prefix = parent.dir_prefix
        entries: dict[str, Entry] = {}
        marker = False
        token = None
        self.stats["listings"] += 1
        while True:
            page = await store.list_page(vol.bucket, prefix, token=token)
            for p in page.prefixes:
                name = p[len(prefix):-1]
                if _usable_name(name, p):
                    entries[name] = Entry(True)
            for o in page.objects:
                name = o.key[len(prefix):]
                if not name:
                    marker = True  # the directory's own marker object
                    continue
                if name.endswith("/"):
                    name = name[:-1]
                    if _usable_name(name, o.key):
                        entries.setdefault(name, Entry(True, mtime_ns=o.mtime_ns))
                    continue
                if not _usable_name(name, o.key):
                    continue
                if name in entries and entries[name].is_dir:
                    log.info("%r is both an object and a directory; showing the directory", o.key)
                    continue
                entries[name] = Entry(False, o.size, o.etag, o.mtime_ns)
            token = page.next_token
            if token is None:
                return entries, marker

    def _reconcile(self, parent: Inode, entries: dict[str, Entry], since: float) -> None:
        """Bring known children in line with a fresh listing (true as of `since`)."""
        expires = time.monotonic() + self.cfg.metadata_ttl_s
        for name, node in list(parent.children_by_name.items()):
            if node.staged is not None or node.creating:
                continue
            if self._changed_since(node, since):
                continue  # known from a newer answer (a HEAD sent after the LIST) or our own change
            entry = entries.get(name)
            if entry is None or entry.is_dir != (node.kind is not Kind.FILE):
                log.debug("listing of %s: %s %s", parent.mount_path(), name,
                          "absent" if entry is None else "changed kind")
                self.inodes.detach(node)  # gone, or changed kind: a fresh lookup makes a new inode
                if node.kind is Kind.FILE:
                    self.retire_version(node.volume, node.key, node.etag)
                continue
            if node.kind is Kind.FILE:
                if self._outlived(node, entry.etag):
                    # The next lookup of the name makes its new inode. Not told to the kernel: an
                    # opendir's readdirplus is about to hand it that inode, whose fresh dentry a
                    # late invalidation would drop; otherwise the old dentry expires within the TTL.
                    self._supersede(node, tell_kernel=False)
                    continue
                self._describe(node, entry.size, entry.etag, entry.mtime_ns)
            node.attr_expires = expires

    async def opendir(self, ino: int, caller: Caller | None = None) -> int:
        node = self.node(ino)
        if not node.kind.is_dir:
            raise errors.fs_error(errors.ENOTDIR)
        entries: list[tuple[str, Entry | Kind]]
        as_of = time.monotonic()  # the catalog's names are true now; a listing's, as of its LIST
        if node.kind is Kind.ROOT:
            names = sorted({c for (c, _, _), v in self.catalog.volumes.items() if self._visible(v, caller)})
            entries = [(n, Kind.CATALOG) for n in names]
        elif node.kind is Kind.CATALOG:
            names = sorted({s for (c, s, _), v in self.catalog.volumes.items()
                            if c == node.name and self._visible(v, caller)})
            entries = [(n, Kind.SCHEMA) for n in names]
        elif node.kind is Kind.SCHEMA:
            assert node.parent is not None
            names = sorted(v for (c, s, v), vol in self.catalog.volumes.items()
                           if c == node.parent.name and s == node.name and self._visible(vol, caller))
            entries = [(n, Kind.VOLUME) for n in names]
        else:
            listing = node.listing
            assert node.volume is not None
            if listing is not None and not listing.fresh(self.cfg.metadata_ttl_s) and self._skip_asking(node.volume):
                self._answer_stale(node.volume)
            elif listing is None or not listing.fresh(self.cfg.metadata_ttl_s):
                try:
                    listing = await self.refresh_listing(node)
                except errors.StoreError as e:
                    if not self._unreachable(node.volume, e) or listing is None:
                        raise
                    self._answer_stale(node.volume)  # the last listing stands
            as_of = listing.as_of
            merged = dict(listing.entries)
            for name, child in node.children_by_name.items():
                if child.staged is not None:
                    merged[name] = Entry(False, child.staged.size, "", child.staged.mtime_ns)
            entries = sorted(merged.items())
        fh = next(self._next_fh)
        self._handles[fh] = DirHandle(node, entries, as_of=as_of)
        node.opens += 1
        return fh

    def readdir(self, fh: int, start: int) -> Iterator[tuple[int, str, Attributes]]:
        """Entries from index `start`: (index, name, attributes). Inodes are made as entries are asked
        for; `fs` counts a lookup only for entries the kernel accepted (see `entry_accepted`)."""
        h = self._handles.get(fh)
        if not isinstance(h, DirHandle):
            raise errors.fs_error(errors.EBADF)
        parent = h.inode
        for idx in range(start, len(h.entries)):
            name, what = h.entries[idx]
            if isinstance(what, Kind):
                vol = None
                if what is Kind.VOLUME:
                    assert parent.parent is not None
                    vol = self.catalog.volume(parent.parent.name, parent.name, name)
                node = self.inodes.add_child(parent, name, what, vol)
            else:
                # The snapshot fixed which names this handle lists; their attributes come from
                # what we know now, so a listing read long after opendir shows no state older
                # than our own changes since (a commit, an unlink).
                if self._removed_since(parent, name, h.opened_at) and name not in parent.children_by_name:
                    continue
                current = parent.listing.entries.get(name) if parent.listing is not None else None
                if (current is None and parent.listing is not None and parent.listing.as_of > h.as_of
                        and name not in parent.children_by_name):
                    continue  # gone in a listing newer than this handle's: never bring it back
                seen_at = parent.listing.as_of if current is not None else h.as_of
                node = self._apply_entry(parent, name, current or what, seen_at)
            yield idx, name, self.attributes(node)

    def dot_entries(self, fh: int) -> tuple[tuple[bytes, Attributes], tuple[bytes, Attributes]]:
        """"." and ".." of a directory handle: the directory itself and its parent (the root's is itself)."""
        h = self._handles.get(fh)
        if not isinstance(h, DirHandle):
            raise errors.fs_error(errors.EBADF)
        node = h.inode
        return (b".", self.attributes(node)), (b"..", self.attributes(node.parent or node))

    def entry_accepted(self, ino: int, accepted: bool) -> None:
        node = self.inodes.get(ino)
        if node is None:
            return
        if accepted:
            node.lookups += 1
        else:
            self.inodes.forget(ino, 0)

    def releasedir(self, fh: int) -> None:
        h = self._handles.pop(fh, None)
        if isinstance(h, DirHandle):
            self.inodes.release(h.inode)

    def forget(self, ino: int, n: int) -> None:
        self.inodes.forget(ino, n)

    # -- getattr --------------------------------------------------------------------------------
    def access(self, ino: int, mode: int, caller: Caller | None = None) -> None:
        """access(2): raise what a write (W_OK) or a run (X_OK) of ino would fail with. Without an
        answer the kernel takes every access for granted: `test -w` held a read-only volume writable."""
        node = self.node(ino)
        if mode & os.X_OK and node.kind is Kind.FILE:
            raise errors.fs_error(errors.EACCES, "no file here is executable (modes are not stored)")
        if mode & os.W_OK:
            self.check_write(node, caller)

    async def getattr(self, ino: int, caller: Caller | None = None) -> Attributes:
        node = self.node(ino)
        if node.kind is Kind.FILE and node.staged is None and not node.deleted and not node.attrs_fresh():
            try:
                await self._revalidate(node, tell_kernel=True)
            except OSError as e:
                # Deleted elsewhere while handles are open: the kernel asks for their file's
                # attributes before it reads through them (and for fstat). The file lives on for
                # them, as one unlinked here does; its name is gone (_revalidate).
                if e.errno != errors.ENOENT or not node.deleted or node.opens <= 0:
                    raise
        return self.attributes(node)

    async def _revalidate(self, node: Inode, *, tell_kernel: bool = False) -> None:
        """Check a file against the store (its attributes expired). With tell_kernel (a getattr of
        node), a name that no longer leads to node has its dentry invalidated: an open instead
        fails with ESTALE, whose retry looks the name up (see `_supersede`)."""
        parent = node.parent
        assert parent is not None and node.volume is not None
        if parent.listing is not None and parent.listing_refresh is not None:
            await parent.listing_refresh.wait()
            if node.attrs_fresh():
                return
        if self._skip_asking(node.volume):
            self._answer_stale(node.volume)
            return
        started = time.monotonic()
        try:
            info = await self.store_for(node.volume).head(node.volume.bucket, node.key)
        except errors.StoreError as e:
            if e.errno == errors.ENOENT and self._changed_since(node, started):
                return  # committed by us while the HEAD was on its way
            if self._unreachable(node.volume, e):
                self._answer_stale(node.volume)
                return  # what is known of it stands until the store answers again
            if e.errno == errors.ENOENT:
                log.debug("revalidate %s: not in the store (HEAD sent at %.3f)", node.mount_path(), started)
                # Deleted elsewhere. Existing handles keep what they have; new lookups see ENOENT,
                # also those the kernel would answer from its dentry (getattr of an inode with
                # handles open now answers with its attributes).
                named = parent.children_by_name.get(node.name) is node
                if named:
                    self._tell_listing(parent, node.name, None, started)
                self.inodes.detach(node)
                node.deleted = True
                self.retire_version(node.volume, node.key, node.etag)
                if named and tell_kernel and self.invalidate_entry is not None:
                    self.invalidate_entry(parent.ino, node.name)
                raise errors.fs_error(errors.ENOENT, "deleted in the store") from None
            raise
        self._reachable(node.volume)
        if self._changed_since(node, started):
            return  # we changed it while the HEAD was on its way: what we know is newer
        if self._outlived(node, info.etag):
            self._supersede(node, tell_kernel=tell_kernel)
            node = self.inodes.add_child(parent, node.name, Kind.FILE, node.volume)
        self._describe(node, info.size, info.etag, info.mtime_ns)
        node.attr_expires = time.monotonic() + self.cfg.metadata_ttl_s
        # What this HEAD said is newer than any listing or probe sent before it: those must not
        # bring back an older version when they arrive (or are read from a directory handle) later.
        self._changed_at[node] = max(self._changed_at.get(node, float("-inf")), started)
        self._tell_listing(parent, node.name, Entry(False, info.size, info.etag, info.mtime_ns), started)

    @staticmethod
    def _tell_listing(parent: Inode, name: str, entry: Entry | None, seen_at: float) -> None:
        """A HEAD sent at `seen_at` found parent/name so (None: absent). A listing of parent older
        than that learns it too: it answers lookups of the name until it expires, also once the
        kernel has forgotten the name's inode, and would bring back the version the HEAD found
        replaced, or the file it found deleted (its record on the inode goes with the inode)."""
        listing = parent.listing
        if listing is None or listing.as_of >= seen_at:
            return
        if entry is None:
            listing.entries.pop(name, None)
        else:
            listing.entries[name] = entry

    # -- open / read / release ------------------------------------------------------------------
    async def open(self, ino: int, flags: int, caller: Caller | None = None) -> tuple[int, bool]:
        """Open a file; returns (fh, keep_cache)."""
        node = self.node(ino)
        if node.kind.is_dir:
            raise errors.fs_error(errors.EISDIR)
        self._refuse_superseded(node)
        if node.deleted and node.staged is None:
            # Unlinked or replaced by a rename while this open was on its way: the kernel's dentry
            # leads here until that returns. What the inode stood for is gone (a last close that
            # was never committed, or an object deleted): not an older version of it from the
            # store or the cache. ESTALE makes the kernel look the name up again.
            raise errors.fs_error(errors.ESTALE, f"{node.mount_path()} (inode {node.ino}): removed while this open "
                                             "was on its way")
        accmode = flags & os.O_ACCMODE
        writable = accmode != os.O_RDONLY
        if writable or flags & os.O_TRUNC:
            self.check_write(node, caller)
            if self.committer is None:
                raise errors.fs_error(errors.EROFS, "this mount is read-only")
            if node.staged is None and not node.attrs_fresh() and not node.deleted:
                await self._revalidate(node)
                self._refuse_superseded(node)
            append_only = _append_only(flags)
            staged = await self.committer.stage(node, truncate=bool(flags & os.O_TRUNC), append_only=append_only)
            return self._staged_handle(node, staged, writable, append_only=append_only,
                                       direct=_direct(flags)), False
        if node.staged is not None:
            return self._staged_handle(node, node.staged, False, direct=_direct(flags)), False
        if not node.attrs_fresh() and not node.deleted:
            await self._revalidate(node)
            self._refuse_superseded(node)
            if node.staged is not None:
                # Written meanwhile, maybe by a passthrough writer, beside whom the kernel would
                # refuse this open in page-cache mode (EIO): read what is staged, as it would.
                return self._staged_handle(node, node.staged, False, direct=_direct(flags)), False
        return self.open_version(node)

    def _staged_handle(self, node: Inode, staged, writable: bool, *, append_only: bool = False,
                       direct: bool = False) -> int:
        passthrough = self._may_passthrough(node, staged, direct)
        staged.handles += 1
        if writable:
            staged.writers += 1
        h = FileHandle(node, None, staged.size, writable=writable, staged=staged, append_only=append_only)
        fh = self._new_handle(h)
        if passthrough and self.passthrough.grant(fh, staged.backing_id):
            h.passthrough = True
            self.committer.passthrough_opened(staged, writable, append_only)
            self.stats["passthrough_opens"] += 1
        return fh

    def _may_passthrough(self, node: Inode, staged, direct: bool = False) -> bool:
        """Whether a new handle of a staged file opens in passthrough mode (ucfs.passthrough).

        The kernel fails an open with EIO if it would mix passthrough and page-cache opens of one
        inode. So: always while other passthrough handles are open (the kernel may have released
        some of those we still count, never one we do not), never while any other handle is open,
        and otherwise for files whose content is new or changed (created, truncated, written): a
        passthrough writer's every close counts as a change, which would upload a file that was
        merely opened for writing again.

        Not for an O_DIRECT open either, unless the kernel leaves no choice: it opens the backing
        file with the flags of the open, and a later fcntl(F_SETFL) that clears O_DIRECT does not
        reach that file. Its unaligned reads and writes, which the caller has just made legal
        (GNU dd oflag=direct does so for a short last block), then fail with EINVAL."""
        pt = self.passthrough
        if pt is None or self.committer is None:
            return False
        if staged.pt_handles:
            return True
        if direct or node.opens or not staged.dirty or not pt.active:
            return False
        if staged.backing_id is None:
            staged.backing_id = pt.open_backing(staged.fd)
        return staged.backing_id is not None

    def _version(self, node: Inode) -> ObjectVersion:
        vol = node.volume
        assert vol is not None
        return ObjectVersion(self.store_for(vol).name, vol.bucket, node.key, node.etag)

    def open_version(self, node: Inode) -> tuple[int, bool]:
        version = self._version(node)
        if self.cache is not None:
            self.cache.pin(version)
        if any(isinstance(h, FileHandle) and h.inode is node and h.version is not None and not h.direct
               and h.version.etag != version.etag for h in self._handles.values()):
            # Handles of an older version still read through the kernel's page cache of this inode,
            # which every handle shares: pages of this version there would be served to them as
            # theirs. So this handle reads past the page cache (direct I/O), and the pages stay
            # the older version's until its last handle closes.
            fh = self._new_handle(FileHandle(node, version, node.size, direct=True))
            self._skip_flush(fh)
            return fh, True
        # Pages cached by the kernel belong to one version; keep them only if it is still current.
        keep_cache = node.page_cache_etag == node.etag
        node.page_cache_etag = node.etag
        fh = self._new_handle(FileHandle(node, version, node.size))
        self._skip_flush(fh)
        return fh, keep_cache

    def _skip_flush(self, fh: int) -> None:
        """A handle reading a version from the store has nothing to do at close (`flush` returns at
        once for it), yet every close() of it waited for a round trip through this daemon: the
        kernel is asked to send none (FOPEN_NOFLUSH). Its release still comes."""
        if self.passthrough is not None:
            self.passthrough.skip_flush(fh)

    def _new_handle(self, h: FileHandle) -> int:
        fh = next(self._next_fh)
        self._handles[fh] = h
        h.inode.opens += 1
        self.stats["opens"] += 1
        return fh

    def reads_direct(self, fh: int) -> bool:
        h = self._handles.get(fh)
        return isinstance(h, FileHandle) and h.direct

    def file_handle(self, fh: int) -> FileHandle:
        h = self._handles.get(fh)
        if not isinstance(h, FileHandle):
            raise errors.fs_error(errors.EBADF)
        return h

    async def read(self, fh: int, off: int, size: int) -> bytes | memoryview | tuple[memoryview, ...]:
        h = self.file_handle(fh)
        node = h.inode
        if node.staged is not None:
            # Read-your-writes: local data not yet committed is the file's content.
            s = node.staged
            data = await self.committer.read_staged(node, off, size)
            if (len(data) < size and (s.shrinking or h.sized_at < s.shrunk_at)
                    and off + len(data) < min(off + size, s.high_water)):
                # The file was truncated (rewritten) while this handle was open, and this read was
                # asked for when it was longer. A short answer inside the size the kernel may still
                # believe is filled with zeros by the kernel - bytes of no version of the file - so
                # say that the file changed instead.
                raise errors.fs_error(errors.ESTALE, f"{node.mount_path()}: file was truncated while open")
            return data
        if h.version is None:
            # Opened while the file was local only; it has been committed since.
            h.version, h.size = self._version(node), node.size
            if self.cache is not None:
                self.cache.pin(h.version)
        if h.reader is None:
            vol = node.volume
            assert vol is not None and self._nursery is not None
            h.reader = ObjectReader(store=self.store_for(vol), bucket=vol.bucket, key=h.version.key,
                                    version=h.version, size=h.size, cache=self.cache, budget=self.budget,
                                    cfg=self.cfg, nursery=self._nursery, stats=self.stats, pool=self.pool,
                                    inflight=self.inflight)
        self.stats["reads"] += 1
        if not h.direct:
            self._check_page_cache(node, h.version)
        try:
            data = await h.reader.read(off, size, pieces=self.vectored_replies)
        except errors.StaleError:
            node.attr_expires = 0.0  # the next open looks again
            raise
        if not h.direct:
            self._check_page_cache(node, h.version)  # a newer open may have come while we fetched
        return data

    @staticmethod
    def _check_page_cache(node: Inode, version: ObjectVersion) -> None:
        """A handle may read its own version only while the kernel's page cache of the inode holds
        that version. Once a newer version was opened here (the kernel dropped the old pages then)
        or written here, every reply of this handle would put old bytes into the cache that the
        newer readers share: they would read the old version. So the old handle gets ESTALE
        (README "Semantics": Reads)."""
        if node.page_cache_etag is not None and node.page_cache_etag != version.etag:
            raise errors.fs_error(errors.ESTALE, f"{node.mount_path()}: file changed since it was opened")

    async def release(self, fh: int) -> None:
        h = self._handles.pop(fh, None)
        if not isinstance(h, FileHandle):
            return
        try:
            if h.staged is not None:
                if h.passthrough:
                    self.committer.passthrough_closed(h.staged, h.writable, h.append_only)
                await self.committer.release(h)
        finally:
            if h.reader is not None:
                h.reader.close()
            if h.version is not None and self.cache is not None:
                self.cache.unpin(h.version)
                node = h.inode
                if node.deleted or node.key != h.version.key or (node.etag and node.etag != h.version.etag):
                    # The last reader of a version the store no longer holds (unless other handles
                    # still read it: `retire` leaves pinned versions alone).
                    self.retire_version(node.volume, h.version.key, h.version.etag)
            self.inodes.release(h.inode)

    # -- writes ---------------------------------------------------------------------------------
    def _writer(self, caller: Caller | None, node: Inode) -> Volume:
        vol = self.check_write(node, caller)
        if self.committer is None:
            raise errors.fs_error(errors.EROFS, "this mount is read-only")
        return vol

    def _check_new_name(self, parent: Inode, name: str, *, is_dir: bool = False) -> str:
        if len(name.encode("utf-8", "surrogateescape")) > NAME_MAX_BYTES:
            raise errors.fs_error(errors.ENAMETOOLONG, "name longer than 255 bytes")
        key = parent.dir_prefix + name + ("/" if is_dir else "")
        if len(key.encode("utf-8", "surrogateescape")) > 1024:
            raise errors.fs_error(errors.ENAMETOOLONG, "object key would be longer than 1024 bytes")
        try:
            key.encode("utf-8")
        except UnicodeEncodeError:
            raise errors.fs_error(errors.EINVAL, "object keys must be valid UTF-8") from None
        return key

    async def create(self, parent_ino: int, name: str, flags: int,
                     caller: Caller | None = None) -> tuple[int, Attributes]:
        parent = self.node(parent_ino)
        self._writer(caller, parent)
        self._check_new_name(parent, name)
        existing = await self._lookup(parent, name, caller)
        if existing is not None:
            if flags & os.O_EXCL:
                raise errors.fs_error(errors.EEXIST)
            if existing.kind.is_dir:
                raise errors.fs_error(errors.EISDIR)
            node = existing
            staged = await self.committer.stage(node, truncate=bool(flags & os.O_TRUNC),
                                                append_only=_append_only(flags))
        else:
            node = self.inodes.add_child(parent, name, Kind.FILE, parent.volume)
            node.size, node.etag, node.mtime_ns = 0, "", time.time_ns()
            # Until its staging file exists the new name is known only here: a listing refreshed
            # meanwhile must not take it away (the kernel holds the directory lock for the create,
            # but opendir and revalidating lookups reach us without it).
            node.creating += 1
            try:
                staged = await self.committer.stage(node, truncate=True)
            finally:
                node.creating -= 1
                if node.staged is None:
                    self.inodes.detach(node)  # the create failed: the name was never made
        node.deleted = False
        node.lookups += 1
        self.note_changed(node)
        fh = self._staged_handle(node, staged, (flags & os.O_ACCMODE) != os.O_RDONLY,
                                 append_only=_append_only(flags), direct=_direct(flags))
        self.stats["creates"] += 1
        return fh, self.attributes(node)

    async def write(self, fh: int, off: int, data: bytes) -> int:
        h = self.file_handle(fh)
        if not h.writable or h.staged is None:
            raise errors.fs_error(errors.EBADF, "not open for writing")
        self.stats["writes"] += 1
        return await self.committer.write(h.staged, off, data)

    async def flush(self, fh: int) -> None:
        self.stats["flushes"] += 1
        h = self.file_handle(fh)
        s = h.staged
        if s is None:
            return
        if h.writable or s.writers == 0:
            await self.committer.flush(s, unseen=h.passthrough and h.writable, append_only=h.append_only)
        elif s.error is not None:
            # A reader's close while a writer still writes records nothing: recording would make
            # the half-written content the file's closed version (published after a crash). It
            # still reports a failed commit, as every close does.
            raise s.error

    async def fsync(self, fh: int) -> None:
        """fsync(2) syncs the file, not the handle: a handle that reads the committed object also
        waits for what other handles or a truncate(2) have changed since it opened."""
        h = self.file_handle(fh)
        s = h.staged if h.staged is not None else h.inode.staged
        if s is not None and self.committer is not None:
            await self.committer.fsync(s)

    async def fsyncdir(self, fh: int) -> None:
        h = self._handles.get(fh)
        if not isinstance(h, DirHandle):
            raise errors.fs_error(errors.EBADF)
        if self.committer is not None and h.inode.volume is not None:
            await self.committer.fsync_tree(h.inode)
        elif self.committer is not None and h.inode.kind.synthetic:
            for s in list(self.committer.staged.values()):
                if s.dirty and not s.dropped:
                    await self.committer.fsync(s)

    async def setattr(self, ino: int, *, size: int | None = None, mtime_ns: int | None = None,
                      fh: int | None = None, caller: Caller | None = None, changes: bool = False) -> Attributes:
        """truncate, utimens, chmod, chown. Only the size and a file's mtime are kept, but
        each is a change: EROFS on a read-only volume or a synthetic level, EACCES without a write
        grant, as for any write."""
        node = self.node(ino)
        if changes or size is not None or mtime_ns is not None:
            self._writer(caller, node)
        if size is not None:
            if node.kind.is_dir:
                raise errors.fs_error(errors.EISDIR)
            self._refuse_superseded(node)
            staged = node.staged or await self.committer.stage(node, truncate=size == 0)
            # truncate(1), or the kernel's O_TRUNC before an open, holds no handle: pin the staging
            # file so a commit finishing meanwhile cannot retire it under us.
            self.committer.pin(staged)
            try:
                if staged.pt_writers:
                    self.committer.observe(staged)
                if staged.size != size or size == 0:
                    await self.committer.truncate(staged, size)
                    h = self._handles.get(fh) if fh is not None else None
                    if isinstance(h, FileHandle) and h.inode is node:
                        h.sized_at = time.monotonic()  # ftruncate: this handle has seen the new size
                if staged.writers == 0:
                    await self.committer.flush(staged)  # no open file: commit it
            finally:
                self.committer.unpin(staged)
        if mtime_ns is not None and node.staged is not None:
            if node.staged.pt_writers:
                # Take in what passthrough writers wrote before this (futimens after the writes,
                # as tar x does): the next look at the staging file would otherwise put the
                # mtime of those writes back over the one set here.
                self.committer.observe(node.staged)
            node.staged.mtime_ns = mtime_ns
        if mtime_ns is not None and node.kind is Kind.FILE and node.etag:
            # The version in the store: it keeps no mtime of ours, so this host keeps this one for
            # it, as for a version committed here (_describe). Also when staged: touch opens the
            # file for writing first, and a staged copy closed unchanged is dropped, not committed.
            # Left to the store, the old time came back at the end of the TTL: a stamp file
            # touched again went back in time by itself.
            node.mtime_ns = mtime_ns
            node.local_mtime_etag = node.etag
        # Modes and owners are not kept by an object store; accepting them lets cp -a, rsync and tar work.
        return self.attributes(node)

    async def mkdir(self, parent_ino: int, name: str, caller: Caller | None = None) -> Attributes:
        parent = self.node(parent_ino)
        vol = self._writer(caller, parent)
        key = self._check_new_name(parent, name, is_dir=True)
        if await self._lookup(parent, name, caller) is not None:
            raise errors.fs_error(errors.EEXIST)
        await self.store_for(vol).put(vol.bucket, key, b"", 0)  # the marker that makes it exist
        node = self.inodes.add_child(parent, name, Kind.DIR, vol)
        node.mtime_ns = time.time_ns()
        node.attr_expires = time.monotonic() + self.cfg.metadata_ttl_s
        node.listing = Listing({}, time.monotonic())
        self.note_changed(node)
        node.lookups += 1
        if parent.listing is not None:
            parent.listing.entries[name] = Entry(True, mtime_ns=node.mtime_ns)
        self.stats["mkdirs"] += 1
        return self.attributes(node)

    async def unlink(self, parent_ino: int, name: str, caller: Caller | None = None) -> None:
        parent = self.node(parent_ino)
        vol = self._writer(caller, parent)
        node = await self._lookup(parent, name, caller)
        if node is None:
            raise errors.fs_error(errors.ENOENT)
        if node.kind.is_dir:
            raise errors.fs_error(errors.EISDIR)
        if log.isEnabledFor(logging.DEBUG):
            log.debug("unlink %s (inode %d, staged %s)", node.mount_path(), node.ino, node.staged is not None)
        await self._keep_unlinked_for_readers(node)
        # A file taken up from the journal at mount was made without asking the store: an older
        # object may be under its key all the same.
        replayed = node.staged is not None and node.staged.replayed
        # The name goes here before the store is asked, and nothing the store says of it counts
        # until the DELETE is done: the object is older than what is dropped when the file's last
        # close was not committed yet, and a lookup or a listing meanwhile would have served it. An
        # open through the kernel's dentry, which stays until the unlink returns, reads that last
        # close: the staging file is kept until then (dropped, never committed).
        held = node.staged
        if held is not None:
            self.committer.pin(held)
        try:
            if held is not None:
                await self.committer.drop(held)
            if node.etag or replayed:  # the ETag as it is now: a commit may have finished meanwhile
                await self._settle_journal()
                key, etag = node.key, node.etag
                with self._store_unheard(parent, name):
                    self._unname(parent, node)
                    await self.store_for(vol).delete(vol.bucket, key)
                self.retire_version(vol, key, etag)
                await self._keep_dir(parent)
            else:
                await self._forget_name(parent, node)
        finally:
            if held is not None:
                self.committer.unpin(held)
        self.stats["unlinks"] += 1

    def _object_readers(self, node: Inode) -> list[FileHandle]:
        """node's open handles that read its object from the store (not a staging file)."""
        return [h for h in self._handles.values()
                if isinstance(h, FileHandle) and h.inode is node and h.staged is None and h.version is not None]

    def _outlived(self, node: Inode, etag: str) -> bool:
        """Whether the store's version `etag` of node's name replaces a version that handles open
        here still read: then the name gets a new inode for the new version (`_supersede`)."""
        return (node.staged is None and bool(node.etag) and etag != node.etag
                and any(h.version.etag != etag for h in self._object_readers(node)))

    def _supersede(self, node: Inode, *, tell_kernel: bool) -> None:
        """A newer version of node's object was seen in the store while handles of node's own
        version are open. The kernel keeps one size and one page cache per inode: had node taken
        the new version's attributes, those handles would have been cut short at a smaller new
        size (the kernel ends reads at an inode's size without asking us) or served pages of the
        new version. So node stays as it is, for them, as a file replaced under its name does on a
        local file system, and the name gets a new inode (the caller's next add_child): an open
        through the old one is ESTALE, which makes the kernel look the name up again.

        With tell_kernel, the kernel's dentry of the name is invalidated, so that a path walk looks
        the name up again at once. Only where no reply of this request hands the kernel the new
        inode: the invalidation runs later, in pyfuse3's thread, and drops whatever dentry the name
        has by then (the kernel does not compare inodes first). Dropping the new inode's fresh
        dentry makes the kernel forget that inode, and the name's next lookup gives the same
        version yet another inode number."""
        parent = node.parent
        assert parent is not None
        self.inodes.detach(node)
        node.deleted = node.superseded = True
        self.stats["versions_superseded"] += 1
        log.debug("%s: a newer version is in the store while %d handle(s) read inode %d; the name "
                  "gets a new inode", node.mount_path(), len(self._object_readers(node)), node.ino)
        if tell_kernel and self.invalidate_entry is not None:
            self.invalidate_entry(parent.ino, node.name)

    @staticmethod
    def _refuse_superseded(node: Inode) -> None:
        if node.superseded:
            # The kernel answers an open that fails so by looking the path up again and retrying
            # once: that finds the name's new inode.
            raise errors.fs_error(errors.ESTALE, f"{node.mount_path()} (inode {node.ino}): replaced in the store "
                                             "by a newer version")

    async def _follow_rename(self, node: Inode, new_key: str, new_etag: str) -> None:
        """node's object was copied to `new_key` and its old key is about to go: handles reading it
        must read on under the new name, as open files do on a local file system. When the copy
        kept the ETag the bytes are the same, and the handles are pointed at it; otherwise (a copy
        in parts makes a new ETag) they are given a local copy, as for an unlink."""
        readers = self._object_readers(node)
        if not readers or node.superseded:
            # A superseded inode's version is not in the store any more: what the copy moved is
            # the newer one, whose own inode the name has. Its handles read on from the cache, as
            # they did before the rename (a copy of it from the store would fail, and the rename).
            return
        if any(h.version.etag != new_etag for h in readers):
            await self._keep_for_open_handles(node)
            return
        for h in readers:
            old = h.version
            h.version = ObjectVersion(old.store, old.bucket, new_key, old.etag)
            if self.cache is not None:
                self.cache.pin(h.version)
                self.cache.unpin(old)
            if h.reader is not None:
                h.reader.key, h.reader.version = new_key, h.version

    async def _settle_journal(self) -> None:
        """Before a committed object is deleted (unlink, the old name of a rename): a journal row of
        it whose removal a power loss undid would publish it again at the next mount."""
        if self.committer is not None:
            await self.committer.settle_journal()

    async def _keep_unlinked_for_readers(self, node: Inode) -> None:
        """node's name goes (unlink, or a rename over it): handles open on its committed object keep
        reading it, from a local copy (`_keep_for_open_handles`)."""
        if node.etag and node.opens > 0 and node.staged is None:
            await self._keep_for_open_handles(node)

    async def _keep_for_open_handles(self, node: Inode) -> None:
        """node's object is about to be deleted while handles still read it. Read-ahead may not
        have fetched all of it yet, and the store will not serve it again, so copy it into a
        staging file (as an open for writing would) that those handles read from, that is never
        committed (unlink drops it), and that goes with their last close."""
        if not self._object_readers(node):
            return
        s = await self.committer.stage(node, truncate=False)
        for h in self._object_readers(node):  # again: more may have opened during the copy
            h.staged = s
            s.handles += 1
        self.stats["unlinked_while_open"] += 1

    async def _forget_name(self, parent: Inode, node: Inode) -> None:
        """node is gone from parent: drop it from caches, and keep parent itself alive in the store."""
        self._note_removed(parent, node.name)
        self._unname(parent, node)
        await self._keep_dir(parent)

    def _unname(self, parent: Inode, node: Inode) -> None:
        self.inodes.detach(node)
        node.deleted = True
        if parent.listing is not None:
            parent.listing.entries.pop(node.name, None)

    async def _keep_dir(self, d: Inode) -> None:
        """d has just lost an entry. If that entry was what made d exist in the store (a directory
        without a marker is only the common prefix of what lies beneath it), keep d, as a local file
        system would, by giving it a marker. Without a listing of d, one short LIST tells."""
        if d.kind is not Kind.DIR or d.deleted:
            return
        if any(c.staged is not None and not c.staged.dropped for c in d.children_by_name.values()):
            return  # something beneath is on its way to the store
        vol = d.volume
        store = self.store_for(vol)
        listing = d.listing
        if listing is not None:
            if listing.entries or listing.marker:
                return
        elif any(c.etag or c.kind.is_dir for c in d.children_by_name.values()):
            return  # a sibling we know is in the store keeps it (rm of files by name: no LIST each)
        else:
            page = await store.list_page(vol.bucket, d.dir_prefix, max_keys=1)
            if page.objects or page.prefixes:
                return  # its marker, or something else beneath it
        await store.put(vol.bucket, d.dir_prefix, b"", 0)
        if listing is not None:
            listing.marker = True

    async def _is_empty(self, node: Inode) -> bool:
        # Files still to be committed anywhere beneath: a subdirectory without a marker (a prefix
        # only, or made by a journal replay) would hide them from the children's own view.
        p, vol = node.dir_prefix, node.volume
        if any(not s.dropped and s.volume is vol and s.node.key.startswith(p)
               for s in self.committer.staged.values()):
            return False
        page = await self.store_for(vol).list_page(vol.bucket, node.dir_prefix, max_keys=2)
        keys = [o.key for o in page.objects if o.key != node.dir_prefix]
        return not keys and not page.prefixes

    async def rmdir(self, parent_ino: int, name: str, caller: Caller | None = None) -> None:
        parent = self.node(parent_ino)
        vol = self._writer(caller, parent)
        node = await self._lookup(parent, name, caller)
        if node is None:
            raise errors.fs_error(errors.ENOENT)
        if not node.kind.is_dir:
            raise errors.fs_error(errors.ENOTDIR)
        if not await self._is_empty(node):
            raise errors.fs_error(errors.ENOTEMPTY)
        await self.store_for(vol).delete(vol.bucket, node.dir_prefix)
        await self._forget_name(parent, node)
        self.stats["rmdirs"] += 1

    async def rename(self, old_parent_ino: int, old_name: str, new_parent_ino: int, new_name: str,
                     flags: int = 0, caller: Caller | None = None) -> None:
        old_parent = self.node(old_parent_ino)
        new_parent = self.node(new_parent_ino)
        vol = self._writer(caller, old_parent)
        if self._writer(caller, new_parent) is not vol:
            raise errors.fs_error(errors.EXDEV, "rename across volumes")  # mv then copies and deletes
        if flags & ~RENAME_NOREPLACE:
            # RENAME_EXCHANGE, RENAME_WHITEOUT: done as a plain rename, either would lie.
            raise errors.fs_error(errors.EINVAL, f"unsupported rename flags {flags:#x}")
        node = await self._lookup(old_parent, old_name, caller)
        if node is None:
            raise errors.fs_error(errors.ENOENT)
        self._check_new_name(new_parent, new_name, is_dir=node.kind.is_dir)
        # Moving a directory into itself would make it its own ancestor.
        p: Inode | None = new_parent
        while p is not None:
            if p is node:
                raise errors.fs_error(errors.EINVAL, "cannot move a directory into itself")
            p = p.parent
        target = await self._lookup(new_parent, new_name, caller)
        if target is node:
            return
        if target is not None:
            if flags & RENAME_NOREPLACE:
                raise errors.fs_error(errors.EEXIST)
            if target.kind.is_dir and not node.kind.is_dir:
                raise errors.fs_error(errors.EISDIR)
            if node.kind.is_dir and not target.kind.is_dir:
                raise errors.fs_error(errors.ENOTDIR)
            if target.kind.is_dir and not await self._is_empty(target):
                raise errors.fs_error(errors.ENOTEMPTY)
        store = self.store_for(vol)
        if log.isEnabledFor(logging.DEBUG):
            log.debug("rename %s -> %s/%s (inode %d, staged %s, replacing %s)", node.mount_path(),
                      new_parent.mount_path(), new_name, node.ino, node.staged is not None,
                      "nothing" if target is None else f"inode {target.ino}")
        # The replaced file goes at once, and until the rename is done nothing the store says of
        # the name counts: its object there is older than the replaced file's last close when that
        # was not committed yet, and a lookup meanwhile would have served it. An open through the
        # kernel's dentry, which stays until the rename returns, reads that last close: its staging
        # file is kept until then (dropped, never committed).
        held = target.staged if target is not None else None
        if held is not None:
            self.committer.pin(held)
        try:
            with self._store_unheard(new_parent, new_name) if target is not None else contextlib.nullcontext():
                if node.kind is Kind.FILE:
                    await self._rename_file(store, vol, node, target, new_parent, new_name)
                else:
                    await self._rename_dir(store, vol, node, target, new_parent, new_name)
        finally:
            if held is not None:
                self.committer.unpin(held)
        if old_parent.listing is not None:
            old_parent.listing.entries.pop(old_name, None)
        if old_parent is not new_parent:
            await self._keep_dir(old_parent)
        if new_parent.listing is not None:
            new_parent.listing.entries[new_name] = (
                Entry(True, mtime_ns=node.mtime_ns) if node.kind.is_dir
                else Entry(False, node.size, node.etag, node.mtime_ns))
        self._note_removed(old_parent, old_name)
        self.note_changed(node)
        self.stats["renames"] += 1

    async def _rename_file(self, store: AsyncStore, vol: Volume, node: Inode, target: Inode | None,
                           new_parent: Inode, new_name: str) -> None:
        if target is not None:
            # The replaced file is unlinked: handles that read its object keep reading it, as they
            # do after an unlink (the store will soon hold the new content there).
            await self._keep_unlinked_for_readers(target)
            if target.staged is not None:
                await self.committer.drop(target.staged)
            self.inodes.detach(target)
            target.deleted = True
            self.retire_version(vol, target.key, target.etag)  # replaced by what is renamed over it
        old_key = node.key
        if node.staged is None:
            # Committed file: copy on the server, then remove the old name.
            new_key = new_parent.dir_prefix + new_name
            info = await store.copy(vol.bucket, old_key, new_key)
            await self._follow_rename(node, new_key, info.etag)
            await self._settle_journal()
            await store.delete(vol.bucket, old_key)
            self.moved_version(vol, old_key, node.etag, info)
            self.inodes.move(node, new_parent, new_name)
            if node.local_mtime_etag and node.local_mtime_etag == node.etag:
                node.local_mtime_etag = info.etag  # renamed, not changed: its mtime stays
            node.etag = info.etag
            node.page_cache_etag = info.etag if node.page_cache_etag else None
            return
        # Local data: it is committed under the new name; whatever the old name held goes.
        had_remote = bool(node.etag) or node.staged.replayed
        old_parent, old_name, old_etag = node.parent, node.name, node.etag
        self.inodes.move(node, new_parent, new_name)
        # As for an unlink: the old name's object, if any, is older than the file's last close, and
        # until it is deleted nothing the store says of that name counts.
        with self._store_unheard(old_parent, old_name):
            if old_parent.listing is not None:
                old_parent.listing.entries.pop(old_name, None)
            await self._move_staged(store, vol, node, target, old_key, old_parent, old_name, old_etag, had_remote)

    async def _move_staged(self, store: AsyncStore, vol: Volume, node: Inode, target: Inode | None, old_key: str,
                           old_parent: Inode, old_name: str, old_etag: str, had_remote: bool) -> None:
        # The replaced file's object stays under the new name until our commit overwrites it. The
        # node now stands for that object, so that an unlink (or another rename) before the commit
        # deletes it: otherwise the old content would come back once the listing is refreshed. Set
        # before any await: a commit finishing meanwhile records the new object's ETag here.
        node.etag = target.etag if target is not None else ""
        try:
            plan = await self.committer.renamed(node.staged, old_key)
        except OSError:
            # Not recorded (the journal's disk full): the file keeps its name, as the failed rename
            # says; it was renamed all the same, its row left under the old name. (A file it was to
            # replace stays replaced: its object, if any, is listed again.)
            self.inodes.move(node, old_parent, old_name)
            node.etag = old_etag
            raise
        if (had_remote or plan.old_object) and not plan.copied:  # (copied: the committer deleted it)
            await self._settle_journal()
            await store.delete(vol.bucket, old_key)
        self.moved_version(vol, old_key, old_etag, plan.copy)  # the old name's object, committed before the rename

    async def _rename_dir(self, store: AsyncStore, vol: Volume, node: Inode, target: Inode | None,
                          new_parent: Inode, new_name: str) -> None:
        """Copy every object under the old prefix to the new one, then delete the old ones. Not atomic:
        another host may see both or part of each while it runs (README "Semantics")."""
        old_prefix = node.dir_prefix
        new_prefix = new_parent.dir_prefix + new_name + "/"
        staged = [s for s in self.committer.staged.values()
                  if not s.dropped and s.volume is vol and s.node.key.startswith(old_prefix)]
        async with contextlib.AsyncExitStack() as stack:
            # No commit beneath may land under the old name while we move things: hold them all.
            # Each commit in progress is asked to give up when its turn comes: asked all at once,
            # one given up while we wait for another's lock could be started afresh by a worker,
            # and then run to its end before we get its lock.
            for s in staged:
                await stack.enter_async_context(self.committer.namespace_lock(s))
            # A commit that finished while we waited for another file's lock may have retired its
            # file: its object is in the store now, and is moved with the others.
            staged = [s for s in staged if not s.retired and not s.dropped and s.node.staged is s]
            left: dict[str, str] = {}  # key -> ETag of the versions the move leaves behind (and the cache)
            token = None
            while True:
                page = await store.list_page(vol.bucket, old_prefix, delimiter="", token=token)
                left.update((o.key, o.etag) for o in page.objects)
                token = page.next_token
                if token is None:
                    break
            keys = list(left)
            staged_keys = {s.node.key for s in staged}
            # A longer name may push keys beneath it past the store's limit. Find out before moving
            # anything: failing half way would leave objects under both names.
            for key in (*keys, *staged_keys):
                if len((new_prefix + key[len(old_prefix):]).encode()) > MAX_KEY_BYTES:
                    raise errors.fs_error(errors.ENAMETOOLONG, "a key beneath the renamed directory would "
                                          f"be longer than {MAX_KEY_BYTES} bytes")
            limiter = trio.CapacityLimiter(32)

            copies: dict[str, ObjectInfo] = {}  # old key -> its copy

            async def copy(key: str) -> None:
                async with limiter:
                    if key in staged_keys:
                        return  # its local data is committed under the new name below
                    info = await store.copy(vol.bucket, key, new_prefix + key[len(old_prefix):])
                    copies[key] = info

            async with trio.open_nursery() as n:
                for k in keys:
                    n.start_soon(copy, k)
            if old_prefix not in keys:
                await store.put(vol.bucket, new_prefix, b"", 0)  # keep the (possibly empty) directory
            # Files beneath that are open for reading read on under their new names, as one renamed
            # alone does (before the move: a local copy, if one is needed, reads the old key).
            reading = {h.inode: h.version.key for h in self._handles.values()
                       if isinstance(h, FileHandle) and h.staged is None and h.version is not None
                       and h.version.key in copies}
            for f, old in reading.items():
                await self._follow_rename(f, new_prefix + old[len(old_prefix):], copies[old].etag)
            old_parent, old_name, old_path = node.parent, node.name, node.mount_path()
            self.inodes.move(node, new_parent, new_name)
            etags = [(s, s.node.etag) for s in staged]
            for s in staged:
                s.node.etag = ""
            try:
                await self.committer.renamed_together(
                    [(s, old_prefix + s.node.key[len(new_prefix):]) for s in staged])
            except OSError as e:
                # Not recorded (the journal's disk full), for none of the files: the rename fails
                # and must leave everything as it was. Done half, mv said ENOSPC with the directory
                # renamed here, its files committed under the new names, and their rows (some of
                # them) under the old ones for the next mount to publish there.
                log.warning("rename of %s to %s undone: %s", old_path, node.mount_path(), e)
                # A replaced directory's marker (new_prefix) stays: it marked that directory before.
                made = {new_prefix + k[len(old_prefix):] for k in (*copies, *staged_keys)} | {new_prefix}
                if target is not None:
                    made.discard(new_prefix)
                self.inodes.move(node, old_parent, old_name)
                if target is not None and self.inodes.get(target.ino) is target:
                    self.inodes.move(target, new_parent, new_name)  # detached by the move
                for s, etag in etags:
                    s.node.etag = etag
                for f, old in reading.items():  # readers back on the old keys
                    await self._follow_rename(f, old, copies[old].etag)
                await self._delete_quietly(store, vol, made)
                raise
            for s in staged:
                self.note_changed(s.node)
            if target is not None:
                # The empty directory replaced: its marker, if any, was new_prefix, which now marks
                # the moved directory (copied or put above). Nothing of it is left to delete.
                self.inodes.detach(target)
                target.deleted = True

        async def delete(key: str) -> None:
            async with limiter:
                await store.delete(vol.bucket, key)
            self.moved_version(vol, key, left.get(key, ""), copies.get(key))

        # Objects first, then directory markers deepest first, so no store sees a marker go while
        # something beneath it is still there.
        await self._settle_journal()
        async with trio.open_nursery() as n:
            for k in keys:
                if not k.endswith("/"):
                    n.start_soon(delete, k)
        for k in sorted((k for k in keys if k.endswith("/")), key=lambda k: -k.count("/")):
            await store.delete(vol.bucket, k)
        self._invalidate_subtree(node)

    async def _delete_quietly(self, store: AsyncStore, vol: Volume, keys: set[str]) -> None:
        """Delete what a directory rename that failed had made under the new name (objects, then
        markers deepest first, as the rename deletes the old ones); what cannot be deleted is
        logged, and shows under that name until someone removes it."""
        limiter = trio.CapacityLimiter(32)

        async def delete(key: str) -> None:
            async with limiter:
                try:
                    await store.delete(vol.bucket, key)
                except errors.StoreError as e:
                    log.warning("could not delete %r, made by a rename that failed: %s", key, e)

        with trio.CancelScope(shield=True):
            async with trio.open_nursery() as n:
                for k in keys:
                    if not k.endswith("/"):
                        n.start_soon(delete, k)
            for k in sorted((k for k in keys if k.endswith("/")), key=lambda k: -k.count("/")):
                await delete(k)

    def _invalidate_subtree(self, node: Inode) -> None:
        """After a directory rename, what we knew about its contents is keyed by old names."""
        stack = [node]
        while stack:
            d = stack.pop()
            d.listing = None
            d.attr_expires = 0.0
            for c in d.children_by_name.values():
                if c.staged is None:
                    c.attr_expires = 0.0
                if c.kind.is_dir:
                    stack.append(c)

    def materialize(self, vol: Volume, rel_path: str) -> Inode:
        """The inode for a path in a volume, made with its parents if unknown (journal replay)."""
        node = self.inodes.root
        for name, kind in ((vol.catalog, Kind.CATALOG), (vol.schema, Kind.SCHEMA), (vol.name, Kind.VOLUME)):
            node = self.inodes.add_child(node, name, kind, vol if kind is Kind.VOLUME else None)
        parts = rel_path.split("/")
        for name in parts[:-1]:
            node = self.inodes.add_child(node, name, Kind.DIR, vol)
        return self.inodes.add_child(node, parts[-1], Kind.FILE, vol)

    # -- file system ----------------------------------------------------------------------------
    def statfs(self) -> dict[str, int]:
        """Sizes reported to df. The object store has no fixed size and none of it is ours to
        count as used: a large size, all of it free, so df shows 0 % used, not 100 %. What may be
        written now (f_bavail: df's Avail, shutil.disk_usage's free) is what the staging disk has,
        since every write lands there first and fails with ENOSPC without it. Blocking (a statfs of
        the staging disk): never on the event loop."""
        bsize = self.cfg.block_bytes
        avail = 1 << 50
        if self.cache is not None:
            st = os.statvfs(self.cache.root)
            avail = st.f_bavail * st.f_frsize
        total = max(1 << 50, avail)
        return {"f_bsize": bsize, "f_frsize": bsize, "f_blocks": total // bsize,
                "f_bfree": total // bsize, "f_bavail": avail // bsize, "f_files": 1 << 32,
                "f_ffree": 1 << 31, "f_favail": 1 << 31, "f_namemax": NAME_MAX_BYTES}

    def statistics(self) -> dict:
        out: dict = {"core": dict(self.stats), "inodes": len(self.inodes),
                     "readahead_bytes": self.budget.used_bytes,
                     "readahead_peak_bytes": self.budget.peak_bytes,
                     "readahead_budget_bytes": self.budget.capacity_bytes,
                     "buffers_reused": self.pool.reused, "buffers_discarded": self.pool.discarded,
                     "buffers_trimmed": self.pool.trimmed, "buffers_prefilled": self.pool.prefilled,
                     "buffers_mapped": self.pool.mapped, "buffers_idle": self.pool.idle,
                     "open_handles": len(self._handles)}
        out["stores"] = {name: s.store.statistics() for name, s in self.stores.items()}
        now = time.monotonic()
        out["unreachable"] = {name: {"for_s": round(now - o.since, 1), "answered_from_known": o.answered}
                              for name, o in self._outages.items()
                              if not self._answered_since(name, o)}
        if self.cache is not None:
            out["cache"] = self.cache.statistics()
        if self.committer is not None:
            out["commits"] = self.committer.statistics()
        if self.passthrough is not None:
            out["passthrough"] = self.passthrough.statistics()
        return out


def _direct(flags: int) -> bool:
    return bool(flags & getattr(os, "O_DIRECT", 0))


def _append_only(flags: int) -> bool:
    """Opened so that every write lands at the end: O_WRONLY | O_APPEND, not truncating. (With read
    access the file could be mapped and written through memory, past the daemon in passthrough.)"""
    return flags & os.O_ACCMODE == os.O_WRONLY and bool(flags & os.O_APPEND) and not flags & os.O_TRUNC


def _usable_name(name: str, key: str) -> bool:
    """Can this store name be shown as a file name? Keys with '//', '.', '..' or over-long parts
    cannot; they are skipped (and logged) rather than shown wrongly."""
    if not name or name in (".", "..") or "/" in name or len(name.encode()) > NAME_MAX_BYTES or "\0" in name:
        log.info("skipping key %r: its name %r cannot be a file name", key, name)
        return False
    return True
