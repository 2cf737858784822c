"""Images of vision workloads: the spec's bounds, WxH parsing, pixels fixed by the seed,
data URLs Pillow reads back, and unique against repeated images."""

from __future__ import annotations

import pytest

from tests.benchmark.conftest import open_data_url
from tgis.benchmark.images import (
    MAX_IMAGE_SIDE,
    MAX_IMAGES_PER_PROMPT,
    ImageSpec,
    data_url,
    describe_images,
    image_sets,
    make_image,
    parse_size,
)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"per_prompt": 0}, "images per prompt must be 1 to 64, got 0"),
        ({"per_prompt": MAX_IMAGES_PER_PROMPT + 1}, "images per prompt must be 1 to 64"),
        ({"width": 0}, "image width must be 1 to 8192 pixels, got 0"),
        ({"height": -3}, "image height must be 1 to 8192 pixels, got -3"),
        ({"width": MAX_IMAGE_SIDE + 1}, "image width must be 1 to 8192"),
        ({"format": "gif"}, "unknown image format 'gif': choose one of png, jpeg"),
    ],
)
def test_spec_bounds(kwargs: dict[str, object], message: str) -> None:
    fields: dict[str, object] = {"per_prompt": 1, "width": 8, "height": 8, **kwargs}
    with pytest.raises(ValueError, match=message):
        ImageSpec(**fields)  # type: ignore[arg-type]


def test_spec_json_words_and_pool() -> None:
    spec = ImageSpec(2, 640, 480, "png", unique=False)
    assert spec.to_dict() == {
        "per_prompt": 2, "width": 640, "height": 480, "format": "png", "unique": False,
    }  # fmt: skip
    assert spec.size == "640x480"
    assert spec.describe() == "2 images 640x480 png per request, repeated"
    assert describe_images(ImageSpec(1, 8, 4).to_dict()) == "1 image 8x4 jpeg per request, unique"
    assert spec.distinct(10) == 2 and spec.pool_pixels(10) == 2 * 640 * 480
    unique = ImageSpec(2, 640, 480)
    assert unique.distinct(10) == 20 and unique.pool_pixels(10) == 20 * 640 * 480


@pytest.mark.parametrize(
    ("text", "size"), [("640x480", (640, 480)), (" 32X16 ", (32, 16)), ("0x-1", (0, -1))]
)
def test_parse_size(text: str, size: tuple[int, int]) -> None:
    assert parse_size(text) == size  # bounds are ImageSpec's, and the flag's check


@pytest.mark.parametrize("text", ["640", "640x", "x480", "640*480", "6.5x4", "big"])
def test_parse_size_refuses_what_is_not_w_x_h(text: str) -> None:
    with pytest.raises(ValueError, match="is not WIDTHxHEIGHT in pixels"):
        parse_size(text)


def test_pixels_are_fixed_by_seed_and_index() -> None:
    image = make_image(24, 16, seed=3, index=0)
    assert image.size == (24, 16) and image.mode == "RGB"
    assert image.tobytes() == make_image(24, 16, seed=3, index=0).tobytes()
    assert image.tobytes() != make_image(24, 16, seed=3, index=1).tobytes()
    assert image.tobytes() != make_image(24, 16, seed=4, index=0).tobytes()
    assert len(set(image.tobytes())) > 200  # noise: nearly every byte value occurs


@pytest.mark.parametrize(
    ("fmt", "pillow", "media_type"), [("png", "PNG", "image/png"), ("jpeg", "JPEG", "image/jpeg")]
)
def test_data_urls_read_back_with_pillow(fmt: str, pillow: str, media_type: str) -> None:
    image = make_image(40, 30, seed=0, index=0)
    media, opened = open_data_url(data_url(image, fmt))
    assert media == media_type and opened.format == pillow and opened.size == (40, 30)
    if fmt == "png":  # lossless: the very pixels
        assert opened.convert("RGB").tobytes() == image.tobytes()


def test_unique_images_differ_in_every_session() -> None:
    sets = image_sets(ImageSpec(2, 16, 8, "png"), sessions=3, seed=0)
    assert [len(s) for s in sets] == [2, 2, 2]
    urls = [url for s in sets for url in s]
    assert len(set(urls)) == 6
    assert sets == image_sets(ImageSpec(2, 16, 8, "png"), sessions=3, seed=0)
    assert set(urls).isdisjoint(u for s in image_sets(ImageSpec(2, 16, 8, "png"), 3, 1) for u in s)
    for url in urls:
        media, image = open_data_url(url)
        assert media == "image/png" and image.size == (16, 8)


def test_repeated_images_are_the_same_in_every_session_and_encoded_once() -> None:
    sets = image_sets(ImageSpec(2, 16, 8, "jpeg", unique=False), sessions=4, seed=0)
    assert len(set(sets)) == 1 and len(set(sets[0])) == 2  # two images, the same for all
    assert all(s[0] is sets[0][0] and s[1] is sets[0][1] for s in sets)  # one string each
    # The first session's images are the unique run's first ones: only their reuse differs.
    assert sets[0] == image_sets(ImageSpec(2, 16, 8, "jpeg"), sessions=4, seed=0)[0]
