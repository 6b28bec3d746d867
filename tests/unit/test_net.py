"""`agentrl.net.free_port`: a port outside the kernel's ephemeral range, so no process binding
port 0 (vLLM's engine sockets, Ray's workers' clients) can be handed it between pick and bind."""

from __future__ import annotations

import socket

from agentrl.net import _ephemeral_low, free_port


def test_free_ports_are_below_the_ephemeral_range_and_bindable() -> None:
    low = _ephemeral_low()
    ports = {free_port() for _ in range(20)}
    assert all(port < low for port in ports), (sorted(ports), low)
    for port in ports:
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))


def test_a_port_in_use_is_not_given() -> None:
    held = []
    try:
        for _ in range(50):  # hold many of the range's ports: none of them may come back
            s = socket.socket()
            s.bind(("127.0.0.1", free_port()))
            s.listen()
            held.append(s)
        taken = {s.getsockname()[1] for s in held}
        assert not taken & {free_port() for _ in range(50)}
    finally:
        for s in held:
            s.close()
