"""Stop criteria: length, EOS, min tokens, time limit, and stop sequences in streamed text."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from tgis.engine.detokenize import TextStream
from tgis.engine.stopping import StoppingCriteria, StopSequences
from tgis.engine.types import FinishReason
from tgis.params import GenerateParameters as P

EOS = 2


class PieceTokenizer:
    """A tokenizer whose ids decode to fixed pieces: token boundaries exactly as the test says."""

    def __init__(self, pieces: Sequence[str]) -> None:
        self.pieces = ["<unk>", "<s>", "</s>", *pieces]
        self.all_special_ids = [0, 1, EOS]

    def ids(self, *pieces: str) -> list[int]:
        return [self.pieces.index(p) for p in pieces]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False, **_: object) -> str:
        return "".join(
            self.pieces[i] for i in ids if not (skip_special_tokens and i in self.all_special_ids)
        )


TOK = PieceTokenizer(
    ["Hel", "lo", " wor", "ld", "!", " Hi", " w", "x", "a", "STOP", "S", "TO", "P"]
)


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def run(params: P, pieces: Sequence[str], eos: Sequence[int] = (EOS,)) -> tuple[TextStream, list]:
    """Push `pieces` until the stream finishes; return it and its (text, finish) steps."""
    stream = TextStream(TOK, params, eos)
    steps = []
    for token in TOK.ids(*pieces):
        steps.append(stream.push(token))
        if steps[-1].finish is not None:
            break
    return stream, steps


def test_length_eos_and_ignore_eos() -> None:
    criteria = StoppingCriteria(P(max_new_tokens=3), [EOS, 7])
    assert [criteria.on_token(5), criteria.limit_reached()] == [None, None]
    assert criteria.on_token(7) is FinishReason.EOS_TOKEN
    criteria = StoppingCriteria(P(max_new_tokens=2, ignore_eos=True), [EOS])
    assert criteria.on_token(EOS) is None and criteria.limit_reached() is None
    assert criteria.on_token(EOS) is None and criteria.limit_reached() is FinishReason.LENGTH


def test_min_new_tokens_delays_eos_and_stop_sequences() -> None:
    criteria = StoppingCriteria(P(max_new_tokens=10, min_new_tokens=2), [EOS])
    assert criteria.on_token(EOS) is None and not criteria.stop_sequences_allowed
    assert criteria.on_token(EOS) is None and criteria.stop_sequences_allowed
    assert criteria.on_token(EOS) is FinishReason.EOS_TOKEN
    stream, steps = run(P(stop=("lo",), min_new_tokens=3), ["Hel", "lo", " wor", "lo", "!"])
    assert stream.finish_reason is FinishReason.STOP_SEQUENCE
    assert stream.final_text() == "Hello worlo" and len(steps) == 4


def test_time_limit_runs_from_first_scheduling() -> None:
    clock = FakeClock()
    criteria = StoppingCriteria(P(max_new_tokens=100, time_limit_ms=500), [EOS], clock)
    criteria.start()
    clock.now += 0.3
    criteria.on_token(5)
    assert criteria.limit_reached() is None
    clock.now += 0.25
    criteria.on_token(5)
    assert criteria.limit_reached() is FinishReason.TIME_LIMIT
    # Not started explicitly: the clock starts at the first token.
    lazy = StoppingCriteria(P(time_limit_ms=500), [EOS], clock)
    clock.now += 10
    lazy.on_token(5)
    assert lazy.limit_reached() is None
    assert lazy.limit_reached(now=clock.now + 0.5) is FinishReason.TIME_LIMIT


def test_stop_sequence_search_and_partial_matches() -> None:
    stops = StopSequences(["world", "", "wx", "world"])
    assert stops.sequences == ("world", "wx")
    match = stops.find("Hello world!", new_from=9)
    assert match is not None and (match.sequence, match.start, match.end) == ("world", 6, 11)
    assert stops.find("Hello world!", new_from=11) is None  # seen already
    assert stops.partial_len("Hello wor") == 3
    assert stops.partial_len("Hello w") == 1
    assert stops.partial_len("Hello") == 0
    assert not StopSequences([""])


@pytest.mark.parametrize(
    ("stop", "pieces", "included", "omitted"),
    [
        ("lo wo", ["Hel", "lo", " wor", "ld"], "Hello wo", "Hel"),  # 2 tokens, cut mid-token
        ("llo world", ["Hel", "lo", " wor", "ld", "!"], "Hello world", "He"),  # 3 tokens
        ("STOP", ["Hel", "S", "TO", "P", "!"], "HelSTOP", "Hel"),  # 3 tokens, exact
        ("!", ["Hel", "lo", "!", " Hi"], "Hello!", "Hello"),  # 1 token
    ],
)
def test_stop_sequences_across_tokens(
    stop: str, pieces: list[str], included: str, omitted: str
) -> None:
    for include, expected in ((True, included), (False, omitted)):
        stream, steps = run(P(stop=(stop,), include_stop_sequence=include), pieces)
        assert stream.finish_reason is FinishReason.STOP_SEQUENCE
        assert stream.stop_sequence == stop
        assert stream.final_text() == expected
        assert "".join(s.text for s in steps) == expected
        # Streamed text never shows what gets cut.
        shown = ""
        for step in steps:
            shown += step.text
            assert expected.startswith(shown)


def test_partial_match_is_held_back_then_released() -> None:
    params = P(stop=("STOP", "wx"), include_stop_sequence=False, max_new_tokens=6)
    stream, steps = run(params, ["Hel", "S", "TO", " w", "a", "!"])
    assert [s.text for s in steps] == ["Hel", "", "", "STO ", "wa", "!"]
    assert steps[-1].finish is FinishReason.LENGTH
    assert stream.final_text() == "HelSTO wa!"


def test_included_stop_is_streamed_without_holding_back() -> None:
    _, steps = run(P(stop=("STOP",)), ["Hel", "S", "TO", "P", "!"])
    assert [s.text for s in steps] == ["Hel", "S", "TO", "P"]
    assert steps[-1].finish is FinishReason.STOP_SEQUENCE


def test_eos_ends_the_text_without_its_special_piece() -> None:
    stream, steps = run(P(stop=("wx",), include_stop_sequence=False), ["Hel", "lo", " w", "</s>"])
    # "w" could have started "wx": held back, then released when EOS ends the sequence.
    assert [s.text for s in steps] == ["Hel", "lo", " ", "w"]
    assert steps[-1].finish is FinishReason.EOS_TOKEN
    assert stream.final_text() == "Hello w"
    assert stream.token_text == "</s>"  # TGI's token.text keeps special tokens
    kept, _ = run(P(skip_special_tokens=False), ["Hel", "</s>"])
    assert kept.final_text() == "Hel</s>"


def test_eos_beats_length_and_stop_beats_length_on_the_same_token() -> None:
    stream, _ = run(P(max_new_tokens=2), ["Hel", "</s>"])
    assert stream.finish_reason is FinishReason.EOS_TOKEN
    stream, _ = run(P(max_new_tokens=2, stop=("llo",), include_stop_sequence=False), ["Hel", "lo"])
    assert stream.finish_reason is FinishReason.STOP_SEQUENCE and stream.final_text() == "He"
    stream, steps = run(P(max_new_tokens=2), ["Hel", "lo", "!"])
    assert stream.finish_reason is FinishReason.LENGTH and len(steps) == 2


def test_time_limit_finishes_the_stream() -> None:
    clock = FakeClock()
    stream = TextStream(TOK, P(time_limit_ms=1000), [EOS], clock=clock)
    stream.start()
    assert stream.push(TOK.ids("Hel")[0]) == ("Hel", None)
    clock.now += 1.5
    assert stream.push(TOK.ids("lo")[0]) == ("lo", FinishReason.TIME_LIMIT)
    with pytest.raises(RuntimeError, match="already finished"):
        stream.push(TOK.ids("!")[0])
    assert stream.generated_tokens == 2
