"""Process isolation: native code runs in a child process, where an abort is an error message.

A native engine can abort the whole process on a bad file (llama.cpp throws std::out_of_range
from tokenization, for one), so every engine worker (worker.py) and every workbench job (bench,
eval, imatrix) runs in a child that this module starts, as Ollama and LM Studio do. Parent and
child speak newline-delimited JSON (channel.py) over the child's stdin and stdout; the child's
stderr is kept as a tail, and a child that dies becomes an EngineCrashedError whose message
names the signal or exit code and the last line that says why. Errors the child raises cross the
pipe with their class.

A job is one request in and a stream of events out, then {"ok": result} or {"error": ...}:
`python -m localrun.backends.isolation MODULE:FUNCTION [MODULE:WARM]` calls FUNCTION(request,
emit) in the child, after WARM() (which runs while the parent still prepares the request). The
child exits when its stdin closes, so a job dies with its parent and cancels in one step.
"""

from __future__ import annotations

import importlib
import os
import signal
import subprocess
import sys
import threading
from collections import deque
from collections.abc import Callable, Generator, Sequence
from pathlib import Path
from typing import Any

from localrun.backends.channel import Channel, error_from_wire, error_to_wire
from localrun.errors import EngineCrashedError

CRASH_HINT = "the model file may be damaged or unsupported; localrun is still running"
_REASONS = ("what()", "terminate called", "error", "ggml_assert", "abort")  # lowercase
Emit = Callable[[Any], None]


class Child:
    """A child process running `python -m MODULE ARGS...`, talking JSON over its stdin and stdout."""

    def __init__(self, module: str, args: Sequence[str] = (), name: str = "llama.cpp") -> None:
        """Start the child; `name` is what a crash message says crashed ("the llama.cpp engine")."""
        self.name = name
        self.stderr_tail: deque[str] = deque(maxlen=50)
        root = str(Path(__file__).resolve().parents[2])  # this localrun, installed or not
        path = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", module, *args],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, bufsize=0,
            env={**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": path},
        )
        assert self.proc.stdin and self.proc.stdout and self.proc.stderr
        self.chan = Channel(self.proc.stdout.fileno(), self.proc.stdin.fileno())
        self._stderr_thread = threading.Thread(target=self._drain_stderr, daemon=True)
        self._stderr_thread.start()

    def _drain_stderr(self) -> None:
        assert self.proc.stderr
        debug = bool(os.environ.get("LOCALRUN_DEBUG"))
        for raw in iter(self.proc.stderr.readline, b""):
            line = raw.decode("utf-8", errors="replace").rstrip()
            self.stderr_tail.append(line)
            if debug:
                print(f"[{self.name}] {line}", file=sys.stderr)

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def send(self, obj: Any) -> None:
        """One message to the child (OSError when it is gone)."""
        self.chan.send(obj)

    def recv(self, timeout: float | None = None) -> Any:
        """The child's next message; None on timeout or when its output ended (check chan.eof)."""
        return self.chan.recv(timeout)

    def crashed(self, activity: str, hint: str = CRASH_HINT) -> EngineCrashedError:
        """The error for a child whose output ended unasked: how it died, and its last words."""
        try:
            code = self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            code = self.proc.wait()
        self._stderr_thread.join(timeout=2)
        return crash_error(self.name, activity, code, list(self.stderr_tail), hint)

    def close(self, goodbye: Any = None, timeout: float = 5) -> None:
        """End the child: `goodbye` (if given) is sent first, then its stdin closes; a child still
        running after timeout seconds is killed."""
        if self.proc.poll() is None:
            try:
                if goodbye is not None:
                    self.send(goodbye)
                assert self.proc.stdin
                self.proc.stdin.close()
                self.proc.wait(timeout=timeout)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()
        self._stderr_thread.join(timeout=5)  # it ends at EOF; closing its file under it would race
        for f in (self.proc.stdin, self.proc.stdout, self.proc.stderr):
            if f:
                f.close()

    def kill(self) -> None:
        """End the child now (the parent is being torn down)."""
        if self.proc.poll() is None:
            self.proc.kill()


