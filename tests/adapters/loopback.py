"""A threaded TCP server on loopback for the adapters' tests of their sockets: each accepted
connection is served by :meth:`LoopbackServer.serve` on a thread of its own."""

from __future__ import annotations

import socket
import threading


class LoopbackServer:
    """Listens on 127.0.0.1 (a free port) from construction until :meth:`close`; counts the
    connections it accepted."""

    def __init__(self) -> None:
        self.accepted = 0
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port: int = self.sock.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.accepted += 1
            threading.Thread(target=self.serve, args=(conn,), daemon=True).start()

    @staticmethod
    def read_head(conn: socket.socket, buf: bytes = b"") -> tuple[bytes, bytes] | None:
        """An HTTP head from ``conn`` (after what ``buf`` holds already): (the head without
        its blank line, the bytes read after it); ``None`` when the peer ended first."""
        while b"\r\n\r\n" not in buf:
            chunk = conn.recv(65536)
            if not chunk:
                return None
            buf += chunk
        head, rest = buf.split(b"\r\n\r\n", 1)
        return head, rest

    def serve(self, conn: socket.socket) -> None:
        """Serve one accepted connection (and close it)."""
        conn.close()

    def close(self) -> None:
        """Stop listening; connections being served go on."""
        self.sock.close()
