"""The nodes of multi-node tensor parallelism, in one process: the rank layout, the identity
nodes compare, the join (verdict, mismatch, duplicate, timeout) over a real TCPStore, and the
watch that ends a group when a node falls silent, fails or its server goes."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from tgis.backends.paged.nodes import (
    Layout,
    NodeWatch,
    connect_store,
    differences,
    gather_nodes,
    host_store,
    identity,
    interface_towards,
    is_local_address,
    join_nodes,
    model_digest,
    publish_shape,
    resolve,
    socket_interface,
)
from tgis.benchmark.engine_mode import free_port
from tgis.errors import NodeError

SHAPE = {"max_sequences": 8, "kv_tokens": 4096}


def test_layout_numbers_ranks_node_by_node() -> None:
    layout = Layout(world=16, nnodes=2, node_rank=1)
    assert layout.per_node == 8 and layout.ranks == range(8, 16)
    assert [layout.node_of(r) for r in (0, 7, 8, 15)] == [0, 0, 1, 1]
    assert [layout.local(r) for r in (0, 7, 8, 15)] == [0, 7, 0, 7]
    assert layout.describe(1) == "node 1 (ranks 8-15)"
    assert Layout(2, 2, 0).describe(1) == "node 1 (rank 1)"


def _model(path: Path, eps: float = 1e-6, weights: bytes = b"x" * 10) -> Path:
    path.mkdir()
    (path / "config.json").write_text(json.dumps({"model_type": "llama", "rms_norm_eps": eps}))
    (path / "model.safetensors").write_bytes(weights)
    (path / "tokenizer.json").write_text("{}")
    return path


def test_the_model_is_known_by_its_config_and_weight_files(tmp_path: Path) -> None:
    base = model_digest(_model(tmp_path / "a"))
    assert model_digest(_model(tmp_path / "b")) == base  # another directory, the same files
    assert model_digest(_model(tmp_path / "c", eps=1e-5)) != base
    assert model_digest(_model(tmp_path / "d", weights=b"x" * 11)) != base
    copy = shutil.copytree(tmp_path / "a", tmp_path / "e")
    (copy / "tokenizer.json").write_text('{"changed": true}')  # not what the shards load
    assert model_digest(copy) == base


def test_differences_name_each_setting_and_compare_models_by_their_files(tmp_path: Path) -> None:
    values = {"device": "cpu", "dtype": "float32", "num_shard": 2, "nnodes": 2, "quantize": None}
    a = identity("org/model", _model(tmp_path / "a"), None, values)
    b = identity("/mnt/model", _model(tmp_path / "b"), None, values)
    assert a["quantize"] == "-" and differences(a, b) == []  # paths differ, files do not
    c = identity("org/model", _model(tmp_path / "c", eps=1e-5), "v2", {**values, "dtype": "bf16"})
    found = {name: (x, y) for name, x, y in differences(a, c)}
    assert set(found) == {"model", "revision", "dtype"}
    assert found["dtype"] == ("float32", "bf16") and found["revision"] == ("-", "v2")


def test_addresses_of_this_host() -> None:
    assert is_local_address("127.0.0.1")
    assert not is_local_address("192.0.2.1")  # TEST-NET-1: nobody's
    with pytest.raises(NodeError, match=r"--master-addr nohost\.invalid does not resolve"):
        resolve("nohost.invalid", 0.0)
    assert interface_towards("127.0.0.1", 29500) == "lo"


def test_the_socket_interface_the_shards_use() -> None:
    named = socket_interface({}, "eth7", "10.0.0.1", 29500, nnodes=2)
    assert named == {"GLOO_SOCKET_IFNAME": "eth7", "NCCL_SOCKET_IFNAME": "eth7"}
    given = {"GLOO_SOCKET_IFNAME": "ib0"}
    assert socket_interface(given, None, "127.0.0.1", 29500, nnodes=2) == {}  # passes through
    assert socket_interface({}, None, "127.0.0.1", 29500, nnodes=1) == {}  # gloo's own choice
    towards = socket_interface({}, None, "127.0.0.1", 29500, nnodes=2)
    assert towards == {"GLOO_SOCKET_IFNAME": "lo"}  # the interface towards node 0


@pytest.fixture
def store() -> Any:
    return host_store("127.0.0.1", free_port(), 1, timedelta(seconds=10))


def _mine(host: str, **changes: str) -> dict[str, str]:
    base = {"model": "m (files abc)", "files": "abc", "revision": "-", "dtype": "float32",
            "num_shard": "4", "nnodes": "2", "tgis": "0.1.0", "host": host}  # fmt: skip
    return {**base, **changes}


def _client(store: Any) -> Any:
    """Another host's connection to node 0's store."""
    return connect_store("127.0.0.1", store.port, timedelta(seconds=10), 1)


def _in_thread(work: Any) -> tuple[threading.Thread, list[Any]]:
    out: list[Any] = []

    def run() -> None:
        try:
            out.append(work())
        except Exception as exc:
            out.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    return thread, out


def test_nodes_that_match_get_node_0s_shape(store: Any) -> None:
    thread, out = _in_thread(lambda: join_nodes(_client(store), Layout(4, 2, 1), _mine("b"), 10))
    gather_nodes(store, Layout(4, 2, 0), _mine("a"), 10)
    assert not out  # no verdict before node 0's watch beats
    publish_shape(store, SHAPE)
    thread.join(10)
    assert out == [SHAPE]


def test_a_mismatch_is_named_on_every_node(store: Any) -> None:
    theirs = _mine("b", model="other (files def)", files="def", dtype="bfloat16")
    thread, out = _in_thread(lambda: join_nodes(_client(store), Layout(4, 2, 1), theirs, 10))
    with pytest.raises(NodeError) as raised:
        gather_nodes(store, Layout(4, 2, 0), _mine("a"), 10)
    thread.join(10)
    (remote,) = out
    assert isinstance(remote, NodeError) and str(remote) == str(raised.value)
    assert raised.value.message == (
        "the nodes do not match: node 1 (ranks 2-3) on b has model other (files def), node 0 on "
        "a has m (files abc); node 1 (ranks 2-3) on b has dtype bfloat16, node 0 on a has float32"
    )
    assert raised.value.hint == "start every node with the same --dtype, --model-id"


def test_start_up_names_the_nodes_that_never_came(store: Any) -> None:
    joined, out = _in_thread(
        lambda: join_nodes(_client(store), Layout(3, 3, 2), _mine("c", nnodes="3"), 5)
    )
    with pytest.raises(NodeError) as raised:
        gather_nodes(store, Layout(3, 3, 0), _mine("a", nnodes="3"), 0.5)
    joined.join(10)
    assert raised.value.message == "node 1 (rank 1) never joined within --join-timeout-s 0.5"
    assert str(out[0]) == str(raised.value)  # the node that came says it too


def test_a_node_outside_node_0s_count_refuses_itself(store: Any) -> None:
    store.set("node/0", json.dumps(_mine("a")))  # node 0: 2 nodes
    with pytest.raises(NodeError) as raised:
        join_nodes(_client(store), Layout(8, 4, 3), _mine("d", nnodes="4"), 5)
    assert (
        raised.value.message == "--node-rank 3 is not a node of node 0's --nnodes 2 (node 0 on a)"
    )
    assert raised.value.hint == (
        "start every node with --nnodes 2, each with its own --node-rank from 1 to 1"
    )
    assert not store.check(["claim/3"])


def test_a_second_host_claiming_a_node_is_refused_on_both_and_a_restart_is_not(
    store: Any,
) -> None:
    store.set("node/0", json.dumps(_mine("a")))
    layout = Layout(2, 2, 1)
    store.set("claim/1", "b (10.0.0.2)")  # another host joined as node 1
    with pytest.raises(NodeError, match=r"node 1 has joined already, from b \(10\.0\.0\.2\)"):
        join_nodes(_client(store), layout, _mine("c (10.0.0.3)"), 1)
    with pytest.raises(NodeError) as raised:
        gather_nodes(store, Layout(2, 2, 0), _mine("a"), 5)
    assert raised.value.message == "two hosts joined as node 1: b (10.0.0.2), then c (10.0.0.3)"


def test_a_restarted_node_takes_its_claim_back(store: Any) -> None:
    store.set("node/0", json.dumps(_mine("a")))
    store.set("claim/1", "b (10.0.0.2)")  # its earlier run, from the same host and address
    thread, out = _in_thread(
        lambda: join_nodes(_client(store), Layout(2, 2, 1), _mine("b (10.0.0.2)"), 10)
    )
    gather_nodes(store, Layout(2, 2, 0), _mine("a"), 10)
    publish_shape(store, SHAPE)
    thread.join(10)
    assert out == [SHAPE]


class Lost:
    def __init__(self) -> None:
        self.messages: list[str] = []
        self.event = threading.Event()

    def __call__(self, message: str) -> None:
        self.messages.append(message)
        self.event.set()


def test_a_silent_node_is_lost_within_the_timeout(store: Any) -> None:
    lost0, lost1 = Lost(), Lost()
    watch1 = NodeWatch("127.0.0.1", store.port, Layout(2, 2, 1), 1.0, lost1)
    watch0 = NodeWatch("127.0.0.1", store.port, Layout(2, 2, 0), 1.0, lost0)
    time.sleep(1.5)
    assert lost0.messages == [] and lost1.messages == []  # both beat
    watch1.stop()
    assert lost0.event.wait(10)  # a bound on a hang: the message says which timeout fired
    assert lost0.messages == [
        "node 1 (rank 1) has been silent for 1 s (--node-timeout-s): its host is down, "
        "unreachable or its process gone"
    ]
    watch0.stop()


def test_a_node_that_fails_is_reported_at_once(store: Any) -> None:
    lost0 = Lost()
    watch1 = NodeWatch("127.0.0.1", store.port, Layout(4, 2, 1), 30.0, Lost())
    watch0 = NodeWatch("127.0.0.1", store.port, Layout(4, 2, 0), 30.0, lost0)
    watch1.report_failure("rank 3 on node 1 failed: RuntimeError: out of memory")
    assert lost0.event.wait(5)
    assert lost0.messages == [
        "node 1 (ranks 2-3) failed: rank 3 on node 1 failed: RuntimeError: out of memory"
    ]
    watch0.stop()
    watch1.stop()


SERVER = """
import sys, time
from datetime import timedelta
import torch.distributed as dist
store = dist.TCPStore("127.0.0.1", int(sys.argv[1]), None, True, timedelta(seconds=30),
                      wait_for_workers=False)
