"""A worker group's rendezvous (dcpserve/engine/worker/parallel.py): the store listens on the address it was given, not
on every interface, and the helpers around it."""

from __future__ import annotations

import socket
import threading
from datetime import timedelta

import psutil
import pytest
import torch.distributed as dist

from dcpserve.engine.worker.parallel import Rendezvous, interface_with_address, parse_tcp_init_method


def listening_addresses(port: int) -> set[str]:
    return {c.laddr.ip for c in psutil.Process().net_connections(kind="inet")
            if c.status == psutil.CONN_LISTEN and c.laddr.port == port}


def test_the_store_of_a_rendezvous_listens_only_where_the_rendezvous_does() -> None:
    """torch's TCPStore alone binds "::" (every interface) whatever host it is given; the store built on the
    rendezvous' socket serves on 127.0.0.1 alone, and a second rank reaches it there."""
    rendezvous = Rendezvous("127.0.0.1")
    host, port = parse_tcp_init_method(rendezvous.init_method)
    assert (host, port) == ("127.0.0.1", rendezvous.port)
    assert listening_addresses(port) == {"127.0.0.1"}  # held from the moment the port was chosen
    timeout = timedelta(seconds=30)
    stores: dict[int, dist.TCPStore] = {}

    def rank_1() -> None:
        stores[1] = dist.TCPStore(host, port, world_size=2, is_master=False, timeout=timeout)

    peer = threading.Thread(target=rank_1)
    peer.start()
    stores[0] = dist.TCPStore(host, port, world_size=2, is_master=True, timeout=timeout,
                              master_listen_fd=rendezvous.take_fd())
    peer.join(30)
    stores[0].set("from-0", "hello")
    assert stores[1].get("from-0") == b"hello"
    assert listening_addresses(port) == {"127.0.0.1"}
    with pytest.raises(RuntimeError, match="already handed"):
        rendezvous.take_fd()
    rendezvous.close()  # nothing left to close: the store owns the socket


def test_without_a_rendezvous_socket_torch_s_store_listens_on_every_interface() -> None:
    """Why Rendezvous exists: the same store given only host and port listens beyond loopback."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    store = dist.TCPStore("127.0.0.1", port, world_size=1, is_master=True, timeout=timedelta(seconds=30))
    assert listening_addresses(port) - {"127.0.0.1"}, listening_addresses(port)
    del store


def test_init_methods_parse_and_bad_ones_are_refused() -> None:
    assert parse_tcp_init_method("tcp://10.0.0.5:29500") == ("10.0.0.5", 29500)
    assert parse_tcp_init_method("tcp://[::1]:29500") == ("::1", 29500)
    for bad in ("env://", "tcp://host", "tcp://:29500", "file:///tmp/x:1"):
        with pytest.raises(ValueError, match="tcp://host:port"):
            parse_tcp_init_method(bad)


def test_the_interface_holding_an_address() -> None:
    assert interface_with_address("127.0.0.1") == "lo"
    assert interface_with_address("203.0.113.77") is None  # TEST-NET-3: no interface holds it
    for name, addresses in psutil.net_if_addrs().items():
        for address in addresses:
            if address.family == socket.AF_INET and not address.address.startswith("127."):
                assert interface_with_address(address.address) == name
