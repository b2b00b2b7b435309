"""Tables on a volume: Parquet written by real writers, torchio's export_table, and loading for training.

Writers run unmodified on the mount: pyarrow (write_to_dataset, write_dataset), pandas to_parquet,
and Spark in local mode with its commit protocol (_temporary directories, directory renames,
_SUCCESS, overwrite deleting the old output). What reached the store is checked with a separate
boto3 client, and everything is read back through a second mount of the same volume: another host,
with a cold cache, that sees only what was committed.
"""

from __future__ import annotations

import datetime
import io
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

import pytest

pa = pytest.importorskip("pyarrow")
pads = pytest.importorskip("pyarrow.dataset")
pq = pytest.importorskip("pyarrow.parquet")

from torchio.tables import MANIFEST_NAME, exported_files, read_manifest  # noqa: E402
from tests.support import keys, sync_dir  # noqa: E402

KiB = 1 << 10
MiB = 1 << 20


def stored_files(s3, bucket, prefix) -> dict[str, int]:
    """Objects under prefix that are files (not directory markers): relative key -> size."""
    out = {}
    for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
        for o in page.get("Contents", ()):
            if not o["Key"].endswith("/"):
                out[o["Key"][len(prefix):]] = o["Size"]
    return out


def local_files(root) -> dict[str, int]:
    """Files under root as the mount shows them: relative path -> size."""
    out = {}
    for d, _, names in os.walk(root):
        for n in names:
            p = os.path.join(d, n)
            out[os.path.relpath(p, root)] = os.path.getsize(p)
    return out


@pytest.fixture
def hf_datasets(tmp_path, monkeypatch):
    """Hugging Face `datasets`, offline (there is no network), caching under this test's tmp_path."""
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    datasets = pytest.importorskip("datasets")
    # The flags are read when datasets is first imported, which may have been before this test.
    monkeypatch.setattr(datasets.config, "HF_DATASETS_OFFLINE", True, raising=False)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True, raising=False)
    datasets.disable_progress_bars()

    def load(data_files, name: str, **kwargs):
        return datasets.load_dataset("parquet", data_files=data_files, split="train",
                                     cache_dir=str(tmp_path / "hf-cache" / name), **kwargs)

    return load


def events_table(n: int, start: int = 0):
    """A table with the types tables usually have: numbers, text, flags, times, lists, a partition key."""
    ids = list(range(start, start + n))
    t0 = datetime.datetime(2026, 1, 1, tzinfo=datetime.timezone.utc)
    return pa.table({
        "id": pa.array(ids, pa.int64()),
        "x": pa.array([i * 0.5 for i in ids], pa.float64()),
        "f": pa.array([float(i % 1000) for i in ids], pa.float32()),
        "text": pa.array([f"event {i}: " + "lorem ipsum " * (i % 7) for i in ids], pa.string()),
        "ok": pa.array([i % 3 == 0 for i in ids], pa.bool_()),
        "at": pa.array([t0 + datetime.timedelta(seconds=i) for i in ids], pa.timestamp("us", tz="UTC")),
        "tags": pa.array([[f"t{i % 5}"] * (i % 3) for i in ids], pa.list_(pa.string())),
        "region": pa.array([("eu", "us", "ap")[i % 3] for i in ids], pa.string()),
    })


# --------------------------------------------------------------------------------------------------
# export_table


