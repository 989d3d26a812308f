"""The engine thread's waker (``coordinator.dispatch.layer.ThreadWaker``): a wake from another thread
ends a wait at once and is never lost (before, during or after the wait); with a source, the wait
also returns for its sockets (which it hands to the source) and for its timers' deadline."""

from __future__ import annotations

import socket
import threading
import time

from coordinator.dispatch.layer import ThreadWaker


class Source:
    def __init__(self, socks: list[socket.socket], timeout: float | None = None) -> None:
        self.socks = socks
        self._timeout = timeout
        self.polled: list[list[socket.socket]] = []

    def sockets(self) -> list[socket.socket]:
        return self.socks

    def ready_now(self) -> list[socket.socket]:
        return []

    def timeout(self) -> float | None:
        return self._timeout

    def poll(self, ready: list[socket.socket] | object) -> None:
        got = list(ready)  # type: ignore[call-overload]
        if got:
            self.polled.append(got)


def test_a_wake_before_the_wait_is_not_lost() -> None:
    w = ThreadWaker()
    w.wake()
    t0 = time.monotonic()
    assert w.wait(5.0) is True and time.monotonic() - t0 < 1.0
    assert w.wait(0.01) is False  # consumed: the next wait times out
    w.close()


def test_a_wake_from_another_thread_ends_the_wait() -> None:
    w = ThreadWaker()
    started = threading.Event()

    def later() -> None:
        started.wait()
        time.sleep(0.05)
        w.wake()

    t = threading.Thread(target=later)
    t.start()
    started.set()
    t0 = time.monotonic()
    assert w.wait(10.0) is True
    assert time.monotonic() - t0 < 5.0
    t.join()
    assert w.wait(0.01) is False  # the wake pipe was drained
    w.close()


def test_a_readable_socket_ends_the_wait_and_goes_to_the_source() -> None:
    a, b = socket.socketpair()
    with a, b:
        w = ThreadWaker()
        src = Source([a])
        w.source = src
        b.send(b"x")
        w.wait(5.0)
        assert src.polled and src.polled[0] == [a]
        a.recv(10)
        src.socks = []  # unwatched: a later byte no longer wakes it
        b.send(b"y")
        assert w.wait(0.05) is False and len(src.polled) == 1
        w.close()


def test_the_sources_deadline_bounds_the_wait() -> None:
    w = ThreadWaker()
    w.source = Source([], timeout=0.05)
    t0 = time.monotonic()
    assert w.wait(10.0) is False
    assert time.monotonic() - t0 < 5.0
    w.close()


def test_each_thread_has_one_waker() -> None:
    mine = ThreadWaker.current()
    assert ThreadWaker.current() is mine
    other: list[ThreadWaker] = []
    t = threading.Thread(target=lambda: other.append(ThreadWaker.current()))
    t.start()
    t.join()
    assert other[0] is not mine
