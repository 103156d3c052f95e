"""The suite's process census: with `PYTHONPATH=$PWD/tests/census`, every Python process the suite starts (ranks,
launchers, tools, DeepSpeed's helpers) appends one line when it starts and one when it exits normally to
$SUITE_CENSUS (default /tmp/suite-census.tsv), with the test that started it (PYTEST_CURRENT_TEST). A
process killed or ended with os._exit without exit handlers has no end line. Read it with
tests/census/report.py. Imports nothing beyond the standard library's smallest modules."""
import atexit
import os
import sys
import time

os.environ.setdefault("BERT_RECIPES_WARM", "0")   # the census counts every process as it starts cold
_LOG = os.environ.get("SUITE_CENSUS", "/tmp/suite-census.tsv")
_TEST = os.environ.get("PYTEST_CURRENT_TEST", "").split(" (")[0]


def _write(line: str) -> None:
    try:
        with open(_LOG, "a") as f:
            f.write(line + "\n")
    except OSError:
        pass


_write(f"S\t{os.getpid()}\t{time.time():.3f}\t{os.getppid()}\t{' '.join(sys.argv[:4])[:200]}\t{_TEST}")
atexit.register(lambda: _write(f"E\t{os.getpid()}\t{time.time():.3f}\t{time.process_time():.3f}"))