def test_delta_table_exported_and_loaded_with_pyarrow_and_datasets(mount_factory, s3, bucket, prefix, tmp_path,
                                                                   hf_datasets):
    deltalake = pytest.importorskip("deltalake")
    delta = str(tmp_path / "delta")
    deltalake.write_deltalake(delta, events_table(12_000), partition_by=["region"])
    deltalake.write_deltalake(delta, events_table(12_000, start=12_000), partition_by=["region"], mode="append")
    want = deltalake.DeltaTable(delta).to_pyarrow_table().sort_by("id")

    writer = mount_factory()
    target = writer.path() / "tables" / "events"
    target_bytes = 64 * KiB
    files = export_table_checked(delta, target, target_file_bytes=target_bytes, threads=2)
    assert len(files) >= 4
    sizes = [os.path.getsize(f) for f in files]
    # About the target: each file but the last of each of the two encoding threads.
    assert all(0.5 * target_bytes <= s <= 1.5 * target_bytes for s in sorted(sizes)[2:]), sizes

    # In the store: exactly the files and the manifest, nothing staged left beside them.
    stored = stored_files(s3, bucket, f"{prefix}/vol/tables/")
    assert stored == {**{f"events/{os.path.basename(f)}": s for f, s in zip(files, sizes)},
                      f"events/{MANIFEST_NAME}": stored[f"events/{MANIFEST_NAME}"]}
    assert not [k for k in keys(s3, bucket, f"{prefix}/vol/") if ".export-" in k]
    manifest = s3.get_object(Bucket=bucket, Key=f"{prefix}/vol/tables/events/{MANIFEST_NAME}")["Body"].read()
    manifest = json.loads(manifest)
    assert manifest["rows"] == want.num_rows
    assert [f["name"] for f in manifest["files"]] == [os.path.basename(f) for f in files]

    # Another host, cold cache: pyarrow over the directory, and datasets over a glob and the manifest.
    reader = mount_factory(name="reader")
    rtarget = reader.path() / "tables" / "events"
    got = pads.dataset(str(rtarget)).to_table().sort_by("id")
    assert got.schema.equals(want.schema) and got.equals(want)
    for name, data_files in (("glob", f"{rtarget}/*.parquet"), ("manifest", exported_files(rtarget))):
        ds = hf_datasets(data_files, name)
        table = ds.data.table.sort_by("id")
        assert ds.num_rows == want.num_rows
        assert table.schema.equals(want.schema) and table.equals(want), name
    assert set(exported_files(rtarget)) == {str(rtarget / os.path.basename(f)) for f in files}

    # Time travel: version 0 of the table, into another directory.
    v0 = export_table_checked(delta, writer.path() / "tables" / "events-v0", version=0)
    assert pads.dataset(v0).count_rows() == 12_000


def export_table_checked(source, target, **kwargs) -> list[str]:
    from torchio import export_table

    files = export_table(source, target, **kwargs)
    assert files == sorted(files) and all(os.path.dirname(f) == str(target) for f in files)
    assert all(re.fullmatch(r"part-\d{5}-[0-9a-f]{16}\.parquet", os.path.basename(f)) for f in files)
    return files


def test_export_sources_and_refusals(mount, s3, bucket, prefix):
    pd = pytest.importorskip("pandas")
    v = mount.path()
    table = events_table(3_000)
    # A pyarrow Dataset with a projection and a filter.
    files = export_table_checked(pads.dataset(table), v / "sub", columns=["id", "region"],
                                 filter=pads.field("region") == "eu")
    got = pads.dataset(files).to_table()
    assert got.column_names == ["id", "region"] and got.num_rows == 1_000
    # A stream of record batches, read as it is written; one encoding thread keeps the row order.
    reader = pa.RecordBatchReader.from_batches(table.schema, table.to_batches(max_chunksize=500))
    files = export_table_checked(reader, v / "stream", target_file_bytes=16 * KiB, threads=1)
    assert len(files) >= 3 and pads.dataset(files).to_table().equals(table)
    # A pandas DataFrame keeps its index and dtypes, as its own to_parquet does.
    df = pd.DataFrame({"a": [1, 2, 3], "b": ["x", "y", "z"]}, index=pd.Index([7, 8, 9], name="k"))
    files = export_table_checked(df, v / "frame")
    pd.testing.assert_frame_equal(pd.read_parquet(files[0]), df)
    # An empty table still makes one file: the schema.
    files = export_table_checked(table.slice(0, 0), v / "empty")
    assert len(files) == 1 and pq.read_schema(files[0]).names == table.column_names

    from torchio import export_table

    with pytest.raises(FileExistsError):
        export_table(table, v / "sub", overwrite=False)
    with pytest.raises(TypeError):
        export_table([1, 2, 3], v / "nothing")
    (v / "plain.txt").write_bytes(b"x")
    with pytest.raises(NotADirectoryError):
        export_table(table, v / "plain.txt")
    sync_dir(v)
    # Nothing half-made was left by the refusals, and the first export is untouched.
    names = {k.split("/")[2] for k in keys(s3, bucket, f"{prefix}/vol/")} - {""}
    assert names == {"sub", "stream", "frame", "empty", "plain.txt"}
    assert pads.dataset(exported_files(v / "sub")).count_rows() == 1_000


