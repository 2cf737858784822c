"""Tensor parallelism for the paged engine over torch.distributed.

`--num-shard N` runs N processes, one per device, in one torch.distributed group (NCCL on
cuda, gloo on cpu). Each loads only its slices of the weights from the safetensors files:
q/k/v by KV-head groups (with more ranks than KV heads, each KV head on world / kv ranks,
their query heads its group) and gate/up by rows (column-parallel; a checkpoint's fused qkv_proj
and gate_up_proj sliced part by part), o and down by columns (row-parallel, an all-reduce
after each), every expert's MLP the same way by its own width (each rank holds a slice of
every expert, the router whole), the embedding and lm_head by vocabulary rows (an all-reduce
after the embedding, an all-gather of the logits). Its KV pool holds its KV heads.

Rank 0 is the server: scheduler, HTTP/gRPC and sampling. Every step it broadcasts the step
(`TensorParallelBackend.forward`) and the other ranks (`worker_main`) run the same forward,
whose collectives line the ranks up. A rank that fails, or dies, ends the server with a
message naming the rank and its error (`ShardGroup` watches them); SIGTERM stops them all.
"""

from __future__ import annotations

import json
import logging
import math
import multiprocessing
import os
import sys
import threading
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from tgis.backends.common.quant import Quantization
from tgis.backends.common.quant_checkpoint import (
    Checkpoint,
    attach_stored,
    empty_model,
    finish,
    float_state,
)
from tgis.backends.models.families import family_of
from tgis.backends.models.parallel import TensorParallel
from tgis.backends.paged.nodes import (
    SHAPE_FIELDS,
    Layout,
    NodeWatch,
    ServerWatch,
    address_towards,
    announce_stop,
    connect_store,
    gather_nodes,
    host_store,
    identity,
    join_nodes,
    publish_shape,
    report_failure,
    socket_interface,
)
from tgis.config import ServeConfig
from tgis.config.checkpoint_quant import checkpoint_scheme
from tgis.config.env import default_env, set_variables
from tgis.engine.backend import (
    BackendCapacity,
    FedTokens,
    PackedItem,
    PackedOutput,
    Shape,
    ShapeTiming,
)
from tgis.engine.types import ImageInput
from tgis.errors import ConfigError, NodeError

log = logging.getLogger("tgis.backends.paged.tensor_parallel")

# How long a collective may wait for a rank before the group gives up (a dead rank otherwise
# hangs the others): beyond any step, short enough to end a broken server.
COLLECTIVE_TIMEOUT = timedelta(minutes=10)


# The per-expert and shared-expert MLP widths of the mixture-of-experts families' configs.
EXPERT_WIDTHS = ("moe_intermediate_size", "shared_expert_intermediate_size")


