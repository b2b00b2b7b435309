"""The inode table: what the kernel knows by number, and what we remember about each.

An inode is a (parent, name) pair with a kind, its last known attributes and when they expire. Paths
are not stored: they are computed by walking up the parents, so renaming a directory renames
everything below it without touching the children.

Lifetime follows the kernel: every successful lookup (and each entry of a readdirplus) adds one to
the inode's lookup count, `forget` subtracts, and an inode is dropped only when the kernel has
forgotten it, no handle has it open, no child still points at it, and no listing of its directory
is on its way.
"""

from __future__ import annotations

import enum
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from .catalog import Volume

ROOT_INO = 1
# Local mtimes of versions committed here, kept for files whose inodes the kernel forgot (see
# InodeTable.kept_mtimes). About 300 bytes each: at most ~30 MB for the last 100,000 such files;
# an older one shows its Last-Modified again when it is looked up.
KEPT_MTIMES_MAX = 100_000
# Listings of directories whose inodes the kernel forgot (see InodeTable.kept_listings), kept up to
# this many names in all (about 200 bytes each: ~20 MB); the oldest kept go first.
KEPT_LISTING_NAMES_MAX = 100_000
# What was known of files and directories whose inodes the kernel forgot where their directory's
# listing does not say it (found by a lookup's probe): the last this many (see
# InodeTable.kept_entries, about 250 bytes each).
KEPT_ENTRIES_MAX = 50_000


class Kind(enum.IntEnum):
    ROOT = 0
    CATALOG = 1
    SCHEMA = 2
    VOLUME = 3  # the volume's top directory
    DIR = 4
    FILE = 5

    @property
    def is_dir(self) -> bool:
        return self is not Kind.FILE

    @property
    def synthetic(self) -> bool:
        """Levels made up from the catalog, not backed by the store."""
        return self <= Kind.SCHEMA


@dataclass(slots=True)
class Entry:
    """One name in a directory listing, as the store described it."""

    is_dir: bool
    size: int = 0
    etag: str = ""
    mtime_ns: int = 0


@dataclass(eq=False)
class Listing:
    """A directory's children as last listed, and when that was."""

    entries: dict[str, Entry]
    fetched_at: float  # time.monotonic()
    marker: bool = False  # the directory has its own marker object ("dir/"), so it outlives its contents
    asked_at: float | None = None  # when the LIST was sent: what it says is true as of then
    lookups: int = 0  # lookups it answered (core.Core._maybe_refresh_ahead)
    refreshed_ahead: bool = False  # its replacement was asked for before it expired
    # Taken back from a forgotten inode of the directory (InodeTable.kept_listings): never fresh,
    # only what was known should the store not answer.
    kept: bool = False

    @property
    def as_of(self) -> float:
        return self.fetched_at if self.asked_at is None else self.asked_at

    def fresh(self, ttl_s: float) -> bool:
        return not self.kept and time.monotonic() - self.fetched_at <= ttl_s


@dataclass(eq=False)
class Inode:
    ino: int
    kind: Kind
    parent: "Inode | None"
    name: str
    volume: Volume | None = None
    size: int = 0
    etag: str = ""
    mtime_ns: int = 0
    # The version (ETag) this mount committed: it keeps the mtime it had here (core.Core._describe).
    local_mtime_etag: str = ""
    attr_expires: float = 0.0  # time.monotonic() after which attributes must be checked again
    lookups: int = 0  # references the kernel holds
    opens: int = 0  # open file or directory handles
    children: int = 0  # child inodes in the table pointing at us
    page_cache_etag: str | None = None  # version whose pages the kernel may hold for this inode
    listing: Listing | None = None  # directories: last listing
    listing_refresh: Any = None  # a trio.Event while a refresh of the listing runs
    hot_lookups: int = 0  # lookups that found the listing expired (see core._lookup_child)
    hot_since: float = 0.0
    staged: Any = None  # files: local data not yet (or being) committed; see commit.py
    deleted: bool = False  # unlinked while open: still readable through its handles
    # Replaced under its name by a newer version seen in the store while handles of its own version
    # were open (core.Core._supersede): it lives on for those handles, with its version's attributes.
    superseded: bool = False
    # Creates under way: the name exists here before its staging file does, and neither a listing
    # nor the store knows it yet; nothing may take the name away meanwhile (see Core.create).
    creating: int = 0
    children_by_name: dict[str, "Inode"] = field(default_factory=dict)
    # Directories: names a probe found absent from the store, and as of when (time.monotonic()),
    # for core.Core._lookup_child; a name gets a node here and leaves this at once.
    absent: dict[str, float] = field(default_factory=dict)

    def rel_path(self) -> str:
        """Path inside the volume ("" for the volume's top directory)."""
        parts = []
        node: Inode | None = self
        while node is not None and node.kind in (Kind.DIR, Kind.FILE):
            parts.append(node.name)
            node = node.parent
        return "/".join(reversed(parts))

    @property
    def key(self) -> str:
        """The object key of a file, or the key prefix of a directory without its trailing '/'."""
        assert self.volume is not None
        rel = self.rel_path()
        return (self.volume.prefix + rel) if rel else self.volume.prefix.rstrip("/")

    @property
    def dir_prefix(self) -> str:
        """Key prefix of a directory's children ("" or ending in '/')."""
        assert self.volume is not None
        rel = self.rel_path()
        return self.volume.prefix + (rel + "/" if rel else "")

    def mount_path(self) -> str:
        parts = []
        node: Inode | None = self
        while node is not None and node.kind is not Kind.ROOT:
            parts.append(node.name)
            node = node.parent
        return "/" + "/".join(reversed(parts))

    def attrs_fresh(self) -> bool:
        return time.monotonic() <= self.attr_expires


