"""What the validation core needs to know of a model, read from its config.json."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from tgis.config.dtypes import cast_type
from tgis.errors import ConfigError


@dataclass(frozen=True)
class NeuronExport:
    """The static shape a Neuron model was compiled for."""

    batch_size: int
    sequence_length: int
    num_cores: int | None = None
    auto_cast_type: str | None = None
    source: str = "config.neuron"

    @staticmethod
    def from_mapping(data: Mapping[str, Any], source: str) -> NeuronExport:
        batch = data.get("batch_size", data.get("max_batch_size"))
        seq = data.get("sequence_length", data.get("max_context_length"))
        if not isinstance(batch, int) or not isinstance(seq, int):
            raise ConfigError(
                f"{source} lacks integer `batch_size` and `sequence_length`",
                "re-export the model with `tgis export-neuron`",
            )
        cores = data.get("num_cores", data.get("tp_degree"))
        cast = cast_type(data.get("auto_cast_type", data.get("torch_dtype")))
        return NeuronExport(
            batch,
            seq,
            cores if isinstance(cores, int) else None,
            cast if isinstance(cast, str) else None,
            source,
        )


@dataclass(frozen=True)
class ModelFacts:
    """The model type, the positions it can address and, if exported, its Neuron shape."""

    model_type: str | None = None
    max_position_embeddings: int | None = None
    neuron: NeuronExport | None = None
    # An encoder-decoder model (T5, BART, ...: config.json's is_encoder_decoder).
    encoder_decoder: bool = False
    # The whole config.json, for the rules that read more of it (which engine can run it).
    config: Mapping[str, Any] = field(default_factory=dict, compare=False, repr=False)
    # A pooling model (embeddings, scores: tgis.pooling), as its files say (hub.read_model_facts).
    pooling: bool = False

    @staticmethod
    def from_config(
        config: Mapping[str, Any], neuron_config: Mapping[str, Any] | None = None
    ) -> ModelFacts:
        """Facts from a config.json dict (and optimum-neuron's neuron_config.json, if any)."""
        text = config.get("text_config") if isinstance(config.get("text_config"), Mapping) else {}
        max_pos = None
        for key in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
            value = config.get(key, text.get(key) if text else None)
            if isinstance(value, int) and value > 0:
                max_pos = value
                break
        neuron = None
        if isinstance(config.get("neuron"), Mapping):
            neuron = NeuronExport.from_mapping(config["neuron"], "config.json `neuron`")
        elif neuron_config is not None:
            neuron = NeuronExport.from_mapping(neuron_config, "neuron_config.json")
        return ModelFacts(
            config.get("model_type"),
            max_pos,
            neuron,
            bool(config.get("is_encoder_decoder")),
            dict(config),
        )