def shard_unsupported_reason(
    config: dict[str, Any], world: int, group: int | None = None
) -> str | None:
    """Why a config.json of a family the paged forward runs cannot be split `world` ways, or
    None: every width a rank takes a share of (heads, KV heads, the MLP's and each expert's)
    must divide; with int4's `group`, each rank's share of a row-parallel projection's input
    (o's, down's) must hold whole groups."""
    family = family_of(config)
    if family is not None and family.unshardable is not None and world > 1:
        return f"{family.unshardable}; --num-shard can be 1"
    heads = config.get("num_attention_heads")
    kv = config.get("num_key_value_heads") or heads
    ffn = config.get("intermediate_size")
    if not isinstance(heads, int) or not isinstance(kv, int) or not isinstance(ffn, int):
        return "its config.json lacks num_attention_heads / intermediate_size"
    widths = [ffn, *(config[k] for k in EXPERT_WIDTHS if isinstance(config.get(k), int))]
    valid = [
        n
        for n in range(1, heads + 1)
        if (kv % n == 0 or n % kv == 0) and heads % n == 0 and all(w % n == 0 for w in widths)
    ]
    if world not in valid:
        mlp = "/".join(str(w) for w in widths)
        return (
            f"{world} shards must divide its {heads} attention heads and {mlp}-wide MLP, and "
            f"divide its {kv} KV heads or be a multiple of them (each KV head then held by as "
            f"many shards); --num-shard can be {', '.join(map(str, valid))}"
        )
    if group is not None:
        head_dim = config.get("head_dim") or config.get("hidden_size", 0) // heads
        inputs = [heads * head_dim // world, *(w // world for w in widths)]
        split = [i for i in inputs if i % group]
        if split:
            return (
                f"each of {world} shards takes {split[0]} input columns of a row-parallel "
                f"projection, not whole int4 groups of {group}; --quantize-group-size can be "
                f"one dividing {', '.join(map(str, sorted(set(inputs))))}, or --num-shard lower"
            )
    return None


def local_config(config: Any, world: int) -> Any:
    """The config of one rank's part of the model (same head size and hidden size)."""
    local = config.__class__.from_dict(config.to_dict())
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    local.head_dim = head_dim
    local.num_attention_heads = config.num_attention_heads // world
    # More ranks than KV heads: each rank holds one, replicated over world / kv ranks.
    local.num_key_value_heads = max(
        1, (config.num_key_value_heads or config.num_attention_heads) // world
    )
    local.intermediate_size = config.intermediate_size // world
    for width in EXPERT_WIDTHS:
        if isinstance(getattr(config, width, None), int):
            setattr(local, width, getattr(config, width) // world)
    local.vocab_size = math.ceil(config.vocab_size / world)
    return local


# A slice of a parameter: the dimension, and the (start, stop) ranges along it this rank
# takes, concatenated in order (several for projections a checkpoint fuses).
Slice = tuple[int, tuple[tuple[int, int], ...]]


def _share(rank: int, width: int, offset: int = 0) -> tuple[int, int]:
    """Rank `rank`'s range of a width split evenly, `offset` into the tensor."""
    return offset + rank * width, offset + (rank + 1) * width


def _kv_share(rank: int, world: int, kv: int, head_dim: int, offset: int = 0) -> tuple[int, int]:
    """Rank `rank`'s rows of a KV projection (`offset` into the tensor): its kv / world heads,
    or, with more ranks than KV heads, the one head its run of world / kv ranks shares (their
    query heads are that head's group)."""
    if world <= kv:
        return _share(rank, kv // world * head_dim, offset)
    return _share(rank // (world // kv), head_dim, offset)


def _slice_of(name: str, config: Any, rank: int, world: int) -> Slice | None:
    """What of parameter `name` rank `rank` holds; None: all of it. q/k/v (and a fused
    qkv_proj) by heads (k/v's replicated where ranks outnumber KV heads), gate/up (and a fused gate_up_proj) by the MLP's columns, o and down by
    rows of their input; an expert's MLP by its own width, the shared expert's by its; OLMo 2's
    q/k norms (over the whole projection) as q and k; router and per-head norms whole."""
    heads = config.num_attention_heads
    kv = config.num_key_value_heads or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    rows = math.ceil(config.vocab_size / world)
    q = heads // world * head_dim
    ffn = config.intermediate_size
    if ".experts." in name:
        ffn = getattr(config, "moe_intermediate_size", None) or ffn
    elif ".shared_expert." in name:
        ffn = config.shared_expert_intermediate_size
    part = ffn // world
    parts = name.split(".")
    leaf = ".".join(parts[-2:])
    module = parts[-2] if len(parts) > 1 else ""
    if module == "q_proj" or (module == "q_norm" and config.model_type == "olmo2"):
        return 0, (_share(rank, q),)
    if module in ("k_proj", "v_proj") or (module == "k_norm" and config.model_type == "olmo2"):
        return 0, (_kv_share(rank, world, kv, head_dim),)
    if module == "qkv_proj":
        total_q = heads * head_dim
        return 0, (
            _share(rank, q),
            _kv_share(rank, world, kv, head_dim, total_q),
            _kv_share(rank, world, kv, head_dim, total_q + kv * head_dim),
        )
    if leaf == "o_proj.weight":
        return 1, (_share(rank, q),)
    if module in ("gate_proj", "up_proj", "w1", "w3"):
        return 0, (_share(rank, part),)
    if module == "gate_up_proj":
        return 0, (_share(rank, part), _share(rank, part, ffn))
    if leaf in ("down_proj.weight", "w2.weight"):
        return 1, (_share(rank, part),)
    if name in ("model.embed_tokens.weight", "lm_head.weight"):
        return 0, (_share(rank, rows),)
    return None


def load_shard(
    model_dir: Path, rank: int, world: int, dtype: torch.dtype, device: torch.device
) -> tuple[Any, TensorParallel]:
    """Rank `rank`'s part of the model, read slice by slice from the safetensors files (a
    pre-quantized checkpoint's projections read whole, then cut, common/quant_checkpoint.py;
    a vision-language model's language model under its checkpoint's names)."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_utils import no_init_weights

    from tgis.vision.encoder import causal_lm, checkpoint_name
    from tgis.vision.families import vision_family_of

    config = AutoConfig.from_pretrained(model_dir)
    vision = vision_family_of(config.to_dict())
    if vision is not None:
        config = config.get_text_config()
    scheme = checkpoint_scheme(model_dir, config.to_dict())
    group = scheme.group_size if scheme is not None else None
    reason = shard_unsupported_reason(config.to_dict(), world, group)
    if reason is not None:
        raise ConfigError(f"--num-shard {world}: {reason}", "pick one of the values named")
    local = local_config(config, world)
    if scheme is not None:
        model = empty_model(local, dtype, device)
    else:
        with no_init_weights(), torch.device(device):
            if vision is None:
                model = AutoModelForCausalLM.from_config(local, dtype=dtype)
            else:
                model = causal_lm(local, vision, dtype=dtype)

    def read(name: str, source: str, target: torch.Tensor) -> torch.Tensor:
        """This rank's slice of `source`, the vocabulary padded, a row-parallel bias once."""
        part = _slice_of(name, config, rank, world)
        view = checkpoint.view(source)
        if part is None:
            tensor = view[:]
        else:
            dim, ranges = part
            pieces = [view[a:b] if dim == 0 else view[:, a:b] for a, b in ranges]
            tensor = pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=dim)
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            padded = torch.zeros(target.shape, dtype=tensor.dtype)
            padded[: tensor.shape[0]] = tensor
            tensor = padded
        if name.endswith(("o_proj.bias", "down_proj.bias")) and rank != 0:
            tensor = torch.zeros_like(tensor)  # row-parallel biases: added once
        return tensor.to(device=device, dtype=target.dtype)

    parallel = TensorParallel(rank, world, config.vocab_size)
    with Checkpoint(model_dir) as checkpoint:
        if scheme is None:
            rename = None
            if vision is not None:
                family = vision

                def rename(name: str) -> str:
                    return checkpoint_name(family, name, checkpoint)

            model.load_state_dict(float_state(model, checkpoint, set(), read, rename), strict=False)
            return model.eval(), parallel
        quantized = attach_stored(
            model, checkpoint, scheme, lambda name: _slice_of(name, config, rank, world)
        )
        state = float_state(model, checkpoint, quantized, read)
    return finish(model, state, quantized, scheme), parallel


@dataclass(frozen=True)
class ShardSettings:
    """What every rank builds its backend with (the same on all of them)."""

    model_dir: str
    device: str  # "cpu" or "cuda"
    dtype: str | None
    max_sequences: int
    max_sequence_tokens: int
    max_prefill_tokens: int
    kv_tokens: int | None
    memory_fraction: float | None
    master_addr: str
    master_port: int
    world: int
    quantization: Quantization | None = None
    kv_cache_dtype: str | None = None  # --kv-cache-dtype's float8 name (None: the model's)
    attention_backend: str | None = None  # --attention-backend (None: auto)
    # Multi-node (tgis.backends.paged.nodes): the world's ranks over `nnodes` hosts, this
    # process's node, the interface the shards talk over, and the nodes' time limits.
    nnodes: int = 1
    node_rank: int = 0
    socket_ifname: str | None = None
    join_timeout_s: float = 600.0
    node_timeout_s: float = 30.0
    # What the nodes compare: the model as given (and its revision).
    model_id: str = ""
    revision: str | None = None

    @property
    def layout(self) -> Layout:
        return Layout(self.world, self.nnodes, self.node_rank)

    def identity(self) -> dict[str, str]:
        """What this node would load and how (the other nodes must agree)."""
        return identity(
            self.model_id or self.model_dir,
            Path(self.model_dir),
            self.revision,
            {
                "device": self.device,
                "dtype": self.dtype,
                "num_shard": self.world,
                "nnodes": self.nnodes,
                "quantize": None if self.quantization is None else self.quantization.method,
                "kv_cache_dtype": self.kv_cache_dtype,
            },
            address_towards(self.master_addr, self.master_port),
        )

    @staticmethod
    def of(config: ServeConfig, model_dir: Path) -> ShardSettings:
        """The settings of --num-shard N processes serving the model in `model_dir` under
        `config`; a ConfigError when fewer GPUs are visible than shards."""
        from tgis.backends.common.device import layer_shape, resolve_dtype

        world = config.num_shard
        local = world // config.nnodes
        if config.backend == "cuda" and torch.cuda.device_count() < local:
            across = f" over {config.label('nnodes', config.nnodes)}" if config.nnodes > 1 else ""
            raise ConfigError(
                f"{config.label('num_shard', world)}{across} needs {local} GPUs on this host; "
                f"{torch.cuda.device_count()} are visible",
                "lower --num-shard, or make more GPUs visible (CUDA_VISIBLE_DEVICES)",
            )
        model_config = json.loads((model_dir / "config.json").read_text())
        # Resolved once here, so that every rank computes in the same dtype.
        dtype = resolve_dtype(
            torch.device(config.backend), config.dtype, model_config.get("dtype"),
            layer_shape(model_config),
        )  # fmt: skip
        return ShardSettings(
            model_dir=str(model_dir),
            device=config.backend,
            dtype=str(dtype).removeprefix("torch."),
            max_sequences=config.batch_slots,
            max_sequence_tokens=config.max_total_tokens,
            max_prefill_tokens=config.max_batch_prefill_tokens,
            kv_tokens=config.max_batch_total_tokens,
            memory_fraction=config.cuda_memory_fraction,
            master_addr=config.master_addr,
            master_port=config.master_port,
            world=world,
            quantization=Quantization.of(config),
            kv_cache_dtype=config.kv_cache_dtype,
            attention_backend=config.attention_backend,
            nnodes=config.nnodes,
            node_rank=config.node_rank,
            socket_ifname=config.socket_ifname,
            join_timeout_s=config.join_timeout_s,
            node_timeout_s=config.node_timeout_s,
            model_id=config.model_id,
            revision=config.revision,
        )


def rank_device(settings: ShardSettings, rank: int) -> torch.device:
    """`rank`'s device: its local GPU on cuda (ranks count on from node to node)."""
    if settings.device == "cuda":
        return torch.device("cuda", settings.layout.local(rank))
    return torch.device("cpu")


def shard_threads(shards_here: int, env: Mapping[str, str] | None = None) -> int:
    """OpenMP threads of each of this host's CPU shards: the host's cores (affinity and cgroup
    quota) shared among its shards, or fewer where OMP_NUM_THREADS (a plain count) says."""
    from tgis.backends.common.device import cpu_threads

    share = max(1, cpu_threads() // shards_here)
    given = (default_env() if env is None else env).get("OMP_NUM_THREADS", "").strip()
    return min(share, int(given)) if given.isdigit() and int(given) > 0 else share


def _join(settings: ShardSettings, rank: int, store: dist.Store | None = None) -> torch.device:
    """Join the group over node 0's store (`store` on rank 0, which hosts it); this rank's
    device."""
    device = rank_device(settings, rank)
    set_variables(
        socket_interface(
            default_env(), settings.socket_ifname, settings.master_addr, settings.master_port,
            settings.nnodes,
        )
    )  # fmt: skip
    if settings.device == "cuda":
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        torch.set_num_threads(shard_threads(settings.layout.per_node))
        backend = "gloo"
    if store is None:
        store = connect_store(
            settings.master_addr, settings.master_port, COLLECTIVE_TIMEOUT, settings.node_rank
        )
    dist.init_process_group(
        backend,
        store=dist.PrefixStore("group", store),
        rank=rank,
        world_size=settings.world,
        timeout=COLLECTIVE_TIMEOUT,
    )
    return device


def build_rank_backend(settings: ShardSettings, rank: int) -> Any:
    """This rank's PagedTorchBackend over its slices (in the group already)."""
    from tgis.backends.common.device import resolve_dtype
    from tgis.backends.common.kv import kv_dtype
    from tgis.backends.paged.backend import PagedTorchBackend
    from tgis.vision.encoder import load_vision_tower
    from tgis.vision.families import vision_family_of

    device = rank_device(settings, rank)
    dtype = resolve_dtype(device, settings.dtype, None)
    model_dir = Path(settings.model_dir)
    model, tp = load_shard(model_dir, rank, settings.world, dtype, device)
    # A vision-language model: the first shard encodes the images (whole), and the features
    # reach the others with each step (PackedItem.embeds).
    family = vision_family_of(json.loads((model_dir / "config.json").read_text()))
    vision = load_vision_tower(model_dir, device, dtype) if family and rank == 0 else None
    return PagedTorchBackend(
        model,
        max_sequences=settings.max_sequences,
        max_sequence_tokens=settings.max_sequence_tokens,
        max_prefill_tokens=settings.max_prefill_tokens,
        kv_tokens=settings.kv_tokens,
        memory_fraction=settings.memory_fraction,
        cuda_graphs=False,
        parallel=tp,
        packed_weights=None,
        quantization=settings.quantization,
        kv_cache_dtype=kv_dtype(settings.kv_cache_dtype),
        vision=vision,
        bidirectional_images=family is not None and family.bidirectional,
        attention_backend=settings.attention_backend,
    )


def _broadcast(message: Any) -> Any:
    box = [message]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def worker_main(settings: ShardSettings, rank: int, errors: Any) -> None:
    """A rank other than 0: build, then run every step rank 0 broadcasts, until `stop`."""
    parent = os.getppid()
    threading.Thread(target=_exit_with_parent, args=(parent,), daemon=True).start()
    try:
        _join(settings, rank)
        backend = build_rank_backend(settings, rank)
        while True:
            kind, payload = _broadcast(None)
            if kind == "forward":
                backend.forward(payload)
            elif kind == "warmup":
                backend.warmup(*payload)
            elif kind == "stop":
                # The group ends here: leave without tearing it down, as gloo's teardown can
                # abort the process while a peer on another node is exiting too.
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(0)
    except BaseException as exc:  # reported to rank 0, which ends the server
        errors.put((rank, f"{type(exc).__name__}: {exc}", traceback.format_exc()))
        raise SystemExit(1) from None
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _exit_with_parent(parent: int) -> None:
    """A worker whose server is gone has nothing to serve."""
    while os.getppid() == parent:
        time.sleep(1.0)
    os._exit(1)


class ShardGroup:
    """A node's view of its other ranks: starts them, watches them, stops them. A rank that
    exits 0 was stopped (rank 0 broadcast `stop`); any other exit is a failure."""

    def __init__(
        self,
        settings: ShardSettings,
        on_failure: Callable[[str], None],
        ranks: Sequence[int] | None = None,
    ) -> None:
        context = multiprocessing.get_context("spawn")
        self.errors = context.Queue()
        self.ranks = list(range(1, settings.world) if ranks is None else ranks)
        self.layout = settings.layout
        self.workers = [
            context.Process(
                target=worker_main,
                args=(settings, rank, self.errors),
                name=f"tgis-shard-{rank}",
                daemon=True,
            )
            for rank in self.ranks
        ]
        for worker in self.workers:
            worker.start()
        self._on_failure = on_failure
        self._stopping = False
        threading.Thread(target=self._watch, name="tgis-shard-watch", daemon=True).start()

    def _name(self, rank: int) -> str:
        if self.layout.nnodes == 1:
            return f"shard {rank}"
        return f"rank {rank} on node {self.layout.node_of(rank)}"

    def _watch(self) -> None:
        while not self._stopping:
            for rank, worker in zip(self.ranks, self.workers, strict=True):
                if worker.exitcode not in (None, 0) and not self._stopping:
                    message = f"{self._name(rank)} exited with code {worker.exitcode}"
                    try:
                        failed, error, _ = self.errors.get(timeout=1.0)
                        message = f"{self._name(failed)} failed: {error}"
                    except Exception:  # no report: it was killed
                        pass
                    self._on_failure(message)
                    return
            time.sleep(0.2)

    def stopped(self) -> bool:
        """Every rank has exited 0: rank 0 stopped the group."""
        return all(worker.exitcode == 0 for worker in self.workers)

    def stop(self, timeout: float = 10.0) -> None:
        """Wait up to `timeout` in all for the ranks to exit, then kill those left."""
        self._stopping = True
        deadline = time.monotonic() + timeout
        for worker in self.workers:
            worker.join(max(0.0, deadline - time.monotonic()))
        for worker in self.workers:
            if worker.is_alive():
                worker.kill()
                worker.join(5.0)


def fail_server(message: str) -> None:
    """A shard is gone: the server cannot serve; end it with the message (a supervisor
    restarts it)."""
    log.error("%s: the server stops", message)
    os._exit(1)


class TensorParallelBackend:
    """Rank 0's PagedBackend: each step is broadcast to the other ranks, then run here. Across
    nodes it hosts the rendezvous, waits for and checks the other nodes, and watches them."""

    def __init__(
        self, settings: ShardSettings, on_failure: Callable[[str], None] = fail_server
    ) -> None:
        self.settings = settings
        self._failures: list[str] = []

        layout = settings.layout
        self.store = host_store(
            settings.master_addr, settings.master_port, layout.nnodes,
            timedelta(seconds=settings.join_timeout_s),
        )  # fmt: skip

        def failed(message: str) -> None:
            self._failures.append(message)
            if layout.nnodes > 1:  # the other nodes say why, not only that node 0 is gone
                report_failure(self.store, 0, message)
            on_failure(message)

        self._on_failure = failed
        self.watch: ServerWatch | None = None
        self.group: ShardGroup | None = None
        try:
            if layout.nnodes > 1:
                log.info("waiting for %d more nodes to join", layout.nnodes - 1)
                gather_nodes(self.store, layout, settings.identity(), settings.join_timeout_s)
                self.watch = ServerWatch(
                    self.store,
                    (settings.master_addr, settings.master_port, layout, settings.node_timeout_s),
                    failed,
                )
                publish_shape(self.store, {name: getattr(settings, name) for name in SHAPE_FIELDS})
            # From here on the store serves the process group: its waits are collectives'.
            self.store.set_timeout(COLLECTIVE_TIMEOUT)
            self.group = ShardGroup(settings, failed, ranks=layout.ranks[1:])
            _join(settings, 0, self.store)
            self.inner = build_rank_backend(settings, 0)
        except BaseException as exc:
            if self.watch is not None:
                report_failure(self.store, 0, f"{type(exc).__name__}: {exc}")
                self.watch.stop()
            if self.group is not None:
                self.group.stop(1.0)
            if dist.is_initialized():
                dist.destroy_process_group()
            raise
        self.name = f"{self.inner.name} x{settings.world}" + (
            f" over {layout.nnodes} nodes" if layout.nnodes > 1 else ""
        )
        self.device = self.inner.device
        self.vocab_size = self.inner.vocab_size
        self.dtype = self.inner.dtype
        self.device_obj = self.inner.device_obj
        self._closed = False

    @property
    def capacity(self) -> BackendCapacity:
        return self.inner.capacity

    def runtime(self) -> dict[str, Any]:
        """Rank 0's runtime, and how the shards are spread: ranks in all, nodes, ranks on each."""
        layout = self.settings.layout
        return {
            **self.inner.runtime(),
            "shards": layout.world,
            "nodes": layout.nnodes,
            "shards_per_node": layout.per_node,
        }

    def encode_images(self, images: Sequence[ImageInput]) -> list[torch.Tensor]:
        """The images' features, from the first shard's vision tower."""
        return self.inner.encode_images(images)

    def forward(self, items: Sequence[PackedItem], fed: FedTokens | None = None) -> PackedOutput:
        if fed is not None:  # capacity.fed_tokens is False: each rank is sent its ids
            raise ValueError("tensor-parallel shards read no tokens on the device (fed)")
        payload = [_with_cpu_embeds(item) if item.embeds else item for item in items]
        try:
            _broadcast(("forward", payload))
            return self.inner.forward(items)
        except Exception as exc:
            self._broken(exc)
            raise

    def _broken(self, exc: Exception) -> None:
        """A step failed: every rank runs the same step, so the group is out of step (or a
        rank is gone). Give the watches a moment to name the rank or node, else report the
        step's error: either way the server cannot go on."""
        settle = self.settings.node_timeout_s + 2 if self.watch is not None else 3.0
        deadline = time.monotonic() + settle
        while not self._failures and time.monotonic() < deadline:
            time.sleep(0.1)
        if not self._failures:
            self._on_failure(f"a step failed on rank 0, which leaves the shards out of step: {exc}")

    def warmup_plan(self, max_batch_size: int, max_input_tokens: int) -> list[Shape]:
        return self.inner.warmup_plan(max_batch_size, max_input_tokens)

    def warmup(
        self,
        max_batch_size: int,
        max_input_tokens: int,
        on_shape: Callable[[ShapeTiming], None] | None = None,
    ) -> list[ShapeTiming]:
        try:
            _broadcast(("warmup", (max_batch_size, max_input_tokens)))
            return self.inner.warmup(max_batch_size, max_input_tokens, on_shape)
        except Exception as exc:
            self._broken(exc)
            raise

    def close(self) -> None:
        """Stop the other ranks (those still alive, on every node) and leave the group."""
        if self._closed:
            return
        self._closed = True
        assert self.group is not None
        self.group._stopping = True
        try:
            alive = all(worker.is_alive() for worker in self.group.workers)
            if alive and not self._failures:
                if self.watch is not None:  # the nodes' ranks stop now: no loss, no watch
                    announce_stop(self.store)
                    self.watch.stop()
                _broadcast(("stop", None))
            elif self.watch is not None:
                self.watch.stop()
        except Exception as exc:  # a node is gone already: nothing left to stop there
            log.warning("stopping the shards: %s", exc)
        finally:
            self.group.stop(1.0 if self._failures else 10.0)  # a broken group stops no sooner
            if dist.is_initialized():
                dist.destroy_process_group()


# How long a node's ranks may take to stop after node 0 announced it stops them.
STOP_GRACE_S = 15.0


def serve_node(settings: ShardSettings, shutdown_grace_s: float = 30.0) -> None:
    """Node R > 0 of a multi-node server: join node 0 (checked against it), run this node's
    ranks, and return when node 0 stops them; a NodeError naming what failed when node 0
    refuses this node, is gone or failed, or one of the ranks here fails. SIGTERM (the whole
    group going, say) waits up to `shutdown_grace_s` + STOP_GRACE_S for node 0, which drains
    its requests first, to stop the ranks; then they stop regardless, node 0 told why."""
    import signal
    from dataclasses import replace

    layout = settings.layout
    store = connect_store(
        settings.master_addr, settings.master_port,
        timedelta(seconds=settings.join_timeout_s), layout.node_rank,
    )  # fmt: skip
    log.info("node %d joined node 0 at %s:%d", layout.node_rank, settings.master_addr,
             settings.master_port)  # fmt: skip
    shape = join_nodes(store, layout, settings.identity(), settings.join_timeout_s)
    settings = replace(settings, **shape)
    failures: list[str] = []
    ended = threading.Event()

    def lost(message: str) -> None:
        failures.append(message)
        ended.set()

    watch = NodeWatch(
        settings.master_addr, settings.master_port, layout, settings.node_timeout_s, lost
    )

    def rank_failed(message: str) -> None:
        watch.report_failure(message)
        lost(message)

    terminated: list[float] = []
    signal.signal(signal.SIGTERM, lambda *_: terminated.append(time.monotonic()))
    group = ShardGroup(settings, rank_failed, ranks=layout.ranks)
    log.info("%s runs its shards", layout.describe(layout.node_rank))
    stopping_since: float | None = None
    try:
        while not ended.wait(0.2):
            now = time.monotonic()
            if group.stopped():
                return  # node 0 stopped the group
            if watch.stopping and stopping_since is None:
                stopping_since = now
            if stopping_since is not None and now - stopping_since > STOP_GRACE_S:
                raise NodeError(
                    f"node 0 stopped the group, and the ranks of {layout.describe(layout.node_rank)}"
                    f" did not stop within {STOP_GRACE_S:g} s",
                    "they are stopped now; see this node's log for what held them",
                )
            if terminated and now - terminated[0] > shutdown_grace_s + STOP_GRACE_S:
                watch.report_failure(f"{layout.describe(layout.node_rank)} was stopped (SIGTERM)")
                log.warning("SIGTERM: node 0 did not stop the group; the ranks here stop")
                return
        # Node 0 stopping can look like node 0 gone: its ranks exit 0 first.
        deadline = time.monotonic() + 3.0
        while time.monotonic() < deadline and not group.stopped():
            time.sleep(0.1)
        if group.stopped():
            return
        raise NodeError(
            failures[0],
            "the node stops; restart the nodes together (a supervisor such as a "
            "LeaderWorkerSet recreates the group)",
        )
    finally:
        watch.stop()
        group.stop(
            1.0 if failures or terminated else 5.0
        )  # a rank stuck in a collective waits no longer


def _with_cpu_embeds(item: PackedItem) -> PackedItem:
    from dataclasses import replace

    return replace(item, embeds=tuple((at, rows.cpu()) for at, rows in item.embeds))


__all__ = [
    "ShardSettings",
    "TensorParallel",
    "TensorParallelBackend",
    "load_shard",
    "serve_node",
    "shard_unsupported_reason",
]
