"""An Allreduce's traffic between two hosts over plain TCP, without MPI: each call, both sides send `size` bytes and
receive `size` bytes at once, split evenly over `sockets` connections (what a 2-rank ring allreduce sends a rank).

    python -m benchmarks.socket_exchange serve HOST SOCKETS SIZE CALLS     prints its port, then serves
    python -m benchmarks.socket_exchange connect HOST:PORT SOCKETS SIZE CALLS   prints each call's seconds (JSON)

Each call follows an 8-byte exchange on every connection that lines the two sides up (the Allreduce jobs' barrier),
after two untimed calls. benchmarks/tcp_links.py runs it on its namespace nodes, to tell Open MPI's TCP transport
from TCP itself over the rate-limited link.
"""

from __future__ import annotations

import json
import socket
import sys
import threading
import time

CHUNK = 1 << 20


def serve(host: str, sockets: int) -> list[socket.socket]:
    """Listen on a free port of `host`, print it, and accept `sockets` connections."""
    listener = socket.create_server((host, 0))
    print(listener.getsockname()[1], flush=True)
    return [listener.accept()[0] for _ in range(sockets)]


def connect(address: str, sockets: int, wait_s: float = 10.0) -> list[socket.socket]:
    host, port = address.rsplit(":", 1)
    return [socket.create_connection((host, int(port)), timeout=wait_s) for _ in range(sockets)]


def send(connection: socket.socket, size: int) -> None:
    block = memoryview(bytes(min(size, CHUNK)))
    while size:
        size -= connection.send(block[: min(size, len(block))])


def receive(connection: socket.socket, size: int) -> None:
    block = bytearray(min(size, CHUNK))
    while size:
        got = connection.recv_into(block, min(size, len(block)))
        if not got:
            raise EOFError("the other side closed the connection")
        size -= got


def exchange(connections: list[socket.socket], size: int) -> None:
    """Send and receive `size` bytes, split over the connections, all at once."""
    share = size // len(connections)
    threads = [threading.Thread(target=f, args=(c, share)) for c in connections for f in (send, receive)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


def calls(connections: list[socket.socket], size: int, count: int) -> list[float]:
    """Seconds of each of `count` exchanges of `size` bytes, after two untimed ones."""
    for connection in connections:
        connection.settimeout(None)
        connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    seconds = []
    for call in range(count + 2):
        exchange(connections, 8 * len(connections))
        started = time.perf_counter()
        exchange(connections, size)
        if call >= 2:
            seconds.append(time.perf_counter() - started)
    exchange(connections, 8 * len(connections))  # neither side closes while the other still reads
    return seconds


def main(argv: list[str]) -> None:
    role, address, sockets, size, count = argv[0], argv[1], int(argv[2]), int(argv[3]), int(argv[4])
    connections = serve(address, sockets) if role == "serve" else connect(address, sockets)
    seconds = calls(connections, size, count)
    if role == "connect":
        print(json.dumps(seconds), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
