"""The nodes of multi-node tensor parallelism: where they meet, how they check each other, and
how they watch each other while serving.

`--num-shard N --nnodes K` spreads the N ranks over K hosts, N / K on each: node R holds ranks
R x N/K ... (R+1) x N/K - 1, each on its local device. Node 0 is the server (rank 0 runs the
scheduler and HTTP/gRPC); it hosts the rendezvous store (torch.distributed's TCPStore) at
--master-addr:--master-port. Every other node (`tgis serve --node-rank R`) connects to it:

1. node 0 says what it loads first; a node checks its rank against node 0's node count,
   claims the rank (a second host's claim is refused, a restarted host's taken back) and
   registers what it would load: the model's files, revision, dtype, shard and node counts,
   quantization, the KV cache's dtype and the tgis version (`identity`);
2. node 0 waits for every node (--join-timeout-s, then it names the nodes that never came),
   compares them with its own and publishes a verdict: the engine's shape settings every rank
   builds with, or what differs, which every node then reports and exits with;
3. the ranks of every node join one process group over the same store, and the nodes beat on
   it while they serve (`NodeWatch`): node 0 ends the server when a node falls silent for
   --node-timeout-s, or reports that one of its ranks failed; the other nodes end when node
   0 is gone.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch.distributed as dist

from tgis import __version__
from tgis.errors import NodeError

log = logging.getLogger("tgis.backends.paged.nodes")

# What every node must agree on (identity's keys), and the settings that set each.
IDENTITY_FLAGS = {
    "model": "--model-id",
    "revision": "--revision",
    "device": "--backend",
    "dtype": "--dtype",
    "num_shard": "--num-shard",
    "nnodes": "--nnodes",
    "quantize": "--quantize",
    "kv_cache_dtype": "--kv-cache-dtype",
    "tgis": "the tgis version",
}
# The engine's shape, which node 0 decides for every rank (its pool and batch must match).
SHAPE_FIELDS = (
    "max_sequences",
    "max_sequence_tokens",
    "max_prefill_tokens",
    "kv_tokens",
    "memory_fraction",
)
# How often a node beats while the others watch (at most: a shorter --node-timeout-s beats
# faster).
BEAT_INTERVAL_S = 1.0


@dataclass(frozen=True)
class Layout:
    """`world` ranks over `nnodes` nodes, the same number on each; this process's node."""

    world: int
    nnodes: int
    node_rank: int

    @property
    def per_node(self) -> int:
        return self.world // self.nnodes

    @property
    def ranks(self) -> range:
        """This node's ranks."""
        return self.ranks_of(self.node_rank)

    def ranks_of(self, node: int) -> range:
        return range(node * self.per_node, (node + 1) * self.per_node)

    def node_of(self, rank: int) -> int:
        return rank // self.per_node

    def local(self, rank: int) -> int:
        """`rank`'s device index on its node."""
        return rank - self.node_of(rank) * self.per_node

    def describe(self, node: int) -> str:
        """`node 1 (rank 1)`, `node 1 (ranks 8-15)`."""
        ranks = self.ranks_of(node)
        if len(ranks) == 1:
            return f"node {node} (rank {ranks[0]})"
        return f"node {node} (ranks {ranks[0]}-{ranks[-1]})"


def model_digest(model_dir: Path) -> str:
    """A short digest of what a node would load: config.json's bytes and each weight file's
    name and size (not their bytes: hashing a 400 GB checkpoint at start-up costs minutes)."""
    digest = hashlib.sha256()
    config = model_dir / "config.json"
    digest.update(config.read_bytes() if config.is_file() else b"")
    for path in sorted(model_dir.glob("*.safetensors")) + sorted(model_dir.glob("*.bin")):
        digest.update(f"{path.name}:{path.stat().st_size}\n".encode())
    return digest.hexdigest()[:12]


def identity(
    model_id: str,
    model_dir: Path,
    revision: str | None,
    values: dict[str, Any],
    address: str | None = None,
) -> dict[str, str]:
    """What this node would load and how, as the other nodes compare it; `host` names it (its
    host name, and `address`, its address towards node 0: containers may share a name)."""
    files = model_digest(model_dir)
    return {
        "model": f"{model_id} (files {files})",
        "files": files,
        "revision": revision or "-",
        **{name: "-" if value is None else str(value) for name, value in values.items()},
        "tgis": __version__,
        "host": socket.gethostname() + (f" ({address})" if address else ""),
    }


