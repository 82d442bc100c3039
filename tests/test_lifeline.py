"""A spawned service stops when the process that spawned it is gone (specsplit.lifeline), and is ended at once
if its orderly stop does not end it within its grace; a SIGTERM reaches `wait_for_signal` whichever thread the
kernel hands it to. Child processes of a few lines, no model."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from specsplit.lifeline import ENV, Lifeline, watch_from_env


def _child(code: str, lifeline: Lifeline | None = None, grace: float | None = None) -> subprocess.Popen:
    env = {**os.environ, **(lifeline.child_env(grace) if lifeline else {})}
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(code)], env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            pass_fds=lifeline.pass_fds if lifeline else ())


def _cut(child: subprocess.Popen, lifeline: Lifeline) -> str:
    """Once the child watches, cut its line (as the kernel does when the parent dies); its output once it ends."""
    try:
        assert child.stdout.readline() == "ready\n"
        lifeline.close()
        return child.communicate(timeout=20)[0]
    finally:
        child.kill()


WATCHING = """
    import signal, sys, time
    from specsplit.lifeline import watch_from_env
    {handler}
    watch_from_env()
    print("ready", flush=True)

    def stuck_at_exit():
        time.sleep(600)

    stuck_at_exit()
"""


def test_a_child_whose_parent_is_gone_stops_in_order_and_removes_the_parents_folder(tmp_path):
    folder = tmp_path / "scratch"
    folder.mkdir()
    lifeline = Lifeline(folder)
    child = _child(WATCHING.format(handler="signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))"), lifeline, 30)
    out = _cut(child, lifeline)
    assert child.returncode == 0, out
    assert "ending it now" not in out
    assert not folder.exists()


def test_a_child_that_does_not_stop_within_its_grace_is_ended_with_its_threads_printed(tmp_path):
    lifeline = Lifeline()
    # Its SIGTERM handler never stops it, as a thread stuck at exit would not let it end.
    child = _child(WATCHING.format(handler="signal.signal(signal.SIGTERM, lambda *_: print('asked', flush=True))"),
                   lifeline, 0.5)
    out = _cut(child, lifeline)
    assert child.returncode == 1, out
    assert "asked" in out and "ending it now" in out
    assert "stuck_at_exit" in out  # the main thread's stack, for whoever reads the log


def test_a_child_whose_logging_is_stuck_is_ended_all_the_same():
    """The lifeline's own log line never returns (a handler stuck, as on a pipe nobody reads): its grace runs
    from the parent's death on a timer of its own, and the ending takes no lock."""
    lifeline = Lifeline()
    child = _child(WATCHING.format(handler=textwrap.dedent("""
        import logging, threading
        class Stuck(logging.Handler):
            def emit(self, record):
                threading.Event().wait()
        logging.getLogger().addHandler(Stuck())
    """).replace("\n", "\n    ")), lifeline, 0.5)
    out = _cut(child, lifeline)
    assert child.returncode == 1 and "ending it now" in out and "in emit" in out, out


def test_without_a_grace_a_child_is_left_to_its_orderly_stop():
    lifeline = Lifeline()
    child = _child(WATCHING.format(handler="signal.signal(signal.SIGTERM, lambda *_: print('asked', flush=True))"),
                   lifeline, None)
    try:
        assert child.stdout.readline() == "ready\n"
        lifeline.close()
        assert child.stdout.readline().endswith("is gone: stopping\n")
        assert child.stdout.readline() == "asked\n"
        with pytest.raises(subprocess.TimeoutExpired):
            child.wait(timeout=2)
    finally:
        child.kill()
        child.communicate()


@pytest.mark.parametrize("value", ["x", "3:soon:", "3:-1:", "3:nan:", "3:inf:/tmp/f"])
def test_a_lifeline_that_is_not_one_is_refused(monkeypatch, value):
    monkeypatch.setenv(ENV, value)
    with pytest.raises(SystemExit, match="is not FD:GRACE:FOLDER"):
        watch_from_env()


@pytest.mark.parametrize("grace", [-1.0, float("nan"), float("inf")])
def test_a_grace_that_is_not_seconds_is_refused(grace):
    lifeline = Lifeline()
    try:
        with pytest.raises(ValueError, match="grace"):
            lifeline.child_env(grace)
    finally:
        lifeline.close()


def test_the_line_names_its_read_end_grace_and_folder(tmp_path):
    with_folder, bare = Lifeline(tmp_path), Lifeline()
    try:
        assert with_folder.child_env(2.5) == {ENV: f"{with_folder.pass_fds[0]}:2.5:{tmp_path}"}
        assert bare.child_env() == {ENV: f"{bare.pass_fds[0]}::"}
    finally:
        with_folder.close()
        bare.close()


def test_a_sigterm_another_thread_receives_still_ends_wait_for_signal():
    # The main thread blocks SIGTERM, so the kernel must hand it to the other thread: Python only flags the
    # handler there, and the main thread runs it once it wakes.
    child = _child("""
        import os, signal, threading, time
        from specsplit.services import wait_for_signal
        started = threading.Event()

        def other():
            started.set()
            while signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:  # until wait_for_signal has its handler
                time.sleep(0.01)
            time.sleep(0.2)  # (into its wait)
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(600)

        threading.Thread(target=other, daemon=True).start()
        started.wait()
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
        print("stopped:", wait_for_signal(), flush=True)
    """)
    try:
        out, _ = child.communicate(timeout=20)
    finally:
        child.kill()
    assert child.returncode == 0 and "stopped: True" in out, out
