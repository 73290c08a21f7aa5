"""A stalled target call becomes a failure naming what stalled, with every thread's Python and native stacks.

Why: a replay once sat for 15 and for 30 minutes with idle CPU, its main thread blocked in jax's `BlockUntilReady`
under `ArrayImpl.__array__` inside `ReferenceTarget.layer_forward` (issue 14), and nothing would ever have ended it.
A thread blocked inside native code cannot be interrupted from Python, so the target's calls run on a worker thread
and the caller waits with a limit. On expiry:
- the Python stacks of every thread (`faulthandler`, which reads other threads' frames without needing them to run)
  and the native stacks (`gdb -batch -ex "thread apply all bt"` attached to this process, when gdb is installed;
  otherwise each thread's kernel state from /proc) are written to a file;
- `StallError` names the call (layer, phase, step, which target method) and the file;
- the blocked worker thread is abandoned (a daemon thread: it cannot keep the process alive), and every later call of
  the same watchdog fails at once: the runtime that hung is in an unknown state, so waiting the limit again for each
  remaining layer would only multiply the wait.
`limit_s` None or 0 runs calls directly on the caller's thread (no watchdog).
"""

from __future__ import annotations

import faulthandler
import os
import shutil
import subprocess
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable

from parity.errors import ParityError

DEFAULT_LIMIT_S = 600.0  # a whole Ling3-Tiny-shaped layer, cold (compile included), takes seconds on 2 CPU cores


class StallError(ParityError):
    """A target call that did not return within the watchdog's limit (or one after such a call)."""


class _Worker:
    """One daemon thread running submitted calls in order."""

    def __init__(self) -> None:
        self._cv = threading.Condition()
        self._job: tuple | None = None
        self.thread = threading.Thread(target=self._run, name="ling3-parity-target-call", daemon=True)
        self.thread.start()

    def submit(self, fn: Callable, args: tuple, kwargs: dict) -> dict:
        box: dict[str, Any] = {"done": threading.Event()}
        with self._cv:
            self._job = (fn, args, kwargs, box)
            self._cv.notify()
        return box

    def stop(self) -> None:
        """End the thread once it is idle (its calls are synchronous: no job is pending when the watchdog closes)."""
        with self._cv:
            self._job = _STOP
            self._cv.notify()

    def _run(self) -> None:
        while True:
            with self._cv:
                while self._job is None:
                    self._cv.wait()
                job, self._job = self._job, None
            if job is _STOP:
                return
            fn, args, kwargs, box = job
            try:
                box["value"] = fn(*args, **kwargs)
            except BaseException as e:  # handed to the caller
                box["error"] = e
            box["done"].set()
            # Drop this frame's references while waiting for the next job: the last call's bound method (its target:
            # embedding, LM head) and arguments would otherwise stay alive for as long as the thread waits.
            del job, fn, args, kwargs, box


_STOP = ("stop",)


def native_stacks(pid: int | None = None, timeout_s: float = 120.0) -> str:
    """Every thread's native (C/C++) stack: gdb attached to `pid` (default this process) when installed, else each
    thread's name, state and kernel wait channel from /proc."""
    pid = os.getpid() if pid is None else pid
    gdb, timeout = shutil.which("gdb"), shutil.which("timeout")
    if gdb and timeout:
        # gdb stops every thread of the process it attaches to — this one included when pid is ours — so: its output
        # goes to a file (a pipe nobody reads while stopped fills up and deadlocks gdb), and the time limit is
        # enforced from outside (`timeout`, SIGKILL: the kernel then detaches and resumes the process)
        with tempfile.TemporaryFile("w+") as out:
            try:
                r = subprocess.run([timeout, "-s", "KILL", str(int(timeout_s)), gdb, "-p", str(pid), "-batch", "-nx",
                                    "-ex", "set pagination off", "-ex", "thread apply all bt 40"],
                                   stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
                out.seek(0)
                text = out.read()
                lines = [ln for ln in text.splitlines() if ln.startswith(("Thread ", "#"))]
                if lines:
                    return "\n".join(lines)
                why = f"gdb gave no stacks (exit {r.returncode}): {text.strip().splitlines()[-1:]}"
            except OSError as e:
                why = f"gdb failed: {e}"
    else:
        why = "gdb is not installed"
    out = [f"(native stacks unavailable: {why}; thread states from /proc instead)"]
    for task in sorted(Path(f"/proc/{pid}/task").iterdir(), key=lambda p: int(p.name)):
        def read(name: str) -> str:
            try:
                return (task / name).read_text().strip()
            except OSError:
                return "?"
        stat = read("stat")
        state = stat.rsplit(")", 1)[-1].split()[0] if ")" in stat else "?"
        out.append(f"tid {task.name} {read('comm')!r} state {state} wchan {read('wchan')}")
    return "\n".join(out)


def dump_stacks(what: str, out_dir: str | os.PathLike | None = None) -> Path:
    """Write every thread's Python and native stacks to a file; returns its path."""
    d = Path(out_dir) if out_dir else Path(tempfile.gettempdir())
    d.mkdir(parents=True, exist_ok=True)
    path = d / f"ling3-parity-stall-{os.getpid()}-{time.strftime('%Y%m%dT%H%M%S')}.txt"
    with open(path, "w") as f:
        f.write(f"stalled: {what}\n\n== Python stacks of every thread (faulthandler) ==\n")
        f.flush()
        faulthandler.dump_traceback(file=f, all_threads=True)
        f.write("\n== native stacks ==\n")
        f.write(native_stacks() + "\n")
    return path


class Watchdog:
    """Runs target calls with a time limit (see the module docstring). `out_dir`: where stack files go."""

    def __init__(self, limit_s: float | None = DEFAULT_LIMIT_S, out_dir: str | os.PathLike | None = None) -> None:
        self.limit_s = float(limit_s) if limit_s else None
        self.out_dir = out_dir
        self.stalled: str | None = None  # the call that stalled, once one has
        self._worker: _Worker | None = None

    def call(self, what: str, fn: Callable, *args, **kwargs):
        if self.limit_s is None:
            return fn(*args, **kwargs)
        if self.stalled is not None:
            raise StallError(f"{what}: not run: an earlier target call stalled ({self.stalled}); the runtime it hung "
                             "in is in an unknown state")
        if self._worker is None:
            self._worker = _Worker()
        box = self._worker.submit(fn, args, kwargs)
        if not box["done"].wait(self.limit_s):
            self.stalled = what
            self._worker = None  # abandoned: blocked for good, a daemon thread
            path = dump_stacks(what, self.out_dir)
            raise StallError(f"{what}: no result after {self.limit_s:g} s (stalled); Python and native stacks of "
                             f"every thread: {path}")
        if "error" in box:
            raise box.pop("error")
        return box.pop("value")

    def close(self) -> None:
        """End the worker thread (a stalled one is already abandoned); a later call starts a new one."""
        if self._worker is not None:
            self._worker.stop()
            self._worker = None
