"""Profiles: validation, the built-in set, deterministic sampling per seed."""

from __future__ import annotations

import random

import pytest

from tgis.benchmark.images import ImageSpec
from tgis.benchmark.profiles import PROFILES, LengthDistribution, get_profile


def test_builtin_profiles() -> None:
    assert set(PROFILES) == {
        "chat", "code-generation", "code-editing", "classification", "fixed-length", "vision",
    }  # fmt: skip
    assert get_profile("chat").turns > 1
    assert get_profile("code-generation").prompt.mean == 4096
    assert get_profile("classification").prompt.mean > get_profile("code-generation").prompt.mean
    assert get_profile("classification").decode.maximum <= 20
    fixed = get_profile("fixed-length")
    assert fixed.prompt.minimum == fixed.prompt.maximum and fixed.prompt.spread == 0


def test_unknown_profile_names_the_choices() -> None:
    with pytest.raises(ValueError, match=r"unknown profile 'chit': choose one of chat, "):
        get_profile("chit")


def test_sampling_is_deterministic_per_seed_and_clamped() -> None:
    dist = LengthDistribution(mean=100, minimum=90, maximum=130, spread=50)
    first = [dist.sample(random.Random(7)) for _ in range(3)]
    rng_a, rng_b = random.Random(7), random.Random(7)
    a = [dist.sample(rng_a) for _ in range(500)]
    b = [dist.sample(rng_b) for _ in range(500)]
    assert a == b
    assert first == [a[0]] * 3
    assert a != [dist.sample(random.Random(8)) for _ in range(500)]
    assert min(a) == 90 and max(a) == 130  # the spread is wide: both bounds are hit
    assert all(isinstance(x, int) for x in a)


def test_fixed_lengths_consume_no_randomness() -> None:
    rng = random.Random(3)
    assert LengthDistribution.fixed(42).sample(rng) == 42
    assert rng.random() == random.Random(3).random()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ((10, 0, 20, 1.0), "minimum must be at least 1"),
        ((30, 1, 20, 1.0), "need minimum <= mean <= maximum"),
        ((10, 1, 20, -1.0), "spread must be >= 0"),
    ],
)
def test_invalid_distributions(args: tuple[int, int, int, float], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        LengthDistribution(*args)


def test_with_lengths_and_json_form() -> None:
    chat = get_profile("chat")
    short = chat.with_lengths(decode=LengthDistribution.fixed(5))
    assert short.decode.mean == 5 and short.prompt == chat.prompt and short.turns == chat.turns
    assert short.to_dict()["decode"] == {"mean": 5, "minimum": 5, "maximum": 5, "spread": 0.0}


def test_the_vision_profile_carries_images_and_the_others_none() -> None:
    vision = get_profile("vision")
    assert vision.images == ImageSpec(1, 512, 512, "jpeg", unique=True)
    assert vision.turns == 1 and vision.prompt.maximum <= 128
    assert all(p.images is None for name, p in PROFILES.items() if name != "vision")
    assert vision.to_dict()["images"] == {
        "per_prompt": 1, "width": 512, "height": 512, "format": "jpeg", "unique": True,
    }  # fmt: skip
    assert get_profile("chat").to_dict()["images"] is None


def test_with_images_adds_or_removes_them() -> None:
    spec = ImageSpec(3, 64, 32, "png", unique=False)
    chat = get_profile("chat").with_images(spec)
    assert chat.images == spec and chat.turns == get_profile("chat").turns
    assert chat.with_lengths(decode=LengthDistribution.fixed(5)).images == spec
    assert get_profile("vision").with_images(None).images is None