@pytest.mark.slow
def test_overwrite_never_shows_a_mix_of_exports(mount_factory, s3, bucket, prefix):
    """Overwrite an export three times while readers on this host and on another poll it."""
    writer = mount_factory()
    reader = mount_factory(name="reader")
    target, rtarget = writer.path() / "t" / "x", reader.path() / "t" / "x"
    rows = 20_000

    def generation(g: int):
        return events_table(rows).append_column("gen", pa.array([g] * rows, pa.int64()))

    exports = {}  # export id -> its file names, in the order of the exports

    def export(g: int) -> None:
        files = export_table_checked(generation(g), target, target_file_bytes=32 * KiB)
        exports[read_manifest(target)["export_id"]] = sorted(os.path.basename(f) for f in files)

    export(0)
    stop = threading.Event()
    seen = {"local": [], "remote": [], "store": [], "manifest": []}
    errors = []

    def ids_in(directory) -> tuple[set[str], list[str]] | None:
        try:
            names = sorted(n for n in os.listdir(directory) if n.startswith("part-"))
        except FileNotFoundError:
            return None
        return {n.split("-")[2].split(".")[0] for n in names}, names

    def poll_listing(directory, into) -> None:
        while not stop.is_set():
            into.append(ids_in(directory))
            time.sleep(0.005)

    def poll_store() -> None:
        # What any other host sees once its cached listing expires, at a finer grain than the TTL.
        while not stop.is_set():
            names = [k.rsplit("/", 1)[1] for k in keys(s3, bucket, f"{prefix}/vol/t/x/")]
            names = sorted(n for n in names if n.startswith("part-"))
            seen["store"].append(({n.split("-")[2].split(".")[0] for n in names}, names) if names else None)

    def poll_manifest() -> None:
        while not stop.is_set():
            try:
                files = exported_files(rtarget)
                table = pads.dataset(files).to_table(columns=["id", "gen"])
            except OSError:
                # No manifest (an export is being published), or the files of the manifest just
                # read went away with their export: an error to retry, never wrong data.
                seen["manifest"].append(None)
                continue
            except Exception as e:  # noqa: BLE001 - reported by the main thread
                errors.append(repr(e))
                return
            seen["manifest"].append((table.num_rows, set(table.column("gen").to_pylist())))

    threads = [threading.Thread(target=poll_listing, args=(target, seen["local"])),
               threading.Thread(target=poll_listing, args=(rtarget, seen["remote"])),
               threading.Thread(target=poll_store), threading.Thread(target=poll_manifest)]
    for t in threads:
        t.start()
    try:
        for g in (1, 2, 3):
            export(g)
            time.sleep(1.5)  # let the other host's listing expire, so it sees every export
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=60)
    assert not errors
    # What each poller saw, for the log: (export ids, file count) or None, with repeat counts.
    print(json.dumps({k: _runs([s if s is None or k == "manifest" else (sorted(s[0]), len(s[1])) for s in v])
                      for k, v in seen.items()}, default=str))

    # Every poller watched the exports change (or this test proves nothing).
    last = list(exports)[-1]
    for where in ("local", "store"):
        ids = {i for snap in seen[where] if snap for i in snap[0]}
        assert len(ids) >= 2 and last in ids, (where, ids)
    assert {g for m in seen["manifest"] if m for g in m[1]} >= {1, 3}

    # This host: the whole of one export, or nothing; never a part, never a mix.
    for snap in seen["local"]:
        if snap is not None and snap[1]:
            ids, names = snap
            assert len(ids) == 1 and names == exports[next(iter(ids))], snap
    # Another host: possibly part of one export while it moves, but never files of two.
    for where in ("remote", "store"):
        assert all(snap is None or len(snap[0]) <= 1 for snap in seen[where]), \
            (where, [s for s in seen[where] if s and len(s[0]) > 1][:3])
    # Through the manifest: always one whole export.
    complete = [m for m in seen["manifest"] if m is not None]
    assert all(n == rows and len(gens) == 1 for n, gens in complete), complete[:5]

    stored = stored_files(s3, bucket, f"{prefix}/vol/t/")
    assert sorted(stored) == sorted([f"x/{n}" for n in exports[last]] + [f"x/{MANIFEST_NAME}"])
    assert not [k for k in keys(s3, bucket, f"{prefix}/vol/") if ".export-" in k]