def crash_error(name: str, activity: str, code: int, stderr: list[str], hint: str = CRASH_HINT) -> EngineCrashedError:
    """'NAME crashed while ACTIVITY (signal SIGABRT: <its last line that says why>)'."""
    if code < 0:
        try:
            how = f"signal {signal.Signals(-code).name}"
        except ValueError:
            how = f"signal {-code}"
    else:
        how = f"exit code {code}"
    reason = next((line.strip() for line in reversed(stderr) if any(k in line.lower() for k in _REASONS)), "")
    return EngineCrashedError(f"{name} crashed while {activity} ({how}{': ' + reason if reason else ''})", hint)


def child_channel() -> Channel:
    """In a child: the channel to the parent. Ctrl-C is left to the parent (which cancels), and
    stdout is kept for the protocol: stray prints from native code go to stderr."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    proto = os.dup(1)
    os.dup2(2, 1)
    return Channel(0, proto)


class Job:
    """One request handled in a child process; the child starts (and warms up) at once, so the
    caller can prepare the request meanwhile."""

    def __init__(self, target: str, activity: str, *, warm: str | None = None, hint: str = CRASH_HINT) -> None:
        """target and warm are "module:function" names; `activity` completes "crashed while ..."."""
        self.activity, self.hint = activity, hint
        self.child = Child("localrun.backends.isolation", [target, *([warm] if warm else [])])

    def __enter__(self) -> Job:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def stream(self, request: Any) -> Generator[Any, None, Any]:
        """Send the request; yield the child's events; return its result (the child is then gone).

        Raises:
            EngineCrashedError: the child died. LocalrunError: what the job raised, as its class.
        """
        try:
            try:
                self.child.send(request)
            except OSError:
                raise self.child.crashed(self.activity, self.hint) from None
            while True:
                msg = self.child.recv()
                if msg is None:
                    raise self.child.crashed(self.activity, self.hint)
                if "event" in msg:
                    yield msg["event"]
                elif "ok" in msg:
                    return msg["ok"]
                else:
                    raise error_from_wire(msg.get("error") or {})
        finally:
            self.close()

    def run(self, request: Any, on_event: Emit | None = None) -> Any:
        """stream(), with each event handed to on_event; the result."""
        events = self.stream(request)
        while True:
            try:
                event = next(events)
            except StopIteration as done:
                return done.value
            if on_event is not None:
                on_event(event)

    def close(self) -> None:
        """Cancel the job if it still runs (its stdin closes and it exits), and reap the child."""
        self.child.close(timeout=2)


def _function(name: str) -> Callable[..., Any]:
    module, _, attr = name.partition(":")
    fn: Callable[..., Any] = getattr(importlib.import_module(module), attr)
    return fn


def _exit_on_eof(chan: Channel) -> None:
    """The parent closed our stdin (cancelled, or gone): end now, native code and all."""
    while chan.recv() is not None:
        pass
    sys.stderr.flush()
    os._exit(1)


def job_main(argv: list[str]) -> int:
    """The child's side of a Job: warm up, read the request, run it, send the result and exit."""
    chan = child_channel()
    try:
        if len(argv) > 1:
            _function(argv[1])()
        target = _function(argv[0])
        request = chan.recv()
        if request is None:
            return 0  # the parent went away before sending work
        threading.Thread(target=_exit_on_eof, args=(chan,), daemon=True).start()
        chan.send({"ok": target(request, lambda event: chan.send({"event": event}))})
    except Exception as e:  # every failure crosses the pipe as the caller's LocalrunError
        if os.environ.get("LOCALRUN_DEBUG"):
            import traceback

            traceback.print_exc()
        chan.send({"error": error_to_wire(e)})
    sys.stderr.flush()
    os._exit(0)  # the answer is sent: freeing models and contexts would only delay the parent


if __name__ == "__main__":
    sys.exit(job_main(sys.argv[1:]))
