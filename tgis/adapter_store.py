"""LoRA adapters (PEFT) for the llama-family paged engine: named at start-up, or found by name
in a directory on demand, checked against the model and cached.

`--lora-adapters name=path,...` names adapters (a path is a directory or a Hub id in the
cache; a bare path is also its name); `--lora-adapter-dir DIR` serves every `DIR/<name>`
holding an adapter, loaded the first time a request names it. An adapter directory holds
`adapter_config.json` (`peft_type: LORA`) and `adapter_model.safetensors` or
`adapter_model.bin`, read as tensors only. Served: LoRA on the attention and MLP projections
(q/k/v/o, gate/up/down) of any layers, with `lora_alpha`, `use_rslora`, `rank_pattern` and
`alpha_pattern`, ranks up to --max-lora-rank. Refused, naming the reason: DoRA, biases,
`modules_to_save`, `fan_in_fan_out`, adapted embeddings or lm_head, shapes that are not this
model's. Loaded adapters live on the serving device in the serving dtype, the factors
transposed and scaled once (tgis.engine.types.LoraAdapter); at most --max-loras of them stay
cached (least recently used first out; a request holding one keeps it until it ends).

A vision-language model's adapters adapt its language model (`VisionNames`): PEFT on the whole
model names its layers `base_model.model.model.language_model.layers.N...` (Llava-Next,
Qwen2-VL and Qwen2.5-VL; Idefics3's `model.text_model`), Llava-Next adapters made before
transformers 4.52 `base_model.model.language_model.model.layers.N...`, and an adapter of the
text model of the same family `base_model.model.model.layers.N...` (what Qwen2-VL's
adapters named before 4.52 too): all three apply to the language model. An adapter that
adapts a module of the vision tower or the projector is refused, naming the module.
"""

from __future__ import annotations

import hashlib
import math
import re
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch

from tgis.backends.paged.lora import LoraShapes
from tgis.config.types import ADAPTER_NAME as ADAPTER_NAME_PATTERN
from tgis.engine.types import LoraAdapter
from tgis.errors import InputValidationError
from tgis.peft_files import PEFT_CONFIG, PeftFileError, read_config, read_weights

ADAPTER_NAME = re.compile(ADAPTER_NAME_PATTERN)


# What PEFT puts before the adapted model's own module names.
PEFT_PREFIX = "base_model.model."


@dataclass(frozen=True)
class VisionNames:
    """Where a vision-language model's adapters name its parts: the model type (for
    messages), the attribute of the inner model that is the language model
    (`VisionFamily.language_model`) and the inner model's other modules (vision tower,
    projector: `VisionEncoder.parts`)."""

    model_type: str
    language_model: str
    vision_parts: tuple[str, ...]

    def language_prefixes(self) -> tuple[str, ...]:
        """The module paths (less PEFT's prefix) the language model's layers may sit under:
        transformers' layout, Llava-Next's before 4.52, and a text model's (module doc)."""
        lm = self.language_model
        return (f"model.{lm}.", f"{lm}.model.", "model.")

    def vision_part(self, module: str) -> str | None:
        """The vision tower or projector module path `module` (less PEFT's prefix) lies in,
        as the model names it, or None."""
        for part in self.vision_parts:
            for where in (f"model.{part}", part):  # transformers' layout, the one before 4.52
                if module == where or module.startswith(f"{where}."):
                    return where
        return None


def _weight_pattern(modules: Iterable[str], vision: VisionNames | None) -> re.Pattern[str]:
    """A PEFT LoRA weight on one of `modules`:
    base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight. A text model's may sit
    under any prefix; a vision-language model's under its language model's alone (its vision
    tower has layers with projections of the same names)."""
    where = r"(?:.*\.)?"
    if vision is not None:
        prefixes = "|".join(re.escape(p) for p in vision.language_prefixes())
        where = f"(?:{re.escape(PEFT_PREFIX)})?(?:{prefixes})"
    return re.compile(
        rf"{where}layers\.(\d+)\.(self_attn|mlp)\.(" + "|".join(modules) + r")\.lora_([AB])"
        r"(?:\.[\w\-]+)?\.weight"
    )


