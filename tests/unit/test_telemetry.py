"""The event-loop watchdog explains a stall with where the loop thread was while it lasted."""

from __future__ import annotations

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
