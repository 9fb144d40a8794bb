"""The harness's free ports: none that Ray or the OS hands to a process unasked (a Serve proxy
once failed to bind its HTTP port because Ray's processes had taken it as an ephemeral one)."""

from __future__ import annotations

import socket

from harness.local_ray import RAY_WORKER_PORTS, ephemeral_port_range, free_ports


def test_free_ports_are_distinct_bindable_and_outside_ray_and_ephemeral_ranges():
    ports = free_ports(20)
    assert len(set(ports)) == 20
    ephemeral = ephemeral_port_range()
    for port in ports:
        assert port not in RAY_WORKER_PORTS
        if ephemeral.start - 20000 >= 1000:  # the quiet gap exists (Linux's default range)
            assert port not in ephemeral
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", port))  # still free: nothing else holds it
