"""The demo's acceptance-over-time series: counter differences per bin, new pods, version changes."""

from demo.timeline import Sample, Timeline


def sample(t, version, counters):
    return Sample(t, version, True, counters, "Serving", version, None)


def test_bins_take_counter_differences_and_a_restarted_pod_starts_from_zero():
    tl = Timeline(samples=[
        sample(0, "1", {"a": (0, 0)}),
        sample(2, "1", {"a": (10, 8)}),
        sample(4, "1", {"a": (20, 16), "b": (10, 0)}),     # bin 1: 20 drafted, 16 accepted
        sample(6, "2", {"a": (5, 1)}),                     # another version: not differenced across
        sample(8, "2", {"a": (15, 3)}),
        sample(12, "2", {"a": (2, 2)}),                    # counters went down: a new pod
    ])
    points = tl.acceptance_points(bin_seconds=4)
    assert [(round(acc, 3), drafted, v) for _, acc, drafted, v in points] == [
        (round(16 / 30, 3), 30, "1"),   # 0..4 s: a +20/+16 and b +10/+0
        (round(4 / 12, 3), 12, "2"),    # 6..12 s: +10/+2, then the restarted pod's own 2/2
    ]


def test_unreachable_engine_samples_are_skipped():
    tl = Timeline(samples=[sample(0, "1", {"a": (0, 0)}), sample(1, "", {}), sample(2, "1", {"a": (4, 2)})])
    assert tl.acceptance_points(bin_seconds=10) == []
