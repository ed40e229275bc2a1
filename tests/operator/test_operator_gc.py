"""The operator's garbage-collector tuning (handlers.tune_garbage_collector): applied where the
operator owns its process, never to a program that embeds it in a thread (a test process)."""

import gc
import subprocess
import sys
import threading

from specpair_operator import handlers


def test_an_operator_on_its_own_process_freezes_its_start_up_heap_and_collects_young_objects_less_often():
    done = subprocess.run([sys.executable, "-c", (
        "import gc; from specpair_operator import handlers; "
        "assert handlers.tune_garbage_collector(); "
        "print(gc.get_threshold()[0], gc.get_freeze_count())")], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    threshold, frozen = map(int, done.stdout.split())
    assert threshold == handlers.GC_YOUNG_THRESHOLD
    assert frozen > 50_000     # the imports of Kopf, MLflow, gRPC and the operator: ~190,000 objects


def test_an_operator_embedded_in_a_thread_leaves_the_programs_collector_alone():
    before = (gc.get_threshold(), gc.get_freeze_count())
    applied: list[bool] = []
    thread = threading.Thread(target=lambda: applied.append(handlers.tune_garbage_collector()))
    thread.start()
    thread.join()
    assert applied == [False]
    assert (gc.get_threshold(), gc.get_freeze_count()) == before
