"""The GPU run's summary of its tests log (cluster/bench/gpu.py): what failed, even where the part was cut."""

from cluster.bench.gpu import test_counts as counts_of


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
