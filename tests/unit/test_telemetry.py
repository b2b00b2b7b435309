"""The event-loop watchdog explains a stall with where the loop thread was while it lasted."""

from __future__ import annotations

import os
import time

import trio

from ucfs import telemetry


def _block_the_loop_for(seconds: float) -> None:
    time.sleep(seconds)  # what a blocking call on the event loop would do


def test_a_stall_is_measured_and_its_stack_sampled():
    dog = telemetry.LoopWatchdog()

    async def main():
        async with trio.open_nursery() as n:
            n.start_soon(dog.run)
            await trio.sleep(0.3)  # healthy for a while: the sampler sleeps until a beat is overdue
            _block_the_loop_for(0.4)
            await trio.sleep(0.2)  # the watchdog wakes late, and reports
            n.cancel_scope.cancel()

    trio.run(main)
    stats = dog.statistics()
    assert 300 <= stats["loop_max_stall_ms"] < 1000, stats
    assert stats["loop_stalls_over_100ms"] == 1, stats
    (sample,) = stats["loop_stall_samples"]
    assert any("_block_the_loop_for" in frame for frame in sample["stack"]), sample
    assert sample["threads"]["loop"] == "S", sample  # asleep in the call, not running


def _proc_stat(steal_cpu0: int, steal_cpu1: int) -> bytes:
    """/proc/stat as the kernel writes it (columns: user nice system idle iowait irq softirq steal ...)."""
    return (f"cpu  900 0 500 8000 40 0 10 {steal_cpu0 + steal_cpu1} 0 0\n"
            f"cpu0 450 0 250 4000 20 0 5 {steal_cpu0} 0 0\n"
            f"cpu1 450 0 250 4000 20 0 5 {steal_cpu1} 0 0\n"
            "intr 12345 0 1 2\nctxt 999\nbtime 1700000000\n").encode()


def test_cpu_time_the_hypervisor_took_is_told_apart_from_blocked_time():
    """On a virtual machine the host stops our CPUs at times (steal). A thread whose CPU is stopped
    is neither on a CPU nor waiting for one as its scheduler counters see it: that time read as
    "blocked", as if the daemon had made a blocking call. The soak test failed on such stalls."""
    stolen = telemetry._stolen_ms(_proc_stat(100, 200), _proc_stat(112, 203))
    assert stolen == 12 * 1000 / telemetry._CLOCK_TICKS  # the CPU that lost most, not the sum
    assert telemetry._stolen_ms(_proc_stat(5, 5), _proc_stat(5, 5)) == 0
    assert telemetry._stolen_ms(b"", _proc_stat(5, 5)) == 0  # no /proc/stat: nothing known, nothing taken

    dog = telemetry.LoopWatchdog()
    # A 300 ms stall (350 ms between beats): 60 ms on a CPU, 90 ms waiting for one, 120 ms taken.
    dog._explain(0.0, 0.300, 60.0, 90.0, 120.0)
    # Steal beyond what is left of the window cannot all have been the loop's.
    dog._explain(0.0, 0.300, 60.0, 90.0, 500.0)
    first, second = dog.statistics()["loop_stall_samples"]
    assert (first["cpu_stolen_by_host_ms"], first["blocked_ms"]) == (120.0, 80.0), first
    assert (second["cpu_stolen_by_host_ms"], second["blocked_ms"]) == (200.0, 0.0), second


def test_blocked_time_while_other_threads_waited_for_a_cpu_is_told_apart(tmp_path):
    """The loop thread waiting for the GIL sleeps, so its counters call that time blocked. When the
    thread holding the GIL is itself runnable but without a CPU (a machine at a load of 10-20 on 2
    cores), the loop waits as long as it does: the machine's doing, not a blocking call. The soak
    failed in CI on such a stall (on a CPU 112 ms, waiting 117, blocked 72 at a line that cannot
    block). The kernel's CPU pressure (PSI) says how long some thread waited for a CPU; the most of
    the blocked time that can be is told apart, the rest stays blocked."""
    psi = tmp_path / "cpu"
    psi.write_text("some avg10=61.20 avg60=55.00 avg300=40.10 total=655858880\n"
                   "full avg10=0.00 avg60=0.00 avg300=0.00 total=0\n")
    fd = telemetry._open_counters(str(psi))
    try:
        assert telemetry._cpu_pressure_us(fd) == 655858880
    finally:
        os.close(fd)
    assert telemetry._cpu_pressure_us(None) is None  # a kernel without PSI: nothing is told apart

    dog = telemetry.LoopWatchdog()
    # A 300 ms stall (350 ms between beats): 60 ms on a CPU, 90 ms waiting for one, 20 ms taken by
    # the host, 180 ms blocked, and someone waited for a CPU 250 ms of the window: 90 of those were
    # the loop's own wait, so at most 160 were spent by others while the loop was blocked.
    dog._explain(0.0, 0.300, 60.0, 90.0, 20.0, 250.0)
    # Pressure beyond the loop's blocked time cannot all have been while it was blocked.
    dog._explain(0.0, 0.300, 60.0, 90.0, 20.0, 900.0)
    # No pressure (a quiet machine): a blocked loop is blocked.
    dog._explain(0.0, 0.300, 60.0, 90.0, 20.0, 0.0)
    split = [(s["cpu_stolen_by_host_ms"], s["blocked_while_others_waited_for_cpu_ms"], s["blocked_ms"])
             for s in dog.statistics()["loop_stall_samples"]]
    assert split == [(20.0, 160.0, 20.0), (20.0, 180.0, 0.0), (20.0, 0.0, 180.0)], split


def test_metric_label_values_are_escaped_as_the_text_format_requires():
    """A store's name comes from the catalog and may hold a quote, a backslash or a newline; written
    as is, it broke the line (or the page) and Prometheus rejected the whole scrape."""
    name = 'odd "store" \\ with\nnewline'
    text = telemetry.prometheus_text({"stores": {name: {"get": 3}}, "ready_s": 1})
    assert text.splitlines() == ['ucfs_store_get_total{store="odd \\"store\\" \\\\ with\\nnewline"} 3',
                                 "ucfs_ready_s 1"]


def test_a_store_in_an_outage_is_a_gauge_of_its_seconds_unreachable():
    text = telemetry.prometheus_text({"unreachable": {"rgw": {"for_s": 12.5, "answered_from_known": 40}},
                                      "core": {"stale_answers": 40}})
    assert text.splitlines() == ['ucfs_store_unreachable_seconds{store="rgw"} 12.5',
                                 "ucfs_core_stale_answers 40"]
