"""A vision-language model on the device: its language model for the paged forward, and its
vision tower and projector, which turn images into the rows that replace their tokens'
embeddings.

The model is loaded whole with transformers (AutoModelForImageTextToText). Its language model
and output head become a causal LM of the language family (so the paged forward reads its
weights like any other), and the rest (vision tower, projector, any-resolution newline) stays
here, where `encode` runs the model's own `get_image_features` over the step's images at once.
"""

from __future__ import annotations

import logging
from collections.abc import Container, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from tgis.engine.types import ImageInput
from tgis.vision.families import VisionFamily, vision_family_of

if TYPE_CHECKING:
    from transformers import PreTrainedModel

log = logging.getLogger("tgis.backends")


class VisionEncoder:
    """The vision half of a loaded vision-language model (module doc)."""

    def __init__(self, family: VisionFamily, model: PreTrainedModel) -> None:
        self.family = family
        self.model = model  # the whole ForConditionalGeneration (its language model is shared)
        self.inner = model.model  # type: ignore[union-attr]
        parameter = next(getattr(self.inner, self.parts()[0]).parameters())
        self.device = parameter.device
        self.dtype = parameter.dtype

    def parts(self) -> tuple[str, ...]:
        """The inner model's modules other than the language model, by attribute name: the
        vision tower and the projector (what a LoRA adapter may not adapt)."""
        return tuple(
            name
            for name, _module in self.inner.named_children()
            if name != self.family.language_model
        )

    def vision_bytes(self) -> int:
        """Bytes of the weights that are not the language model's."""
        language = getattr(self.inner, self.family.language_model)
        shared = {id(p) for p in language.parameters()}
        shared |= {id(p) for p in self.model.lm_head.parameters()}
        return sum(
            p.numel() * p.element_size() for p in self.model.parameters() if id(p) not in shared
        )

    @torch.inference_mode()
    def encode(self, images: Sequence[ImageInput]) -> list[torch.Tensor]:
        """Each image's features [image.tokens, hidden] in the serving dtype, the images run
        through the tower together."""
        if not images:
            return []
        pixels = [{k: v.to(self.device) for k, v in image.pixels.items()} for image in images]
        name = self.family.name
        if name == "llava_next":
            values = torch.cat([p["pixel_values"] for p in pixels]).to(self.dtype)
            sizes = torch.cat([p["image_sizes"] for p in pixels])
            features = list(self.inner.get_image_features(values, sizes))
        elif name == "idefics3":
            tiles = [p["pixel_values"].shape[0] for p in pixels]
            values = torch.cat([p["pixel_values"] for p in pixels])[None].to(self.dtype)
            masks = None
            if all("pixel_attention_mask" in p for p in pixels):
                masks = torch.cat([p["pixel_attention_mask"] for p in pixels])[None]
            out = self.inner.get_image_features(values, masks)  # [tiles, rows, hidden]
            features = [f.reshape(-1, f.shape[-1]) for f in torch.split(out, tiles)]
        elif name == "qwen2_vl":
            values = torch.cat([p["pixel_values"] for p in pixels]).to(self.dtype)
            grids = torch.cat([p["image_grid_thw"] for p in pixels])
            features = list(self.inner.get_image_features(values, grids))
        elif name == "gemma3":
            values = torch.cat([p["pixel_values"] for p in pixels]).to(self.dtype)
            features = list(self.inner.get_image_features(values))  # [images, rows, hidden]
        else:  # families.py refuses the others before a model is loaded
            raise ValueError(f"no image encoder for the {name} family")
        for image, rows in zip(images, features, strict=True):
            if rows.shape[0] != image.tokens:
                raise ValueError(
                    f"an image gave {rows.shape[0]} feature rows where its prompt holds "
                    f"{image.tokens} image tokens"
                )
        return [rows.to(self.dtype) for rows in features]


def language_model_view(model: PreTrainedModel, family: VisionFamily) -> PreTrainedModel:
    """The language model of `model` with its output head, as a causal LM of its own family:
    the same modules (no copy), so the paged forward reads them like any text model's."""

    config = model.config.get_text_config()  # type: ignore[union-attr]
    with torch.device("meta"):
        causal = causal_lm(config, family)
    causal.model = getattr(model.model, family.language_model)  # type: ignore[union-attr]
    causal.lm_head = model.get_output_embeddings()
    return causal.eval()


def causal_lm(config: Any, family: VisionFamily, **kwargs: Any) -> PreTrainedModel:
    """A causal LM of the language model's family with text config `config` (built where
    torch's default device says; `kwargs` for from_config), which keeps `config` itself."""
    from transformers import AutoModelForCausalLM

    if family.causal_model_type is None:
        return AutoModelForCausalLM.from_config(config, **kwargs)
    # A text config transformers maps to no causal LM: its family's class.
    from transformers import AutoConfig

    settings = {k: v for k, v in config.to_dict().items() if k != "model_type"}
    causal = AutoModelForCausalLM.from_config(
        AutoConfig.for_model(family.causal_model_type, **settings), **kwargs
    )
    causal.config = config
    return causal


def checkpoint_name(family: VisionFamily, name: str, present: Container[str]) -> str:
    """The checkpoint's name of the language model's tensor `name` (as a causal LM names it:
    `model.layers.0...`, `lm_head.weight`): under `model.<language model>.` (transformers'
    layout since 4.52), `<language model>.model.` (before), or the causal LM's own name
    (Qwen2-VL's first checkpoints); `name` itself when none is present."""
    lm = family.language_model
    if name.startswith("model."):
        rest = name.removeprefix("model.")
        candidates = [f"model.{lm}.{rest}", f"{lm}.model.{rest}", name]
    else:
        candidates = [name, f"{lm}.{name}"]
    return next((c for c in candidates if c in present), name)


def load_vision_tower(model_dir: Path, device: torch.device, dtype: torch.dtype) -> VisionEncoder:
    """The vision tower and projector of the vision-language model in `model_dir` alone, on
    `device` in `dtype` (the language model dropped once read: tensor parallelism's first
    shard, whose language model is its slices)."""
    from transformers import AutoConfig, AutoModelForImageTextToText

    config = AutoConfig.from_pretrained(model_dir)
    family = vision_family_of(config.to_dict())
    if family is None:
        raise ValueError(f"{model_dir}: model_type {config.model_type!r} is not a vision family")
    model: Any = AutoModelForImageTextToText.from_pretrained(model_dir, config=config, dtype=dtype)
    setattr(model.model, family.language_model, torch.nn.Module())
    model.lm_head = torch.nn.Module()
    encoder = VisionEncoder(family, model.to(device).eval())
    log.info("vision tower and projector: %.1f MiB", encoder.vision_bytes() / 2**20)
    return encoder


def load_vision_lm(
    model_dir: Path, config: Any, device: torch.device, dtype: torch.dtype
) -> tuple[PreTrainedModel, VisionEncoder]:
    """The vision-language model in `model_dir` (whose transformers config is `config`) on
    `device` in `dtype`: its language model (`language_model_view`) and its vision encoder."""
    from transformers import AutoModelForImageTextToText

    family = vision_family_of(config.to_dict())
    if family is None:
        raise ValueError(f"{model_dir}: model_type {config.model_type!r} is not a vision family")
    model: Any = AutoModelForImageTextToText.from_pretrained(model_dir, config=config, dtype=dtype)
    model = model.to(device).eval()
    encoder = VisionEncoder(family, model)
    log.info("vision tower and projector: %.1f MiB", encoder.vision_bytes() / 2**20)
    return language_model_view(model, family), encoder