def differences(base: dict[str, str], other: dict[str, str]) -> list[tuple[str, str, str]]:
    """(setting, node 0's, the other node's) for each identity setting they differ in. The
    model compares by its files' digest: the directory may differ between hosts."""
    found = []
    for name in IDENTITY_FLAGS:
        key = "files" if name == "model" else name  # the model by its files, not its path
        if base.get(key, "-") != other.get(key, "-"):
            found.append((name, base.get(name, "-"), other.get(name, "-")))
    return found


def resolve(host: str, timeout_s: float, flag: str = "--master-addr") -> list[Any]:
    """`host`'s addresses, waiting up to `timeout_s` for its name to resolve (a pod's DNS name
    appears a little after the pod); a NodeError naming it when it never does."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
        except socket.gaierror as exc:
            if time.monotonic() > deadline:
                raise NodeError(
                    f"{flag} {host} does not resolve ({exc.strerror}) after {timeout_s:g} s",
                    "set --master-addr (MASTER_ADDR) to node 0's address or a name every "
                    "node resolves",
                ) from None
            time.sleep(0.5)


def is_local_address(host: str, timeout_s: float = 0.0) -> bool:
    """Whether `host` names an address of this host (one a socket can bind here)."""
    for family, kind, proto, _, address in resolve(host, timeout_s):
        with socket.socket(family, kind, proto) as probe:
            try:
                probe.bind((address[0], 0, *address[2:]))
            except OSError:  # not ours (or not bindable as written: a scope-less link-local)
                continue
            return True
    return False


def address_towards(host: str, port: int) -> str | None:
    """This host's address on the route to `host` (the one packets to it leave from)."""
    try:
        family, _, _, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)[0]
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            probe.connect(address)  # no packet is sent: this only picks the route
            return str(probe.getsockname()[0])
    except OSError:
        return None


def interface_towards(host: str, port: int) -> str | None:
    """The name of the network interface this host reaches `host` through (the one holding the
    address the route to it leaves from); None where it cannot be told (IPv6 included)."""
    import fcntl
    import struct

    local = address_towards(host, port)
    if local is None or ":" in local:
        return None
    siocgifaddr = 0x8915
    try:
        names = [name for _, name in socket.if_nameindex()]
    except OSError:
        return None
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as query:
        for name in names:
            try:
                packed = fcntl.ioctl(
                    query.fileno(), siocgifaddr, struct.pack("256s", name.encode())
                )
            except OSError:  # no IPv4 address
                continue
            if socket.inet_ntoa(packed[20:24]) == local:
                return name
    return None


def socket_interface(
    env: Mapping[str, str],
    flag: str | None,
    master_addr: str,
    master_port: int,
    nnodes: int,
) -> dict[str, str]:
    """The variables that point gloo and NCCL at the interface the nodes talk over:
    --socket-ifname's where given; else none beside GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME as
    `env` has them; else, across nodes, gloo's at the interface towards node 0 (gloo otherwise
    binds the address the host name resolves to, which another host often cannot reach)."""
    if flag:
        return {"GLOO_SOCKET_IFNAME": flag, "NCCL_SOCKET_IFNAME": flag}
    if nnodes > 1 and "GLOO_SOCKET_IFNAME" not in env:
        found = interface_towards(master_addr, master_port)
        if found is not None:
            return {"GLOO_SOCKET_IFNAME": found}
    return {}


def host_store(addr: str, port: int, nnodes: int, timeout: timedelta) -> dist.TCPStore:
    """Node 0's rendezvous store, listening on --master-port; across nodes --master-addr must
    be an address of this host (else this is not node 0)."""
    if nnodes > 1 and not is_local_address(addr, timeout.total_seconds()):
        raise NodeError(
            f"--node-rank 0 serves at --master-addr {addr}, which is not an address of this "
            f"host ({socket.gethostname()})",
            "run node 0 on the host --master-addr names, and give this host its own "
            f"--node-rank (1 to {nnodes - 1})",
        )
    try:
        return dist.TCPStore(addr, port, None, True, timeout, wait_for_workers=False)
    except dist.DistNetworkError as exc:
        raise NodeError(
            f"the shards' rendezvous cannot listen on --master-port {port}: {exc}",
            "pick a free port with --master-port (MASTER_PORT), the same on every node",
        ) from None