def _module_of(key: str) -> str:
    """The module path a PEFT weight name adapts, less PEFT's prefix:
    base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight ->
    model.layers.3.self_attn.q_proj."""
    return key.split(".lora_", 1)[0].removeprefix(PEFT_PREFIX)


class AdapterStore:
    """The LoRA adapters one server may apply. Thread-safe; `get` may read files."""

    def __init__(
        self,
        shapes: LoraShapes,
        *,
        named: Mapping[str, Path] | None = None,
        directory: Path | None = None,
        dtype: torch.dtype,
        device: torch.device,
        max_loras: int,
        max_rank: int,
        model_thread: Callable[[Callable[[], LoraAdapter]], LoraAdapter] | None = None,
        vision: VisionNames | None = None,
    ) -> None:
        """model_thread: runs a load (which moves tensors to the device) on the thread that
        runs the model (`Engine.call`); None: on the calling thread. vision: the model is a
        vision-language one whose language model `shapes` describes (module doc)."""
        self.shapes = shapes
        self.vision = vision
        self._weight = _weight_pattern(shapes.modules, vision)
        self.named = dict(named or {})
        self.directory = directory.resolve() if directory is not None else None
        self.dtype, self.device = dtype, device
        self.max_loras, self.max_rank = max_loras, max_rank
        self._cache: OrderedDict[str, LoraAdapter] = OrderedDict()
        self._lock = threading.Lock()
        self._model_thread = model_thread

    def names(self) -> list[str]:
        """The adapters requests may name: the named ones, then the directory's, sorted."""
        found = list(self.named)
        if self.directory is not None and self.directory.is_dir():
            for config in sorted(self.directory.rglob(PEFT_CONFIG)):
                name = config.parent.relative_to(self.directory).as_posix()
                if name not in self.named and ADAPTER_NAME.fullmatch(name):
                    found.append(name)
        return found

    def cached(self) -> list[str]:
        """Names of the adapters loaded now, least recently used first."""
        with self._lock:
            return list(self._cache)

    def get(self, name: str) -> LoraAdapter:
        """The adapter `name`, from the cache or loaded now; InputValidationError (a 422)
        naming the reason when there is no such adapter or it cannot be served."""
        with self._lock:
            cached = self._cache.get(name)
            if cached is not None:
                self._cache.move_to_end(name)
                return cached
        try:
            path = self._path(name)
            load = partial(self._load, name, path)
            adapter = load() if self._model_thread is None else self._model_thread(load)
        except PeftFileError as exc:
            raise InputValidationError(f"adapter_id '{name}': {exc}") from None
        with self._lock:
            if name not in self._cache:
                self._cache[name] = adapter
                while len(self._cache) > self.max_loras:
                    self._cache.popitem(last=False)
            return self._cache[name]

    def _path(self, name: str) -> Path:
        path = self.named.get(name)
        if path is not None:
            return path
        if self.directory is None:
            raise PeftFileError(f"no such adapter; this server has: {self._known()}")
        if not ADAPTER_NAME.fullmatch(name) or ".." in name.split("/"):
            raise PeftFileError("an adapter id is letters, digits, '_', '-', '.' and '/'")
        path = (self.directory / name).resolve()
        if not path.is_relative_to(self.directory):
            raise PeftFileError("the id resolves outside the adapter directory")
        if not (path / PEFT_CONFIG).is_file():
            raise PeftFileError(
                f"no adapter {name!r} in the adapter directory (no {PEFT_CONFIG}); this "
                f"server has: {self._known()}"
            )
        return path

    def _known(self) -> str:
        """The adapters there are, for a refusal's message."""
        return ", ".join(self.names()) or "none"

    def _load(self, name: str, path: Path) -> LoraAdapter:
        config = read_config(path, "LORA", "a LoRA adapter")
        for field, refusal in (
            ("use_dora", "DoRA adapters are not served"),
            ("modules_to_save", "adapters with modules_to_save (full copies of modules) are not "
             "served"),
            ("fan_in_fan_out", "fan_in_fan_out adapters (Conv1D models) are not served"),
        ):  # fmt: skip
            if config.get(field):
                raise PeftFileError(refusal)
        if config.get("bias", "none") != "none":
            raise PeftFileError(f"bias {config['bias']!r}: adapters with biases are not served")
        file, state = read_weights(path)
        pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
        paths: dict[tuple[int, str], str] = {}
        for key, tensor in state.items():
            match = self._weight.fullmatch(key)
            if match is None or not isinstance(tensor, torch.Tensor):
                raise PeftFileError(self._refusal(file, key))
            layer, module, side = int(match[1]), match[3], match[4]
            if layer >= self.shapes.num_layers:
                raise PeftFileError(
                    f"{key} is for layer {layer}; the model has {self.shapes.num_layers} layers"
                )
            pairs.setdefault((layer, module), {})[side] = tensor
            # As PEFT matches rank_pattern and alpha_pattern: the module's path in the model.
            paths[(layer, module)] = _module_of(key)
        if not pairs:
            raise PeftFileError(f"{file} holds no LoRA weights")
        layers: list[dict[str, tuple[torch.Tensor, torch.Tensor]]] = [
            {} for _ in range(self.shapes.num_layers)
        ]
        rank = 0
        digest = hashlib.sha256()
        for (layer, module), sides in sorted(pairs.items()):
            where = f"layer {layer} {module}"
            if set(sides) != {"A", "B"}:
                raise PeftFileError(f"{where} has lora_{''.join(sides)} without its pair")
            a, b = sides["A"], sides["B"]
            fan_in, fan_out = self.shapes.modules[module]
            r = a.shape[0]
            if a.shape != (r, fan_in) or b.shape != (fan_out, r):
                raise PeftFileError(
                    f"{where}: lora_A is {tuple(a.shape)} and lora_B {tuple(b.shape)}; this "
                    f"model needs (rank, {fan_in}) and ({fan_out}, rank)"
                )
            if not 0 < r <= self.max_rank:
                raise PeftFileError(
                    f"{where} has rank {r}; this server serves ranks up to {self.max_rank} "
                    "(--max-lora-rank)"
                )
            if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
                raise PeftFileError(f"{where} has values that are not finite numbers")
            scaled = b.float() * _scale(config, paths[(layer, module)], r)
            layers[layer][module] = (
                a.t().to(self.device, self.dtype).contiguous(),
                scaled.t().to(self.device, self.dtype).contiguous(),
            )
            digest.update(f"{layer}.{module}".encode())
            digest.update(a.float().numpy().tobytes())
            digest.update(scaled.numpy().tobytes())
            rank = max(rank, r)
        key = b"lora:" + name.encode() + b":" + digest.digest()[:16]
        return LoraAdapter(name, tuple(layers), key, rank)

    def _refusal(self, file: str, key: str) -> str:
        """Why weight `key` of `file` cannot be served: it adapts the vision tower or the
        projector of a vision-language model, or a module that is not a projection."""
        projections = ", ".join(self.shapes.modules)
        vision = self.vision
        if vision is not None:
            module = _module_of(key)
            part = vision.vision_part(module)
            if part is not None:
                return (
                    f"{file} holds {key!r}, LoRA on {module}, which is in {vision.model_type}'s "
                    f"vision tower or projector ({part}): only the language model's projections "
                    f"({projections}) can be adapted; train the adapter with target_modules "
                    f"that match modules under model.{vision.language_model} alone"
                )
            return (
                f"{file} holds {key!r}: only LoRA on the language model's projections "
                f"({projections}) is served for {vision.model_type}"
            )
        return (
            f"{file} holds {key!r}: only LoRA on the projections {projections} is served for "
            f"{self.shapes.family.name}"
        )


def _scale(config: Mapping[str, Any], module_path: str, rank: int) -> float:
    """The update's scale: lora_alpha (or alpha_pattern's match for this module) over the
    rank, or over its square root with use_rslora, as PEFT computes it."""
    alpha = config.get("lora_alpha", 8)
    for pattern, value in (config.get("alpha_pattern") or {}).items():
        if re.match(rf"(.*\.)?({pattern})$", module_path):
            alpha = value
            break
    return alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank


__all__ = ["ADAPTER_NAME", "AdapterStore", "LoraShapes", "VisionNames"]
