"""The volume registry: which `/Volumes/<catalog>/<schema>/<volume>` exist, where they live, who may use them.

A catalog is a TOML file::

    [stores.minio]                      # optional: an S3 endpoint (default: AWS, standard credential chain);
                                        # any name but "local", the built-in store of local directories
    endpoint_url = "http://127.0.0.1:9000"
    region = "us-east-1"

    [volumes."main.default.raw"]
    location = "s3://my-bucket/datasets/raw"   # or "file:///srv/data", or an absolute path
    store = "minio"                     # which [stores.*] entry; default "default" if present, else AWS
    read_only = false
    readers = ["*"]                     # user names or uids, "@group" names or gids, "*" for everyone
    writers = ["alice", "@ml"]

Everything here is plain data; nothing talks to a store.
"""

from __future__ import annotations

import grp
import os
import pwd
import re
import tomllib
import urllib.parse
from dataclasses import dataclass, field
from pathlib import Path

from .errors import ConfigError

# The store of every volume on a local directory; a [stores.*] table may not take this name.
LOCAL_STORE = "local"

# Characters a catalog, schema or volume name may hold: what works unquoted in a shell and a URL.
_NAME_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,254}$")


@dataclass(frozen=True)
class StoreSpec:
    name: str
    kind: str = "s3"  # "s3" or "local"
    endpoint_url: str | None = None
    region: str | None = None
    profile: str | None = None
    path_style: bool = True
    # Sign upload bodies (SHA-256) on plain-HTTP endpoints. Off by default: it costs ~2 s of CPU per
    # GB uploaded, HTTPS endpoints never do it (TLS protects the body), and ETags are checked.
    payload_signing: bool = False


@dataclass(frozen=True)
class Grants:
    """Who may do something: user ids, group ids, or everyone."""

    everyone: bool = False
    uids: frozenset[int] = frozenset()
    gids: frozenset[int] = frozenset()

    def allows(self, uid: int, gids: frozenset[int] | set[int]) -> bool:
        return self.everyone or uid in self.uids or bool(self.gids & set(gids))


@dataclass(frozen=True)
class Volume:
    catalog: str
    schema: str
    name: str
    store: StoreSpec
    bucket: str  # S3 bucket, or the directory of a local store
    prefix: str  # "" or "some/prefix/" (always ends with "/")
    read_only: bool = False
    readers: Grants = field(default_factory=lambda: Grants(everyone=True))
    writers: Grants = field(default_factory=lambda: Grants(everyone=True))

    @property
    def full_name(self) -> str:
        return f"{self.catalog}.{self.schema}.{self.name}"

    @property
    def location(self) -> str:
        if self.store.kind == "local":
            return f"file://{self.bucket}"
        return f"s3://{self.bucket}/{self.prefix}".rstrip("/")

    def can_read(self, uid: int, gids: frozenset[int] | set[int]) -> bool:
        return self.readers.allows(uid, gids) or self.writers.allows(uid, gids)

    def can_write(self, uid: int, gids: frozenset[int] | set[int]) -> bool:
        return not self.read_only and self.writers.allows(uid, gids)


