"""The caller's connections to its ranks, for ``zerofn.launch``.

:class:`RankLinks` owns a listening TCP socket on 127.0.0.1 (port 0: the OS
picks a free one, so there is no port race). Being a plain socket, it can be
waited on with ``multiprocessing.connection.wait`` together with the
connections and the process handles, so a rank that dies before it connects
cannot hang the start. Each accepted socket becomes a
``multiprocessing.connection.Connection`` and passes the same authkey
handshake as ``Listener.accept`` (``deliver_challenge`` then
``answer_challenge``); ranks connect with the plain ``Client``. The first
message on a connection is the rank's greeting ``("hello", rank)``.
"""

from __future__ import annotations

import os
import socket
from multiprocessing import AuthenticationError
from multiprocessing.connection import Connection, answer_challenge, deliver_challenge

HOST = "127.0.0.1"


class RankLinks:
    """One authenticated connection per rank, accepted on a socket of our own.

    Args:
        world_size: number of ranks that will connect.

    Attributes:
        address: ``(host, port)`` for the ranks' ``Client``.
        authkey: the random key both sides prove they hold.
    """

    def __init__(self, world_size: int):
        self.world_size = world_size
        self.authkey = os.urandom(32)
        self._server: socket.socket | None = socket.create_server((HOST, 0), backlog=max(world_size, 8))
        # Readable only says a connection was there: it may be gone by accept.
        self._server.setblocking(False)
        self.address: tuple[str, int] = self._server.getsockname()[:2]
        self._conns: list[Connection | None] = [None] * world_size

    @property
    def listening(self) -> socket.socket | None:
        """The socket to wait on while some rank has not connected, else ``None``."""
        return self._server if None in self._conns else None

    def accept(self, label: str) -> None:
        """Accept one pending connection and file it under the rank it names."""
        try:
            sock, _ = self._server.accept()
        except OSError:
            return  # it went away before we took it
        sock.setblocking(True)
        conn = Connection(sock.detach())
        try:
            deliver_challenge(conn, self.authkey)
            answer_challenge(conn, self.authkey)
            kind, rank = conn.recv()
        except (AuthenticationError, EOFError, OSError):
            # A stranger on the port, or a rank that died mid-handshake: its
            # death shows on its process handle.
            conn.close()
            return
        if kind != "hello" or not 0 <= rank < self.world_size or self._conns[rank] is not None:
            conn.close()
            raise RuntimeError(f"{label}: unexpected greeting {kind!r} from rank {rank!r}.")
        self._conns[rank] = conn

    def connections(self, ranks: list[int]) -> dict[Connection, int]:
        """The connections of those ``ranks`` that have connected, to their rank."""
        return {self._conns[r]: r for r in ranks if self._conns[r] is not None}

    def send(self, rank: int, message) -> None:
        """Send ``message`` to ``rank``; ``OSError`` if its connection is gone."""
        self._conns[rank].send(message)

    def recv(self, rank: int):
        """The next message from ``rank``; ``EOFError`` or ``OSError`` if it is gone."""
        return self._conns[rank].recv()

    def pending(self, rank: int):
        """The message ``rank`` sent that we have not read yet, else ``None``."""
        conn = self._conns[rank]
        try:
            if conn is None or not conn.poll():
                return None
            return conn.recv()
        except (EOFError, OSError):
            return None

    def send_all(self, message) -> None:
        """Send ``message`` to every connected rank, skipping those that are gone."""
        for conn in self._conns:
            if conn is not None:
                try:
                    conn.send(message)
                except OSError:
                    pass

    def close(self) -> None:
        """Close every connection and the listening socket; idempotent."""
        for conn in self._conns:
            if conn is not None:
                conn.close()
        self._conns = [None] * self.world_size
        if self._server is not None:
            self._server.close()
            self._server = None
