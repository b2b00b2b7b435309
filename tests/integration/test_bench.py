"""`ucfs bench` end to end, made small: every phase runs against the test server, prints its figures
and ratios, writes them as JSON, and says what the machine's CPUs did during each phase."""

from __future__ import annotations

import json
import subprocess
import sys

from ucfs.bench import (BenchMount, Figure, ThreadCpu, _cpu_delta, _cpu_shares, _fmt_requests,
                        _fmt_thread_cpu, _request_delta, _returned_to_host_kib, combine_rounds, format_table,
                        median_rounds)

from tests.support import REPO


def test_cpu_shares_are_percent_of_all_cpu_time_by_kind():
    before = [100, 0, 50, 1000, 10, 0, 5, 0]
    after = [160, 0, 80, 1080, 20, 0, 10, 50]  # 60 user, 30 system, 80 idle, 10 iowait, 5 softirq, 50 steal
    shares = _cpu_shares(before, after)
    assert shares == {"user": 25.5, "nice": 0.0, "system": 12.8, "idle": 34.0, "iowait": 4.3, "irq": 0.0,
                      "softirq": 2.1, "steal": 21.3}
    assert _cpu_shares(None, after) is None and _cpu_shares(before, before) is None


def test_a_thread_that_ended_during_a_phase_keeps_its_cpu_in_the_daemons_split():
    """A pool thread that ends mid-phase (after 10 s idle) is gone from /proc/<pid>/task: its time is
    in the process's alone. The split counts what it used during the phase as "exited threads", its
    kind keeps what its live threads used, and the kinds add up to the process's own time."""
    before = ThreadCpu({100: ("loop", 2.0), 101: ("store", 1.0), 102: ("store", 0.5)}, process_s=3.5)
    # 101 ran 0.7 s more, then ended; 102 ran 0.1, the loop 0.2; 103 started and ran 0.1.
    after = ThreadCpu({100: ("loop", 2.2), 102: ("store", 0.6), 103: ("disk", 0.1)}, process_s=4.6)
    cpu = _cpu_delta(before, after)
    assert {k: round(v, 6) for k, v in cpu.items()} == {
        "loop": 0.2, "store": 0.1, "disk": 0.1, "journal": 0.0, "other": 0.0, "exited": 0.7}
    assert _fmt_thread_cpu(cpu) == ("1.10 s (event loop 0.20, store threads 0.10, disk threads 0.10, "
                                    "exited threads 0.70)")
    # Without the process's time (the daemon is gone) there is no "exited" share to give.
    assert "exited" not in _cpu_delta(before, ThreadCpu(after.threads))


_BURNER = """
import os, sys, threading, time
def burn():
    with open(f"/proc/self/task/{threading.get_native_id()}/comm", "w") as f:
        f.write("ucfs-store")
    while time.thread_time() < 0.3:
        pass
print("ready", flush=True)
sys.stdin.readline()
t = threading.Thread(target=burn)
t.start()
t.join()
while len(os.listdir("/proc/self/task")) > 1:  # join() returns before the OS thread is gone
    time.sleep(0.001)
print("done", flush=True)
sys.stdin.readline()
"""


