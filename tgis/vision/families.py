"""The vision-language families tgis serves, and what each takes: the one table.

A vision-language model is a language model of a family the paged forward runs
(backends/models/families.py) behind a vision tower and a projector. Its processor (from
transformers) turns each image into pixels and the prompt's image placeholder into as many
image tokens as the image has feature rows; the engine puts the features in those rows' place
(tgis.vision.processor on the host, tgis.vision.encoder on the device).

Reads config.json alone (no torch): the chooser, `serve --check` and the server ask it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class VisionFamily:
    """One family of vision-language models (module doc)."""

    name: str
    model_types: tuple[str, ...]
    # How the images reach the language model (`serve --check` and the start-up log say it).
    describes: str
    # The attribute of the ForConditionalGeneration's inner model that is the language model.
    language_model: str
    # Why tgis cannot serve it yet (None: it can).
    refusal: str | None = None
    # The model type whose causal LM class holds its language model, where transformers
    # maps its text config to none (None: AutoModelForCausalLM takes the text config).
    causal_model_type: str | None = None
    # Whether an image's rows attend to each other both ways (not only to earlier rows).
    bidirectional: bool = False


FAMILIES: tuple[VisionFamily, ...] = (
    VisionFamily(
        "llava_next",
        ("llava_next",),
        "CLIP tower over any-resolution tiles, a two-layer projector, a newline row per "
        "tile row; the language model is Llama or Mistral",
        "language_model",
    ),
    VisionFamily(
        "idefics3",
        ("idefics3", "smolvlm"),
        "SigLIP tower over the image split into tiles plus the whole image, pixel shuffle "
        "and a projection; the language model is Llama",
        "text_model",
    ),
    VisionFamily(
        "qwen2_vl",
        ("qwen2_vl", "qwen2_5_vl"),
        "a vision tower over patches at native resolution, merged 2x2 into rows laid out "
        "as a grid; the language model is Qwen2 rotating with three position streams "
        "(multimodal rope) that follow the grid",
        "language_model",
        causal_model_type="qwen2",
    ),
    VisionFamily(
        "gemma3",
        ("gemma3",),
        "SigLIP tower at 896x896, pooled to 256 rows that attend to each other both ways; "
        "the language model is Gemma 3",
        "language_model",
        bidirectional=True,
    ),
)
_BY_TYPE = {t: family for family in FAMILIES for t in family.model_types}
VISION_MODEL_TYPES = tuple(_BY_TYPE)


def vision_family_of(config: Mapping[str, Any]) -> VisionFamily | None:
    """The vision family of a config.json's model (None: not a vision-language model tgis
    knows)."""
    return _BY_TYPE.get(str(config.get("model_type")))


def text_config(config: Mapping[str, Any]) -> Mapping[str, Any]:
    """The language model's part of a vision-language config.json (the config itself for a
    text model)."""
    if vision_family_of(config) is None:
        return config
    text = config.get("text_config")
    if isinstance(text, Mapping):
        return text
    # Qwen2-VL's first configs keep the language model's settings at the top level.
    if "num_hidden_layers" not in config:
        return {}
    return {**config, "model_type": f"{config['model_type']}_text"}
