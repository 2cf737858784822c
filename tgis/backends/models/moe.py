"""The mixture-of-experts MLP of the paged forward (Mixtral, Qwen2-MoE, Qwen3-MoE): the experts'
weights stacked for grouped matmuls, and the routed computation over packed tokens.

`MoeMlp.of(block)` takes an HF sparse-MoE block's weights: the router, every expert's gate and up
rows stacked into one [experts, 2 * inter, hidden] tensor, every down projection into one
[experts, hidden, inter], and Qwen2-MoE's shared expert. Stacking re-points the HF experts'
weights at views of the stacked tensors, so the model holds one copy of the weights and still
computes what it did (tests compare against it), as decoder.py's fusing does.

`MoeMlp(x, act)` computes x [N, hidden] grouped by expert, not by token: route each token to its
top-k experts exactly as HF does (softmax in float32, top-k, renormalized where the model says,
weights cast to x's dtype), sort the N * top_k assignments by expert, gather the tokens' rows in
that order, run gate/up and down as one grouped matmul each over all experts
(torch._grouped_mm), scale the rows by their routing weights and add them back to their tokens.
The work is that of the N * top_k routed rows: no per-token loop and no dense compute of every
expert on every token.

Where the grouped matmul cannot run (a torch without it, a device or dtype it has no kernel for,
widths whose strides it refuses), one matmul per expert that received tokens replaces it. That
path reads the experts' token counts on the host; the grouped one never does, so a decode step
through it can be recorded in a CUDA graph.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from tgis.backends.common.gemm import linear
from tgis.backends.common.quant import QuantLinear

# The HF sparse-MoE blocks computed here, by class name -> an expert's (gate, up, down)
# projections. Matched by class, not by having `gate` and `experts`: other blocks built of the
# same modules route differently (DeepSeek's grouped top-k and sigmoid scores, Qwen3-Next's
# shared expert, ...), and each is added here only once checked against its HF forward.
BLOCKS: dict[str, tuple[str, str, str]] = {
    "MixtralSparseMoeBlock": ("w1", "w3", "w2"),
    "Qwen2MoeSparseMoeBlock": ("gate_proj", "up_proj", "down_proj"),
    "Qwen3MoeSparseMoeBlock": ("gate_proj", "up_proj", "down_proj"),
}
# CUDA architectures (compute capability majors) whose torch build has a grouped-GEMM kernel
# for bfloat16 (CUTLASS, sm90 and sm100). On any other GPU torch._grouped_mm still answers, but
# through a loop that copies the offsets to the host: a sync, so not capturable in a graph.
# On CPU it is that same loop of matmuls, in C++, and there is no host to sync with.
GROUPED_MM_CUDA_MAJORS = (9, 10)


def moe_block(layer: nn.Module) -> nn.Module | None:
    """The HF sparse-MoE block of decoder `layer`, or None when its MLP is dense.

    Mixtral keeps it as `block_sparse_moe`; Qwen2/3-MoE as `mlp`, which is a dense MLP on
    `mlp_only_layers` and on layers off `decoder_sparse_step`. Any `*SparseMoeBlock` is
    returned, computed here or not, so a model of another MoE family is refused by
    `MoeMlp.of` rather than mistaken for a dense one."""
    block = getattr(layer, "block_sparse_moe", None)
    if block is not None:
        return block
    mlp = getattr(layer, "mlp", None)
    if mlp is not None and type(mlp).__name__.endswith("SparseMoeBlock"):
        return mlp
    return None


@functools.cache
def _grouped_mm_kernel(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether torch._grouped_mm has a kernel for `dtype` on `device` that never reads its
    offsets on the host. Tried once on a tiny product besides: which devices and dtypes it
    takes changed across torch releases (this one's CPU kernel takes float32, bfloat16 and
    float16, not float64), and one probe per process is cheaper than a table of versions."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    if device.type == "cuda":
        if torch.version.hip is not None or dtype != torch.bfloat16:
            return False
        if torch.cuda.get_device_capability(device)[0] not in GROUPED_MM_CUDA_MAJORS:
            return False
    elif device.type != "cpu":
        return False
    a = torch.zeros(2, 8, dtype=dtype, device=device)
    b = torch.zeros(1, 8, 8, dtype=dtype, device=device)
    offs = torch.tensor([2], dtype=torch.int32, device=device)
    try:
        torch._grouped_mm(a, b.transpose(1, 2), offs=offs)
    except (RuntimeError, NotImplementedError):
        return False
    return True


def _grouped_mm_takes(b: torch.Tensor) -> bool:
    """Whether torch._grouped_mm accepts `b` [E, K, N] as its right operand: one of its last
    two dimensions unit-strided and every other stride, and its start, on 16 bytes (it raises
    "strides should be multiple of 16 bytes" otherwise). b's strides are the weights' row
    widths, hidden and inter, which are also those of the rows it multiplies."""
    if b.stride(-1) != 1 and b.stride(-2) != 1:
        return False
    size = b.element_size()
    return b.data_ptr() % 16 == 0 and all(
        stride * size % 16 == 0 for stride in b.stride() if stride != 1
    )


def _stack(groups: list[list[nn.Linear]]) -> torch.Tensor:
    """One tensor [len(groups), rows, in] of the weights of each group's linears concatenated
    along their outputs; each module's weight then becomes a view of its rows (one copy in
    memory: the old weights are freed as the modules let go of them)."""
    first = groups[0][0].weight
    layouts = {
        tuple((m.weight.shape, m.weight.dtype, m.weight.device) for m in group) for group in groups
    }
    if len(layouts) != 1 or len({m.in_features for m in groups[0]}) != 1:
        raise ValueError("the experts' weights differ in shape, dtype or device")
    rows = sum(m.out_features for m in groups[0])
    stacked = torch.empty(
        (len(groups), rows, first.shape[1]), dtype=first.dtype, device=first.device
    )
    for index, group in enumerate(groups):
        offset = 0
        for m in group:
            view = stacked[index, offset : offset + m.out_features]
            view.copy_(m.weight)
            m.weight = nn.Parameter(view, requires_grad=False)
            offset += m.out_features
    return stacked


def released(weight: torch.Tensor) -> nn.Parameter:
    """A parameter of `weight`'s shape and dtype on the meta device: an HF module (or a
    stacked tensor) keeps its shape while the forward holds the only (packed or quantized) copy
    of the values."""
    return nn.Parameter(torch.empty_like(weight, device="meta"), requires_grad=False)


def _kernel(
    quantize: Callable[[list[nn.Linear]], torch.Tensor | QuantLinear], linears: list[nn.Linear]
) -> QuantLinear:
    weight = quantize(linears)
    if not isinstance(weight, QuantLinear):
        raise ValueError("a quantized checkpoint stores this expert's projections in float")
    return weight


def _projections(
    block: nn.Module, names: tuple[str, str, str], shared: nn.Module | None
) -> list[nn.Linear]:
    """Every expert's (and the shared expert's) gate, up and down modules of `block`."""
    modules = [getattr(e, name) for e in block.experts for name in names]
    if shared is not None:
        modules += [shared.gate_proj, shared.up_proj, shared.down_proj]
    return modules


def _refuse_biases(block: nn.Module) -> None:
    """The forward computes the experts, router and shared expert without biases (none of the
    three families has them); a block that has them would be computed wrong, so it is refused."""
    for name, module in block.named_modules():
        if isinstance(module, nn.Linear) and module.bias is not None:
            raise ValueError(
                f"{type(block).__name__}.{name} has a bias: MoE biases are unsupported"
            )


@dataclass(frozen=True)
class MoeMlp:
    """One layer's sparse-MoE MLP: router, stacked experts, Qwen2-MoE's shared expert."""

    router: torch.Tensor  # [experts, hidden]
    gate_up: torch.Tensor  # [experts, 2 * inter, hidden]: each expert's gate rows, then its up rows
    down: torch.Tensor  # [experts, hidden, inter]
    top_k: int
    renormalize: bool  # the top-k weights divided by their sum (Mixtral; Qwen's norm_topk_prob)
    shared_gate_up: torch.Tensor | None = None  # [2 * shared_inter, hidden] (Qwen2-MoE)
    shared_down: torch.Tensor | None = None  # [hidden, shared_inter]
    shared_gate: torch.Tensor | None = None  # [1, hidden]
    # Use the grouped matmul where it runs (False: one matmul per expert everywhere).
    grouped: bool = True
    # Quantized experts (common/quant.py): each expert's (gate/up, down) kernels, and the
    # shared expert's; the stacked tensors above then hold only shapes (the meta device).
    expert_kernels: tuple[tuple[QuantLinear, QuantLinear], ...] | None = None
    shared_kernels: tuple[QuantLinear, QuantLinear] | None = None
    # Whether calls take the grouped path: decided once from the weights' device, dtype and
    # strides (x has the weights' device and dtype), not tried and caught per call.
    runs_grouped: bool = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        runs = (
            self.grouped
            and self.expert_kernels is None
            and _grouped_mm_kernel(self.gate_up.device, self.gate_up.dtype)
            and _grouped_mm_takes(self.gate_up.transpose(1, 2))
            and _grouped_mm_takes(self.down.transpose(1, 2))
        )
        object.__setattr__(self, "runs_grouped", bool(runs))

    @classmethod
    @torch.no_grad()
    def of(
        cls,
        block: nn.Module,
        quantize: Callable[[list[nn.Linear]], torch.Tensor | QuantLinear] | None = None,
    ) -> MoeMlp:
        """The MLP of HF sparse-MoE `block` (one of BLOCKS), its experts' weights stacked and
        the block's modules re-pointed at them. Mixtral's router jitter is a training setting
        (HF applies it only in training mode), so it is ignored. `quantize`: each expert's
        (and the shared expert's) projections through it, the router kept in the model's
        dtype; the block's expert weights then move to the meta device. It takes a projection's
        linears (gate and up fused) and gives their kernel (decoder.DecoderWeights._quantizer)."""
        kind = type(block).__name__
        names = BLOCKS.get(kind)
        if names is None:
            raise ValueError(
                f"{kind} is not a sparse-MoE block the paged forward computes ({', '.join(BLOCKS)})"
            )
        _refuse_biases(block)
        experts = list(block.experts)
        top_k = int(block.top_k)
        if not 0 < top_k <= len(experts) or block.gate.out_features != len(experts):
            raise ValueError(
                f"{kind} routes to {top_k} of {block.gate.out_features} experts but has "
                f"{len(experts)}"
            )
        gate, up, down = names
        shared = getattr(block, "shared_expert", None)
        # The fused gate/up product is split in halves: gate and up of one width.
        pairs = [(getattr(e, gate), getattr(e, up)) for e in experts]
        if shared is not None:
            pairs.append((shared.gate_proj, shared.up_proj))
        if any(g.out_features != u.out_features for g, u in pairs):
            raise ValueError(f"{kind}'s gate and up projections differ in width")
        shared_gate_up = shared_down = shared_gate = None
        if shared is not None:
            shared_gate_up = _stack([[shared.gate_proj, shared.up_proj]])[0]
            shared_down = shared.down_proj.weight
            shared_gate = block.shared_expert_gate.weight
        gate_up = _stack([[getattr(e, gate), getattr(e, up)] for e in experts])
        down_w = _stack([[getattr(e, down)] for e in experts])
        expert_kernels = shared_kernels = None
        if quantize is not None:
            expert_kernels = tuple(
                (
                    _kernel(quantize, [getattr(e, gate), getattr(e, up)]),
                    _kernel(quantize, [getattr(e, down)]),
                )
                for e in experts
            )
            if shared is not None:
                assert shared_gate_up is not None and shared_down is not None
                shared_kernels = (
                    _kernel(quantize, [shared.gate_proj, shared.up_proj]),
                    _kernel(quantize, [shared.down_proj]),
                )
                shared_gate_up, shared_down = released(shared_gate_up), released(shared_down)
            gate_up, down_w = released(gate_up), released(down_w)
            for module in _projections(block, names, shared):
                module.weight = released(module.weight)
        return cls(
            router=block.gate.weight,
            gate_up=gate_up,
            down=down_w,
            top_k=top_k,
            # Mixtral always renormalizes; the Qwen blocks as their config's norm_topk_prob says.
            renormalize=bool(getattr(block, "norm_topk_prob", True)),
            shared_gate_up=shared_gate_up,
            shared_down=shared_down,
            shared_gate=shared_gate,
            expert_kernels=expert_kernels,
            shared_kernels=shared_kernels,
        )

    def __call__(
        self, x: torch.Tensor, act: Callable[[torch.Tensor], torch.Tensor]
    ) -> torch.Tensor:
        """x [N, hidden] -> the block's output [N, hidden]; `act` is the experts' activation."""
        # Routing as HF's blocks: softmax in float32, top-k, renormalized, cast to x's dtype.
        probs = F.softmax(F.linear(x, self.router), dim=-1, dtype=torch.float32)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        weights = weights.to(x.dtype)
        # The N * top_k assignments in expert order. Stable, so that within an expert the rows
        # keep token order, and each token's rows come in ascending expert order: the order in
        # which HF sums a token's experts, so the sums below round as HF's do.
        sorted_experts, order = torch.sort(experts.flatten(), stable=True)
        tokens = order // self.top_k
        rows = x[tokens]
        if self.runs_grouped:
            out = self._grouped(rows, sorted_experts, act)
        else:
            out = self._per_expert(rows, sorted_experts, act)
        out = out * weights.flatten()[order, None]
        # Back to the tokens: index_add_ adds the rows in their order (ascending expert per
        # token, as HF) on CPU; on CUDA it adds atomically, in no fixed order.
        result = torch.zeros_like(x).index_add_(0, tokens, out)
        if self.shared_gate_up is not None:
            assert self.shared_down is not None and self.shared_gate is not None
            shared_up, shared_down = self.shared_kernels or (self.shared_gate_up, self.shared_down)
            gate, up = linear(x, shared_up).chunk(2, dim=-1)
            shared = linear(act(gate) * up, shared_down)
            result = result + torch.sigmoid(F.linear(x, self.shared_gate)) * shared
        return result

    def _grouped(
        self,
        rows: torch.Tensor,
        sorted_experts: torch.Tensor,
        act: Callable[[torch.Tensor], torch.Tensor],
    ) -> torch.Tensor:
        """rows [M, hidden] in expert order -> their experts' outputs [M, hidden], two grouped
        matmuls over all experts. Nothing here reads a tensor on the host (graph-capturable)."""
        # Each expert's cumulative row end, found on the device: experts without rows get an
        # empty group (bincount would size its output from a host-read maximum on CUDA).
        ids = torch.arange(self.gate_up.shape[0], device=rows.device, dtype=sorted_experts.dtype)
        ends = torch.searchsorted(sorted_experts, ids, right=True, out_int32=True)
        # The weights as [E, K, N] views of their [E, N, K] storage: the nn.Linear layout,
        # which the grouped kernel reads as column-major (no transposed copy of the experts).
        gate, up = torch._grouped_mm(rows, self.gate_up.transpose(1, 2), offs=ends).chunk(2, -1)
        return torch._grouped_mm(act(gate) * up, self.down.transpose(1, 2), offs=ends)

    def _per_expert(
        self,
        rows: torch.Tensor,
        sorted_experts: torch.Tensor,
        act: Callable[[torch.Tensor], torch.Tensor],
    ) -> torch.Tensor:
        """As _grouped, with one matmul pair per expert that has rows (the others are skipped).
        Reads the per-expert row counts on the host: a sync on a GPU."""
        counts = torch.bincount(sorted_experts, minlength=self.gate_up.shape[0]).tolist()
        out = rows.new_empty(rows.shape[0], self.down.shape[1])
        start = 0
        for expert, count in enumerate(counts):
            if count == 0:
                continue
            end = start + count
            up_w, down_w = (
                self.expert_kernels[expert]
                if self.expert_kernels is not None
                else (self.gate_up[expert], self.down[expert])
            )
            gate, up = linear(rows[start:end], up_w).chunk(2, dim=-1)
            out[start:end] = linear(act(gate) * up, down_w)
            start = end
        return out
