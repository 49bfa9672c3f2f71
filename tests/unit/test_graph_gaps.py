"""`opfuse.bench.gaps`: the idle stretches of a replay between GPU activities, and the totals that split a replay's
span into kernels, copies/memsets and idle time (synthetic timelines; the profiler side needs a GPU)."""

from opfuse.bench.gaps import Activity, idle_gaps, summarize


def test_gaps_between_activities_largest_first_with_their_neighbours():
    timeline = [Activity("gemm", 0, 10), Activity("Memcpy DtoD", 12, 13), Activity("relu", 13, 15),
                Activity("softmax", 20, 21)]
    gaps = idle_gaps(timeline[::-1])            # any order in
    assert [(g.before, g.after, g.microseconds) for g in gaps] == [("relu", "softmax", 5), ("gemm", "Memcpy DtoD", 2)]


def test_overlapping_activities_are_one_stretch_of_work():
    # the short kernel starts and ends inside the long one: no gap after it, the next gap counts from the long one
    timeline = [Activity("long", 0, 10), Activity("short", 2, 4), Activity("next", 11, 12)]
    (gap,) = idle_gaps(timeline)
    assert (gap.before, gap.after, gap.microseconds) == ("long", "next", 1)


def test_summary_splits_the_span():
    timeline = [Activity("gemm", 0, 10), Activity("Memset (Device)", 11, 12), Activity("relu", 14, 15)]
    assert summarize(timeline) == {"span_us": 15, "kernels_us": 11, "kernels": 2, "copies_us": 1, "copies": 1,
                                   "idle_us": 3}
    assert summarize([])["span_us"] == 0.0
