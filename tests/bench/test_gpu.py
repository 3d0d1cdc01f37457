"""The GPU run's summary of its tests logs (cluster/bench/gpu.py): what failed, even where a part was cut, and the
suites' groups, run at once, as one summary."""

from cluster.bench.gpu import merged, test_counts as counts_of


def test_a_finished_run_gives_its_counts_and_failures(tmp_path):
    log = tmp_path / "tests.log"
    log.write_text("tests/engine/test_a.py::test_x PASSED [ 50%]\ntests/engine/test_a.py::test_y FAILED [100%]\n"
                   "=== short test summary info ===\nFAILED tests/engine/test_a.py::test_y - AssertionError\n"
                   "=== 1 failed, 1 passed in 3.2s ===\n")
    assert counts_of(log) == {"failed": 1, "passed": 1, "failed_tests": ["tests/engine/test_a.py::test_y"]}


def test_a_run_cut_by_its_timeout_still_names_what_failed_so_far(tmp_path):
    log = tmp_path / "tests.log"
    log.write_text("tests/engine/test_a.py::test_x PASSED [  1%]\n"
                   "tests/engine/test_lockstep.py::test_two[tiny-dense-tensor-0] FAILED [  2%]\n"
                   "tests/engine/test_b.py::test_z ERROR [  3%]\n")
    assert counts_of(log)["failed_tests"] == ["tests/engine/test_b.py::test_z",
                                              "tests/engine/test_lockstep.py::test_two[tiny-dense-tensor-0]"]


def test_groups_run_at_once_add_up_to_one_summary():
    a = {"suites": ["tests/engine"], "rc": 0, "seconds": 244.0, "passed": 94, "skipped": 9, "failed_tests": []}
    b = {"suites": ["tests/kvcache", "tests/store"], "rc": 1, "seconds": 186.0, "passed": 335, "failed": 2,
         "skipped": 7, "failed_tests": ["tests/kvcache/test_b.py::t", "tests/kvcache/test_a.py::t"]}
    c = {"suites": ["tests/kernels"], "rc": "timeout", "seconds": 530.0, "passed": 10, "failed_tests": []}
    assert merged([a, b]) == {"rc": 1, "seconds": 244.0, "passed": 429, "skipped": 16, "failed": 2,
                              "failed_tests": ["tests/kvcache/test_a.py::t", "tests/kvcache/test_b.py::t"],
                              "groups": [a, b]}
    assert merged([a, c])["rc"] == "timeout" and merged([a])["rc"] == 0
