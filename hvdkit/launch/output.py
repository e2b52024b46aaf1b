"""Run a launcher with a readable console: tracebacks go to a log file, one line to the user.

horovodrun and mpirun end a failed job with pages of their own (horovodrun's
Python traceback, Open MPI's dashed banners) under every rank's traceback. The
console keeps what ranks print for people (hvdkit's own lines, a rank's
one-line ``Error:``) and hides traceback bodies and launcher banners; the whole
output, untouched, goes to a log file whose name the closing line gives.
"""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from ..preemption import EXIT_PREEMPTED

__all__ = ["ConsoleFilter", "ConsoleLog", "Rejoiner", "RunOutcome", "run_with_log"]

# horovodrun's Gloo controller tags worker lines "[0]<stderr>:", its MPI controller (mpirun
# --tag-output) "[1,0]<stderr>:"; torch tags tracebacks "[rank0]: "
_TAG = re.compile(r"^(\[\d+(?:,\d+)?\]<std(?:out|err)>:|\[rank\d+\]:\s?)")
_BANNER = re.compile(r"^-{40,}$")
_LAUNCHER_NOISE = re.compile(r"^(Process \d+ exit with status code \d+\.|"
                             r"Terminating remaining workers after failure of Process \d+\.|"
                             r"Process name: \S+|Exit code: \d+|)$")  # the last: blank lines
# what a rank's shell prints when the launcher kills it (SIGTERM) because another rank failed
_KILLED_BY_LAUNCHER = "Terminated"
_PREEMPTED_AT = re.compile(r"preempted at step (\d+)")  # hvdkit.preemption's line, rank 0
_CHAIN = ("During handling of the above exception", "The above exception was the direct cause")


# a tag inside a line: Open MPI tags every chunk a rank writes, so print(..., flush=True) of
# a line and its newline in two writes came out as "[1,0]<stdout>:text[1,0]<stdout>:"
_TAG_INSIDE = re.compile(r"\[\d+(?:,\d+)?\]<std(?:out|err)>:")


def _tag_rank(tag: str) -> int | None:
    """The rank a tag names: ``[r]<...>`` (horovodrun, Ray), ``[job,r]<...>`` (mpirun), ``[rankr]:``."""
    numbers = re.findall(r"\d+", tag)
    return int(numbers[-1]) if numbers else None


class Rejoiner:
    """Whole lines, one source each, from Open MPI's tagged chunks. It tags every chunk a rank
    writes, as it comes: a rank's line can run on into another's (``[1,0]<stderr>:...Error[1,1]
    <stderr>:  File ...``) and end later (``[1,0]<stderr>:: the message``), and a flushed
    newline arrives as a chunk of its own. Each source's unfinished text is held until its
    newline."""

    def __init__(self) -> None:
        self.partial: dict[str, str] = {}

    def feed(self, line: str) -> list[str]:
        """The whole lines that ``line`` (one line of the launcher's pipe) completes."""
        m = _TAG.match(line)
        if not m or not _TAG_INSIDE.match(m.group(1)):
            return [line]
        marks = list(_TAG_INSIDE.finditer(line))
        for mark, after in zip(marks, [*marks[1:], None]):
            tag, text = mark.group(0), line[mark.end():after.start() if after else len(line)]
            self.partial[tag] = self.partial.get(tag, "") + text
        tag = marks[-1].group(0)  # the line's newline ends this source's line
        return [tag + self.partial.pop(tag)]

    def flush(self) -> list[str]:
        """What is left unfinished at the end, one line per source."""
        left = [tag + text + "\n" for tag, text in self.partial.items() if text]
        self.partial.clear()
        return left


def untagged(line: str) -> str:
    """A line without the launcher's tag where the tag says nothing: hvdkit's own lines name
    their rank already (``[hvdkit]`` is rank 0, ``[hvdkit r1]`` rank 1, ``Error: rank 1/2
    ...``), and rank 0's lines of any program read as they would alone. Other ranks' lines
    keep the tag that tells them apart."""
    m = _TAG.match(line)
    if not m:
        return line
    body = _TAG_INSIDE.sub("", line[m.end():])
    if body.startswith(("[hvdkit", "Error: ", "WARNING: ")) or _tag_rank(m.group(1)) == 0:
        return body
    return line[:m.end()] + body