@dataclass(frozen=True)
class Catalog:
    volumes: dict[tuple[str, str, str], Volume]
    source: str = "<embedded>"

    # -- namespace ------------------------------------------------------------------------------
    def catalogs(self) -> list[str]:
        return sorted({c for c, _, _ in self.volumes})

    def schemas(self, catalog: str) -> list[str]:
        return sorted({s for c, s, _ in self.volumes if c == catalog})

    def volume_names(self, catalog: str, schema: str) -> list[str]:
        return sorted(v for c, s, v in self.volumes if c == catalog and s == schema)

    def volume(self, catalog: str, schema: str, name: str) -> Volume | None:
        return self.volumes.get((catalog, schema, name))

    def stores(self) -> list[StoreSpec]:
        seen: dict[str, StoreSpec] = {}
        for v in self.volumes.values():
            seen.setdefault(v.store.name, v.store)
        return list(seen.values())

    # -- loading --------------------------------------------------------------------------------
    @classmethod
    def load(cls, path: str | os.PathLike) -> "Catalog":
        path = Path(path)
        try:
            raw = path.read_bytes()
        except FileNotFoundError:
            raise ConfigError(f"{path}: catalog file not found") from None
        except OSError as e:
            raise ConfigError(f"{path}: cannot read catalog file: {e.strerror}") from None
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            # TOML is UTF-8; say where the offending byte is rather than let a codec error escape.
            line = raw[:e.start].count(b"\n") + 1
            raise ConfigError(f"{path}:{line}: not UTF-8 text (byte 0x{raw[e.start]:02x}); "
                              "a catalog must be UTF-8") from None
        return cls.parse(text, str(path))

    @classmethod
    def parse(cls, text: str, source: str = "<string>") -> "Catalog":
        try:
            data = tomllib.loads(text)
        except tomllib.TOMLDecodeError as e:
            # tomllib says "... (at line N, column M)"; lead with "file:N:" like every other catalog
            # error, so the user (and their editor) know where.
            m = re.search(r"\(at line (\d+), column (\d+)\)", str(e))
            if m is None:
                raise ConfigError(f"{source}: not valid TOML: {e}") from None
            what = str(e)[:m.start()].strip()
            raise ConfigError(f"{source}:{m[1]}: not valid TOML: {what} (column {m[2]})") from None
        return cls.from_dict(data, source, text)

    @classmethod
    def from_dict(cls, data: dict, source: str = "<dict>", text: str = "") -> "Catalog":
        lines = _LineIndex(text)

        def where(kind: str, name: str, key: str | None = None) -> str:
            # "file:line" of the key (or else of the table header), so every error points at its line.
            line = lines.find((kind, name), key)
            return f"{source}:{line}" if line else source

        unknown = set(data) - {"stores", "volumes"}
        if unknown:
            raise ConfigError(f"{source}: unknown top-level key(s) {sorted(unknown)}; "
                              "expected [stores.*] and [volumes.\"catalog.schema.volume\"]")
        stores: dict[str, StoreSpec] = {}
        if not isinstance(data.get("stores") or {}, dict):
            raise ConfigError(f"{source}: 'stores' must be a table of [stores.NAME] tables")
        for sname, s in (data.get("stores") or {}).items():
            if not isinstance(s, dict):
                raise ConfigError(f"{where('stores', sname)}: [stores.{sname}] must be a table")
            if sname == LOCAL_STORE:
                # Volumes on local directories share a built-in store of this name; a second store
                # of the same name would have one set of volumes sent to the other's store.
                raise ConfigError(f"{where('stores', sname)}: [stores.{sname}]: the store name "
                                  f"{sname!r} is reserved for volumes on local directories; "
                                  "give this store another name")
            bad = sorted(set(s) - {"endpoint_url", "region", "profile", "path_style", "payload_signing"})
            if bad:
                raise ConfigError(f"{where('stores', sname, bad[0])}: unknown key(s) {bad} "
                                  f"in [stores.{sname}]")
            # Wrong types would otherwise surface later, as a traceback from deep inside boto3.
            for k in ("endpoint_url", "region", "profile"):
                if k in s and not isinstance(s[k], str):
                    raise ConfigError(f"{where('stores', sname, k)}: {k} of [stores.{sname}] "
                                      "must be a string")
            if s.get("endpoint_url"):
                # Checked here, with its line: at mount time a bad one was "Port out of range
                # 0-65535" or "unsupported endpoint", naming neither the file nor the key.
                why = _bad_endpoint(s["endpoint_url"])
                if why:
                    raise ConfigError(f"{where('stores', sname, 'endpoint_url')}: endpoint_url of "
                                      f"[stores.{sname}] {s['endpoint_url']!r}: {why}")
            for k in ("path_style", "payload_signing"):
                if k in s and not isinstance(s[k], bool):
                    raise ConfigError(f"{where('stores', sname, k)}: {k} of [stores.{sname}] must be "
                                      "true or false")
            stores[sname] = StoreSpec(sname, "s3", s.get("endpoint_url"), s.get("region"),
                                      s.get("profile"), s.get("path_style", True),
                                      s.get("payload_signing", False))
        volumes: dict[tuple[str, str, str], Volume] = {}
        vols = data.get("volumes") or {}
        if not isinstance(vols, dict):
            raise ConfigError(f"{source}: 'volumes' must be a table of tables")
        for full, v in vols.items():
            loc = where("volumes", full)

            def at(key: str, full: str = full) -> str:
                return where("volumes", full, key)

            parts = full.split(".")
            if len(parts) != 3 or not all(_NAME_RE.match(p) for p in parts):
                raise ConfigError(f"{loc}: volume name {full!r} must be catalog.schema.volume, each part "
                                  "letters, digits, '_', '-' or '.' (and not starting with '.' or '-')")
            if not isinstance(v, dict):
                raise ConfigError(f"{loc}: [volumes.\"{full}\"] must be a table")
            bad = sorted(set(v) - {"location", "store", "read_only", "readers", "writers"})
            if bad:
                raise ConfigError(f"{at(bad[0])}: unknown key(s) {bad} in volume {full!r}")
            location = v.get("location")
            if not isinstance(location, str) or not location:
                raise ConfigError(f"{at('location')}: volume {full!r} needs a location "
                                  "(s3://bucket/prefix or a path)")
            read_only = v.get("read_only", False)
            if not isinstance(read_only, bool):
                raise ConfigError(f"{at('read_only')}: read_only of {full!r} must be true or false")
            if location.startswith("s3://"):
                rest = location[5:]
                bucket, _, prefix = rest.partition("/")
                if not bucket:
                    raise ConfigError(f"{at('location')}: location {location!r} has no bucket")
                prefix = prefix.strip("/")
                prefix = prefix + "/" if prefix else ""
                sname = v.get("store") or ("default" if "default" in stores else "aws")
                if sname == "aws" and "aws" not in stores:
                    stores["aws"] = StoreSpec("aws", "s3")
                if sname == LOCAL_STORE:
                    raise ConfigError(f"{at('store')}: volume {full!r} names store {LOCAL_STORE!r}, the built-in "
                                      f"store of volumes on local directories, for the S3 location {location!r}: "
                                      "name an S3 store of [stores] instead, or give a local directory as "
                                      "its location")
                if not isinstance(sname, str) or sname not in stores:
                    raise ConfigError(f"{at('store')}: volume {full!r} names store {sname!r}, which has no "
                                      f"[stores.{sname}] table")
                spec = stores[sname]
            else:
                d = location.removeprefix("file://")
                if not os.path.isabs(d):
                    raise ConfigError(f"{at('location')}: location {location!r} must be s3://bucket/prefix "
                                      "or an absolute directory path")
                bucket, prefix, spec = os.path.normpath(d), "", StoreSpec(LOCAL_STORE, "local")
            grants = {}
            for kind in ("readers", "writers"):
                try:
                    grants[kind] = parse_grants(v.get(kind, ["*"]))
                except ValueError as e:
                    raise ConfigError(f"{at(kind)}: volume {full!r}: {kind}: {e}") from None
            readers, writers = grants["readers"], grants["writers"]
            volumes[tuple(parts)] = Volume(parts[0], parts[1], parts[2], spec, bucket, prefix,
                                           read_only, readers, writers)
        if not volumes:
            raise ConfigError(f"{source}: no volumes registered; add a [volumes.\"catalog.schema.volume\"] "
                              "table with a location")
        return cls(volumes, source)

    @classmethod
    def embedded(cls, demo_dir: str | os.PathLike) -> "Catalog":
        """The catalog `ucfs mount` uses when given none: one sample volume on the local disk."""
        spec = StoreSpec(LOCAL_STORE, "local")
        vol = Volume("main", "default", "samples", spec, os.path.abspath(demo_dir), "")
        return cls({("main", "default", "samples"): vol}, "<embedded>")


