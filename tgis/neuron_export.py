"""Compile a causal LM for AWS Inferentia2 / Trainium with optimum-neuron.

The static shape is validated by the same core as serving before anything is compiled, so
an exported model is always one `tgis serve --backend neuron` accepts. The SDK calls sit in
`_export_with_optimum`; everything else runs (and is tested) without the Neuron SDK.
"""

from __future__ import annotations

import shutil
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tgis.backends.registry import has_module
from tgis.config import (
    CAST_TO_DTYPE,
    CAST_TYPES,
    LauncherArgs,
    ModelFacts,
    NeuronExport,
    ServeConfig,
    build_serve_config,
)
from tgis.errors import BackendUnavailableError, ConfigError

# optimum-neuron's own cap on the default sequence length of a decoder export.
DEFAULT_SEQUENCE_CAP = 4096
INSTALL_HINT = (
    "install it on an AWS Inferentia2 / Trainium instance (inf2, trn1, trn2) with the Neuron SDK: "
    "pip install 'tgis[neuron]' --extra-index-url https://pip.repos.neuron.amazonaws.com, "
    "or build Dockerfile.neuron"
)


@dataclass(frozen=True)
class ExportRequest:
    """What to compile: a local model directory and the static shape to compile it for."""

    model_dir: Path
    output: Path
    batch_size: int
    sequence_length: int
    num_cores: int
    auto_cast_type: str

    @property
    def torch_dtype(self) -> str:
        return CAST_TO_DTYPE[self.auto_cast_type]

    def neuron_config_kwargs(self) -> dict[str, Any]:
        """Keyword arguments of optimum-neuron 0.4's `NeuronModelForCausalLM.get_neuron_config`."""
        return {
            "model_name_or_path": str(self.model_dir),
            "batch_size": self.batch_size,
            "sequence_length": self.sequence_length,
            "tensor_parallel_size": self.num_cores,
        }


def plan_export(
    model_dir: Path,
    config_json: Mapping[str, Any],
    output: Path,
    env: Mapping[str, str],
    batch_size: int = 1,
    sequence_length: int | None = None,
    num_cores: int = 2,
    auto_cast_type: str = "bf16",
) -> tuple[ExportRequest, ServeConfig]:
    """Validate the export shape through the serving rules and return what to compile.

    Returns the request and the ServeConfig `tgis serve --backend neuron` will derive from the
    compiled model, so the user sees the resulting limits before a long compile.
    """
    cast = auto_cast_type.lower()
    if cast not in CAST_TYPES:
        raise ConfigError(
            f"--auto-cast-type {auto_cast_type!r} is not a Neuron cast type",
            f"use one of {', '.join(CAST_TYPES)}",
        )
    for name, value in (("--batch-size", batch_size), ("--num-cores", num_cores)):
        if value < 1:
            raise ConfigError(f"{name} {value} must be >= 1", f"set {name} to a positive value")
    facts = ModelFacts.from_config(config_json)
    if facts.neuron is not None:
        raise ConfigError(
            f"{model_dir} is already compiled for Neuron ({facts.neuron.source})",
            "export from the original checkpoint instead",
        )
    if sequence_length is None:
        sequence_length = min(facts.max_position_embeddings or 1024, DEFAULT_SEQUENCE_CAP)
    max_pos = facts.max_position_embeddings
    if max_pos is not None and sequence_length > max_pos:
        raise ConfigError(
            f"--sequence-length {sequence_length} exceeds the model's {max_pos} positions "
            "(max_position_embeddings in its config.json)",
            f"set --sequence-length {max_pos} or less",
        )
    if sequence_length < 2:
        raise ConfigError(
            f"--sequence-length {sequence_length} must be >= 2",
            "a prompt and one new token need two positions",
        )
    shape = NeuronExport(batch_size, sequence_length, num_cores, cast, "export parameters")
    compiled = ModelFacts(facts.model_type, facts.max_position_embeddings, shape)
    serve = build_serve_config(LauncherArgs(model_id=str(output), backend="neuron"), compiled, env)
    request = ExportRequest(model_dir, output, batch_size, sequence_length, num_cores, cast)
    return request, serve


def require_neuron_sdk() -> None:
    """One clear line when optimum-neuron or the Neuron compiler is missing."""
    needed = ("optimum.neuron", "neuronxcc", "neuronx_distributed")
    missing = [name for name in needed if not has_module(name)]
    if missing:
        raise BackendUnavailableError(
            f"export-neuron needs {', '.join(missing)} (the Neuron SDK), not installed here",
            INSTALL_HINT,
        )


TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "generation_config.json",
)


def export(request: ExportRequest) -> NeuronExport:
    """Compile and save the model and its tokenizer files to `request.output`.

    Returns the shape read back from the written model, checked against the request.
    """
    from tgis.hub import read_model_facts

    require_neuron_sdk()
    _export_with_optimum(request)
    for name in TOKENIZER_FILES:
        source = request.model_dir / name
        if source.is_file() and not (request.output / name).exists():
            shutil.copy2(source, request.output / name)
    written = read_model_facts(request.output).neuron
    wanted = (request.batch_size, request.sequence_length, request.num_cores)
    if (
        written is None
        or (written.batch_size, written.sequence_length, written.num_cores) != wanted
    ):
        raise ConfigError(
            f"the exported model in {request.output} does not record the requested shape "
            f"batch_size={wanted[0]}, sequence_length={wanted[1]}, num_cores={wanted[2]} (found {written})",
            "check the optimum-neuron version (0.4.x is supported)",
        )
    return written


def _export_with_optimum(request: ExportRequest) -> None:
    """The SDK boundary: optimum-neuron 0.4's decoder export API."""
    import torch
    from optimum.neuron import NeuronModelForCausalLM
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(request.model_dir)
    # optimum-neuron takes the compute dtype from the model config (no auto_cast_type argument).
    config.dtype = getattr(torch, request.torch_dtype)
    neuron_config = NeuronModelForCausalLM.get_neuron_config(
        config=config, **request.neuron_config_kwargs()
    )
    # tgis samples on the host (every warper, seeded, logprobs): the compiled graphs must return
    # logits, not tokens sampled on the device (optimum-neuron's default for llama and others).
    neuron_config.on_device_sampling = False
    model = NeuronModelForCausalLM.export(
        model_id=str(request.model_dir),
        config=config,
        neuron_config=neuron_config,
        load_weights=False,
    )
    request.output.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(request.output)
