"""`tgis serve --num-shard 2 --nnodes 2` across two hosts, played by two network namespaces
joined by a veth pair with private addresses: node 0 serves HTTP and gRPC in one, node 1 runs
its shard in the other. The answers are one device's; a node that dies ends the other within
--node-timeout-s, naming it; a node that does not match, or claims the wrong rank, is refused
when it joins. Needs root and iproute2 (skips with the reason elsewhere)."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.netns import Hosts, two_hosts, unavailable
from tests.shards import PARAMETERS, PROMPTS, one_shard_answers
from tgis.benchmark.engine_mode import free_port

NODE_TIMEOUT_S = 8
# What ends a server after its node is lost: the silence bound plus a beat, the log written.
LOST_BOUND_S = NODE_TIMEOUT_S + 7


pytestmark = pytest.mark.skipif((reason := unavailable()) is not None, reason=reason or "")


@pytest.fixture(scope="module")
def hosts() -> Iterator[Hosts]:
    with two_hosts() as made:
        yield made


class Node:
    """One `tgis serve` of the group, run in a namespace; its output gathered in a file."""

    def __init__(self, command: list[str], log: Path) -> None:
        self.log = log
        env = {**os.environ, "WARMUP_ENABLED": "false", "PYTHONUNBUFFERED": "1"}
        self.out = log.open("wb")
        self.proc = subprocess.Popen(command, env=env, stdout=self.out, stderr=subprocess.STDOUT)

    def text(self) -> str:
        """What it wrote, its lines unwrapped (rich folds long lines to the terminal)."""
        return re.sub(r"\s+", " ", self.log.read_text(errors="replace"))

    def wait_for(self, needle: str, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while needle not in self.log.read_text(errors="replace"):
            if self.proc.poll() is not None:
                pytest.fail(f"the node exited ({self.proc.returncode}): {self.text()[-3000:]}")
            assert time.monotonic() < deadline, f"no {needle!r} in: {self.text()[-3000:]}"
            time.sleep(0.3)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self.out.close()


class Group:
    """The nodes a test starts, stopped (killed where still running) at its end."""

    def __init__(self, hosts: Hosts, model_dir: Path, workdir: Path) -> None:
        self.hosts, self.model_dir, self.workdir = hosts, model_dir, workdir
        self.master_port = free_port()
        self.http_port, self.grpc_port = free_port(), free_port()
        self.nodes: list[Node] = []

    def start(self, host: int, rank: int, *extra: str, model: Path | None = None) -> Node:
        args = [
            "--model-id", str(model or self.model_dir), "--backend", "cpu",
            "--dtype", "float32", "--num-shard", "2", "--nnodes", "2",
            "--node-rank", str(rank), "--master-addr", self.hosts.addresses[0],
            "--master-port", str(self.master_port), "--max-total-tokens", "256",
            "--node-timeout-s", str(NODE_TIMEOUT_S), "--join-timeout-s", "120",
            "--port", str(self.http_port), "--grpc-port", str(self.grpc_port), *extra,
        ]  # fmt: skip
        log = self.workdir / f"node{len(self.nodes)}-host{host}-rank{rank}.log"
        node = Node(self.hosts.run(host, [sys.executable, "-m", "tgis", "serve", *args]), log)
        self.nodes.append(node)
        return node

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()


@pytest.fixture
def group(hosts: Hosts, demo_model_dir: Path, tmp_path: Path) -> Iterator[Group]:
    started = Group(hosts, demo_model_dir, tmp_path)
    try:
        yield started
    finally:
        started.stop()


CLIENT = """
import json, sys
import grpc, httpx
from tgis.fmaas import generation_pb2 as pb, generation_pb2_grpc as pb_grpc
port, grpc_port, prompts, parameters = json.loads(sys.argv[1])
url = f"http://127.0.0.1:{port}"
http = [httpx.post(f"{url}/generate", json={"inputs": p, "parameters": parameters},
                   timeout=120).json()["generated_text"] for p in prompts]
with grpc.insecure_channel(f"127.0.0.1:{grpc_port}") as channel:
    stub = pb_grpc.GenerationServiceStub(channel)
    request = pb.BatchedGenerationRequest(
        requests=[pb.GenerationRequest(text=p) for p in prompts],
        params=pb.Parameters(stopping=pb.StoppingCriteria(max_new_tokens=12)))
    grpc_texts = [r.text for r in stub.Generate(request, timeout=120).responses]