@dataclass
class ConsoleFilter:
    """Line filter, one state per source tag: shows a line, or hides it (returns ``None``)."""

    causes: list[str] = field(default_factory=list)  # last line of each hidden traceback
    errors: list[str] = field(default_factory=list)  # "Error: ..." lines ranks printed
    preempted_at: int | None = None  # the step of rank 0's "preempted at step N" line
    _in_traceback: dict[str, bool] = field(default_factory=dict)
    _in_banner: bool = False

    def __call__(self, line: str) -> str | None:
        m = _TAG.match(line)
        tag = m.group(1) if m else ""
        body = line[m.end():] if m else line
        text = body.rstrip("\n")
        if _BANNER.match(text):
            self._in_banner = not self._in_banner
            return None
        if self._in_banner:
            return None
        if self._in_traceback.get(tag):
            if text.startswith((" ", "\t")) or not text.strip() or text.startswith(_CHAIN) \
                    or text.startswith("Traceback (most recent call last)"):
                return None
            self._in_traceback[tag] = False
            self.causes.append(text.strip())
            return None
        if text.startswith("Traceback (most recent call last)"):
            self._in_traceback[tag] = True
            return None
        if _LAUNCHER_NOISE.match(text):
            return None
        if text == _KILLED_BY_LAUNCHER and self.errors:
            # a peer of the rank that failed, stopped by the launcher: not a second failure.
            # Without an Error: line first it stays shown (scancel, a batch system's SIGTERM).
            return None
        stop = _PREEMPTED_AT.search(text)
        if stop:
            self.preempted_at = int(stop.group(1))
        if text.startswith("Error: "):
            # every rank that fails says so, often the same words: they are kept for the one
            # closing line (RunOutcome.summary) and the log, not shown once per rank
            self.errors.append(text)
            return None
        return line


@dataclass
class RunOutcome:
    """How a launched job ended, and where its full output is."""

    returncode: int
    log: Path | None  # None: the job printed nothing (no empty log is kept)
    errors: list[str]
    causes: list[str]
    preempted_at: int | None = None
    started: bool = True  # False: a preemption signal came before the ranks were started

    def closing_line(self) -> str:
        """What 'hvdkit run' prints last for a run that did not succeed: a preemption (exit 75)
        is not a failure, the rest is one Error: line."""
        if not self.started:
            return ("preempted (exit 75) before the ranks started: nothing ran and nothing was saved; run the "
                    "same command again (it resumes from the last checkpoint, if there is one)")
        if self.returncode == EXIT_PREEMPTED:
            where = f" at step {self.preempted_at}" if self.preempted_at is not None else ""
            return (f"preempted (exit 75): the ranks saved a checkpoint{where} and stopped, not requeued; "
                    "run the same command again to resume from it")
        return f"Error: {self.summary()}"

    def summary(self) -> str:
        """One line: the first rank error (or hidden exception), and the log file.

        A rank's own failure beats the "lost contact" lines its peers print after it.
        """
        own = [e for e in self.errors if "lost contact with" not in e]
        if own or self.errors:
            chosen = own or self.errors
            what = chosen[0].removeprefix("Error: ")
            others = len({e.removeprefix("Error: ") for e in chosen}) - 1
            if others:
                what += f" (and {others} other error line(s) in the log)"
        elif self.causes:
            what = self.causes[0]
        else:
            what = f"the launcher exited with status {self.returncode}"
        where = f"full output: {self.log}" if self.log is not None else "it printed nothing"
        return f"job failed (exit {self.returncode}): {what} [{where}]"


class ConsoleLog:
    """The console side of a launched job: each line goes whole to a log file, and through
    :class:`ConsoleFilter` to the console; rank 0's progress lines become a bar (``progress``).

    Fed by :func:`run_with_log` from a launcher's pipes, and by the Ray launcher
    (:mod:`hvdkit.rayrun`) from lines its workers relay; both tag lines as horovodrun does.
    """

    def __init__(self, log_dir: str | None = None, out: IO[str] = sys.stdout, err: IO[str] = sys.stderr,
                 progress: bool = False) -> None:
        from ..observe import ProgressRelay

        self.relay = ProgressRelay() if progress else None
        self.handle = tempfile.NamedTemporaryFile("w", prefix="hvdkit-run-", suffix=".log", dir=log_dir,
                                                  delete=False)
        self.log = Path(self.handle.name)
        self.keep = ConsoleFilter()
        self.rejoin = Rejoiner()
        self.started = True
        self.lock = threading.Lock()
        self.out, self.err = out, err

    def feed(self, line: str, sink: IO[str] | None = None) -> None:
        """One line (with its newline) as a launcher printed it; ``sink``: its stream (stdout)."""
        with self.lock:
            for whole in self.rejoin.feed(line):
                self._one(whole, sink)

    def _one(self, line: str, sink: IO[str] | None) -> None:
        if self.relay is not None and self.relay.feed(line):
            return  # drawn as the bar; not a line of the log
        self.handle.write(line)
        shown = self.keep(line)
        if shown is not None:
            # horovodrun tags say which stream a worker used; honour them
            target = self.err if "<stderr>:" in shown[:16] else (sink or self.out)
            shown = untagged(shown)
            if self.relay is not None:
                self.relay.write(shown, target)
            else:
                target.write(shown)
                target.flush()

    def not_started(self) -> None:
        """A preemption came before the ranks were started: none will be (see RunOutcome.started)."""
        self.started = False

    def close(self, code: int) -> RunOutcome:
        """The outcome; the log is kept when the job failed and removed when it succeeded, or
        when it holds nothing (a job that printed nothing: an empty file helps no one)."""
        with self.lock:
            for whole in self.rejoin.flush():
                self._one(whole, None)
        if self.relay is not None:
            self.relay.close()
        empty = self.handle.tell() == 0
        self.handle.close()
        if code == 0 or empty:
            self.log.unlink(missing_ok=True)
        return RunOutcome(code, None if empty else self.log, self.keep.errors, self.keep.causes,
                          self.keep.preempted_at, self.started)


