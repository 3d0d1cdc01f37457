"""stop_tagged: the processes that save something on SIGTERM get the whole grace; the rest, a brief one."""

import os
import subprocess
import sys

from cluster.fleet import processes

# Saves (writes its file) one second after SIGTERM, then exits: a supervisor recording its state.
SAVER = """
import signal, sys, time
def save(*_):
    time.sleep(1.0)
    open(sys.argv[1], "w").write("saved")
    sys.exit(0)
signal.signal(signal.SIGTERM, save)
print("ready", flush=True)
time.sleep(600)
"""
# Ignores SIGTERM: a Ray daemon that lingers.
LINGERER = """
import signal, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
print("ready", flush=True)
time.sleep(600)
"""


def spawn(code: str, tag: str, *args: str) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", code, *args], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, processes.TAG_ENV: tag})
    assert proc.stdout.readline().strip() == "ready"  # its handler is set
    return proc


def test_the_patient_get_the_grace_and_the_rest_a_brief_one(tmp_path):
    tag = str(tmp_path)
    saver, lingerer = spawn(SAVER, tag, str(tmp_path / "saved")), spawn(LINGERER, tag)
    try:
        assert processes.stop_tagged(tag, grace_s=20, patient=[saver.pid], brief_s=0.2) == 2
        assert (tmp_path / "saved").read_text() == "saved"  # it had its second to save
        assert processes.tagged(tag) == []  # and the lingerer, which ignores SIGTERM, was killed
    finally:
        for p in (saver, lingerer):
            p.kill()
            p.wait()


def test_without_the_patient_named_all_get_the_brief_grace(tmp_path):
    tag = str(tmp_path)
    saver = spawn(SAVER, tag, str(tmp_path / "saved"))
    try:
        assert processes.stop_tagged(tag, grace_s=20, brief_s=0.2) == 1
        assert processes.tagged(tag) == [] and not (tmp_path / "saved").exists()  # killed before it saved
    finally:
        saver.kill()
        saver.wait()
