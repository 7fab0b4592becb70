"""Processes forked from one server process that has imported ectier and torch already
(:data:`FORKSERVER`, multiprocessing's forkserver), instead of a fresh interpreter each: the same
code in a real process (its own pid, signals, exit status, SIGKILL), without the seconds of an
interpreter start and a torch import (on CI's 2 cores, most of a daemon test's time).

A forked process takes what a ``subprocess`` child would from the test process at its launch
(working directory, environment, stdio as asked) and, for scripts, runs the exit handlers at the
end as an interpreter's exit would. Daemons: ``daemon_helpers.DaemonProcess`` (``via="module"``,
``"slow-nvme"``); any script or ``-c`` code: :func:`forked_python`.
"""

from __future__ import annotations

import atexit
import contextlib
import multiprocessing
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

__all__ = ["FORKSERVER", "ForkedProcess", "ForkedPython", "forked_daemon", "forked_python"]


#: the server that forks daemons (``daemon_helpers.DaemonProcess``: ``via="module"``, ``"slow-nvme"``),
#: client jobs and :func:`forked_python`: started at the first of them, with ectier's daemon, its CLI
#: and torch imported once; it ends with the test process
FORKSERVER = multiprocessing.get_context("forkserver")
FORKSERVER.set_forkserver_preload(["fork_helpers", "daemon_helpers", "slow_nvme_daemon", "ectier.cli", "ectier.daemon.server"])


def _as_launched(cwd: str, env: dict[str, str] | None) -> None:
    """What a forked process takes from the test process at its launch, as ``subprocess`` would
    give it: the working directory and (unless None) the environment, and the temp dir it names."""
    os.chdir(cwd)
    if env is not None:
        os.environ.clear()
        os.environ.update(env)
        tempfile.tempdir = None  # TMPDIR as given, not the forkserver's cached temp dir
    sys.stdout.reconfigure(line_buffering=True)


def forked_daemon(argv: list[str], log_path: str, cwd: str, env: dict[str, str]) -> None:
    """The body of a forked daemon: stdio as a launched one's (stdin ``/dev/null``, stdout and
    stderr appended to ``log_path``, unbuffered), the working directory ``cwd`` and the environment
    ``env``, then ``ectier serve ARGV`` (``argv[0] == "slow-nvme"``: :func:`slow_nvme_daemon.main` on
    ``argv[1:]``). Its exit status is the command's, as a launched process's would be."""
    fd = os.open(log_path, os.O_WRONLY | os.O_APPEND)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    _as_launched(cwd, env)
    sys.stderr.reconfigure(line_buffering=True)
    if argv[0] == "slow-nvme":
        import slow_nvme_daemon

        sys.exit(slow_nvme_daemon.main(*argv[1:]))
    from ectier.cli import main

    main(["serve", *argv], prog_name="python -m ectier.daemon")


class ForkedProcess:
    """The part of :class:`subprocess.Popen` that :class:`DaemonProcess` uses, over a process
    forked by :data:`FORKSERVER` (``returncode``: the exit status, ``-signal`` when killed)."""

    def __init__(self, process: multiprocessing.process.BaseProcess) -> None:
        self._process = process

    @property
    def pid(self) -> int:
        return self._process.pid

    @property
    def returncode(self) -> int | None:
        return self._process.exitcode

    def poll(self) -> int | None:
        return self._process.exitcode

    def wait(self, timeout: float | None = None) -> int:
        self._process.join(timeout)
        if self._process.exitcode is None:
            raise subprocess.TimeoutExpired(f"daemon pid {self.pid}", timeout)
        return self._process.exitcode

    def send_signal(self, sig: int) -> None:
        if self._process.exitcode is None:  # never a signal to a pid that may be reused
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def _forked_python(argv: list[str], stdout, stderr_path: str, cwd: str, env: dict[str, str] | None) -> None:
    """The body of :func:`forked_python`: stdio set up as ``subprocess`` would, then ``python ARGV``."""
    if stdout is not None:
        os.dup2(stdout.fileno(), 1)
        stdout.close()
    else:
        null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, 1)
        os.close(null)
    err = os.open(stderr_path, os.O_WRONLY | os.O_APPEND)
    os.dup2(err, 2)
    os.close(err)
    _as_launched(cwd, env)
    try:
        if argv[0] == "-c":
            sys.argv = ["-c", *argv[2:]]
            exec(compile(argv[1], "<string>", "exec"), {"__name__": "__main__"})
        else:
            import runpy

            sys.argv = list(argv)
            sys.path.insert(0, os.path.dirname(os.path.abspath(argv[0])))
            runpy.run_path(argv[0], run_name="__main__")
    finally:
        atexit._run_exitfuncs()  # as an interpreter's exit would (a forked process ends in os._exit)


class ForkedPython(ForkedProcess):
    """A ``python ARGV`` forked by :data:`FORKSERVER` (see :func:`forked_python`): ``stdout``, a
    text stream of its standard output (or None), ``stderr_text()``, what it wrote to stderr."""

    def __init__(self, process, stdout, stderr_path: str) -> None:
        super().__init__(process)
        self.stdout = stdout
        self._stderr_path = stderr_path

    def stderr_text(self) -> str:
        try:
            return Path(self._stderr_path).read_text(errors="replace")
        except OSError:
            return ""

    def close(self) -> None:
        """Kill it if it still runs, reap it, close its stdout and remove its stderr file."""
        self.kill()
        self.wait(30)
        if self.stdout is not None:
            self.stdout.close()
        with contextlib.suppress(OSError):
            os.unlink(self._stderr_path)


def forked_python(argv: list[str], *, stdout: bool = False, env: dict[str, str] | None = None) -> ForkedPython:
    """``python ARGV`` (``ARGV``: a script and its arguments, or ``-c CODE ARGS...``) in a process
    forked by :data:`FORKSERVER`, where ectier and torch are imported already, instead of a fresh
    interpreter: the same code in a real process, without seconds of imports. ``stdout=True``: its
    standard output is readable as ``.stdout`` (text, line by line), else it goes to /dev/null;
    stdin is /dev/null; ``env``: its environment (default: the test process's). Stop it with
    :meth:`ForkedPython.close`."""
    fd, stderr_path = tempfile.mkstemp(prefix="ectier-forked-", suffix=".stderr")
    os.close(fd)
    reader = writer = None
    if stdout:
        reader, writer = FORKSERVER.Pipe(duplex=False)
    process = FORKSERVER.Process(target=_forked_python, args=(argv, writer, stderr_path, os.getcwd(), env),
                                 daemon=True)
    process.start()
    out = None
    if writer is not None:
        writer.close()
        out = os.fdopen(os.dup(reader.fileno()), "r")
        reader.close()
    return ForkedPython(process, out, stderr_path)
