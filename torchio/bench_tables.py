"""`python -m torchio.bench_tables`: Parquet tables on the mount, against what the store allows.

Two figures, each with its reference measured in the same run on the same store:

    export   `export_table` of a synthetic table (~`--size`, on disk) into a volume, timed until it
             returns (every file and the manifest committed to the store), first into an empty
             directory, then again over it (overwrite: the old export is retired and deleted too).
             references: the same export into a local directory (what encoding alone allows on this
             host), and a direct multipart upload of the same bytes with ucfs.store (the ceiling: 8 MiB
             parts, 16 in flight, as the mount uploads).
    read     one column of the exported (multi-file) dataset read through a fresh mount (cold cache),
             with pyarrow.dataset and with Hugging Face datasets: bytes the mount fetched from the
             store (its `get_bytes`) against the bytes of that column (the sum of its column chunks'
             sizes in the Parquet footers). Their ratio is the read amplification: what the footer
             reads and the read-ahead's 1 MiB block granularity add.

No S3 endpoint given: a throw-away Ceph RGW is started on loopback (`python -m ucfs.testing.rgw`).
Everything written goes to a scratch prefix of this run and is deleted afterwards. Quote ratios, not
absolute figures: the machines these run on are shared.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

from torchio.bench import (BenchError, Endpoint, Figure, Mount, add_store_arguments, delete_prefix, run_bench,
                           start_rgw)
from ucfs.config import MiB, parse_size

# The direct upload's shape: the mount's part size and parts in flight (torchio.bench uses the same).
PART_BYTES = 8 * MiB
UPLOAD_PARTS_IN_FLIGHT = 16
# Float features per row: random floats do not compress, so they set the table's size on disk.
FEATURES = 16
# Columns whose reads are measured: narrow (8 bytes a row), one feature (4), and the widest.
READ_COLUMNS = ("id", "f3", "text")
VOLUME = ("bench", "tables", "data")


def say(msg: str) -> None:
    print(f"bench_tables: {msg}", file=sys.stderr, flush=True)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m torchio.bench_tables", description=__doc__.split("\n\n")[0])
    add_store_arguments(p)
    w = p.add_argument_group("workload")
    w.add_argument("--size", default="300M", help="the exported table's size on disk (default 300M)")
    w.add_argument("--target-file-size", default="64M", help="export_table's target_file_bytes (default 64M)")
    r = p.add_argument_group("run")
    r.add_argument("--work-dir", help="mountpoints, caches, logs, the local export (default: a temp dir)")
    r.add_argument("--json", dest="json_path", help="also write the figures to this file")
    args = p.parse_args(argv)
    args.size = parse_size(args.size)
    args.target_file_size = parse_size(args.target_file_size)
    return args


def make_table(nbytes: int):
    """A training table of about nbytes on disk: an id, a label, FEATURES random floats, a short text."""
    import numpy as np
    import pyarrow as pa

    # ~4 bytes per feature (incompressible) + ~20 for id, label and text after compression.
    rows = max(1000, nbytes // (4 * FEATURES + 20))
    rng = np.random.default_rng(0)
    columns = {"id": pa.array(np.arange(rows, dtype=np.int64)),
               "label": pa.array(rng.integers(0, 1000, rows, dtype=np.int32))}
    for i in range(FEATURES):
        columns[f"f{i}"] = pa.array(rng.random(rows, dtype=np.float32))
    words = np.array(["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta"])
    text = np.char.add(np.char.add(words[rng.integers(0, 8, rows)], " "), np.arange(rows).astype(str))
    columns["text"] = pa.array(text.astype(object), pa.string())
    return pa.table(columns)


def store_counters(m: Mount) -> dict:
    """The mount's per-store request and byte counters, summed over its stores."""
    res = subprocess.run([sys.executable, "-m", "ucfs", "status", str(m.mountpoint), "--json"],
                         capture_output=True, text=True, env=m.env)
    try:
        stores = json.loads(res.stdout)[str(m.mountpoint)]["stores"]
    except (ValueError, KeyError) as e:
        raise BenchError(f"ucfs status said nothing useful: {res.stderr.strip()[-300:]}") from e
    out: dict[str, int] = {}
    for s in stores.values():
        for k, v in s.items():
            if isinstance(v, int):
                out[k] = out.get(k, 0) + v
    return out