def _runs(items: list) -> list:
    """[(item, times seen in a row), ...]: what a poller saw, compressed."""
    out = []
    for x in items:
        if out and out[-1][0] == x:
            out[-1][1] += 1
        else:
            out.append([x, 1])
    return out


# --------------------------------------------------------------------------------------------------
# real writers on the mount


def test_pyarrow_partitioned_writes_read_back(mount_factory, s3, bucket, prefix):
    writer = mount_factory()
    v = writer.path()
    table = events_table(6_000).append_column("year", pa.array([2024 + i // 7 % 3 for i in range(6_000)], pa.int64()))
    hive = pads.partitioning(pa.schema([("year", pa.int64()), ("region", pa.string())]), flavor="hive")

    pq.write_to_dataset(table, root_path=str(v / "w2d"), partition_cols=["year", "region"])
    pads.write_dataset(table, str(v / "wds"), format="parquet", partitioning=hive, max_rows_per_file=300,
                       max_rows_per_group=300)
    # Overwrite the partitions it touches (pyarrow deletes what matches, then writes).
    second = table.filter(pads.field("year") == 2024)
    second = second.set_column(1, "x", pa.array([-1.0] * second.num_rows))
    pads.write_dataset(second, str(v / "wds"), format="parquet", partitioning=hive,
                       existing_data_behavior="delete_matching", basename_template="second-{i}.parquet")
    expected = {"w2d": table, "wds": pa.concat_tables([table.filter(pads.field("year") != 2024), second])}
    for name in expected:
        sync_dir(v / name)
        assert stored_files(s3, bucket, f"{prefix}/vol/{name}/") == local_files(v / name)
    assert len(local_files(v / "w2d")) == 9 and len(local_files(v / "wds")) >= 4_000 // 300 + 3

    reader = mount_factory(name="reader")
    for name, want in expected.items():
        got = pads.dataset(str(reader.path() / name), format="parquet", partitioning=hive).to_table()
        got = got.select(table.column_names).sort_by("id")
        assert got.equals(want.sort_by("id")), name


def test_pandas_to_parquet_round_trip(mount_factory, s3, bucket, prefix):
    pd = pytest.importorskip("pandas")
    writer = mount_factory()
    v = writer.path()
    n = 5_000
    df = pd.DataFrame({
        "id": range(n),
        "x": [i / 7 for i in range(n)],
        "name": [f"name-{i}" for i in range(n)],
        "when": pd.date_range("2026-01-01", periods=n, freq="min"),
        "kind": pd.Categorical([("a", "b", "c")[i % 3] for i in range(n)]),
    }).set_index("id")
    df.to_parquet(v / "frame.parquet")
    df.reset_index().to_parquet(v / "by-kind", partition_cols=["kind"])
    sync_dir(v)
    assert stored_files(s3, bucket, f"{prefix}/vol/") == local_files(v)

    reader = mount_factory(name="reader")
    r = reader.path()
    pd.testing.assert_frame_equal(pd.read_parquet(r / "frame.parquet"), df)
    back = pd.read_parquet(r / "by-kind").sort_values("id").set_index("id")[df.columns]
    pd.testing.assert_frame_equal(back, df, check_categorical=False)


SPARK_JOB = r"""
import json, os, sys
from pyspark.sql import SparkSession

out, local_dir = sys.argv[1], sys.argv[2]
spark = (SparkSession.builder.master("local[2]").appName("ucfs-test")
         .config("spark.ui.enabled", "false").config("spark.ui.showConsoleProgress", "false")
         .config("spark.driver.memory", "512m").config("spark.driver.host", "127.0.0.1")
         .config("spark.driver.bindAddress", "127.0.0.1").config("spark.sql.shuffle.partitions", "2")
         .config("spark.local.dir", local_dir).getOrCreate())
spark.sparkContext.setLogLevel("ERROR")

def tree():
    return sorted(os.path.relpath(os.path.join(d, n), out) for d, _, names in os.walk(out) for n in names)

jobs = []
# Job 1: three partitions. Job 2: two, so overwriting must also remove the third's directory.
for rows, parts, scale in ((3000, 3, 1), (2000, 2, 10)):
    df = spark.range(0, rows).selectExpr("id", f"id * {scale} AS v", f"CAST(id % {parts} AS INT) AS k")
    df.repartition(2).write.mode("overwrite").partitionBy("k").parquet(out)
    jobs.append(tree())
count = spark.read.parquet(out).count()
spark.stop()
print("RESULT " + json.dumps({"jobs": jobs, "count": count}), flush=True)
"""


@pytest.mark.slow
def test_spark_overwrite_twice_leaves_exactly_the_second_job(mount_factory, s3, bucket, prefix, tmp_path):
    pytest.importorskip("pyspark")
    writer = mount_factory()
    out = writer.path() / "spark" / "out"
    script = tmp_path / "spark_job.py"
    script.write_text(SPARK_JOB)
    (tmp_path / "spark-local").mkdir()
    env = dict(os.environ, PYSPARK_PYTHON=sys.executable, SPARK_LOCAL_IP="127.0.0.1",
               JAVA_TOOL_OPTIONS=f"-Djava.io.tmpdir={tmp_path}")
    # Its own session: the JVM it starts is killed with it, whatever happens here.
    proc = subprocess.Popen([sys.executable, str(script), str(out), str(tmp_path / "spark-local")],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=tmp_path,
                            start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        else:
            try:
                os.killpg(proc.pid, signal.SIGKILL)  # a JVM left behind by the job
            except ProcessLookupError:
                pass
    result = [line for line in output.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and result, output[-4000:]
    result = json.loads(result[0][len("RESULT "):])
    first, second = result["jobs"]
    assert result["count"] == 2000

    def job_ids(tree):
        return {m.group(1) for f in tree if (m := re.search(r"part-\d+-([0-9a-f-]{36})", f))}

    assert len(job_ids(first)) == 1 and len(job_ids(second)) == 1 and job_ids(first) != job_ids(second)
    assert "_SUCCESS" in second and {f.split("/")[0] for f in second if "/" in f} == {"k=0", "k=1"}

    sync_dir(out)
    stored = stored_files(s3, bucket, f"{prefix}/vol/spark/out/")
    # Exactly the second job's files (part files, their .crc checksums, _SUCCESS): no _temporary,
    # no k=2 left from the first job.
    assert sorted(stored) == second
    assert stored == local_files(out)
    markers = [k for k in keys(s3, bucket, f"{prefix}/vol/spark/") if k.endswith("/")]
    assert all(m.rstrip("/").split("/")[-1] in ("spark", "out", "k=0", "k=1") for m in markers), markers

    reader = mount_factory(name="reader")
    got = pads.dataset(str(reader.path() / "spark" / "out"), format="parquet", partitioning="hive").to_table()
    got = got.sort_by("id")
    assert got.column("id").to_pylist() == list(range(2000))
    assert got.column("v").to_pylist() == [i * 10 for i in range(2000)]
    assert got.column("k").to_pylist() == [i % 2 for i in range(2000)]


# --------------------------------------------------------------------------------------------------
# reading Parquet through the mount


def test_footer_and_column_reads_fetch_only_what_they_touch(mount, s3, bucket, prefix):
    """A Parquet reader reads the footer first, then the column chunks it wants, at random offsets:
    the read-ahead must fetch the blocks those reads touch, not the whole file."""
    import numpy as np

    rng = np.random.default_rng(3)
    n, groups = 400_000, 4
    table = pa.table({f"c{i}": rng.random(n) for i in range(8)})  # random doubles: ~no compression
    buf = io.BytesIO()
    pq.write_table(table, buf, compression="none", row_group_size=n // groups)
    s3.put_object(Bucket=bucket, Key=f"{prefix}/vol/wide.parquet", Body=buf.getvalue())
    path = mount.path() / "wide.parquet"
    size = len(buf.getvalue())

    def fetched() -> int:
        return mount.store_stats().get("get_bytes", 0)

    before = fetched()
    meta = pq.ParquetFile(path).metadata
    footer = fetched() - before
    assert meta.num_rows == n
    assert footer <= 2 * MiB < size // 10, (footer, size)

    column = sum(meta.row_group(g).column(3).total_compressed_size for g in range(groups))
    before = fetched()
    got = pq.read_table(path, columns=["c3"])
    read = fetched() - before
    assert got.column("c3").equals(table.column("c3"))
    # Each column chunk may cost the 1 MiB blocks it straddles, plus one: the kernel's own read-ahead
    # (1 MiB on the mount, which keeps sequential reads in 1 MiB requests) reads past the chunk.
    assert read <= column + 3 * groups * MiB and read < size // 2, (read, column, size)


@pytest.mark.parametrize("how", ["path", "file-uri", "DeltaTable", "symlink"])
def test_an_export_over_its_own_delta_table_is_refused(tmp_path, how):
    """Only a plain path was checked: given as a file:// URI, a DeltaTable or a symbolic link, the
    export went ahead and deleted the table with its history."""
    deltalake = pytest.importorskip("deltalake")
    from torchio import export_table

    t = tmp_path / "events"
    deltalake.write_deltalake(str(t), pa.table({"x": [1, 2]}))
    deltalake.write_deltalake(str(t), pa.table({"x": [3]}), mode="append")
    (tmp_path / "link").symlink_to(t)
    source = {"path": str(t), "file-uri": f"file://{t}", "DeltaTable": deltalake.DeltaTable(str(t)),
              "symlink": str(tmp_path / "link")}[how]
    with pytest.raises(ValueError, match="lies inside the target"):
        export_table(source, t)
    assert deltalake.DeltaTable(str(t)).version() == 1


def test_the_leftover_warning_names_only_this_targets_staging(tmp_path, caplog):
    """An export to "events" warned about (and told users to remove) a staging directory of an
    export to "events-v0", which may be running."""
    from torchio import export_table

    (tmp_path / ".export-events-v0-0123456789abcdef").mkdir()
    (tmp_path / ".export-events-fedcba9876543210.old").mkdir()
    with caplog.at_level("WARNING", logger="torchio.tables"):
        export_table(pa.table({"x": [1]}), tmp_path / "events")
    warned = " ".join(r.getMessage() for r in caplog.records if "did not finish" in r.getMessage())
    assert ".export-events-fedcba9876543210.old" in warned and "events-v0" not in warned
