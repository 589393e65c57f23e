"""This machine's side of the network between nodes: the address and interface on the route to
another node, and the interface gloo's and NCCL's sockets use. Torch-free; used by the launcher
(``launch.nodes``) and by a process joining its group (``distributed.process``)."""
from __future__ import annotations

import os
import socket


def route_to(host: str, port: int) -> tuple[str | None, str | None]:
    """(this machine's address on the route to ``host``, the interface that holds it), Nones where
    they cannot be found. A UDP connect picks the route without sending anything."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((socket.gethostbyname(host), port))
            addr = s.getsockname()[0]
    except OSError:
        return None, None
    return addr, _interface_of(addr)


def _interface_of(addr: str) -> str | None:
    """The network interface that holds ``addr`` (Linux), for gloo's and NCCL's sockets."""
    try:
        import fcntl  # Linux only: elsewhere the ImportError below leaves the choice to gloo and NCCL
        import struct
        names = [name for _, name in socket.if_nameindex()]
    except (ImportError, OSError, AttributeError):  # not Linux: leave gloo's and NCCL's own choice
        return None
    for name in names:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            try:
                packed = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name.encode()[:15]))  # SIOCGIFADDR
            except OSError:
                continue
        if socket.inet_ntoa(packed[20:24]) == addr:
            return name
    return None


def use_interface(iface: str | None) -> None:
    """Send gloo's and NCCL's traffic through ``iface`` unless the user chose: by default they take the
    hostname's address, which is often 127.0.x.x or another network than the other nodes'."""
    if iface:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", iface)
        os.environ.setdefault("NCCL_SOCKET_IFNAME", iface)