def connect_store(addr: str, port: int, timeout: timedelta, node_rank: int) -> dist.TCPStore:
    """A client of node 0's store; a NodeError when node 0 does not answer in `timeout`."""
    resolve(addr, timeout.total_seconds())
    try:
        return dist.TCPStore(addr, port, None, False, timeout)
    except dist.DistError as exc:
        raise NodeError(
            f"node {node_rank} could not reach node 0 at --master-addr {addr} --master-port "
            f"{port} within {timeout.total_seconds():g} s: {str(exc).splitlines()[0]}",
            "start node 0 (`tgis serve --node-rank 0`) on that host, check that this host "
            "reaches it on that port, or wait longer with --join-timeout-s",
        ) from None


def gather_nodes(store: dist.Store, layout: Layout, mine: dict[str, str], timeout_s: float) -> None:
    """Node 0: say what it serves, wait for every node and compare it with this one. A
    NodeError, which every node that joined reports too (the error verdict), when one never
    came, two hosts claimed one node, or a node differs; else `publish_shape` follows."""
    store.set("node/0", json.dumps(mine))
    others = range(1, layout.nnodes)
    deadline = time.monotonic() + timeout_s
    error: NodeError | None = None
    while error is None:
        taken = [n for n in others if store.check([f"duplicate/{n}"])]
        if taken:
            second = store.get(f"duplicate/{taken[0]}").decode()
            first = store.get(f"claim/{taken[0]}").decode()
            error = NodeError(
                f"two hosts joined as node {taken[0]}: {first}, then {second}",
                "give each host its own --node-rank (NODE_RANK), 1 to "
                f"{layout.nnodes - 1}, then restart every node",
            )
            break
        missing = [n for n in others if not store.check([f"node/{n}"])]
        if not missing:
            break
        if time.monotonic() > deadline:
            error = NodeError(
                f"{_nodes(layout, missing)} never joined within --join-timeout-s {timeout_s:g}",
                f"start `tgis serve --nnodes {layout.nnodes} --node-rank N` with node 0's "
                "--master-addr and --master-port on each, or wait longer with --join-timeout-s",
            )
            break
        time.sleep(0.1)
    if error is None:
        found = []
        for node in others:
            theirs = json.loads(store.get(f"node/{node}"))
            found.extend((node, theirs["host"], *d) for d in differences(mine, theirs))
        if found:
            error = NodeError(
                "the nodes do not match: "
                + "; ".join(
                    f"{layout.describe(node)} on {host} has {name} {b}, node 0 on "
                    f"{mine['host']} has {a}"
                    for node, host, name, a, b in found
                ),
                "start every node with the same "
                + ", ".join(sorted({IDENTITY_FLAGS[name] for _, _, name, _, _ in found})),
            )
    if error is None:
        return
    store.set("verdict", json.dumps({"error": error.message, "hint": error.hint}))
    # The nodes that joined read it before node 0, and its store, are gone (a few seconds).
    joined = sum(store.check([f"node/{n}"]) for n in others)
    until = time.monotonic() + 5.0
    while store.add("read", 0) < joined and time.monotonic() < until:
        time.sleep(0.05)
    raise error


def publish_shape(store: dist.Store, shape: dict[str, Any]) -> None:
    """Node 0, every node checked and its watch beating: the ranks may build, with this shape."""
    store.set("verdict", json.dumps({"shape": shape}))


def report_failure(store: dist.Store, node: int, message: str) -> None:
    """Node `node` fails: the nodes that watch it read why (best effort: the store may be gone)."""
    with contextlib.suppress(dist.DistError):
        store.set(f"failed/{node}", message)


def announce_stop(store: dist.Store) -> None:
    """Node 0: the group is stopping on purpose; its store going away next is no failure."""
    with contextlib.suppress(dist.DistError):
        store.set("stopping", "1")


