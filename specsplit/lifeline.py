"""A service spawned by another process exits when that process dies, however it dies (SIGKILL included).

The parent keeps the write end of a pipe; each service it spawns gets the read end (named in the
SPECSPLIT_LIFELINE environment variable, `FD:GRACE:FOLDER`, the last two possibly empty) and a thread
that blocks reading it. The kernel closes the write end when the parent dies, the read returns
end-of-file, and the service removes the parent's scratch folder (when the parent made one) and stops as
on SIGTERM. Should that orderly stop not end the process within GRACE seconds of the parent's death (a
thread stuck at exit), a timer prints every thread's stack to the service's stderr and ends the process
at once. Services
run in sessions of their own, so no terminal hangup reaches them; without this they outlived a killed
`specsplit up`.
"""

from __future__ import annotations

import faulthandler
import logging
import os
import shutil
import signal
import threading

log = logging.getLogger(__name__)
ENV = "SPECSPLIT_LIFELINE"


def _check_grace(grace: float | None) -> None:
    if grace is not None and not 0 <= grace < float("inf"):
        raise ValueError(f"a lifeline's grace is seconds >= 0, not {grace!r}")


class Lifeline:
    """The parent's side: the pipe, and the arguments that hand its read end to a child."""

    def __init__(self, folder: str | os.PathLike | None = None) -> None:
        self._read, self._write = os.pipe()  # neither inherited, except as `pass_fds` names it
        self.folder = folder  # removed by the children when the parent dies

    @property
    def pass_fds(self) -> tuple[int]:
        return (self._read,)

    def child_env(self, grace: float | None = None) -> dict[str, str]:
        """The child's environment entry; `grace`: seconds its orderly stop may take once the parent is gone
        before it is ended at once (None: as long as it takes)."""
        _check_grace(grace)
        folder = os.fspath(self.folder) if self.folder is not None else ""
        return {ENV: f"{self._read}:{'' if grace is None else grace}:{folder}"}

    def close(self) -> None:
        """Cut the line: children still running see their parent gone."""
        for fd in (self._read, self._write):
            try:
                os.close(fd)
            except OSError:
                pass
        self._read = self._write = -1


def watch(fd: int, folder: str | None = None, grace: float | None = None) -> None:
    """In the child: when the parent is gone, remove `folder` and SIGTERM this process (it drains); if it
    still runs `grace` seconds later, print its threads' stacks and end it."""
    _check_grace(grace)

    def wait() -> None:
        while True:
            try:
                if os.read(fd, 1) == b"":
                    break
            except InterruptedError:
                continue
            except OSError:
                break
        if grace is not None:  # (first: nothing below, a log write included, may hold this thread for good)
            timer = threading.Timer(grace, _end_now, args=(grace,))
            timer.daemon = True  # (a process that stops in time ends it)
            timer.start()
        log.warning("the process that started this service is gone: stopping")
        if folder is not None:
            shutil.rmtree(folder, ignore_errors=True)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=wait, name="lifeline", daemon=True).start()


def _end_now(grace: float) -> None:
    """End this process at once, having printed every thread's stack. Straight to file descriptor 2, taking no
    lock: a thread stuck holding the logging handler's must not hold this one too."""
    try:
        os.write(2, f"still running {grace:g} s after the process that started it died: ending it now; its "
                    f"threads:\n".encode())
        faulthandler.dump_traceback(file=2, all_threads=True)
    finally:
        os._exit(1)


def watch_from_env() -> None:
    """`watch` the line SPECSPLIT_LIFELINE names, if any (it is not passed on to our own children)."""
    value = os.environ.pop(ENV, None)
    if not value:
        return
    fd, _, rest = value.partition(":")
    grace, _, folder = rest.partition(":")
    try:
        watch(int(fd), folder or None, float(grace) if grace else None)
    except ValueError:
        raise SystemExit(f"{ENV}={value!r} is not FD:GRACE:FOLDER (GRACE and FOLDER may be empty)") from None
