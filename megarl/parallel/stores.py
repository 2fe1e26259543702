"""TCPStores that listen on one address: the job's interface, not every interface of the node.

torch's `TCPStore(is_master=True)` binds the wildcard address, so on a cluster the trainer's rendezvous store and
the weight-sync store would answer anyone who can reach the node. `tcp_store` binds the listening socket itself,
to `host` only, and hands it to torch (`master_listen_fd`); clients connect as usual. The master's `host` must
therefore be an address of its own node (the name or address the other processes use to reach it).
"""

from __future__ import annotations

import socket
from datetime import timedelta

import torch.distributed as dist


class StoreAddressError(RuntimeError):
    """The store's address cannot be bound on this node (not local, or the port is taken)."""


def _listening_socket(host: str, port: int) -> socket.socket:
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except socket.gaierror as err:
        raise StoreAddressError(f"store address {host!r} does not resolve ({err}): set MEGARL_MASTER_ADDR to an "
                                "address of the node that runs trainer rank 0") from None
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
        sock.listen(socket.SOMAXCONN)
    except OSError as err:
        sock.close()
        raise StoreAddressError(
            f"cannot listen on {host}:{port} ({err.strerror}): the port is taken or {host} is not an address of "
            "this node; set MEGARL_MASTER_PORT to a free port or MEGARL_MASTER_ADDR to this node's address") from None
    return sock


def tcp_store(host: str, port: int, world_size: int, is_master: bool, timeout_s: float) -> dist.TCPStore:
    """The master serves the store on `host:port` only; the others connect to it (waiting up to `timeout_s`)."""
    timeout = timedelta(seconds=timeout_s)
    if not is_master:
        return dist.TCPStore(host, port, world_size, is_master=False, timeout=timeout)
    sock = _listening_socket(host, port)
    store = dist.TCPStore(host, port, world_size, is_master=True, timeout=timeout, wait_for_workers=False,
                          master_listen_fd=sock.fileno())
    sock.detach()  # the store owns the descriptor now
    return store
