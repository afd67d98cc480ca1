"""Measuring equipment: a TCP relay that puts a round-trip time between a client and a server.

The kernels here have no ``netem``, so a cache "30 ms away" is Redis on loopback behind this
relay. Each new connection pays one round trip before its first byte goes through (TCP's
handshake), and every chunk of bytes arrives half a round trip after it was sent, in order, in
both directions: what a server at that distance costs, and nothing about bandwidth or loss.
TLS goes through it untouched, so its handshake pays the distance too.

    python -m loadtests.delay_relay --rtt-ms 30   # to the local Redis (--target); prints its port
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager


async def _carry(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, delay_s: float) -> None:
    """Bytes from ``reader`` to ``writer``, each chunk ``delay_s`` after it was read."""
    loop = asyncio.get_running_loop()
    chunks: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()

    async def read() -> None:
        while data := await reader.read(65536):
            chunks.put_nowait((loop.time() + delay_s, data))
        chunks.put_nowait((loop.time() + delay_s, b""))  # the end, delayed like the rest

    async def deliver() -> None:
        while True:
            due, data = await chunks.get()
            await asyncio.sleep(max(0.0, due - loop.time()))
            if not data:
                break
            writer.write(data)
            await writer.drain()

    try:
        await asyncio.gather(read(), deliver())
    except (ConnectionError, OSError):
        pass
    finally:
        writer.close()


async def serve(target_host: str, target_port: int, rtt_s: float, port: int = 0) -> asyncio.Server:
    async def relay(client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        await asyncio.sleep(rtt_s)  # the TCP handshake's round trip
        try:
            server_r, server_w = await asyncio.open_connection(target_host, target_port)
        except OSError:
            client_w.close()
            return
        await asyncio.gather(_carry(client_r, server_w, rtt_s / 2), _carry(server_r, client_w, rtt_s / 2))

    return await asyncio.start_server(relay, "127.0.0.1", port)


async def _main(target: str, rtt_ms: float) -> None:
    host, port = target.rsplit(":", 1)
    server = await serve(host, int(port), rtt_ms / 1e3)
    print(server.sockets[0].getsockname()[1], flush=True)
    async with server:
        await server.serve_forever()


@contextmanager
def relay(target_port: int, rtt_ms: float, target_host: str = "127.0.0.1") -> Iterator[int]:
    """A relay process to ``target_host:target_port`` at ``rtt_ms``; yields its port."""
    command = [sys.executable, "-m", "loadtests.delay_relay", "--target", f"{target_host}:{target_port}"]
    process = subprocess.Popen([*command, "--rtt-ms", str(rtt_ms)], stdout=subprocess.PIPE, text=True)
    try:
        assert process.stdout is not None
        yield int(process.stdout.readline())
    finally:
        process.terminate()
        process.wait(timeout=10)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--target", default="127.0.0.1:6379", help="host:port to relay to (the local Redis)")
    parser.add_argument("--rtt-ms", type=float, required=True, help="round-trip time to add")
    args = parser.parse_args()
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(_main(args.target, args.rtt_ms))