def volume(m: Mount) -> Path:
    return m.mountpoint.joinpath(*VOLUME)


def direct_upload(store, bucket: str, prefix: str, files: list[str]) -> float:
    """Seconds to upload the files as multipart uploads straight to the store (ucfs.store, no mount),
    PART_BYTES parts, all files' parts sharing UPLOAD_PARTS_IN_FLIGHT threads (the ceiling)."""
    t0 = time.perf_counter()
    uploads = []
    for f in files:
        key = f"{prefix}/{os.path.basename(f)}"
        uploads.append((f, key, store.create_multipart(bucket, key)))

    def part(job):
        path, key, upload_id, number, offset, size = job
        with open(path, "rb") as fh:
            fh.seek(offset)
            body = fh.read(size)
        return store.upload_part(bucket, key, upload_id, number, body, size)

    jobs = []
    for path, key, upload_id in uploads:
        size = os.path.getsize(path)
        for i, off in enumerate(range(0, max(size, 1), PART_BYTES), 1):
            jobs.append((path, key, upload_id, i, off, min(PART_BYTES, size - off)))
    with concurrent.futures.ThreadPoolExecutor(UPLOAD_PARTS_IN_FLIGHT) as pool:
        etags = list(pool.map(part, jobs))
    for path, key, upload_id in uploads:
        store.complete_multipart(bucket, key, upload_id, [(j[3], e) for j, e in zip(jobs, etags) if j[1] == key])
    return time.perf_counter() - t0


def column_bytes(files: list[str], column: str) -> tuple[int, int]:
    """(bytes of the column's chunks, bytes of the files' footers) from the Parquet metadata."""
    import pyarrow.parquet as pq

    col = footers = 0
    for f in files:
        meta = pq.ParquetFile(f).metadata
        footers += meta.serialized_size + 8
        idx = meta.schema.names.index(column)
        col += sum(meta.row_group(g).column(idx).total_compressed_size for g in range(meta.num_row_groups))
    return col, footers


def read_column(reader: str, files: list[str], column: str, cache_dir: Path) -> int:
    """Read one column of the files the way `reader` does; returns the rows read."""
    if reader == "pyarrow.dataset":
        import pyarrow.dataset as pads

        return pads.dataset(files, format="parquet").to_table(columns=[column]).num_rows
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import datasets

    datasets.disable_progress_bars()
    ds = datasets.load_dataset("parquet", data_files=files, split="train", columns=[column],
                               cache_dir=str(cache_dir))
    return ds.num_rows


