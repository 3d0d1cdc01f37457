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


def test_a_group_whose_process_aborted_counts_what_ended_and_names_the_test_running(tmp_path):
    """As on the H100 (seventeenth session): MLX's CUDA backend aborted the process, so pytest wrote no summary."""
    log = tmp_path / "tests-3.log"
    log.write_text("collecting ... collected 345 items\n\n"
                   "tests/kvcache/test_admission.py::test_a[tiny-dense] PASSED [  0%]\n"
                   "tests/kvcache/test_batch_restore.py::test_b[tiny-dense] SKIPPED [  1%]\n"
                   "tests/kvcache/test_batch_restore.py::test_c[tiny-swa] PASSED [  2%]\n"
                   "tests/kvcache/test_canonical_schedule.py::test_d[float32-224-tiny-dense] Fatal Python error: "
                   "Aborted\n\nCurrent thread 0x00007f0c8d936140 (most recent call first):\n"
                   '  File "/work/main/cluster/engine/model_thread.py", line 90 in guarded\n')
    got = counts_of(log)
    assert got == {"passed": 2, "skipped": 1, "failed_tests": [],
                   "running": "tests/kvcache/test_canonical_schedule.py::test_d[float32-224-tiny-dense]"}
    whole = {"suites": ["tests/engine"], "rc": 0, "seconds": 300.0, "passed": 94, "failed_tests": []}
    summary = merged([whole, {"suites": ["tests/kvcache"], "rc": -6, "seconds": 42.0, **got}])
    assert (summary["rc"], summary["passed"], summary["skipped"]) == (-6, 96, 1)
    assert summary["running_when_cut"] == ["tests/kvcache/test_canonical_schedule.py::test_d[float32-224-tiny-dense]"]
    assert "running_when_cut" not in merged([whole])
