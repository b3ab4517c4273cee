"""The pipeline's channels: the one owner of its sender and receiver threads.

A pipeline boundary message is ``gradcomp.collectives.send`` (header, then payload) and that
send blocks until the peer receives. If a rank sent on its own thread, two neighbours sending
to each other at once (stage ``s`` an activation forward, stage ``s + 1`` a gradient back)
would wait for each other forever. So every message goes through a *channel*, a FIFO thread:

- one receive channel per (peer, tag) receives, from the start of the step, every message
  the schedule expects with that tag, in order, and keeps each decoded tensor until the
  schedule takes it (:meth:`Channels.take`). A message is received as soon as it arrives,
  whatever the receiver computes, so a send never waits for its peer's schedule;
- one send channel per peer runs the sends to it in the order the schedule produced them,
  one at a time: a message does not share the link with later ones, so it arrives as early
  as the link allows.

A send only waits for the peer's receive channel, which waits for nothing but the network:
the rank's schedule only waits in :meth:`Channels.take`, for a message its peer's schedule
produces, so no schedule that :func:`gradcomp.pipeline.schedule.simulate` accepts can
deadlock.

A job runs in the context (``contextvars``) it was posted from: the step's state transaction
covers it. A job that fails keeps its error and the channel drops the jobs after it (it is
out of step): :meth:`Channels.take` raises it for every receive still expected, and
:meth:`Channels.flush`, which waits for every posted job, raises the first error (a
``CommunicationError`` for a dead or silent peer, within the group timeout). ``close()`` ends
the threads; a pipeline that is dropped closes them.
"""
from __future__ import annotations

import atexit
import contextvars
import queue
import threading
import time
import weakref
from typing import Any, Callable, Dict, List, Optional, Tuple

_STOP = object()
_JOIN_S = 1.0  # how long close() waits for a thread to end (one in a dead peer's receive is left behind)
_open: "weakref.WeakSet[Channels]" = weakref.WeakSet()


class _Channel:
    """One FIFO thread; a receive channel keeps each job's result for :meth:`take`."""

    def __init__(self, name: str, keep: bool) -> None:
        self.jobs: "queue.Queue[Any]" = queue.Queue()
        self.results: "queue.Queue[Tuple[bool, Any]]" = queue.Queue()
        self.keep = keep
        self.pending = 0
        self.error: Optional[BaseException] = None
        self.idle = threading.Condition()
        self.thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        while True:
            item = self.jobs.get()
            if item is _STOP:
                return
            ctx, job = item
            ok, value = False, self.error
            if self.error is None:
                try:
                    ok, value = True, ctx.run(job)
                except BaseException as exc:
                    self.error = value = exc
            if self.keep:
                self.results.put((ok, value))
            with self.idle:
                self.pending -= 1
                self.idle.notify_all()

    def post(self, job: Callable[[], Any]) -> None:
        with self.idle:
            self.pending += 1
        self.jobs.put((contextvars.copy_context(), job))

    def take(self) -> Any:
        ok, value = self.results.get()
        if not ok:
            raise value
        return value

    def wait(self, deadline: Optional[float]) -> bool:
        with self.idle:
            while self.pending:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self.idle.wait(left)
        return True


class Channels:
    """The threads of one pipeline, made on first use of each (direction, peer, tag)."""

    def __init__(self, prefix: str = "gradcomp-pipeline") -> None:
        self.prefix = prefix
        self._channels: Dict[Tuple[str, int, int], _Channel] = {}
        _open.add(self)

    def _get(self, way: str, peer: int, tag: int) -> _Channel:
        ch = self._channels.get((way, peer, tag))
        if ch is None:
            name = f"{self.prefix}-to{peer}" if way == "out" else f"{self.prefix}-from{peer}-tag{tag}"
            ch = self._channels[(way, peer, tag)] = _Channel(name, keep=way == "in")
        return ch

    def post(self, peer: int, job: Callable[[], None]) -> None:
        """Run ``job`` (a send to ``peer``) after the sends to ``peer`` posted before it."""
        self._get("out", peer, -1).post(job)

    def expect(self, peer: int, tag: int, job: Callable[[], Any]) -> None:
        """Run ``job`` (a receive from ``peer`` with ``tag``) after the receives expected before
        on that channel; :meth:`take` hands out its result."""
        self._get("in", peer, tag).post(job)

    def take(self, peer: int, tag: int) -> Any:
        """The next expected message from ``peer`` with ``tag`` (waits for it)."""
        return self._get("in", peer, tag).take()

    def flush(self, timeout_s: Optional[float] = None) -> None:
        """Wait for every posted job; raise the first error one of them met (the channel then
        drops what it still holds, and the error stays: the pipeline is out of step)."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        for (way, peer, tag), ch in self._channels.items():
            if not ch.wait(deadline):
                raise TimeoutError(f"pipeline: a message {'to' if way == 'out' else 'from'} rank {peer} (tag {tag}) "
                                   f"did not finish within {timeout_s:g} s")
        errors: List[BaseException] = [ch.error for ch in self._channels.values() if ch.error is not None]
        if errors:
            raise errors[0]

    def close(self) -> None:
        """End the threads and wait (briefly) until they have: a thread still inside the
        backend when the interpreter shuts down would abort the process."""
        channels, self._channels = list(self._channels.values()), {}
        for ch in channels:
            ch.jobs.put(_STOP)
        deadline = time.monotonic() + _JOIN_S
        for ch in channels:
            if ch.thread is not threading.current_thread():
                ch.thread.join(max(0.0, deadline - time.monotonic()))


@atexit.register
def _close_all() -> None:
    for channels in list(_open):
        channels.close()