class Bench:
    def __init__(self, args: argparse.Namespace):
        self.a = args
        self.stack = contextlib.ExitStack()
        self.figures: list[Figure] = []
        self.prefix = f"bench-tables-{uuid.uuid4().hex[:8]}"
        if args.work_dir:
            self.work = Path(args.work_dir)
            self.work.mkdir(parents=True, exist_ok=True)
        else:
            self.work = Path(tempfile.mkdtemp(prefix="bench-tables-"))
            self.stack.callback(shutil.rmtree, self.work, True)

    def run(self) -> list[Figure]:
        with self.stack:
            self._run()
        return self.figures

    def _run(self) -> None:
        from torchio.tables import export_table
        from ucfs.store import S3Store

        a = self.a
        if a.endpoint:
            ep = Endpoint(a.endpoint, a.access_key, a.secret_key, a.region)
        else:
            # Data in RAM: two exports, the ceiling's copy, and the overwrite's server-side copy.
            rgw, ep = start_rgw(max(4.0, 6 * a.size / (1 << 30)))
            self.stack.callback(rgw.stop)
        store = S3Store(endpoint_url=ep.url, region=ep.region, access_key=ep.access_key,
                        secret_key=ep.secret_key, concurrency=UPLOAD_PARTS_IN_FLIGHT * 2)
        store.create_bucket(a.bucket)
        self.stack.callback(delete_prefix, store, a.bucket, self.prefix + "/")
        catalog = self.work / "catalog.toml"
        catalog.write_text("\n".join([
            "[stores.bench]", f'endpoint_url = "{ep.url}"', f'region = "{ep.region}"', "",
            f'[volumes."{".".join(VOLUME)}"]', f'location = "s3://{a.bucket}/{self.prefix}/vol"',
            'store = "bench"', ""]))
        env = dict(os.environ, PYTHONUNBUFFERED="1", AWS_REGION=ep.region, AWS_EC2_METADATA_DISABLED="true")
        if ep.access_key:
            env.update(AWS_ACCESS_KEY_ID=ep.access_key, AWS_SECRET_ACCESS_KEY=ep.secret_key)

        say(f"making a table of about {a.size / 1e6:,.0f} MB on disk")
        table = make_table(a.size)

        say("export_table into a local directory (encoding alone)")
        t0 = time.perf_counter()
        local_files = export_table(table, self.work / "local" / "exp", target_file_bytes=a.target_file_size)
        local_s = time.perf_counter() - t0
        nbytes = sum(os.path.getsize(f) for f in local_files)
        mb = nbytes / 1e6
        say(f"{len(local_files)} files, {mb:,.0f} MB, {table.num_rows:,} rows")

        say(f"direct multipart upload of the same {mb:,.0f} MB ({UPLOAD_PARTS_IN_FLIGHT} parts of "
            f"{PART_BYTES // MiB} MiB in flight)")
        ceiling_s = direct_upload(store, a.bucket, f"{self.prefix}/ceiling", local_files)
        ceiling = mb / ceiling_s

        say("export_table into the volume, fresh mount, until committed; then again over it")
        with Mount(self.work, "export", catalog, env) as m:
            target = volume(m) / "tables" / "exp"
            t0 = time.perf_counter()
            files = export_table(table, target, target_file_bytes=a.target_file_size)
            export_s = time.perf_counter() - t0
            t0 = time.perf_counter()
            files = export_table(table, target, target_file_bytes=a.target_file_size)
            overwrite_s = time.perf_counter() - t0
            names = [os.path.basename(f) for f in files]
            sizes = {c: column_bytes(files, c) for c in READ_COLUMNS}  # footers: not measured
        del table
        self.figures += [
            Figure("export.local_disk", mb / local_s, "MB/s", note=f"{mb:,.0f} MB in {len(local_files)} files, "
                                                                   f"{local_s:.1f} s: encoding alone"),
            Figure("export.ceiling.multipart_put", ceiling, "MB/s", note=f"{ceiling_s:.1f} s"),
            Figure("export.mount", mb / export_s, "MB/s", ceiling, mb / export_s / ceiling, None,
                   f"{export_s:.1f} s to committed; {mb / export_s / (mb / local_s):.2f} x local disk"),
            Figure("export.mount.overwrite", mb / overwrite_s, "MB/s", ceiling, mb / overwrite_s / ceiling, None,
                   f"{overwrite_s:.1f} s, incl. retiring the old export"),
        ]

        for reader in ("pyarrow.dataset", "datasets"):
            for column in READ_COLUMNS:
                col, footers = sizes[column]
                say(f"{reader}: column {column!r} ({col / 1e6:,.1f} MB in {len(names)} files), fresh mount")
                with Mount(self.work, f"read-{reader}-{column}", catalog, env) as m:
                    paths = [str(volume(m) / "tables" / "exp" / n) for n in names]
                    before = store_counters(m)
                    t0 = time.perf_counter()
                    rows = read_column(reader, paths, column, self.work / f"hf-{column}")
                    seconds = time.perf_counter() - t0
                    after = store_counters(m)
                shutil.rmtree(self.work / f"hf-{column}", ignore_errors=True)
                fetched = after.get("get_bytes", 0) - before.get("get_bytes", 0)
                gets = after.get("get", 0) - before.get("get", 0)
                self.figures.append(Figure(
                    f"read.{reader}.{column}", fetched / 1e6, "MB", col / 1e6, fetched / col, None,
                    f"fetched / column bytes; {gets} GETs, footers {footers / 1e3:,.0f} kB, "
                    f"{rows:,} rows in {seconds:.1f} s; file bytes {nbytes / 1e6:,.0f} MB"))


def main(argv: list[str] | None = None) -> int:
    return run_bench("bench_tables", Bench, parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
