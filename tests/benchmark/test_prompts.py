"""Prompts cut from the standard library's sources to exact token counts."""

from __future__ import annotations

import random
from typing import Any

import pytest

from tests.benchmark.conftest import SMALL, open_data_url
from tgis.benchmark.images import ImageSpec
from tgis.benchmark.profiles import LengthDistribution, get_profile
from tgis.benchmark.prompts import (
    ECHO_REQUEST,
    build_sessions,
    count_tokens,
    load_corpus,
    make_prompt,
)


def test_corpus_is_the_standard_library() -> None:
    corpus = load_corpus()
    assert len(corpus) > 1_000_000
    assert "def " in corpus and "import " in corpus


@pytest.mark.parametrize("tokens", [1, 2, 7, 64, 500, 3000])
def test_prompts_have_exact_token_counts(tokenizer: Any, tokens: int) -> None:
    rng = random.Random(tokens)
    for _ in range(3):
        assert count_tokens(tokenizer, make_prompt(tokenizer, tokens, rng)) == tokens


def test_prompts_with_a_tokenizers_tokenizer(tokenizer: Any) -> None:
    raw = tokenizer.backend_tokenizer  # a `tokenizers.Tokenizer`: .encode returns an Encoding
    prompt = make_prompt(raw, 50, random.Random(0))
    assert len(raw.encode(prompt, add_special_tokens=False).ids) == 50


def test_prompt_rejects_empty_length(tokenizer: Any) -> None:
    with pytest.raises(ValueError, match="at least 1 token"):
        make_prompt(tokenizer, 0, random.Random(0))


def test_sessions_are_deterministic_per_seed(tokenizer: Any) -> None:
    a = build_sessions(SMALL, tokenizer, 5, seed=1)
    assert a == build_sessions(SMALL, tokenizer, 5, seed=1)
    assert a != build_sessions(SMALL, tokenizer, 5, seed=2)
    assert len({s.turns[0].text for s in a}) == 5


def test_chat_sessions_have_turns_of_sampled_lengths(tokenizer: Any) -> None:
    chat = get_profile("chat").with_lengths(prompt=LengthDistribution(30, 10, 60, 15.0))
    sessions = build_sessions(chat, tokenizer, 4, seed=0)
    assert all(len(s.turns) == chat.turns for s in sessions)
    turns = [t for s in sessions for t in s.turns]
    assert len({t.tokens for t in turns}) > 1  # lengths vary
    for turn in turns:
        assert count_tokens(tokenizer, turn.text) == turn.tokens
        assert 10 <= turn.tokens <= 60
        assert chat.decode.minimum <= turn.max_new_tokens <= chat.decode.maximum


def test_code_editing_prompts_hold_their_answer(tokenizer: Any) -> None:
    profile = get_profile("code-editing").with_lengths(prompt=LengthDistribution.fixed(80))
    for session in build_sessions(profile, tokenizer, 3, seed=5):
        (turn,) = session.turns
        code, rest = turn.text.split(ECHO_REQUEST)
        assert rest == code.split("\n", 1)[0] + "\n"  # the answer begins as the code did
        assert count_tokens(tokenizer, code) == 60  # three quarters of the length
        assert turn.tokens == count_tokens(tokenizer, turn.text)


def test_images_go_to_each_sessions_first_turn_and_leave_the_texts_alone(tokenizer: Any) -> None:
    chat = get_profile("chat").with_lengths(prompt=LengthDistribution(20, 10, 30, 5.0))
    spec = ImageSpec(2, 24, 12, "png")
    with_images = build_sessions(chat.with_images(spec), tokenizer, 3, seed=4)
    plain = build_sessions(chat, tokenizer, 3, seed=4)
    for session, text_only in zip(with_images, plain, strict=True):
        first, *later = session.turns
        assert len(first.images) == 2 and all(not t.images for t in later)
        # Same texts, lengths and answer lengths as without images: another random stream.
        assert [(t.text, t.tokens, t.max_new_tokens) for t in session.turns] == [
            (t.text, t.tokens, t.max_new_tokens) for t in text_only.turns
        ]
        for url in first.images:
            media, image = open_data_url(url)
            assert media == "image/png" and image.size == (24, 12)
    assert len({url for s in with_images for url in s.turns[0].images}) == 6  # unique
    assert with_images == build_sessions(chat.with_images(spec), tokenizer, 3, seed=4)
    repeated = build_sessions(
        chat.with_images(ImageSpec(2, 24, 12, "png", unique=False)), tokenizer, 3, seed=4
    )
    assert len({s.turns[0].images for s in repeated}) == 1
    assert "data:" not in repr(with_images[0])  # a turn's repr leaves the images out


def test_vision_sessions(tokenizer: Any) -> None:
    vision = get_profile("vision").with_images(ImageSpec(1, 32, 32))
    sessions = build_sessions(vision, tokenizer, 4, seed=0)
    for session in sessions:
        (turn,) = session.turns
        (url,) = turn.images
        assert open_data_url(url)[0] == "image/jpeg"
        assert count_tokens(tokenizer, turn.text) == turn.tokens  # the text's tokens only
