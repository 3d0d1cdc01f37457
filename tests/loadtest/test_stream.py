"""What one streamed request reports: ITL per token, however many tokens a chunk carries."""

import pytest

from loadtest.stream import Result


def test_itl_is_the_time_per_token_after_the_first_not_the_gap_between_chunks():
    # 11 tokens, the first at 0.1 s and the last at 1.1 s: 0.1 s per token, whether they came in 10 chunks or 2
    assert Result(status=200, ttft_s=0.1, last_s=1.1, completion_tokens=11).itl_s == pytest.approx(0.1)


@pytest.mark.parametrize("res", [Result(status=200, ttft_s=0.1, last_s=0.1, completion_tokens=1),
                                 Result(status=200, completion_tokens=5),
                                 Result(status=200, ttft_s=0.1, last_s=0.5, completion_tokens=0)])
def test_no_itl_without_two_tokens_and_their_times(res):
    assert res.itl_s is None
