"""Incremental detokenization over tokenizers built on the fly: byte-level BPE, sentencepiece
(Metaspace, with and without byte fallback) and WordPiece."""

from __future__ import annotations

import copy
import json
from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from tests.factories import tiny_tokenizer
from tgis.engine.detokenize import (
    IncrementalDetokenizer,
    TextStream,
    TokenizerFacts,
    decoder,
    token_texts,
    tokenizer_facts,
)
from tgis.engine.types import FinishReason
from tgis.params import GenerateParameters as P

SPECIALS = ["<unk>", "<s>", "</s>", "<pad>"]
CORPUS = [
    "Hello world! The quick brown fox jumps over the lazy dog.",
    "A text generation server streams tokens to many clients, don't you think?",
    "Continuous batching keeps the accelerator busy between requests.",
]
TEXTS = [
    "Hello world! The quick brown fox.",
    "Hello 中文 🎉 world! 日本語 ok",
    "streams   tokens,\n\tbatching 👍🏽 done.",
]
EOS = 2


def wrap(tokenizer: Tokenizer) -> PreTrainedTokenizerFast:
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    )


def byte_level() -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer=trainer)
    return wrap(tok)


def sentencepiece_byte_fallback() -> PreTrainedTokenizerFast:
    """Llama-style: "▁" for spaces, unknown characters as <0xXX> byte tokens (not special)."""
    trained = Tokenizer(models.BPE(unk_token="<unk>"))
    trained.normalizer = normalizers.Replace(" ", "▁")
    trainer = trainers.BpeTrainer(vocab_size=200, special_tokens=SPECIALS, show_progress=False)
    trained.train_from_iterator(CORPUS, trainer=trainer)
    model = json.loads(trained.to_str())["model"]
    vocab = dict(model["vocab"])
    for byte in range(256):
        vocab.setdefault(f"<0x{byte:02X}>", len(vocab))
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in model["merges"]]
    tok = Tokenizer(models.BPE(vocab, merges, unk_token="<unk>", byte_fallback=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    tok.add_special_tokens(SPECIALS)
    return wrap(tok)


def wordpiece() -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.WordPiece(unk_token="<unk>"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece()
    trainer = trainers.WordPieceTrainer(
        vocab_size=200, special_tokens=SPECIALS, show_progress=False
    )
    tok.train_from_iterator(CORPUS + TEXTS, trainer=trainer)
    return wrap(tok)


TOKENIZERS: dict[str, Callable[[], PreTrainedTokenizerFast]] = {
    "byte-level": byte_level,
    "metaspace": tiny_tokenizer,
    "sentencepiece-byte-fallback": sentencepiece_byte_fallback,
    "wordpiece": wordpiece,
}


@pytest.fixture(scope="module", params=list(TOKENIZERS))
def tokenizer(request: pytest.FixtureRequest) -> PreTrainedTokenizerFast:
    return TOKENIZERS[request.param]()


def stream_pieces(tok: PreTrainedTokenizerFast, ids: list[int], context: list[int]) -> list[str]:
    detok = IncrementalDetokenizer(tok, context)
    return [*(detok.push(i) for i in ids), detok.flush()]


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("with_context", [False, True])
def test_streamed_pieces_concatenate_to_the_full_decode(
    tokenizer: PreTrainedTokenizerFast, text: str, with_context: bool
) -> None:
    ids = tokenizer.encode(text, add_special_tokens=False)
    context = tokenizer.encode("Say it:", add_special_tokens=False) if with_context else []
    pieces = stream_pieces(tokenizer, ids, context)
    full = tokenizer.decode(context + ids, skip_special_tokens=True)
    prefix = tokenizer.decode(context, skip_special_tokens=True)
    expected = full[len(prefix) :] if context else full
    assert "".join(pieces) == expected
    assert not any("\ufffd" in p for p in pieces)


@pytest.mark.parametrize("make", [byte_level, sentencepiece_byte_fallback])
def test_multibyte_characters_split_across_tokens_are_never_broken(
    make: Callable[[], PreTrainedTokenizerFast],
) -> None:
    tok = make()
    ids = tok.encode("a🎉中b", add_special_tokens=False)
    # The emoji and the CJK character are spread over several byte tokens...
    assert sum(tok.decode([i]) in ("\ufffd", "") for i in ids) >= 4
    pieces = stream_pieces(tok, ids, [])
    # ...and come out whole, once, in order.
    assert [p for p in pieces if p] == ["a", "🎉", "中", "b"]


def test_first_token_keeps_its_leading_space_after_a_prompt() -> None:
    tok = tiny_tokenizer()  # Metaspace: "▁Hello" alone decodes to "Hello"
    prompt = tok.encode("The quick", add_special_tokens=False)
    ids = tok.encode("brown fox", add_special_tokens=False)
    assert "".join(stream_pieces(tok, ids, prompt)) == " brown fox"
    assert "".join(stream_pieces(tok, ids, [])) == "brown fox"


def test_special_tokens_skipped_or_kept() -> None:
    tok = byte_level()
    ids = [*tok.encode("Hello", add_special_tokens=False), EOS, 1]
    ids += tok.encode(" world", add_special_tokens=False)
    assert "".join(stream_pieces(tok, ids, [])) == tok.decode(ids, skip_special_tokens=True)
    detok = IncrementalDetokenizer(tok, skip_special_tokens=False)
    assert "".join(detok.push(i) for i in ids) == "Hello</s><s> world"


def tgi_token_texts(tok: PreTrainedTokenizerFast, prompt: list[int], ids: list[int]) -> list[str]:
    """TGI's decode_token loop for token.text (prefix_offset = prompt_length - 5)."""
    all_ids, prefix, read, out = list(prompt), max(len(prompt) - 5, 0), len(prompt), []
    for i in ids:
        all_ids.append(i)
        prefix_text = tok.decode(all_ids[prefix:read], skip_special_tokens=False)
        new_text = tok.decode(all_ids[prefix:], skip_special_tokens=False)
        if len(new_text) > len(prefix_text) and not new_text.endswith("\ufffd"):
            out.append(new_text[len(prefix_text) :])
            prefix, read = read, len(all_ids)
        else:
            out.append("")
    return out


def test_token_text_is_tgis_incremental_text() -> None:
    tok = byte_level()
    prompt = tok.encode("Say: hello there, my friend", add_special_tokens=False)
    ids = [*tok.encode(" 中文 ok!", add_special_tokens=False), EOS]
    stream = TextStream(tok, P(max_new_tokens=50), [EOS], prompt)
    texts = []
    for i in ids:
        stream.push(i)
        texts.append(stream.token_text)
    assert texts == tgi_token_texts(tok, prompt, ids)
    assert texts[-1] == "</s>" and stream.finish_reason is FinishReason.EOS_TOKEN


def test_token_texts_decode_each_id_alone() -> None:
    tok = tiny_tokenizer()
    ids = [*tok.encode("Hello world", add_special_tokens=False), EOS]
    texts = token_texts(tok, ids)
    assert texts[-1] == "</s>"
    assert texts == [tok.decode([i], clean_up_tokenization_spaces=False) for i in ids]


def test_stop_sequence_inside_a_split_character() -> None:
    tok = byte_level()
    ids = tok.encode("ok 中文 more", add_special_tokens=False)
    for include, expected in ((False, "ok 中"), (True, "ok 中文")):
        stream = TextStream(tok, P(stop=("文",), include_stop_sequence=include), [EOS])
        shown = ""
        for i in ids:
            text, finish = stream.push(i)
            shown += text
            assert "\ufffd" not in shown and expected.startswith(shown)
            if finish:
                break
        assert finish is FinishReason.STOP_SEQUENCE
        assert shown == stream.final_text() == expected


def test_incomplete_character_is_flushed_at_the_length_limit() -> None:
    tok = byte_level()
    ids = tok.encode("ab🎉", add_special_tokens=False)[:-1]  # the emoji's last byte missing
    stream = TextStream(tok, P(max_new_tokens=len(ids)), [EOS])
    steps = [stream.push(i) for i in ids]
    assert steps[-1].finish is FinishReason.LENGTH
    assert "".join(s.text for s in steps) == stream.final_text() == tok.decode(ids)
    assert stream.final_text().endswith("\ufffd")


def test_final_text_before_the_end_includes_held_text() -> None:
    tok = byte_level()
    ids = tok.encode("a🎉", add_special_tokens=False)
    stream = TextStream(tok, P(max_new_tokens=20), [EOS])
    for i in ids[:-1]:
        stream.push(i)
    assert stream.final_text() == tok.decode(ids[:-1])
    assert stream.push(ids[-1]) == ("🎉", None)
    assert stream.final_text() == "a🎉"


@pytest.mark.parametrize("clean_up", [False, True])
def test_the_fast_decoder_is_the_tokenizers_decode(
    tokenizer: PreTrainedTokenizerFast, clean_up: bool
) -> None:
    """The Rust tokenizer called directly gives what transformers' `decode` gives, with and
    without special tokens, with the tokenizer's clean-up of spaces on and off."""
    import random

    # A copy: the module's tokenizer is shared by the other tests.
    tokenizer = copy.copy(tokenizer)
    tokenizer.clean_up_tokenization_spaces = clean_up
    fast = decoder(tokenizer)
    plain_ids = decoder(tokenizer, clean_up=False)
    rng = random.Random(0)
    # Spaces before punctuation: what the clean-up removes.
    texts = [*TEXTS, "A text , don 't you think ? Yes ."]
    ids = [i for text in texts for i in tokenizer(text)["input_ids"]] + [EOS, 0, 1]
    cleaned = 0
    for _ in range(200):
        start = rng.randrange(len(ids))
        window = ids[start : start + rng.randint(1, 8)]
        for skip in (False, True):
            assert fast(window, skip) == tokenizer.decode(window, skip_special_tokens=skip)
            assert plain_ids(window, skip) == tokenizer.decode(
                window, skip_special_tokens=skip, clean_up_tokenization_spaces=False
            )
            cleaned += fast(window, skip) != plain_ids(window, skip)
    assert bool(cleaned) == clean_up  # the clean-up was exercised where it is on
    assert token_texts(tokenizer, ids[:20]) == [
        tokenizer.decode([i], skip_special_tokens=False, clean_up_tokenization_spaces=False)
        for i in ids[:20]
    ]


def test_a_tokenizer_that_decodes_its_own_way_is_called_as_it_is() -> None:
    """A subclass with its own decode (or anything not a transformers fast tokenizer) keeps
    its decode."""
    base = byte_level()

    class Shouting(PreTrainedTokenizerFast):
        def _decode(self, token_ids, skip_special_tokens=False, **kwargs):  # type: ignore[no-untyped-def]
            return super()._decode(token_ids, skip_special_tokens, **kwargs).upper()

    shouting = Shouting(tokenizer_object=base._tokenizer, eos_token="</s>")
    ids = base("hello world")["input_ids"]
    assert decoder(shouting)(ids, True) == "HELLO WORLD"
    assert decoder(base)(ids, True) == "hello world"


# A transformers tokenizer's reads that walk its whole vocabulary (a tenth of a second each, the
# GIL held, for a 128k-token one): none may happen per request.
VOCABULARY_WALKS = ("__len__", "get_vocab", "get_added_vocab", "added_tokens_decoder")


def count_vocabulary_walks(tokenizer: PreTrainedTokenizerFast) -> Counter[str]:
    """Make `tokenizer` count its VOCABULARY_WALKS: it becomes an instance of a subclass of its
    class that counts them (and decodes as its class does). The counts, as they grow."""
    walks: Counter[str] = Counter()
    base = type(tokenizer)

    def counted(name: str) -> Any:
        attr = getattr(base, name)
        if isinstance(attr, property):
            getter = attr.fget
            assert getter is not None

            def read(self: Any) -> Any:
                walks[name] += 1
                return getter(self)

            return property(read)

        def call(self: Any, *args: Any, **kwargs: Any) -> Any:
            walks[name] += 1
            return attr(self, *args, **kwargs)

        return call

    methods = {name: counted(name) for name in VOCABULARY_WALKS}
    tokenizer.__class__ = type(base.__name__, (base,), methods)
    return walks


def test_a_tokenizers_facts_are_read_once() -> None:
    """Special ids and size are read on the first call and kept: detokenizers and streams
    made later (one per request) never walk the vocabulary again."""
    tok = byte_level()
    tok.add_tokens(["<plain>"])
    tok.add_special_tokens({"additional_special_tokens": ["<tool>"]})
    size, tool = len(tok), tok.convert_tokens_to_ids("<tool>")
    walks = count_vocabulary_walks(tok)
    facts = tokenizer_facts(tok)
    assert facts == TokenizerFacts(frozenset({0, 1, 2, 3, tool}), size)
    assert walks["__len__"] == 1
    read = sum(walks.values())
    ids = tok.encode("Hello <tool> world", add_special_tokens=False)
    for _ in range(3):
        assert tokenizer_facts(tok) is facts
        stream = TextStream(tok, P(max_new_tokens=8), [EOS], ids)
        assert stream.push(tool).text == ""  # special: skipped
        IncrementalDetokenizer(tok, ids)
    assert sum(walks.values()) == read
    # Another tokenizer object has facts of its own.
    assert tokenizer_facts(byte_level()).special_ids == frozenset({0, 1, 2, 3})

    class Sizeless:
        all_special_ids = (7,)

    assert tokenizer_facts(Sizeless()) == TokenizerFacts(frozenset({7}), None)