def test_a_daemon_thread_that_ended_is_read_from_the_process_time(tmp_path):
    """The same through /proc and the process's CPU clock: a child whose 'ucfs-store' thread runs
    0.3 s of CPU and ends between two readings."""
    m = BenchMount(tmp_path, tmp_path / "catalog.toml", {}, "t")
    m.proc = subprocess.Popen([sys.executable, "-c", _BURNER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True)
    try:
        assert m.proc.stdout.readline() == "ready\n"
        before = m.thread_cpu()
        assert [kind for kind, _ in before.threads.values()] == ["loop"] and before.process_s is not None
        m.proc.stdin.write("go\n")
        m.proc.stdin.flush()
        assert m.proc.stdout.readline() == "done\n"
        after = m.thread_cpu()
        cpu = _cpu_delta(before, after)
        assert 0.3 <= cpu["exited"] < 0.5, cpu
        assert cpu["store"] == 0.0, cpu
        assert abs(sum(cpu.values()) - (after.process_s - before.process_s)) < 1e-6
    finally:
        m.proc.kill()
        m.proc.wait()


def _bench(s3_endpoint, bucket, prefix, tmp_path, *args):
    """`ucfs bench` against the test server with a work dir under tmp_path: (the run, its JSON)."""
    out = tmp_path / "bench.json"
    r = subprocess.run(
        [sys.executable, "-m", "ucfs", "bench", "--endpoint", s3_endpoint.url,
         # The `=` form: a generated secret may begin with "-", which argparse
         # would otherwise read as the next option.
         f"--access-key={s3_endpoint.access_key}", f"--secret-key={s3_endpoint.secret_key}",
         "--region", s3_endpoint.region, "--bucket", bucket, "--prefix", f"{prefix}/bench/",
         *args, "--work-dir", str(tmp_path / "work"), "--json", str(out)],
        capture_output=True, text=True, cwd=REPO, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    return r, json.loads(out.read_text())


def test_a_small_bench_runs_every_phase_and_reports_ratios(s3_endpoint, bucket, prefix, tmp_path):
    r, doc = _bench(s3_endpoint, bucket, prefix, tmp_path, "--size", "24M", "--small-files", "40",
                    "--small-size", "20K", "--listing-entries", "60")
    figures = doc["figures"]
    for name in ("mount.cold_read", "mount.warm_read", "mount.small_parallel", "mount.write.commit",
                 "mount.small_write.committed"):
        assert figures[name]["value"] > 0 and figures[name]["ratio"] is not None, figures[name]
    assert figures["mount.ls_cold"]["value"] > 0
    # After a remount the same read comes from the disk cache alone: no GET, and no target.
    remount = figures["mount.remount_read"]
    assert remount["value"] > 0 and remount["ceiling"] == figures["mount.cold_read"]["value"], remount
    assert remount["passed"] is None and doc["details"]["mount.remount_read"]["requests"].get("get", 0) == 0
    # The bounds: measured beside the ceilings, compared with them, and what they imply printed.
    for name in ("ceiling.read_keep", "ceiling.write_pair.local", "ceiling.write_pair.put"):
        assert figures[name]["value"] > 0 and figures[name]["ratio"] is not None, figures[name]
        assert figures[name]["target"] == "" and figures[name]["passed"] is None
    assert figures["ceiling.read_keep"]["ceiling"] == figures["ceiling.read"]["value"]
    assert "what this machine allows" in r.stdout and "close after a local sync" in r.stdout
    assert len(doc["bounds"]) == 6 and doc["bounds"][0].startswith("cold read: keeping every part")
    # The CPU bound of the cold read: the whole machine's work in ceiling.read and in the cold read of
    # the same round, and their quotient.
    cold = doc["details"]["mount.cold_read"]
    assert cold["machine_cpu_s"] > 0 and cold["ceiling_machine_cpu_s"] > 0, cold
    assert cold["ceiling_machine_cpu_s"] == doc["details"]["ceiling.read"]["machine_cpu_s"]
    bound = f"at most {cold['ceiling_machine_cpu_s'] / cold['machine_cpu_s']:.2f} x ceiling.read"
    assert doc["bounds"][1].startswith("cold read, CPU:") and bound in doc["bounds"][1], doc["bounds"]
    left = [p.name for p in (tmp_path / "work").glob("*.bin") if not p.name.startswith("src-")]
    assert not left, f"local copies left behind: {left}"
    # Each phase's CPU line, in the log and in the JSON.
    assert "mount.cold_read: CPUs" in r.stderr and "stolen by the hypervisor" in r.stderr
    cpu = doc["phase_cpu_percent"]["mount.cold_read"]
    assert 99 <= sum(cpu.values()) <= 101
    # ... and which processes used them: the mount's daemon lives through the cold read.
    assert "mount.cold_read: CPU seconds by process:" in r.stderr
    by_process = doc["phase_cpu_seconds_by_process"]["mount.cold_read"]
    assert by_process["ucfs mount"] >= 0 and "its ended children (mounts, dd, cp)" in by_process, by_process
    # Free memory the VM handed back to its hypervisor, phase by phase, where its kernel says.
    returned = doc["phase_returned_to_host_mib"]
    if _returned_to_host_kib() is None:
        assert returned == {} and doc["host"]["returned_to_host_mib"] is None
        assert "handed back to the hypervisor" not in r.stderr
    else:
        assert set(returned) == set(doc["phase_cpu_percent"]), returned
        assert all(v >= 0 for v in returned.values()) and doc["host"]["returned_to_host_mib"] >= 0
        assert "mount.cold_read: free memory handed back to the hypervisor since the phase before:" in r.stderr
    assert "targets met" in r.stdout


def test_memory_handed_back_to_the_hypervisor_is_read_where_the_kernel_reports_it(tmp_path):
    (tmp_path / "reported_kib").write_text("7602\n")
    assert _returned_to_host_kib(tmp_path) == 7602
    (tmp_path / "reported_kib").write_text("")
    assert _returned_to_host_kib(tmp_path) is None
    assert _returned_to_host_kib(tmp_path / "absent") is None


def test_repeated_rounds_are_judged_by_their_median_round():
    def fig(name, ratio, target=""):
        return Figure(name, value=100 * ratio, unit="MB/s", ceiling=100.0, ratio=ratio, target=target)

    rounds = [{"cold": fig("cold", 0.9, ">= 0.8"), "close": fig("close", 1.1, "<= 1.5"), "dd": Figure("dd", 2.0, "s")},
              {"cold": fig("cold", 0.6, ">= 0.8"), "close": fig("close", 1.6, "<= 1.5"), "dd": Figure("dd", 3.0, "s")},
              {"cold": fig("cold", 0.7, ">= 0.8"), "close": fig("close", 1.2, "<= 1.5"), "dd": Figure("dd", 1.0, "s")}]
    assert median_rounds(rounds) == {"cold": 2, "close": 2, "dd": 0}
    combined = combine_rounds(rounds)
    assert combined["cold"].ratio == 0.7 and combined["cold"].rounds == [0.9, 0.6, 0.7]
    assert combined["dd"].value == 2.0 and combined["dd"].rounds == [2.0, 3.0, 1.0]
    # Two rounds: of the two in the middle, the one worse for the target.
    assert median_rounds(rounds[:2]) == {"cold": 1, "close": 1, "dd": 0}
    table = format_table(list(combined.values()))
    assert "each round" in table and "0.90 0.60 0.70" in table


def test_request_counts_tell_retries_from_requests_of_any_kind():
    before = {"get": 1, "attempts": 1}
    after = {"get": 1, "create_multipart": 2, "upload_part": 255, "complete_multipart": 1, "abort_multipart": 1,
             "list_multipart": 1, "put_bytes": 9, "attempts": 262}
    d = _request_delta(before, after)
    # An abort (or any kind the bench does not list by name) is a request, not a retry.
    assert _fmt_requests(d) == ("create_multipart 2, upload_part 255, complete_multipart 1, abort_multipart 1, "
                                "list_multipart 1, retries 1")
    assert _fmt_requests({"get": 3, "errors": 1, "attempts": 4}) == "get 3, errors 1, retries 1"
    assert _fmt_requests({}) == "none"


def test_the_mount_log_lines_that_explain_a_figure(tmp_path):
    m = BenchMount(tmp_path, tmp_path / "catalog.toml", {}, "t")
    m.log_path.write_text("2026-11-30 10:00:00,000 INFO ucfs: ready\n")
    at = m.log_end()
    with open(m.log_path, "a") as f:
        f.write("2026-11-30 10:00:01,000 DEBUG ucfs.commit: committed /x\n"
                "2026-11-30 10:00:02,000 INFO ucfs.commit: stream upload of /x abandoned after 3 part(s)\n"
                "2026-11-30 10:00:03,000 WARNING ucfs.store: PUT x: timed out; retrying\n")
    assert m.notable_since(at) == ["2026-11-30 10:00:02,000 INFO ucfs.commit: stream upload of /x abandoned after "
                                   "3 part(s)", "2026-11-30 10:00:03,000 WARNING ucfs.store: PUT x: timed out; "
                                   "retrying"]
    assert m.notable_since(at, limit=1)[1] == "... and 1 more"
    assert m.notable_since(m.log_end()) == []


def test_repeat_must_be_positive():
    r = subprocess.run([sys.executable, "-m", "ucfs", "bench", "--repeat", "0"], capture_output=True, text=True,
                       cwd=REPO, timeout=60)
    assert r.returncode == 2 and "--repeat must be at least 1" in r.stderr


def test_repeated_rounds_end_to_end(s3_endpoint, bucket, prefix, tmp_path):
    r, doc = _bench(s3_endpoint, bucket, prefix, tmp_path, "--size", "16M", "--small-files", "20",
                    "--small-size", "10K", "--listing-entries", "30", "--repeat", "2",
                    "--skip", "mount.small_serial,ceiling.write_pair,mount.write,ceiling.put,ceiling.local_write")
    assert r.stderr.count("bench: round ") == 2 and "each round" in r.stdout
    assert doc["repeat"] == 2 and len(doc["rounds"]) == 2
    for name in ("mount.cold_read", "mount.small_parallel", "mount.small_write.committed"):
        f = doc["figures"][name]
        per_round = [rd["figures"][name]["ratio"] for rd in doc["rounds"]]
        assert f["rounds"] == per_round and f["ratio"] == min(per_round), (name, f)  # ">=": the worse
    # Each round mounted afresh under names of its own.
    logs = sorted(p.name for p in (tmp_path / "work").glob("ucfs-small-parallel*.log"))
    assert logs == ["ucfs-small-parallel-r1.log", "ucfs-small-parallel-r2.log"], logs