if sys.argv[2] == "stopping":
    store.set("stopping", "1")
print("up", flush=True)
time.sleep(60)
"""


@pytest.mark.parametrize("stopping", [False, True])
def test_the_other_nodes_end_when_node_0_is_gone_unless_it_stopped(stopping: bool) -> None:
    port = free_port()
    server = subprocess.Popen(
        [sys.executable, "-c", SERVER, str(port), "stopping" if stopping else "serving"],
        stdout=subprocess.PIPE, env={**os.environ, "TORCH_CPP_LOG_LEVEL": "ERROR"},
    )  # fmt: skip
    try:
        assert server.stdout is not None and server.stdout.readline().strip() == b"up"
        lost = Lost()
        watch = NodeWatch("127.0.0.1", port, Layout(2, 2, 1), 2.0, lost)
        time.sleep(1.0)  # a beat or two: it has seen node 0 (and whether it stops)
        server.kill()
        server.wait(10)
        if stopping:
            assert not lost.event.wait(4)
        else:
            assert lost.event.wait(4)
            assert lost.messages[0].startswith(
                f"node 0 (rank 0, the server at 127.0.0.1:{port}) is gone"
            )
        watch.stop()
    finally:
        server.kill()


def test_cpu_shards_share_the_hosts_cores_unless_omp_num_threads_says() -> None:
    from tgis.backends.common.device import cpu_threads
    from tgis.backends.paged.tensor_parallel import shard_threads

    assert shard_threads(1, {}) == cpu_threads()
    assert shard_threads(cpu_threads() * 2, {}) == 1
    assert shard_threads(1, {"OMP_NUM_THREADS": "1"}) == 1
    assert shard_threads(1, {"OMP_NUM_THREADS": "4096"}) == cpu_threads()  # never more
    assert shard_threads(1, {"OMP_NUM_THREADS": "4,2"}) == cpu_threads()  # nested: not a count


def test_node_0_beats_while_the_server_holds_its_interpreter(store: Any) -> None:
    """The server's process may hold Python's lock for long stretches (a large vocabulary's
    grammar tables): node 0's beat runs in a process of its own and goes on meanwhile."""
    import re

    from tgis.backends.paged.nodes import ServerWatch

    failures: list[str] = []
    watch = ServerWatch(store, ("127.0.0.1", store.port, Layout(2, 2, 0), 120.0), failures.append)
    try:
        before = store.add("beat/0", 0)
        began = time.monotonic()
        # The regex engine keeps the lock throughout a match; matches back to back hold it
        # for 3 s in all, however fast this machine's are.
        while time.monotonic() - began < 3:
            re.match(r"(a+)+$", "a" * 22 + "b")
        held = time.monotonic() - began
        assert store.add("beat/0", 0) - before >= int(held) - 1
        # The watch going (it never should) ends the server: nothing would see a lost node.
        watch.process.kill()
        deadline = time.monotonic() + 10
        while not failures:
            assert time.monotonic() < deadline
            time.sleep(0.1)
        assert failures[0].startswith("node 0's watch of the nodes exited (")
    finally:
        watch.stop()
