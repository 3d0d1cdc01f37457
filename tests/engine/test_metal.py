"""The RAM tier's budget against a Mac's GPU working set (pure arithmetic: runs anywhere)."""

from cluster.engine.metal import budget_warning

GiB = 2**30


def test_a_tier_that_fits_next_to_the_weights_is_quiet():
    assert budget_warning({"metal": True, "working_set": 48 * GiB}, 16 * GiB, 8 * GiB) is None


def test_a_tier_past_the_working_set_names_the_option_and_a_size_that_fits():
    got = budget_warning({"metal": True, "working_set": 24 * GiB}, 16 * GiB, 12 * GiB)
    assert got is not None and "--cache-ram-gb" in got and "at most 6.0" in got


def test_off_metal_there_is_nothing_to_say():
    assert budget_warning({"metal": False}, 16 * GiB, 1 << 50) is None
