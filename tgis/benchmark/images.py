"""Images of vision workloads: random pixels fixed by the run's seed, each encoded once as a
data URL (`data:image/jpeg;base64,...`) that the client sends as it is.

An `ImageSpec` says how many images a prompt carries, their size and format, and whether every
session gets images of its own (`unique`, the default: each image is new to the server, so the
run measures decoding and encoding them) or every session carries the same ones (the server
may find them in its prefix cache after the first request).

Pixels are uniform random bytes drawn from `random.Random` seeded with the run's seed and the
image's index, so a seed fixes every image whatever the text prompts draw, and no two images of
a run are alike. Random pixels do not compress: a PNG is about 3 bytes per pixel, a JPEG about
0.6 (Pillow's quality 75).

    spec = ImageSpec(per_prompt=2, width=512, height=512, format="jpeg", unique=True)
    per_session = image_sets(spec, sessions=64, seed=0)   # 64 tuples of 2 data URLs
"""

from __future__ import annotations

import base64
import io
import random
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from PIL.Image import Image

# Format name -> (Pillow's format, the data URL's media type, Pillow's save options).
FORMATS: dict[str, tuple[str, str, dict[str, int]]] = {
    "png": ("PNG", "image/png", {"compress_level": 6}),
    "jpeg": ("JPEG", "image/jpeg", {"quality": 75}),
}
MAX_IMAGES_PER_PROMPT = 64
MAX_IMAGE_SIDE = 8192
# Pixels of all the distinct images of a run together (768 MiB of RGB; a PNG's base64 text is
# about 4/3 of that): the images are built before the run and held in memory.
MAX_POOL_PIXELS = 2**28
DEFAULT_IMAGE_SIZE = (512, 512)
DEFAULT_IMAGE_FORMAT = "jpeg"
_SIZE = re.compile(r"^\s*(-?\d+)\s*[xX]\s*(-?\d+)\s*$")


@dataclass(frozen=True)
class ImageSpec:
    """`per_prompt` images of `width` x `height` pixels in `format` (png or jpeg) per prompt;
    `unique`: each session has images of its own, else every session the same ones."""

    per_prompt: int
    width: int
    height: int
    format: str = DEFAULT_IMAGE_FORMAT
    unique: bool = True

    def __post_init__(self) -> None:
        if not 1 <= self.per_prompt <= MAX_IMAGES_PER_PROMPT:
            raise ValueError(
                f"images per prompt must be 1 to {MAX_IMAGES_PER_PROMPT}, got {self.per_prompt}"
            )
        for side, value in (("width", self.width), ("height", self.height)):
            if not 1 <= value <= MAX_IMAGE_SIDE:
                raise ValueError(f"image {side} must be 1 to {MAX_IMAGE_SIDE} pixels, got {value}")
        if self.format not in FORMATS:
            raise ValueError(
                f"unknown image format {self.format!r}: choose one of {', '.join(FORMATS)}"
            )

    @property
    def size(self) -> str:
        """`WIDTHxHEIGHT`, as --image-size takes it."""
        return f"{self.width}x{self.height}"

    def distinct(self, sessions: int) -> int:
        """How many different images `sessions` sessions carry."""
        return self.per_prompt * sessions if self.unique else self.per_prompt

    def pool_pixels(self, sessions: int) -> int:
        """Pixels of the distinct images of `sessions` sessions, all together."""
        return self.distinct(sessions) * self.width * self.height

    def describe(self) -> str:
        """e.g. `2 images 512x512 jpeg per request, unique`."""
        return describe_images(self.to_dict())

    def to_dict(self) -> dict[str, object]:
        """The JSON form used in results files."""
        return {
            "per_prompt": self.per_prompt,
            "width": self.width,
            "height": self.height,
            "format": self.format,
            "unique": self.unique,
        }


def describe_images(images: dict[str, Any]) -> str:
    """The JSON form of an ImageSpec (as a results file holds it) in words, e.g.
    `2 images 512x512 jpeg per request, unique`."""
    count = images.get("per_prompt", "?")
    noun = "image" if count == 1 else "images"
    size = f"{images.get('width', '?')}x{images.get('height', '?')}"
    reuse = "unique" if images.get("unique", True) else "repeated"
    return f"{count} {noun} {size} {images.get('format', '?')} per request, {reuse}"


def parse_size(text: str) -> tuple[int, int]:
    """`"640x480"` -> (640, 480); ValueError for anything that is not two whole numbers
    joined by `x` (the bounds are ImageSpec's)."""
    match = _SIZE.match(text)
    if match is None:
        raise ValueError(f"{text!r} is not WIDTHxHEIGHT in pixels")
    return int(match.group(1)), int(match.group(2))


def make_image(width: int, height: int, seed: int, index: int) -> Image:
    """The RGB image `index` of the run seeded with `seed`: uniform random pixels."""
    from PIL import Image

    rng = random.Random(f"tgis-benchmark-image:{seed}:{index}")
    return Image.frombytes("RGB", (width, height), rng.randbytes(width * height * 3))


def data_url(image: Image, format: str) -> str:
    """`image` encoded in `format` (png or jpeg) as a base64 data URL."""
    pillow_format, media_type, options = FORMATS[format]
    buffer = io.BytesIO()
    image.save(buffer, format=pillow_format, **options)
    return f"data:{media_type};base64," + base64.b64encode(buffer.getvalue()).decode("ascii")


def image_sets(spec: ImageSpec, sessions: int, seed: int) -> list[tuple[str, ...]]:
    """The data URLs of each of `sessions` sessions, `spec.per_prompt` apiece; each distinct
    image is drawn and encoded once (repeated images are the same string objects)."""
    encoded: dict[int, str] = {}

    def url(index: int) -> str:
        if index not in encoded:
            encoded[index] = data_url(make_image(spec.width, spec.height, seed, index), spec.format)
        return encoded[index]

    per = spec.per_prompt
    return [
        tuple(url(session * per + k if spec.unique else k) for k in range(per))
        for session in range(sessions)
    ]