info = httpx.get(f"{url}/info", timeout=30).json()
print(json.dumps({"http": http, "grpc": grpc_texts, "info": info}))
"""


def ask(group: Group) -> dict[str, object]:
    """HTTP and gRPC answers to PROMPTS from node 0, asked from inside its namespace."""
    payload = json.dumps([group.http_port, group.grpc_port, PROMPTS, PARAMETERS])
    done = subprocess.run(
        group.hosts.run(0, [sys.executable, "-c", CLIENT, payload]),
        capture_output=True, text=True, timeout=300, cwd=Path(__file__).resolve().parents[1],
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


def serving(group: Group) -> tuple[Node, Node]:
    """Node 0 (gloo's interface found from the route to --master-addr) and node 1 (its
    interface named), up and serving."""
    first = group.start(0, 0)
    second = group.start(1, 1, "--socket-ifname", group.hosts.interfaces[1])
    first.wait_for("Application startup complete", 240)
    return first, second


@pytest.fixture(scope="module")
def one_shard(demo_model_dir: Path) -> list[str]:
    return one_shard_answers(demo_model_dir)


def test_two_nodes_answer_as_one_device_and_stop_together(
    group: Group, one_shard: list[str]
) -> None:
    first, second = serving(group)
    answers = ask(group)
    assert answers["http"] == one_shard
    # gRPC stops at EOS (the HTTP requests ignore it): the same text up to there.
    texts = answers["grpc"]
    assert isinstance(texts, list)
    assert all(one.startswith(text) for one, text in zip(one_shard, texts, strict=True))
    runtime = answers["info"]["runtime"]  # type: ignore[index]
    assert (runtime["shards"], runtime["nodes"], runtime["shards_per_node"]) == (2, 2, 1)
    assert "node 1 (rank 1) runs its shards" in second.text()
    # SIGTERM to every node at once (the group deleted): node 1 waits for node 0 to drain and
    # stop the shards; all exit 0.
    second.proc.send_signal(signal.SIGTERM)
    first.proc.send_signal(signal.SIGTERM)
    assert first.proc.wait(60) == 0
    assert second.proc.wait(30) == 0, second.text()[-2000:]


def test_a_lost_node_ends_the_server_naming_it(group: Group) -> None:
    first, second = serving(group)
    second.proc.kill()
    code = first.proc.wait(LOST_BOUND_S + 10)  # the node timeout ends it; this only bounds a hang
    assert code != 0
    assert re.search(r"node 1 \(rank 1\) .*the server stops", first.text()), first.text()[-2000:]


def test_a_lost_server_ends_the_other_nodes_naming_it(group: Group) -> None:
    first, second = serving(group)
    first.proc.kill()
    code = second.proc.wait(LOST_BOUND_S + 10)  # as above: a bound on a hang, not a window
    assert code != 0
    assert "node 0 (rank 0, the server at" in second.text(), second.text()[-2000:]


def test_an_unreachable_node_ends_the_server_and_itself(
    demo_model_dir: Path, tmp_path: Path
) -> None:
    """The link between the hosts goes down: no connection closes, nothing answers. (Hosts of
    its own: the link stays down.)"""
    with two_hosts() as hosts:
        group = Group(hosts, demo_model_dir, tmp_path)
        try:
            first, second = serving(group)
            subprocess.run(["ip", "-n", hosts.names[1], "link", "set", hosts.interfaces[1],
                            "down"], check=True)  # fmt: skip
            assert first.proc.wait(LOST_BOUND_S + 10) != 0
            assert second.proc.wait(LOST_BOUND_S + 10) != 0
        finally:
            group.stop()
    assert "node 1 (rank 1) has been silent for 8 s" in first.text(), first.text()[-2000:]
    # The second node hears nothing more of node 0 either way: its store stops answering, or
    # its heartbeats stop; whichever of the two the watch checks first when 8 s have passed.
    assert re.search(
        r"node 0's store at \S+ has not answered for 8 s|node 0 \(rank 0\) has been silent "
        r"for 8 s",
        second.text(),
    ), second.text()[-2000:]


def test_a_node_with_another_model_is_refused_on_every_node(
    group: Group, demo_model_dir: Path, tmp_path: Path
) -> None:
    other = tmp_path / "other-model"
    shutil.copytree(demo_model_dir, other)
    config = json.loads((other / "config.json").read_text())
    config["rms_norm_eps"] = config.get("rms_norm_eps", 1e-6) * 2  # another model's settings
    (other / "config.json").write_text(json.dumps(config))
    first = group.start(0, 0)
    second = group.start(1, 1, "--dtype", "bfloat16", model=other)
    assert first.proc.wait(120) != 0 and second.proc.wait(120) != 0
    for node in (first, second):
        text = node.text()
        assert "the nodes do not match: node 1 (rank 1)" in text, text[-2000:]
        assert "has model" in text and "has dtype bfloat16, node 0" in text
        assert "start every node with the same --dtype, --model-id" in text


def test_a_wrong_node_rank_is_refused_when_it_joins(group: Group) -> None:
    # Node 0 runs where --master-addr points; a host elsewhere claiming it is refused.
    impostor = group.start(1, 0)
    assert impostor.proc.wait(120) != 0
    text = impostor.text()
    assert (
        f"--node-rank 0 serves at --master-addr {group.hosts.addresses[0]}, which is not "
        "an address of this host" in text
    ), text[-2000:]
    # Two hosts claiming node 1: the second is refused, and node 0 names it.
    first = group.start(0, 0)
    second = group.start(1, 1)
    second.wait_for("runs its shards", 120)
    again = group.start(0, 1)
    assert again.proc.wait(120) != 0
    claimed = re.escape(f"({group.hosts.addresses[1]})")
    assert re.search(f"node 1 has joined already, from \\S+ {claimed}: --node-rank 1 is that "
                     "host's", again.text()), again.text()[-2000:]  # fmt: skip
    first.wait_for("Application startup complete", 240)  # the group itself serves on


def test_start_up_names_the_node_that_never_came(group: Group) -> None:
    alone = group.start(0, 0, "--join-timeout-s", "3")
    assert alone.proc.wait(120) != 0
    assert "node 1 (rank 1) never joined within --join-timeout-s 3" in alone.text()
    orphan = group.start(1, 1, "--join-timeout-s", "3")
    assert orphan.proc.wait(120) != 0
    assert "node 1 could not reach node 0 at --master-addr" in orphan.text()
