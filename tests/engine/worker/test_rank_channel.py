"""The driver <-> rank step channel (dcpserve.engine.worker.rank_channel) over real loopback sockets, without Ray:
frames of every size arrive whole and in order, a closed peer is EOF, and only holders of the group's key get through
the handshake."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator

import pytest

from dcpserve.engine.worker.rank_channel import (
    SMALL_FRAME_BYTES,
    ChannelAuthError,
    ChannelListener,
    FrameSocket,
    connect_rank,
)


@pytest.fixture(params=["tcp", "unix"])
def transport(request: pytest.FixtureRequest) -> str:
    """How the ranks connect: over TCP (a rank on another host), or over the driver's Unix socket (its host)."""
    return str(request.param)


@pytest.fixture
def listener(transport: str) -> Iterator[ChannelListener]:
    listener = ChannelListener("127.0.0.1")
    # A rank given no Unix socket (or one on another host, where the name does not exist) connects over TCP.
    listener.rank_local_address = listener.local_address if transport == "unix" else None  # type: ignore[attr-defined]  # the tests' own note on the listener
    yield listener
    listener.close()


def _connect_in_thread(listener: ChannelListener, authkey: bytes, rank: int) -> tuple[threading.Thread, list]:
    result: list = []
    local_address = listener.rank_local_address  # type: ignore[attr-defined]  # set by the fixture

    def connect() -> None:
        try:
            result.append(connect_rank(listener.address, authkey, rank, timeout_s=10, local_address=local_address))
        except Exception as err:  # noqa: BLE001 - the test inspects it
            result.append(err)

    thread = threading.Thread(target=connect)
    thread.start()
    return thread, result


def test_frames_of_every_size_arrive_whole_and_in_order(listener: ChannelListener, transport: str) -> None:
    thread, connected = _connect_in_thread(listener, listener.authkey, rank=1)
    accepted = listener.accept(num_ranks=2, timeout_s=10)
    thread.join()
    assert accepted is not None and accepted[0] == 1
    driver, rank = accepted[1], connected[0]
    assert isinstance(rank, FrameSocket) and rank.transport == driver.transport == transport
    frames = [b"", b"x", bytes(range(256)) * 3, b"s" * SMALL_FRAME_BYTES, bytes(range(251)) * 40_000]  # up to 10 MB

    def send_all() -> None:
        for frame in frames:
            driver.send(frame)

    sender = threading.Thread(target=send_all)  # large frames need a reader
    sender.start()
    received = [bytes(rank.recv()) for _ in frames]
    sender.join()
    assert received == frames
    rank.send(b"reply")
    assert driver.recv() == b"reply"
    rank.close()
    with pytest.raises(EOFError):
        driver.recv()
    driver.close()


def test_a_peer_closing_inside_a_frame_is_eof(listener: ChannelListener) -> None:
    thread, connected = _connect_in_thread(listener, listener.authkey, rank=0)
    accepted = listener.accept(num_ranks=1, timeout_s=10)
    thread.join()
    assert accepted is not None
    driver, rank = accepted[1], connected[0]
    rank.sock.sendall((100).to_bytes(8, "big") + b"only ten b")  # a header promising 100 bytes, then 10
    rank.close()
    with pytest.raises(EOFError, match="10 of 100 bytes"):
        driver.recv()
    driver.close()


def test_only_holders_of_the_key_get_through(listener: ChannelListener) -> None:
    # A rank with the wrong key is refused on both sides, and the listener keeps waiting for the real ranks.
    thread, connected = _connect_in_thread(listener, b"not the key", rank=0)
    assert listener.accept(num_ranks=1, timeout_s=10) is None
    thread.join()
    assert isinstance(connected[0], (ChannelAuthError, EOFError, OSError)), connected
    # A stray connection that never speaks, on either socket, costs the listener at most its timeout.
    with socket.create_connection(listener.address):
        assert listener.accept(num_ranks=1, timeout_s=0.5) is None
    if listener.local_address is not None:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as stray:
            stray.connect(listener.local_address)
            assert listener.accept(num_ranks=1, timeout_s=0.5) is None
    thread, connected = _connect_in_thread(listener, listener.authkey, rank=0)
    accepted = listener.accept(num_ranks=1, timeout_s=10)
    thread.join()
    assert accepted is not None and accepted[0] == 0
    accepted[1].close()
    connected[0].close()


def test_a_rank_outside_the_group_is_an_error(listener: ChannelListener) -> None:
    thread, connected = _connect_in_thread(listener, listener.authkey, rank=2)
    with pytest.raises(ConnectionError, match="rank 2 of a group of 2"):
        listener.accept(num_ranks=2, timeout_s=10)
    thread.join()
    connected[0].close()


def test_a_rank_whose_unix_socket_does_not_exist_connects_over_tcp() -> None:
    # As a rank on another host does: the abstract name exists only on the driver's.
    listener = ChannelListener("127.0.0.1")
    listener.rank_local_address = "\0dcpserve-step-not-this-host"  # type: ignore[attr-defined]  # see the fixture
    try:
        thread, connected = _connect_in_thread(listener, listener.authkey, rank=0)
        accepted = listener.accept(num_ranks=1, timeout_s=10)
        thread.join()
        assert accepted is not None and accepted[1].transport == connected[0].transport == "tcp"
        accepted[1].close()
        connected[0].close()
    finally:
        listener.close()


def test_a_listener_without_the_unix_socket_has_no_local_address() -> None:
    listener = ChannelListener("127.0.0.1", local=False)
    assert listener.local_address is None
    listener.close()
