"""Workload profiles: the length distributions of prompts and answers, how many turns, and the
images each prompt carries (none but for the `vision` profile, unless asked for).

A `LengthDistribution` is a normal distribution (`mean`, standard deviation `spread`) clamped to
`[minimum, maximum]` and rounded to whole tokens; `spread=0` gives fixed lengths. Sampling only
ever uses the `random.Random` it is given, so a seed fixes every length of a run.

    profile = get_profile("code-generation")
    rng = random.Random(0)
    prompt_tokens, new_tokens = profile.prompt.sample(rng), profile.decode.sample(rng)
"""

from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass

from tgis.benchmark.images import DEFAULT_IMAGE_FORMAT, DEFAULT_IMAGE_SIZE, ImageSpec


@dataclass(frozen=True)
class LengthDistribution:
    """Token lengths: normal(mean, spread) clamped to [minimum, maximum], at least 1."""

    mean: int
    minimum: int
    maximum: int
    spread: float = 0.0

    def __post_init__(self) -> None:
        if self.minimum < 1:
            raise ValueError(f"minimum must be at least 1 token, got {self.minimum}")
        if not self.minimum <= self.mean <= self.maximum:
            raise ValueError(
                f"need minimum <= mean <= maximum, got {self.minimum} <= {self.mean} <= {self.maximum}"
            )
        if self.spread < 0:
            raise ValueError(f"spread must be >= 0, got {self.spread}")

    @classmethod
    def fixed(cls, length: int) -> LengthDistribution:
        """Always `length` tokens."""
        return cls(length, length, length, 0.0)

    def sample(self, rng: random.Random) -> int:
        """One length drawn with `rng` (no draw is consumed when the spread is 0)."""
        if self.spread == 0:
            return self.mean
        value = round(rng.gauss(self.mean, self.spread))
        return max(self.minimum, min(self.maximum, value))

    def to_dict(self) -> dict[str, float]:
        """The JSON form used in results files."""
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class Profile:
    """A named workload: prompt and decode lengths, and turns per conversation.

    For multi-turn profiles (`turns > 1`), `prompt` is the length of each new user message; the
    request of turn k carries the prompts and answers of turns 1..k-1 before it.

    With `images`, the first message of each session carries `images.per_prompt` images before
    its text; later turns resend them with the rest of the history, so every request of the
    session carries them. `prompt` counts text tokens only.
    """

    name: str
    description: str
    prompt: LengthDistribution
    decode: LengthDistribution
    turns: int = 1
    # The prompt is a piece of code, a request to write it again, and its beginning: the
    # answer is mostly in the prompt (editing, reformatting, quoting).
    echo: bool = False
    images: ImageSpec | None = None

    def __post_init__(self) -> None:
        if self.turns < 1:
            raise ValueError(f"turns must be at least 1, got {self.turns}")

    def with_lengths(
        self,
        prompt: LengthDistribution | None = None,
        decode: LengthDistribution | None = None,
        turns: int | None = None,
    ) -> Profile:
        """A copy with some distributions replaced (what `--prompt-*`/`--decode-*` flags do)."""
        return dataclasses.replace(
            self,
            prompt=prompt or self.prompt,
            decode=decode or self.decode,
            turns=turns or self.turns,
        )

    def with_images(self, images: ImageSpec | None) -> Profile:
        """A copy whose prompts carry `images` (None: text only)."""
        return dataclasses.replace(self, images=images)

    def to_dict(self) -> dict[str, object]:
        """The JSON form used in results files."""
        return {
            "name": self.name,
            "description": self.description,
            "prompt": self.prompt.to_dict(),
            "decode": self.decode.to_dict(),
            "turns": self.turns,
            "echo": self.echo,
            "images": None if self.images is None else self.images.to_dict(),
        }


PROFILES: dict[str, Profile] = {
    p.name: p
    for p in (
        Profile(
            "chat",
            "multi-turn conversations: each turn resends the previous prompts and answers",
            prompt=LengthDistribution(mean=200, minimum=20, maximum=800, spread=100),
            decode=LengthDistribution(mean=200, minimum=20, maximum=600, spread=100),
            turns=3,
        ),
        Profile(
            "code-generation",
            "long code contexts (~4k tokens) with short completions",
            prompt=LengthDistribution(mean=4096, minimum=3072, maximum=5120, spread=512),
            decode=LengthDistribution(mean=50, minimum=10, maximum=100, spread=20),
        ),
        Profile(
            "classification",
            "very long documents with a few tokens of answer",
            prompt=LengthDistribution(mean=10000, minimum=8000, maximum=12000, spread=1000),
            decode=LengthDistribution(mean=10, minimum=1, maximum=20, spread=5),
        ),
        Profile(
            "code-editing",
            "code to write again with a small change: the answer is mostly in the prompt (what "
            "speculative decoding's prompt lookup drafts from)",
            prompt=LengthDistribution(mean=300, minimum=100, maximum=600, spread=100),
            decode=LengthDistribution(mean=128, minimum=32, maximum=256, spread=32),
            echo=True,
        ),
        Profile(
            "fixed-length",
            "every request has the same prompt and answer lengths",
            prompt=LengthDistribution.fixed(200),
            decode=LengthDistribution.fixed(800),
        ),
        Profile(
            "vision",
            "short questions about images: by default one 512x512 jpeg per request, each "
            "session's images new to the server",
            prompt=LengthDistribution(mean=64, minimum=16, maximum=128, spread=24),
            decode=LengthDistribution(mean=128, minimum=32, maximum=256, spread=48),
            images=ImageSpec(1, *DEFAULT_IMAGE_SIZE, format=DEFAULT_IMAGE_FORMAT, unique=True),
        ),
    )
}


def get_profile(name: str) -> Profile:
    """The built-in profile `name`; ValueError naming the choices otherwise."""
    try:
        return PROFILES[name]
    except KeyError:
        raise ValueError(
            f"unknown profile {name!r}: choose one of {', '.join(sorted(PROFILES))}"
        ) from None
