"""rlfleet.wire.service: a service process leaves promptly on SIGTERM, even when a signal lands while the main thread
holds the stop event's lock (a kill -9'd coordinator's PR_SET_PDEATHSIG comes as a burst: one signal each time
the child is handed to another of the coordinator's dying threads; the old handler, Event.set, deadlocked on it)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SERVE = """
import concurrent.futures, os, signal, sys, time, grpc
from rlfleet.wire.service import ServiceRuntime
server = grpc.server(concurrent.futures.ThreadPoolExecutor(2))
port = server.add_insecure_port("127.0.0.1:0")
server.start()
rt = ServiceRuntime("env", 0, server, f"127.0.0.1:{port}", None)
if sys.argv[1] == "inside-lock":
    plain_wait = rt.stop_event.wait
    def wait(timeout=None):
        with rt.stop_event._cond:  # hold the event's lock on the main thread, as Event.wait itself does
            os.kill(os.getpid(), signal.SIGTERM)  # the Python handler runs here, on this thread
            time.sleep(0.01)
        return plain_wait(timeout)
    rt.stop_event.wait = wait
rt.run()
print("left", flush=True)
"""


def serve(mode):
    proc = subprocess.Popen([sys.executable, "-c", SERVE, mode], stdout=subprocess.PIPE, text=True, cwd=ROOT)
    assert "serving on" in proc.stdout.readline()
    return proc


def wait_gone(proc, timeout=10):
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        pytest.fail(f"the service did not leave within {timeout} s of SIGTERM (its signal handler deadlocked)")
    assert proc.returncode == 0 and "left" in out


def test_sigterm_inside_the_stop_events_lock_stops_the_service():
    wait_gone(serve("inside-lock"))


def test_a_burst_of_sigterm_stops_the_service():
    proc = serve("plain")
    for _ in range(2000):  # a zombie until communicate() reaps it: no other process receives these
        os.kill(proc.pid, signal.SIGTERM)
    wait_gone(proc)


def test_sigint_stops_the_service():
    proc = serve("plain")
    time.sleep(0.1)
    proc.send_signal(signal.SIGINT)
    wait_gone(proc)