class _LineIndex:
    """Where tables and keys are in a catalog's text, for error messages.

    Each line is read on its own with tomllib: a table header gives the table's path, a `key = value`
    line a key of the current table. Lines that are not complete on their own (arrays spread over
    several lines) are skipped; their errors then point at the table's header.
    """

    def __init__(self, text: str):
        self.headers: dict[tuple[str, ...], int] = {}
        self.keys: dict[tuple[tuple[str, ...], str], int] = {}
        current: tuple[str, ...] = ()
        for i, line in enumerate(text.splitlines(), 1):
            stripped = line.strip()
            if not stripped or stripped.startswith("#"):
                continue
            try:
                parsed = tomllib.loads(stripped)
            except tomllib.TOMLDecodeError:
                continue
            if stripped.startswith("["):
                path: list[str] = []
                node = parsed
                while isinstance(node, dict) and len(node) == 1:
                    k, node = next(iter(node.items()))
                    path.append(k)
                current = tuple(path)
                self.headers.setdefault(current, i)
            else:
                for k in parsed:
                    self.keys.setdefault((current, k), i)

    def find(self, table: tuple[str, ...], key: str | None = None) -> int | None:
        if key is not None and (table, key) in self.keys:
            return self.keys[(table, key)]
        return self.headers.get(table)


def _bad_endpoint(url: str) -> str:
    """Why `url` cannot be a store's endpoint, or "" when it can."""
    u = urllib.parse.urlsplit(url)
    if u.scheme not in ("http", "https"):
        return "must start with http:// or https://"
    try:
        port = u.port
    except ValueError:
        return "its port is not a number from 1 to 65535"
    if not u.hostname:
        return "names no host"
    if port == 0:
        return "its port is not a number from 1 to 65535"
    return ""


def parse_grants(entries) -> Grants:
    if isinstance(entries, str):
        entries = [entries]
    if not isinstance(entries, list):
        raise ValueError("readers/writers must be a list of names")
    everyone, uids, gids = False, set(), set()
    for e in entries:
        e = str(e).strip()
        if e == "*":
            everyone = True
        elif e.startswith("@"):
            g = e[1:]
            if g.isdigit():
                gids.add(int(g))
            else:
                try:
                    gids.add(grp.getgrnam(g).gr_gid)
                except KeyError:
                    raise ValueError(f"unknown group {g!r}") from None
        elif e.isdigit():
            uids.add(int(e))
        else:
            try:
                uids.add(pwd.getpwnam(e).pw_uid)
            except KeyError:
                raise ValueError(f"unknown user {e!r}") from None
    return Grants(everyone, frozenset(uids), frozenset(gids))
