from cluster.engine.stops import StopMatcher


def run(stops, pieces):
    m = StopMatcher(stops)
    out = "".join(m.feed(p) for p in pieces)
    return out + m.flush(), m.stopped


def test_no_stops_passes_everything_through():
    assert run([], ["ab", "c"]) == ("abc", False)


def test_stop_inside_one_piece():
    assert run(["END"], ["abcENDxyz"]) == ("abc", True)


def test_stop_split_across_pieces_is_never_leaked():
    m = StopMatcher(["END"])
    assert m.feed("abcE") == "abc"  # "E" could start END: held back
    assert m.feed("N") == ""
    assert m.feed("D tail") == ""
    assert m.stopped and m.flush() == ""


def test_held_text_is_released_when_the_stop_does_not_complete():
    m = StopMatcher(["END"])
    assert m.feed("abE") == "ab"
    assert m.feed("x") == "Ex"
    assert m.flush() == ""


def test_flush_releases_a_dangling_partial_at_the_end():
    assert run(["END"], ["abEN"]) == ("abEN", False)


def test_earliest_of_several_stops_wins():
    assert run(["zz", "b"], ["aazzb"]) == ("aa", True)
