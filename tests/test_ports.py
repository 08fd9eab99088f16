"""`sglang_ernie55.ports.free_port`: the ports test servers, the demo and the benchmarks start SGLang on."""

from __future__ import annotations

import random
import socket

import pytest

from sglang_ernie55 import ports


def _span(port: int) -> list[int]:
    return [
        port,
        *range(port + ports.DERIVED_PORT_DELTA, port + ports.DERIVED_PORT_DELTA + ports.DERIVED_PORT_COUNT),
    ]


def test_server_ports_and_their_derived_ports_stay_below_the_ephemeral_range_and_off_mooncakes():
    low = ports._ephemeral_low()
    if low <= ports._LOW + 300:
        pytest.skip(f"this machine's ephemeral range starts at {low}: no room below it")
    for _ in range(20):
        p = ports.free_port()
        assert all(q < low and q < 22000 for q in _span(p)), p  # SGLang draws its NCCL port from 22000 up
        assert not any(q in ports.AVOID for q in _span(p)), p  # Mooncake's RPC ports


def test_sglang_derives_the_ports_this_module_reserves():
    server_args = pytest.importorskip("sglang.srt.server_args")
    assert server_args.ZMQ_TCP_PORT_DELTA == ports.DERIVED_PORT_DELTA


def test_no_port_is_handed_out_twice_even_inside_another_servers_span():
    spans = [set(_span(ports.free_port())) for _ in range(50)]
    plain = [ports.free_port(server=False) for _ in range(50)]
    every = [q for s in spans for q in s] + plain
    assert len(every) == len(set(every))


def test_a_port_whose_derived_port_is_taken_is_skipped(monkeypatch):
    # a listener on the first candidate's derived rpc port (port + 235): SGLang would wait 30 s for it, then fail
    with socket.socket() as listener:
        listener.bind(("0.0.0.0", 0))
        first = listener.getsockname()[1] - ports.DERIVED_PORT_DELTA - 2
        listener.listen()
        second = next(
            p for p in random.sample(range(ports._LOW, 14000), 100) if all(map(ports._bindable, _span(p)))
        )
        monkeypatch.setattr(ports.random, "sample", lambda seq, k: [first, second])
        monkeypatch.setattr(ports, "_given", set())
        assert ports.free_port() == second