def join_nodes(
    store: dist.Store, layout: Layout, mine: dict[str, str], timeout_s: float
) -> dict[str, Any]:
    """Node R > 0: check the node rank against node 0's node count, claim it (a host that
    claims it again, restarted, takes it back), register, and wait for node 0's verdict; node
    0's shape settings, or the NodeError it found (the same words on every node)."""
    node = layout.node_rank
    try:
        store.set_timeout(timedelta(seconds=timeout_s + 30))
        theirs = json.loads(store.get("node/0"))
        if node >= int(theirs["nnodes"]):
            raise NodeError(
                f"--node-rank {node} is not a node of node 0's --nnodes {theirs['nnodes']} "
                f"(node 0 on {theirs['host']})",
                f"start every node with --nnodes {theirs['nnodes']}, each with its own "
                f"--node-rank from 1 to {int(theirs['nnodes']) - 1}",
            )
        claim = f"claim/{node}"
        held = store.compare_set(claim, "", mine["host"]).decode()
        if held != mine["host"]:
            store.set(f"duplicate/{node}", mine["host"])
            raise NodeError(
                f"node {node} has joined already, from {held}: --node-rank {node} is that host's",
                f"give this host its own --node-rank (1 to {layout.nnodes - 1})",
            )
        store.set(f"node/{node}", json.dumps(mine))
        verdict = json.loads(store.get("verdict"))
        store.add("read", 1)
    except dist.DistError as exc:
        raise NodeError(
            f"node {node} lost node 0's rendezvous while joining: {str(exc).splitlines()[0]}",
            "check node 0's log: it names what it waited for or refused",
        ) from None
    if "error" in verdict:
        raise NodeError(verdict["error"], verdict["hint"])
    return dict(verdict["shape"])


def _nodes(layout: Layout, nodes: Iterable[int]) -> str:
    return ", ".join(layout.describe(n) for n in nodes)


class NodeWatch:
    """Beats for this node on the store and watches the others': node 0 watches every other
    node (from a process of its own: ServerWatch), the others watch node 0. `on_lost` is called
    once, with the message, when a watched node has been silent for `timeout_s`, reported a
    failure, or (for the others) when node 0's store is gone, unless node 0 said it is stopping
    (`announce_stop`)."""

    def __init__(
        self,
        addr: str,
        port: int,
        layout: Layout,
        timeout_s: float,
        on_lost: Callable[[str], None],
    ) -> None:
        self.layout = layout
        self.timeout_s = timeout_s
        self.interval = min(BEAT_INTERVAL_S, timeout_s / 5)
        self.on_lost = on_lost
        self.where = f"{addr}:{port}"
        # Its own connection: a collective's long wait on the group's store must not hold it.
        self.store = connect_store(addr, port, timedelta(seconds=timeout_s), layout.node_rank)
        self.me = layout.node_rank
        self.watched = list(range(1, layout.nnodes)) if self.me == 0 else [0]
        now = time.monotonic()
        self.seen = {node: (-1, now) for node in self.watched}
        self.last_ok = now
        self.stopping = False  # node 0 is stopping: its store going away is no failure
        self.lost: str | None = None
        self._ended = threading.Event()
        self._lock = threading.Lock()
        threading.Thread(target=self._beat, name="tgis-node-beat", daemon=True).start()
        threading.Thread(target=self._check, name="tgis-node-watch", daemon=True).start()

    def stop(self) -> None:
        self._ended.set()

    def report_failure(self, message: str) -> None:
        """This node failed (one of its ranks): tell node 0 before going."""
        report_failure(self.store, self.me, message)

    def _beat(self) -> None:
        while not self._ended.wait(self.interval):
            try:
                self.store.add(f"beat/{self.me}", 1)
                for node in self.watched:
                    if self.store.check([f"failed/{node}"]):
                        failure = self.store.get(f"failed/{node}").decode()
                        self._lose(f"{self.layout.describe(node)} failed: {failure}")
                        return
                    count = self.store.add(f"beat/{node}", 0)
                    if count != self.seen[node][0]:
                        self.seen[node] = (count, time.monotonic())
                if self.me != 0 and self.store.check(["stopping"]):
                    self.stopping = True
                self.last_ok = time.monotonic()
            except dist.DistError as exc:
                if self.me != 0 and not self.stopping:
                    self._lose(
                        f"node 0 (rank 0, the server at {self.where}) is gone: "
                        f"{str(exc).splitlines()[0]}"
                    )
                return

    def _check(self) -> None:
        while not self._ended.wait(self.interval):
            now = time.monotonic()
            if now - self.last_ok > self.timeout_s and not self.stopping:
                target = "node 0's store" if self.me != 0 else "the rendezvous store"
                self._lose(
                    f"{target} at {self.where} has not answered for {self.timeout_s:g} s "
                    f"(--node-timeout-s)"
                )
                return
            for node, (_, when) in self.seen.items():
                if now - when > self.timeout_s and not self.stopping:
                    self._lose(
                        f"{self.layout.describe(node)} has been silent for {self.timeout_s:g} s "
                        "(--node-timeout-s): its host is down, unreachable or its process gone"
                    )
                    return

    def _lose(self, message: str) -> None:
        with self._lock:
            if self.lost is not None or self._ended.is_set():
                return
            self.lost = message
        self._ended.set()
        self.on_lost(message)


