"""bench/worker_timeline.py's thread accounting (issue 51: where a served step's wall time goes):
the split of a window into run / waiting for a core / asleep per group of threads, and the
/proc reading it rests on, against real threads and a real child process (CPU-time bounds only)."""

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"


@pytest.fixture(scope="module")
def timeline():
    saved = dict(os.environ)         # the module sets the serving OpenMP wait for its own runs
    sys.path.insert(0, str(BENCH))
    try:
        import worker_timeline
        yield worker_timeline
    finally:
        sys.path.remove(str(BENCH))
        os.environ.clear()
        os.environ.update(saved)


def test_thread_split_by_group_per_step(timeline):
    before = {1: (1.0, 0.5, 10), 2: (2.0, 0.0, 100), 3: (0.0, 0.0, 0), 4: (5.0, 1.0, 7), "child 9": (1.0, 0.0, 0)}
    after = {1: (1.6, 0.8, 14), 2: (2.5, 0.2, 300), 3: (0.004, 0.0, 50), 4: (5.7, 1.1, 9),
             "child 9": (1.2, 0.0, 0), 5: (0.3, 0.1, 2)}     # 5 started inside the window
    split = timeline.thread_split(1.0, before, after, {1: "engine", 5: "http"}, steps=10)
    assert split == {
        "engine": {"threads": 1, "run_ms": 60.0, "wait_for_core_ms": 30.0, "asleep_ms": 10.0, "sleeps": 0.4},
        # threads 4 and 2 (not named), busiest first; thread 3 ran under 1% of the busiest: left out
        "kernel pool 1": {"threads": 1, "run_ms": 70.0, "wait_for_core_ms": 10.0, "asleep_ms": 20.0, "sleeps": 0.2},
        "kernel pool 2": {"threads": 1, "run_ms": 50.0, "wait_for_core_ms": 20.0, "asleep_ms": 30.0, "sleeps": 20.0},
        "http": {"threads": 1, "run_ms": 30.0, "wait_for_core_ms": 10.0, "asleep_ms": 60.0, "sleeps": 0.2},
        "client": {"threads": 1, "run_ms": 20.0, "wait_for_core_ms": 0.0, "asleep_ms": 0.0, "sleeps": 0.0},
    }


def test_thread_clocks_reads_real_threads_and_a_child(timeline):
    burned = threading.Event()
    stop = threading.Event()
    ids = {}

    def burn():
        ids["burn"] = threading.get_native_id()
        start = time.thread_time()
        while time.thread_time() - start < 0.3:
            pass
        burned.set()
        stop.wait()

    def nap():
        ids["nap"] = threading.get_native_id()
        for _ in range(30):
            time.sleep(0.002)
        stop.wait()

    child = subprocess.Popen([sys.executable, "-c", "import time, sys\nt = time.process_time()\n"
                              "while time.process_time() - t < 0.3: pass\nprint('done', flush=True)\n"
                              "time.sleep(600)"], stdout=subprocess.PIPE, text=True)
    try:
        before = timeline.thread_clocks()
        threads = [threading.Thread(target=burn), threading.Thread(target=nap)]
        for t in threads:
            t.start()
        assert burned.wait(600)
        assert child.stdout.readline().strip() == "done"
        time.sleep(0.1)                    # the napper's 30 sleeps are long over by any clock
        after = timeline.thread_clocks()
        stop.set()
        for t in threads:
            t.join()
    finally:
        child.kill()
        child.wait()
    ran, _, _ = after[ids["burn"]]
    assert ran >= 0.29                     # schedstat's run time covers the thread's CPU time
    ran, _, sleeps = after[ids["nap"]]
    assert sleeps >= 30 and ran < 0.25     # each sleep is a voluntary switch; sleeping is not run
    assert ids["burn"] not in before
    key = f"child {child.pid}"             # the child's CPU (clock ticks), burnt after `before`
    assert after[key][0] - before.get(key, (0.0, 0.0, 0))[0] >= 0.25