class _Forwarder:
    """The launcher's handlers for USR1, USR2 and TERM, installed before it starts anything.

    A signal before the launched process exists is remembered (:attr:`early`); after, USR1 and
    USR2 become ``stop_file`` when one is given (the ranks of ``hvdkit train`` look for it at
    each step, so a rank still starting up is never killed by a signal it has no handler for
    yet), and everything else is passed on to the process."""

    SIGNALS = (signal.SIGUSR1, signal.SIGUSR2, signal.SIGTERM)

    def __init__(self, stop_file: str | None) -> None:
        self.stop_file = stop_file
        self.early: list[int] = []
        self.proc: subprocess.Popen[str] | None = None
        self.previous: dict[int, Any] = {}

    def __enter__(self) -> _Forwarder:
        if threading.current_thread() is threading.main_thread():
            for sig in self.SIGNALS:
                self.previous[sig] = signal.signal(sig, self._on)
        return self

    def _on(self, sig: int, _frame: Any) -> None:
        if self.proc is None:
            self.early.append(sig)
        else:
            self._deliver(sig)

    def _deliver(self, sig: int) -> None:
        from ..preemption import REQUEUE_SIGNALS

        assert self.proc is not None
        if self.stop_file and sig in REQUEUE_SIGNALS:
            Path(self.stop_file).touch()
        elif self.proc.poll() is None:
            self.proc.send_signal(sig)

    def to(self, proc: subprocess.Popen[str]) -> None:
        """From now on signals go to ``proc``; any that came while it was being started, too."""
        self.proc = proc
        for sig in self.early:
            self._deliver(sig)

    def __exit__(self, *exc: Any) -> None:
        for sig, previous in self.previous.items():
            signal.signal(sig, previous)
        if self.stop_file:
            Path(self.stop_file).unlink(missing_ok=True)


def run_with_log(argv: Sequence[str], env: Mapping[str, str], log_dir: str | None = None,
                 out: IO[str] = sys.stdout, err: IO[str] = sys.stderr, progress: bool = False,
                 stop_file: str | None = None) -> RunOutcome:
    """Run ``argv``; filtered lines to ``out``/``err``, everything to a log file.

    With ``progress`` rank 0's ``[hvdkit-progress]`` lines become a progress bar on ``err``
    (hvdkit.observe.ProgressRelay) instead of lines. The log is kept when the job fails and
    removed when it succeeds. USR1/USR2/TERM are caught from the start (:class:`_Forwarder`):
    before the launch they mean "start nothing, exit 75"; after it they reach the ranks,
    USR1/USR2 as ``stop_file`` where the ranks read one (``$HVDKIT_STOP_FILE``).
    """
    from ..faults import hold_point
    from ..preemption import pending_stop

    console = ConsoleLog(log_dir, out, err, progress)
    with _Forwarder(stop_file) as forward:
        hold_point("launch")  # a fault lands here: the handlers are in place, nothing started
        if pending_stop() is not None or forward.early:
            # asked to stop before anything started: start nothing (a requeued job that is
            # preempted again while it starts resumes from its last checkpoint next time)
            console.not_started()
            return console.close(EXIT_PREEMPTED)
        proc = subprocess.Popen(list(argv), env=dict(env), text=True, bufsize=1,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        forward.to(proc)
        return _pumped(proc, console, out, err)


def _pumped(proc: subprocess.Popen[str], console: ConsoleLog, out: IO[str], err: IO[str]) -> RunOutcome:
    """Feed ``proc``'s lines to ``console`` until it exits; its outcome."""

    def pump(stream: IO[str], sink: IO[str]) -> None:
        for line in stream:
            console.feed(line, sink)

    threads = [threading.Thread(target=pump, args=(proc.stdout, out), daemon=True),
               threading.Thread(target=pump, args=(proc.stderr, err), daemon=True)]
    for t in threads:
        t.start()
    try:
        code = proc.wait()
    except KeyboardInterrupt:
        proc.terminate()
        code = proc.wait()
    for t in threads:
        t.join()
    return console.close(code)
