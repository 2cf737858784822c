"""A vision-language model's processor on the host: a prompt with images -> token ids, and each
image's pixels and the rows its features fill.

The model's own processor from transformers does the work (resizing, tiling or any-resolution
grids, normalization, and the expansion of each image placeholder into the image's tokens),
once for the whole prompt, so the ids are those transformers' `generate()` gets. What this
module adds is the split per image: its pixels alone (so that the engine encodes it alone, or
finds it in the prefix cache), and the runs of prompt positions its feature rows fill.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tgis.engine.types import ImageInput
from tgis.vision.families import VisionFamily

if TYPE_CHECKING:
    import torch
    from PIL.Image import Image


class ProcessorMismatch(ValueError):
    """The processor's outputs do not match what the family expects of them."""


@dataclass(frozen=True)
class ProcessedPrompt:
    """A prompt with its images, ready for the engine."""

    input_ids: list[int]
    images: tuple[ImageInput, ...]

    @property
    def image_tokens(self) -> int:
        return sum(image.tokens for image in self.images)


class ImageProcessor:
    """The processor of one vision-language model (loaded from its directory)."""

    def __init__(self, family: VisionFamily, processor: Any, image_token_id: int) -> None:
        self.family = family
        self.processor = processor
        self.tokenizer = processor.tokenizer
        self.image_token_id = image_token_id

    @classmethod
    def load(cls, model_dir: Path, family: VisionFamily, config: Any) -> ImageProcessor:
        """The processor saved with the model in `model_dir`; `config` is its transformers
        config (which names the image token)."""
        from transformers import AutoProcessor

        if family.name == "qwen2_vl":
            processor: Any = GridProcessor.load(model_dir, config)
        else:
            processor = AutoProcessor.from_pretrained(model_dir)
        token_id = getattr(config, "image_token_id", None)
        if token_id is None:
            token_id = getattr(config, "image_token_index", None)
        if token_id is None:
            token_id = processor.tokenizer.convert_tokens_to_ids(processor.image_token)
        return cls(family, processor, int(token_id))

    @property
    def placeholder(self) -> str:
        """The text that stands for one image in a prompt (what a chat template writes for an
        image part, and what a markdown image in TGI's `inputs` becomes)."""
        processor = self.processor
        if self.family.name == "qwen2_vl":
            return processor.placeholder
        if self.family.name == "gemma3":
            return str(processor.boi_token)
        return str(processor.image_token)

    def rows_per_image(self, sizes: Sequence[tuple[int, int]]) -> list[int]:
        """The feature rows (image tokens) of images of these (height, width) sizes, as the
        processor expands them."""
        if self.family.name == "qwen2_vl":
            return [self.processor.rows(height, width) for height, width in sizes]
        counts = self.processor._get_num_multimodal_tokens(image_sizes=[list(s) for s in sizes])
        if self.family.name == "idefics3":
            # Its count holds the tile markers too: image tokens are image_seq_len per tile.
            return [n * int(self.processor.image_seq_len) for n in counts.num_image_patches]
        return [int(n) for n in counts.num_image_tokens]

    def process(
        self,
        text: str,
        images: Sequence[Image],
        digests: Sequence[bytes],
        add_special_tokens: bool = True,
    ) -> ProcessedPrompt:
        """`text`, in which each image is its `placeholder` (in order), with `images` (and
        the digests that identify them) -> token ids and one ImageInput per image.
        ProcessorMismatch when the image tokens the processor wrote are not the images' rows
        (a placeholder missing or extra)."""
        # Gemma 3's processor expands its begin-of-image token; the others their image token.
        marker = self.placeholder if self.family.name == "gemma3" else self.processor.image_token
        written = text.count(str(marker))
        if written != len(images):
            raise ProcessorMismatch(
                f"the text holds {written} image placeholders for {len(images)} images"
            )
        try:
            outputs = self.processor(
                text=[text],
                images=list(images),
                return_tensors="pt",
                add_special_tokens=add_special_tokens,
            )
        except ValueError as exc:  # the processor's own checks of text against images
            raise ProcessorMismatch(str(exc)) from None
        ids = [int(i) for i in outputs["input_ids"][0]]
        rows = self.rows_per_image([(img.height, img.width) for img in images])
        positions = [p for p, token in enumerate(ids) if token == self.image_token_id]
        if len(positions) != sum(rows):
            raise ProcessorMismatch(
                f"the prompt has {len(positions)} image tokens where its {len(images)} "
                f"images fill {sum(rows)}"
            )
        pixels = split_pixels(self.family, self.processor, outputs, rows)
        inputs = []
        taken = 0
        for count, digest, own in zip(rows, digests, pixels, strict=True):
            grid = None
            if "image_grid_thw" in own:  # rows laid out as the merged patch grid
                t, h, w = (int(n) for n in own["image_grid_thw"][0])
                merge = int(self.processor.image_processor.merge_size)
                grid = (t, h // merge, w // merge)
            inputs.append(ImageInput(digest, runs(positions[taken : taken + count]), own, grid))
            taken += count
        return ProcessedPrompt(ids, tuple(inputs))


def runs(positions: Sequence[int]) -> tuple[tuple[int, int], ...]:
    """Ascending positions -> (start, length) runs of consecutive ones."""
    out: list[tuple[int, int]] = []
    for p in positions:
        if out and out[-1][0] + out[-1][1] == p:
            out[-1] = (out[-1][0], out[-1][1] + 1)
        else:
            out.append((p, 1))
    return tuple(out)


def split_pixels(
    family: VisionFamily, processor: Any, outputs: Any, rows: Sequence[int]
) -> list[dict[str, torch.Tensor]]:
    """The processor's batched image outputs for one prompt -> each image's own."""
    n = len(rows)
    if family.name == "llava_next":
        # pixel_values [images, most tiles, 3, h, w] (padded), image_sizes [images, 2].
        from transformers.models.llava_next.modeling_llava_next import (
            image_size_to_num_patches,
        )

        image_processor = processor.image_processor
        tile = image_processor.crop_size["height"]
        out = []
        for i in range(n):
            size = outputs["image_sizes"][i]
            tiles = image_size_to_num_patches(
                size.tolist(), image_processor.image_grid_pinpoints, tile
            )
            out.append(
                {
                    "pixel_values": outputs["pixel_values"][i, :tiles],
                    "image_sizes": size[None],
                }
            )
        return out
    if family.name == "idefics3":
        # pixel_values [1, tiles of every image, 3, h, w]; each image's tiles in order.
        per_tile = int(processor.image_seq_len)
        out = []
        start = 0
        for count in rows:
            take = count // per_tile
            item = {"pixel_values": outputs["pixel_values"][0, start : start + take]}
            if "pixel_attention_mask" in outputs:
                item["pixel_attention_mask"] = outputs["pixel_attention_mask"][
                    0, start : start + take
                ]
            out.append(item)
            start += take
        return out
    if family.name == "qwen2_vl":
        # pixel_values [patches of every image, patch dims]; image_grid_thw [images, 3].
        grids = outputs["image_grid_thw"]
        out = []
        start = 0
        for i in range(n):
            size = int(grids[i].prod())
            out.append(
                {
                    "pixel_values": outputs["pixel_values"][start : start + size],
                    "image_grid_thw": grids[i : i + 1],
                }
            )
            start += size
        return out
    if family.name == "gemma3":
        # pixel_values [images, 3, h, w]: one resized image each (no pan-and-scan crops).
        if len(outputs["pixel_values"]) != n:
            raise ProcessorMismatch(
                f"the processor made {len(outputs['pixel_values'])} images of {n} (pan and "
                "scan crops are not taken)"
            )
        return [{"pixel_values": outputs["pixel_values"][i : i + 1]} for i in range(n)]
    raise ProcessorMismatch(f"no split of processed images for the {family.name} family")


class GridProcessor:
    """Qwen2-VL's and Qwen2.5-VL's processor for images: the model's image processor and
    tokenizer, each image token of the text expanded into as many as the image's merged patch
    grid has rows, as transformers' Qwen2VLProcessor does (whose video half needs
    torchvision, which serving images does not)."""

    def __init__(self, image_processor: Any, tokenizer: Any, config: Any) -> None:
        self.image_processor = image_processor
        self.tokenizer = tokenizer
        self.image_token = tokenizer.convert_ids_to_tokens(int(config.image_token_id))
        start, end = (
            tokenizer.convert_ids_to_tokens(int(config.vision_start_token_id)),
            tokenizer.convert_ids_to_tokens(int(config.vision_end_token_id)),
        )
        # What a chat template writes for an image part.
        self.placeholder = f"{start}{self.image_token}{end}"

    @classmethod
    def load(cls, model_dir: Path, config: Any) -> GridProcessor:
        from transformers import AutoImageProcessor, AutoTokenizer

        return cls(
            AutoImageProcessor.from_pretrained(model_dir),
            AutoTokenizer.from_pretrained(model_dir),
            config,
        )

    def rows(self, height: int, width: int) -> int:
        """Image tokens of an image of this size: its patches, merged merge_size^2 to a row."""
        merge = int(self.image_processor.merge_size)
        return int(self.image_processor.get_number_of_image_patches(height, width, {})) // (
            merge * merge
        )

    def __call__(
        self,
        text: Sequence[str],
        images: Sequence[Image],
        return_tensors: str,
        add_special_tokens: bool = True,
    ) -> dict[str, Any]:
        pixels = self.image_processor(images=list(images), return_tensors=return_tensors)
        merge = int(self.image_processor.merge_size) ** 2
        grids = iter(pixels["image_grid_thw"])
        expanded = []
        for one in text:
            pieces = one.split(self.image_token)
            out = [pieces[0]]
            for piece in pieces[1:]:
                out += [self.image_token * (int(next(grids).prod()) // merge), piece]
            expanded.append("".join(out))
        ids = self.tokenizer(
            expanded, add_special_tokens=add_special_tokens, return_tensors=return_tensors
        )
        return {**ids, **pixels}
