"""The step channel between the driver and one TP rank: an authenticated stream connection carrying length-prefixed
frames.

The driver listens (only until every rank has connected) on an ephemeral TCP port of its node and, on Linux, on a
Unix socket in the abstract namespace (a random name, no file to clean up). A rank tries the Unix socket first: it
exists only on the driver's host (and network namespace), where it is the same stream without the TCP stack, which on
loopback costs 15 us of the sender's time per frame against 1.7 us (bench/rank_transport.py's step channel rows); a
rank anywhere else is refused at once and connects over TCP. Both sides then prove they hold the group's random key
(HMAC challenge-response both ways, so frames, which are unpickled, only ever come from the group). Setup is bounded
by a timeout; afterwards the sockets block: a rank waits in recv between steps without using a core, and a rank
process that dies closes its socket, which the driver sees at once.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import select
import socket
import struct
import sys

HEADER = struct.Struct("!Q")  # frame size in bytes, then the frame
RANK = struct.Struct("!I")  # a rank's first frame after the handshake: its rank
CHALLENGE_BYTES = 32
SMALL_FRAME_BYTES = 64 << 10  # up to this a frame is sent with its header in one write


class ChannelAuthError(ConnectionError):
    """The peer does not hold the group's key (a stray connection to the driver's port)."""


class FrameSocket:
    """Length-prefixed frames over a connected stream socket (TCP, or Unix on the driver's host: `transport`)."""

    def __init__(self, sock: socket.socket) -> None:
        self.transport = "unix" if sock.family == socket.AF_UNIX else "tcp"
        if self.transport == "tcp":
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock = sock

    def fileno(self) -> int:
        return self.sock.fileno()

    def send(self, frame: bytes) -> None:
        header = HEADER.pack(len(frame))
        if len(frame) <= SMALL_FRAME_BYTES:
            self.sock.sendall(header + frame)
        else:  # no copy of a large frame just to prepend 8 bytes
            self.sock.sendall(header)
            self.sock.sendall(frame)

    def recv(self) -> bytearray:
        """The next frame; EOFError when the peer closed the connection (between frames or inside one)."""
        (size,) = HEADER.unpack(self._recv_exactly(HEADER.size))
        return self._recv_exactly(size)

    def _recv_exactly(self, size: int) -> bytearray:
        buffer = bytearray(size)
        view = memoryview(buffer)
        received = 0
        while received < size:
            count = self.sock.recv_into(view[received:])
            if count == 0:
                raise EOFError(f"the peer closed the connection ({received} of {size} bytes of a frame received)")
            received += count
        return buffer

    def close(self) -> None:
        """Closes the connection; a thread blocked reading it (here or at the peer) gets EOF."""
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass  # already closed by the peer
        self.sock.close()


def _authenticate(frames: FrameSocket, authkey: bytes) -> None:
    """Mutual HMAC challenge-response: each side sends a fresh challenge and checks the peer's digest of it."""
    challenge = secrets.token_bytes(CHALLENGE_BYTES)
    frames.send(challenge)
    peer_challenge = bytes(frames.recv())
    frames.send(hmac.digest(authkey, peer_challenge, hashlib.sha256))
    expected = hmac.digest(authkey, challenge, hashlib.sha256)
    if not hmac.compare_digest(bytes(frames.recv()), expected):
        raise ChannelAuthError("the peer's answer to the challenge does not match the group's key")


class ChannelListener:
    """The driver's side of setup: a listening socket on an ephemeral TCP port, one on a Unix socket for the ranks on
    this host (`local`, Linux only; local_address None otherwise), and the group's key."""

    def __init__(self, host: str, local: bool = True) -> None:
        self.authkey = secrets.token_bytes(32)
        self._sock = socket.create_server((host, 0))
        self.address: tuple[str, int] = (host, self._sock.getsockname()[1])
        self._local: socket.socket | None = None
        self.local_address: str | None = None
        if local and sys.platform == "linux":
            name = f"\0dcpserve-step-{secrets.token_hex(12)}"  # the abstract namespace: gone with the socket
            self._local = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            self._local.bind(name)
            self._local.listen()
            self.local_address = name
        self._listening = [sock for sock in (self._local, self._sock) if sock is not None]
        for sock in self._listening:
            sock.setblocking(False)  # accepted only once select says a connection is there

    def accept(self, num_ranks: int, timeout_s: float) -> tuple[int, FrameSocket] | None:
        """The next authenticated rank connection (on either socket) as (rank, channel), or None when none came
        within timeout_s. A connection that fails the handshake (or names no rank of the group) is closed and
        skipped."""
        ready, _, _ = select.select(self._listening, [], [], timeout_s)
        if not ready:
            return None
        try:
            sock, _ = ready[0].accept()
        except (BlockingIOError, ConnectionAbortedError):
            return None  # the connection went away between select and accept
        sock.settimeout(timeout_s)  # the handshake is bounded too: a peer that connects and stays silent
        frames = FrameSocket(sock)
        try:
            _authenticate(frames, self.authkey)
            (rank,) = RANK.unpack(bytes(frames.recv()))
        except (OSError, EOFError, struct.error):
            frames.close()  # a stray or broken connection: not one of ours
            return None
        if rank >= num_ranks:
            frames.close()
            raise ConnectionError(f"a TP rank connected as rank {rank} of a group of {num_ranks}")
        sock.settimeout(None)
        return rank, frames

    def close(self) -> None:
        for sock in self._listening:
            sock.close()


def connect_rank(address: tuple[str, int], authkey: bytes, rank: int, timeout_s: float,
                 local_address: str | None = None) -> FrameSocket:
    """A rank's side of setup: connect to the driver (over its Unix socket when `local_address` is given and this
    rank is on the driver's host, else over TCP), authenticate both ways, say which rank this is."""
    sock: socket.socket | None = None
    if local_address is not None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(timeout_s)
        try:
            sock.connect(local_address)
        except OSError:  # another host or network namespace: no such socket here
            sock.close()
            sock = None
    if sock is None:
        sock = socket.create_connection(address, timeout=timeout_s)
    frames = FrameSocket(sock)
    try:
        _authenticate(frames, authkey)
        frames.send(RANK.pack(rank))
    except BaseException:
        frames.close()
        raise
    sock.settimeout(None)
    return frames
