"""Two hosts on one machine: two network namespaces joined by a veth pair with private
addresses, loopback up in each (root and iproute2's `ip` needed)."""

from __future__ import annotations

import os
import random
import shutil
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass


@dataclass(frozen=True)
class Hosts:
    """(namespace, address, interface) of each of the two hosts."""

    names: tuple[str, str]
    addresses: tuple[str, str]
    interfaces: tuple[str, str]

    def run(self, host: int, command: list[str]) -> list[str]:
        """`command` as run inside host `host`'s namespace."""
        return ["ip", "netns", "exec", self.names[host], *command]


def unavailable() -> str | None:
    """Why namespaces cannot be made here; None where they can."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "network namespaces need iproute2's `ip`"
    probe = f"tgis-probe-{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"`ip netns add` fails here: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], check=True)
    return None


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True)


@contextmanager
def two_hosts() -> Iterator[Hosts]:
    """The two namespaces, deleted (with their veth ends) on exit."""
    tag = f"{os.getpid() % 100000}{random.randrange(100)}"
    names = (f"tgis-a{tag}", f"tgis-b{tag}")
    interfaces = (f"tga{tag}"[:15], f"tgb{tag}"[:15])
    subnet = f"10.{random.randrange(200, 250)}.{random.randrange(256)}"
    addresses = (f"{subnet}.1", f"{subnet}.2")
    for name in names:
        _ip("netns", "add", name)
    try:
        _ip("link", "add", interfaces[0], "netns", names[0], "type", "veth",
            "peer", "name", interfaces[1], "netns", names[1])  # fmt: skip
        for name, address, interface in zip(names, addresses, interfaces, strict=True):
            _ip("-n", name, "addr", "add", f"{address}/24", "dev", interface)
            _ip("-n", name, "link", "set", interface, "up")
            _ip("-n", name, "link", "set", "lo", "up")
        yield Hosts(names, addresses, interfaces)
    finally:
        for name in names:
            subprocess.run(["ip", "netns", "del", name], capture_output=True)