class ServerWatch:
    """Node 0's NodeWatch, in a process of its own: the server's process may hold its
    interpreter's lock for long stretches (a tokenizer's grammar tables for a large vocabulary
    take tens of seconds), and a beat that waits for it would read as a lost node 0. When a node
    is lost, the watch logs why, tells the other nodes, and kills the server (whose step may be
    stuck in a collective with the lost node); it exits with the server. Should the watch itself
    end, `on_failure` ends the server (nothing would notice a lost node)."""

    def __init__(
        self,
        store: dist.Store,
        settings: tuple[str, int, Layout, float],
        on_failure: Callable[[str], None],
    ) -> None:
        import multiprocessing

        context = multiprocessing.get_context("spawn")
        self.process = context.Process(
            target=_server_watch_main, args=(*settings, os.getpid()), name="tgis-node-watch",
            daemon=True,
        )  # fmt: skip
        self.process.start()
        self._stopped = threading.Event()
        # Beating before the nodes are told to build: their watch of node 0 starts then.
        deadline = time.monotonic() + 120.0
        while store.add("beat/0", 0) == 0:
            if self.process.exitcode is not None or time.monotonic() > deadline:
                self.stop()
                raise NodeError(
                    f"node 0's watch did not start (exit code {self.process.exitcode})",
                    "see the log above; the watch connects to the rendezvous at "
                    "--master-addr:--master-port",
                )
            time.sleep(0.05)
        self._on_failure = on_failure
        threading.Thread(target=self._guard, name="tgis-node-watch-guard", daemon=True).start()

    def _guard(self) -> None:
        while not self._stopped.wait(1.0):
            if self.process.exitcode is not None and not self._stopped.is_set():
                self._on_failure(f"node 0's watch of the nodes exited ({self.process.exitcode})")
                return

    def stop(self) -> None:
        """No more watching: the group is stopping on purpose (or never started)."""
        self._stopped.set()
        if self.process.is_alive():
            self.process.kill()
        self.process.join(5.0)


def _server_watch_main(addr: str, port: int, layout: Layout, timeout_s: float, server: int) -> None:
    import signal

    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    watches: list[NodeWatch] = []

    def lost(message: str) -> None:
        log.error("%s: the server stops", message)
        if watches:  # told within a second, or not at all: the server stops regardless
            telling = threading.Thread(target=watches[0].report_failure, args=(message,))
            telling.daemon = True
            telling.start()
            telling.join(1.0)
        os.kill(server, signal.SIGKILL)
        os._exit(1)

    watches.append(NodeWatch(addr, port, layout, timeout_s, lost))
    while os.getppid() == server:
        time.sleep(0.5)
    os._exit(0)


__all__ = [
    "Layout",
    "NodeWatch",
    "ServerWatch",
    "address_towards",
    "announce_stop",
    "connect_store",
    "gather_nodes",
    "host_store",
    "identity",
    "join_nodes",
    "publish_shape",
    "report_failure",
    "socket_interface",
]
