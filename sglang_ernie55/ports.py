"""Loopback ports for servers that bind them later: below the kernel's ephemeral range, where any outgoing
connection may take a `bind(0)` port first, below SGLang's NCCL-port draw (22000-29999) and outside Mooncake's
RPC ports (15000-17000). Under attention DP SGLang also binds ports derived from the HTTP port (port + 233 ..
+ 239) and gives up on a server when one is held, so a server port comes with those checked free too, and no
port is handed out twice by one process.
"""

from __future__ import annotations

import random
import socket
import threading

# SGLang's ZMQ_TCP_PORT_DELTA and the six ports it derives under attention DP (server_args.PortArgs.init_new)
DERIVED_PORT_DELTA = 233
DERIVED_PORT_COUNT = 7
_LOW, _HIGH = 10000, 21999  # below SGLang's nccl-port draw (22000-29999) and the default ephemeral range
# Mooncake's transfer-engine RPC ports (MC_MIN_RPC_PORT .. MC_MAX_RPC_PORT defaults), bound by PD servers at start
AVOID = range(15000, 17001)

_given: set[int] = set()
_lock = threading.Lock()


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("0.0.0.0", port))
        except OSError:
            return False
    return True


def free_port(server: bool = True, attempts: int = 512) -> int:
    """A free port below the ephemeral range that this process has not handed out. server: also keep SGLang's
    derived ports (port + 233 .. + 239) free and unhanded, for a server that may run attention DP."""
    span = [0, *range(DERIVED_PORT_DELTA, DERIVED_PORT_DELTA + DERIVED_PORT_COUNT)] if server else [0]
    high = min(_HIGH, _ephemeral_low() - 1) - span[-1]
    with _lock:
        if high > _LOW:
            for port in random.sample(range(_LOW, high + 1), min(attempts, high + 1 - _LOW)):
                ports = [port + d for d in span]
                if any(p in AVOID for p in ports) or _given.intersection(ports):
                    continue
                if all(_bindable(p) for p in ports):
                    _given.update(ports)
                    return port
        while True:  # a machine whose ephemeral range starts below ours: the kernel's choice, never twice
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            if port not in _given:
                _given.add(port)
                return port
