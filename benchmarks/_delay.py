"""An emulated network round trip for the benchmarks (this kernel has no netem): a TCP relay on
loopback that holds every chunk for half the round trip in each direction."""

from __future__ import annotations

import contextlib
import math
import socket
import threading

import trio

__all__ = ["DelayLink"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


class DelayLink:
    """``--rtt-ms``: a TCP relay on loopback between the coordinator and the volunteer that holds
    every chunk for half the round trip in each direction (order kept; propagation delay, no
    bandwidth limit). The dispatch map gives the coordinator the relay's address; the libp2p
    session (Noise) runs end to end through it. ``tc netem`` would do this in the kernel, but this
    machine's kernel has no netem (``CONFIG_NET_SCH_NETEM`` is not set). The relay is a trio loop on
    a thread of this process (its CPU time shares the two cores)."""

    def __init__(self, rtt_ms: float, target_port: int) -> None:
        self.delay_s, self.target = rtt_ms / 2000.0, target_port
        self.port = _free_port()
        self._ready = threading.Event()
        self._token: trio.lowlevel.TrioToken | None = None
        self._thread = threading.Thread(target=trio.run, args=(self._main,), daemon=True)
        self._thread.start()
        if not self._ready.wait(10):
            raise RuntimeError("the delaying relay did not start")

    async def _pump(self, src: trio.SocketStream, dst: trio.SocketStream) -> None:
        send, recv = trio.open_memory_channel[tuple[float, bytes]](math.inf)

        async def reader() -> None:
            async with send:
                while data := await src.receive_some(1 << 16):
                    send.send_nowait((trio.current_time() + self.delay_s, data))

        async def writer() -> None:
            async with recv:
                async for due, data in recv:
                    await trio.sleep_until(due)
                    await dst.send_all(data)
            with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError, OSError):
                await dst.send_eof()

        async with trio.open_nursery() as n:
            n.start_soon(reader)
            n.start_soon(writer)

    async def _conn(self, client: trio.SocketStream) -> None:
        with contextlib.suppress(OSError, trio.BrokenResourceError, trio.ClosedResourceError):
            server = await trio.open_tcp_stream("127.0.0.1", self.target)
            async with client, server, trio.open_nursery() as n:
                n.start_soon(self._pump, client, server)
                n.start_soon(self._pump, server, client)

    async def _main(self) -> None:
        self._token = trio.lowlevel.current_trio_token()
        self._stop = trio.Event()
        async with trio.open_nursery() as n:
            listeners = await trio.open_tcp_listeners(self.port, host="127.0.0.1")
            n.start_soon(trio.serve_listeners, self._conn, listeners)
            self._ready.set()
            await self._stop.wait()
            n.cancel_scope.cancel()

    def addr(self) -> str:
        return f"/ip4/127.0.0.1/tcp/{self.port}"

    def close(self) -> None:
        if self._token is not None:
            with contextlib.suppress(trio.RunFinishedError):
                trio.from_thread.run_sync(self._stop.set, trio_token=self._token)
        self._thread.join(10)