class InodeTable:
    def __init__(self) -> None:
        self.root = Inode(ROOT_INO, Kind.ROOT, None, "")
        self.root.lookups = 1  # the kernel never forgets the root
        self._by_ino: dict[int, Inode] = {ROOT_INO: self.root}
        self._next = ROOT_INO + 1
        # (volume, key) -> (ETag, mtime) of a file whose inode was dropped while it showed the
        # version this mount committed, with the mtime it had here (core.Core._describe). The next
        # inode of that name takes them back, so that a kernel's forget (memory pressure, a large
        # tree) does not turn the file's mtime into the store's Last-Modified: rsync -a would send
        # it again, and find -newer take it for changed.
        self.kept_mtimes: OrderedDict[tuple[str, str], tuple[str, int]] = OrderedDict()
        # (volume, key prefix) -> the last listing of a directory whose inode was dropped, and how
        # many names it had then. The next inode of that directory takes it back as an expired
        # listing: a lookup lists again, or probes, as without it - but while the store cannot be
        # reached it is what was known (core.Core._stale_child). Without it, a kernel's forget
        # (memory pressure) during an outage left the directory nothing to answer from, and every
        # cached file below it failed with EIO.
        self.kept_listings: OrderedDict[tuple[str, str], tuple[Listing, int]] = OrderedDict()
        self._kept_listing_names = 0
        # (volume, key) -> (entry, as of when) of a file or directory whose inode was dropped, where
        # no listing of its directory says it: a name looked up by path is probed, not listed. Only
        # while the store cannot be reached is this an answer (core.Core._stale_child); a new
        # inode of the name makes it moot.
        self.kept_entries: OrderedDict[tuple[str, str], tuple[Entry, float]] = OrderedDict()
        # Directory inode -> children the kernel forgot while a listing of it was on its way, kept
        # until it is in (`_maybe_drop`, `sweep`).
        self._kept_for_listing: dict[int, list[Inode]] = {}

    def __len__(self) -> int:
        return len(self._by_ino)

    def get(self, ino: int) -> Inode | None:
        return self._by_ino.get(ino)

    def child(self, parent: Inode, name: str) -> Inode | None:
        return parent.children_by_name.get(name)

    def add_child(self, parent: Inode, name: str, kind: Kind, volume: Volume | None) -> Inode:
        """The inode for parent/name, created if new (or if the old one changed kind)."""
        node = parent.children_by_name.get(name)
        if node is not None and node.kind is kind:
            return node
        if node is not None:
            self.detach(node)  # a file became a directory or the other way round
        node = Inode(self._next, kind, parent, name, volume)
        self._next += 1
        self._by_ino[node.ino] = node
        parent.children_by_name[name] = node
        parent.absent.pop(name, None)
        parent.children += 1
        if volume is not None and self.kept_entries:
            self.kept_entries.pop((volume.full_name, node.key), None)
        if kind is Kind.FILE and volume is not None and self.kept_mtimes:
            kept = self.kept_mtimes.pop((volume.full_name, node.key), None)
            if kept is not None:
                # Whoever describes the node next keeps this mtime only for that same version.
                node.local_mtime_etag, node.mtime_ns = kept
        elif kind in (Kind.VOLUME, Kind.DIR) and volume is not None and self.kept_listings:
            kept_listing = self.kept_listings.pop((volume.full_name, node.dir_prefix), None)
            if kept_listing is not None:
                node.listing, names = kept_listing
                node.listing.kept = True
                self._kept_listing_names -= names
        return node

    def detach(self, node: Inode) -> None:
        """Remove node from its parent's names (unlinked or replaced); it lives on while referenced."""
        parent = node.parent
        if parent is not None and parent.children_by_name.get(node.name) is node:
            del parent.children_by_name[node.name]
        self._maybe_drop(node)

    def move(self, node: Inode, new_parent: Inode, new_name: str) -> None:
        """Rename: node is now new_parent/new_name; whatever was there is detached."""
        old = new_parent.children_by_name.get(new_name)
        if old is not None and old is not node:
            self.detach(old)
        parent = node.parent
        assert parent is not None
        if parent.children_by_name.get(node.name) is node:
            del parent.children_by_name[node.name]
        if parent is not new_parent:
            parent.children -= 1
            new_parent.children += 1
            self._maybe_drop(parent)
        node.parent = new_parent
        node.name = new_name
        new_parent.children_by_name[new_name] = node
        new_parent.absent.pop(new_name, None)

    def forget(self, ino: int, n: int) -> None:
        node = self._by_ino.get(ino)
        if node is None or node is self.root:
            return
        node.lookups -= n
        self._maybe_drop(node)

    def sweep(self, parent: Inode) -> None:
        """Drop what a listing of parent kept (see `_maybe_drop`), now that it is no longer on its way."""
        for node in self._kept_for_listing.pop(parent.ino, ()):
            self._maybe_drop(node)

    def _maybe_drop(self, node: Inode) -> None:
        while (node is not self.root and node.lookups <= 0 and node.opens <= 0 and node.creating <= 0
               and node.children <= 0 and node.staged is None and node.ino in self._by_ino):
            parent = node.parent
            named = parent is not None and parent.children_by_name.get(node.name) is node
            if named and parent.listing_refresh is not None:
                # A listing of its directory is on its way. What it says of the name is checked
                # against what this mount knows of the inode (a commit since the LIST was sent):
                # dropped now, the name would take the listing's word, older than that commit - a
                # file just committed absent, or its old version back, for a TTL. The listing's
                # end sweeps it (`sweep`).
                self._kept_for_listing.setdefault(parent.ino, []).append(node)
                return
            del self._by_ino[node.ino]
            if parent is None:
                return
            if named:
                if node.local_mtime_etag and node.local_mtime_etag == node.etag and node.volume is not None:
                    _keep_latest(self.kept_mtimes, (node.volume.full_name, node.key), (node.etag, node.mtime_ns),
                                 KEPT_MTIMES_MAX)
                if node.volume is not None and not node.deleted:
                    self._keep_known(node, parent)
                del parent.children_by_name[node.name]
            parent.children -= 1
            node = parent

    def kept_entry(self, parent: Inode, name: str) -> tuple[Entry, float] | None:
        """What was known of parent/name when its inode was dropped (see `kept_entries`)."""
        if parent.volume is None or not self.kept_entries:
            return None
        return self.kept_entries.get((parent.volume.full_name, parent.dir_prefix + name))

    def _keep_known(self, node: Inode, parent: Inode) -> None:
        """What node knows that its next inode, or an answer from what was known, will want."""
        vol = node.volume
        assert vol is not None
        if node.kind in (Kind.VOLUME, Kind.DIR) and node.listing is not None:
            self._keep_listing((vol.full_name, node.dir_prefix), node.listing)
        if node.kind not in (Kind.DIR, Kind.FILE):
            return
        if parent.listing is not None and node.name in parent.listing.entries:
            return  # the directory's listing says it (and is kept with the directory)
        if node.kind is Kind.FILE and not node.etag:
            return  # never described by the store
        _keep_latest(self.kept_entries, (vol.full_name, node.key),
                     (Entry(node.kind is Kind.DIR, node.size, node.etag, node.mtime_ns), time.monotonic()),
                     KEPT_ENTRIES_MAX)

    def _keep_listing(self, ident: tuple[str, str], listing: Listing) -> None:
        names = len(listing.entries)
        if names > KEPT_LISTING_NAMES_MAX:
            return
        old = self.kept_listings.pop(ident, None)
        if old is not None:
            self._kept_listing_names -= old[1]
        self.kept_listings[ident] = (listing, names)
        self._kept_listing_names += names
        while self._kept_listing_names > KEPT_LISTING_NAMES_MAX:
            _, (_, gone) = self.kept_listings.popitem(last=False)
            self._kept_listing_names -= gone

    def release(self, node: Inode) -> None:
        """A handle on node was closed."""
        node.opens -= 1
        self._maybe_drop(node)

    def all(self):
        return self._by_ino.values()


def _keep_latest(kept: OrderedDict, ident, value, most: int) -> None:
    """Keep `value` as the newest of `kept`, and no more than `most` of them: the oldest go."""
    kept[ident] = value
    kept.move_to_end(ident)
    if len(kept) > most:
        kept.popitem(last=False)
