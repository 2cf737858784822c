"""Image requests with the generation features beside them, on `tgis serve`'s app over tiny
random Llava-Next and Qwen2-VL models whose tokenizer is byte-level (so that structured output
can use it), each checked against transformers on the processor's inputs:

- structured output (TGI `grammar`, json and regex; OpenAI `response_format` json_schema): the
  output satisfies the schema or regex and is the tokens `generate()` chooses under the same
  grammar's masks (llguidance's, applied as a logits processor);
- top-n tokens and logprobs (TGI `details`, `top_n_tokens`, `decoder_input_details`; OpenAI
  `logprobs` and `top_logprobs`): the log_softmax of the model's scores, and their top-k;
- speculative decoding by prompt lookup (`--speculate 3`): greedy tokens equal `generate()`'s
  exactly, drafts are accepted (counted in /metrics), under a grammar too;
- streaming (`/generate_stream` with the `text-generation` client, OpenAI `stream=True`);
- image placeholder tokens in the answer (pushed there by `logit_bias`) are text to the model."""

from __future__ import annotations

import base64
import io
import json
import re
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import pytest
import torch
from openai import OpenAI
from text_generation import Client
from text_generation.types import Grammar, GrammarType

from tests.factories import (
    QWEN_VL_IMAGE,
    VisionArch,
    make_vision_dir,
    qwen_vl_processor,
    random_image,
)
from tests.server.conftest import demo_app, live_server
from tests.server.test_structured_output import PERSON
from tgis.params import GrammarSpec

ARCHS: tuple[VisionArch, ...] = ("llava_next", "qwen2_vl")
# Weights whose greedy text varies with the image and mixes repeats with fresh tokens.
SEEDS: dict[VisionArch, int] = {"llava_next": 3, "qwen2_vl": 0}
NEW_TOKENS = 8
TAIL = " The quick brown fox jumps over the lazy dog. Hello world, hello tokens."


def image_chat(image: Any, text: str) -> Any:
    """One user turn: the image, then `text`."""
    return [
        {
            "role": "user",
            "content": [
                {"type": "image_url", "image_url": {"url": data_url(image)}},
                {"type": "text", "text": text},
            ],
        }
    ]


CODE = r"[0-9]{3}-[a-z]{2,5}"
# float32 on both sides; the paged forward sums in another order than transformers'.
TOLERANCE = 1e-4


def data_url(image: Any) -> str:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def _grammar_processor(tokenizer: Any, eos: list[int], spec: GrammarSpec, prompt: int) -> Any:
    """A logits processor that keeps the tokens llguidance allows after what was generated
    past `prompt` tokens (-inf elsewhere, and past the tokenizer's vocabulary)."""
    import llguidance as llg
    import llguidance.hf
    from llguidance.torch import allocate_token_bitmask, fill_next_token_bitmask
    from transformers import LogitsProcessor

    size = len(tokenizer)
    matcher = llg.LLMatcher(
        llguidance.hf.from_tokenizer(tokenizer, n_vocab=size, eos_token=eos), spec.grammar()
    )
    assert not matcher.is_error(), matcher.get_error()

    class Masked(LogitsProcessor):
        def __call__(self, input_ids: torch.LongTensor, scores: torch.Tensor) -> torch.Tensor:
            if input_ids.shape[1] > prompt:
                assert matcher.consume_token(int(input_ids[0, -1]))
            bitmask = allocate_token_bitmask(1, size)
            fill_next_token_bitmask(matcher, bitmask)
            bits = (bitmask[0].unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1
            allowed = torch.zeros(scores.shape[-1], dtype=torch.bool)
            allowed[:size] = bits.flatten()[:size].bool()
            return scores.masked_fill(~allowed, float("-inf"))

    return Masked()


@dataclass
class Oracle:
    """transformers' model and processor over one model directory."""

    arch: VisionArch
    model_dir: Path
    processor: Any
    model: Any

    @property
    def placeholder(self) -> str:
        """What stands for an image in the processor's text."""
        return QWEN_VL_IMAGE if self.arch.startswith("qwen") else "<image>"

    @property
    def tokenizer(self) -> Any:
        return self.processor.tokenizer

    def inputs(self, text: str, images: list[Any], chat: bool = False) -> Any:
        return self.processor(
            text=text, images=images, return_tensors="pt", add_special_tokens=not chat
        )

    def chat_prompt(self, text: str) -> str:
        """The chat template's prompt of one user turn: an image, then `text`."""
        parts = [{"type": "image"}, {"type": "text", "text": text}]
        return str(
            self.processor.apply_chat_template(
                [{"role": "user", "content": parts}], add_generation_prompt=True
            )
        )

    def generate(
        self,
        text: str,
        images: list[Any],
        new_tokens: int = NEW_TOKENS,
        chat: bool = False,
        grammar: GrammarSpec | None = None,
    ) -> tuple[list[int], torch.Tensor]:
        """Greedy tokens and the log_softmax of the scores that chose each [steps, vocab]."""
        inputs = self.inputs(text, images, chat)
        prompt = inputs["input_ids"].shape[1]
        processors = []
        if grammar is not None:
            eos = self.model.generation_config.eos_token_id
            eos = [eos] if isinstance(eos, int) else list(eos)
            processors.append(_grammar_processor(self.tokenizer, eos, grammar, prompt))
        with torch.no_grad():
            out = self.model.generate(
                **inputs,
                max_new_tokens=new_tokens,
                do_sample=False,
                output_scores=True,
                return_dict_in_generate=True,
                logits_processor=processors,
            )
        scores = torch.log_softmax(torch.cat(out.scores).float(), dim=-1)
        return out.sequences[0, prompt:].tolist(), scores

    def prompt_logprobs(self, text: str, images: list[Any]) -> tuple[list[int], list[float]]:
        """The prompt's ids, and the logprob of each after the first given those before it."""
        inputs = self.inputs(text, images)
        with torch.no_grad():
            logits = self.model(**inputs).logits[0].float()
        ids = inputs["input_ids"][0]
        logprobs = torch.log_softmax(logits[:-1], dim=-1).gather(1, ids[1:, None])[:, 0]
        return ids.tolist(), logprobs.tolist()

    def decode(self, ids: list[int]) -> str:
        return str(self.tokenizer.decode(ids, skip_special_tokens=True))


@dataclass
class Served:
    oracle: Oracle
    url: str

    def markdown(self, image: Any) -> str:
        return f"![]({data_url(image)})"

    def openai(self) -> OpenAI:
        return OpenAI(base_url=f"{self.url}/v1", api_key="none", timeout=60, max_retries=0)

    def metric(self, name: str) -> float:
        for line in httpx.get(f"{self.url}/metrics").text.splitlines():
            if line.startswith(f"{name} "):
                return float(line.split()[1])
        raise AssertionError(f"{name} not in /metrics")


@pytest.fixture(scope="module")
def serve(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[..., Served]]:
    """A server of `arch` with `speculate` draft tokens per step, started on first use and
    kept for the module (tests in any order share them)."""
    from transformers import AutoModelForImageTextToText, AutoProcessor

    oracles: dict[VisionArch, Oracle] = {}
    servers: dict[tuple[VisionArch, int], Served] = {}
    with ExitStack() as stack:

        def served(arch: VisionArch, speculate: int = 0) -> Served:
            if arch not in oracles:
                model_dir = make_vision_dir(
                    tmp_path_factory.mktemp(arch), arch, SEEDS[arch], byte_level=True
                )
                processor = (
                    qwen_vl_processor(model_dir)
                    if arch.startswith("qwen")
                    else AutoProcessor.from_pretrained(model_dir)
                )
                model = AutoModelForImageTextToText.from_pretrained(model_dir).eval()
                oracles[arch] = Oracle(arch, model_dir, processor, model)
            if (arch, speculate) not in servers:
                oracle = oracles[arch]
                flags = {"speculate": speculate} if speculate else {}
                app = stack.enter_context(demo_app(oracle.model_dir, 1024, **flags))
                url, _ = stack.enter_context(live_server(app))
                servers[arch, speculate] = Served(oracle, url)
            return servers[arch, speculate]

        yield served


def _generate(served: Served, inputs: str, **parameters: Any) -> dict[str, Any]:
    response = httpx.post(
        f"{served.url}/generate",
        json={"inputs": inputs, "parameters": {"max_new_tokens": NEW_TOKENS, **parameters}},
        timeout=60,
    )
    assert response.status_code == 200, response.text
    return dict(response.json())


# Structured output


@pytest.mark.parametrize("speculate", [0, 3])
@pytest.mark.parametrize("arch", ARCHS)
def test_tgi_json_grammar_with_an_image(
    serve: Callable[..., Served], arch: VisionArch, speculate: int
) -> None:
    """A JSON schema with an image in the prompt: the output parses, satisfies the schema,
    ends on EOS, and is the tokens generate() chooses under the schema's masks (with drafts
    verified under the grammar too)."""
    served = serve(arch, speculate)
    oracle = served.oracle
    image = random_image(40, 60, 1)
    answer = _generate(
        served,
        f"Who is it? {served.markdown(image)}{TAIL}",
        max_new_tokens=40,
        details=True,
        grammar={"type": "json", "value": PERSON},
    )
    jsonschema.validate(json.loads(answer["generated_text"]), PERSON)
    assert answer["details"]["finish_reason"] == "eos_token"
    expected, _ = oracle.generate(
        f"Who is it? {oracle.placeholder}{TAIL}",
        [image],
        new_tokens=40,
        grammar=GrammarSpec.json_schema(PERSON),
    )
    assert [t["id"] for t in answer["details"]["tokens"]] == expected
    assert answer["generated_text"] == oracle.decode(expected)


@pytest.mark.parametrize("arch", ARCHS)
def test_tgi_regex_grammar_with_an_image_through_the_client(
    serve: Callable[..., Served], arch: VisionArch
) -> None:
    """A regex through the text-generation client, generated and streamed: the text matches
    it and is generate()'s under the regex's masks."""
    served = serve(arch)
    oracle = served.oracle
    image = random_image(64, 30, 2)
    client = Client(served.url, timeout=60)
    grammar = Grammar(type=GrammarType.Regex, value=CODE)
    prompt = f"Code: {served.markdown(image)}{TAIL}"
    answer = client.generate(prompt, max_new_tokens=20, grammar=grammar)
    assert re.fullmatch(CODE, answer.generated_text)
    expected, _ = oracle.generate(
        f"Code: {oracle.placeholder}{TAIL}",
        [image],
        new_tokens=20,
        grammar=GrammarSpec("regex", CODE),
    )
    assert [t.id for t in answer.details.tokens] == expected
    streamed = list(client.generate_stream(prompt, max_new_tokens=20, grammar=grammar))
    assert [r.token.id for r in streamed] == expected
    assert streamed[-1].generated_text == answer.generated_text


@pytest.mark.parametrize("arch", ARCHS)
def test_openai_json_schema_with_an_image(serve: Callable[..., Served], arch: VisionArch) -> None:
    """response_format json_schema on a chat turn with an image part, plain and streamed: the
    content satisfies the schema and is generate()'s on the chat template's prompt."""
    served = serve(arch)
    oracle = served.oracle
    image = random_image(40, 60, 4)
    messages: Any = image_chat(image, "Who is it?")
    fmt: Any = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    client = served.openai()
    reply = client.chat.completions.create(
        model="tgis", messages=messages, response_format=fmt, max_tokens=40, temperature=0
    )
    content = reply.choices[0].message.content
    assert content is not None
    jsonschema.validate(json.loads(content), PERSON)
    assert reply.choices[0].finish_reason == "stop"
    expected, _ = oracle.generate(
        oracle.chat_prompt("Who is it?"),
        [image],
        40,
        chat=True,
        grammar=GrammarSpec.json_schema(PERSON),
    )
    assert content == oracle.decode(expected)
    chunks = client.chat.completions.create(
        model="tgis",
        messages=messages,
        response_format=fmt,
        max_tokens=40,
        temperature=0,
        stream=True,
    )
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == content


# Top-n tokens and logprobs


def _assert_tokens_match(tokens: list[dict[str, Any]], ids: list[int], scores: Any) -> None:
    """TGI tokens (or top tokens) against the oracle's ids and log_softmax rows."""
    assert [t["id"] for t in tokens] == ids
    for token, row, i in zip(tokens, scores, ids, strict=True):
        assert token["logprob"] == pytest.approx(float(row[i]), abs=TOLERANCE)


def _assert_top_tokens(top_tokens: list[list[dict[str, Any]]], scores: Any, n: int) -> None:
    assert len(top_tokens) == len(scores)
    for step, row in zip(top_tokens, scores, strict=True):
        values, ids = row.topk(n)
        assert [t["id"] for t in step] == ids.tolist()
        assert [t["logprob"] for t in step] == pytest.approx(values.tolist(), abs=TOLERANCE)


@pytest.mark.parametrize("arch", ARCHS)
def test_tgi_details_top_n_and_prompt_logprobs_with_an_image(
    serve: Callable[..., Served], arch: VisionArch
) -> None:
    """details, top_n_tokens and decoder_input_details with an image: the generated tokens'
    logprobs and top-n are the log_softmax of generate()'s scores, and the prompt's (its image
    tokens included) those of one forward of the model on the processor's inputs."""
    served = serve(arch)
    oracle = served.oracle
    image = random_image(40, 60, 1)
    answer = _generate(
        served,
        f"Hello {served.markdown(image)}{TAIL}",
        details=True,
        top_n_tokens=3,
        decoder_input_details=True,
    )
    details = answer["details"]
    text = f"Hello {oracle.placeholder}{TAIL}"
    ids, scores = oracle.generate(text, [image])
    _assert_tokens_match(details["tokens"], ids, scores)
    _assert_top_tokens(details["top_tokens"], scores, 3)
    prompt_ids, prompt_logprobs = oracle.prompt_logprobs(text, [image])
    prefill = details["prefill"]
    assert [t["id"] for t in prefill] == prompt_ids
    assert prefill[0]["logprob"] is None
    assert [t["logprob"] for t in prefill[1:]] == pytest.approx(prompt_logprobs, abs=TOLERANCE)
    # The image is seen: another one gives other logprobs.
    other = _generate(
        served, f"Hello {served.markdown(random_image(40, 60, 2))}{TAIL}", details=True
    )
    assert [t["logprob"] for t in other["details"]["tokens"]] != pytest.approx(
        [t["logprob"] for t in details["tokens"]], abs=TOLERANCE
    )


@pytest.mark.parametrize("arch", ARCHS)
def test_openai_logprobs_with_an_image(serve: Callable[..., Served], arch: VisionArch) -> None:
    """Chat logprobs and top_logprobs with an image part, plain and streamed: each token's
    logprob and its alternatives' are the oracle's, and its bytes spell the content."""
    served = serve(arch)
    oracle = served.oracle
    image = random_image(64, 30, 3)
    messages: Any = [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "Describe"},
                {"type": "image_url", "image_url": {"url": data_url(image)}},
            ],
        }
    ]
    parts = [{"type": "text", "text": "Describe"}, {"type": "image"}]
    prompt = oracle.processor.apply_chat_template(
        [{"role": "user", "content": parts}], add_generation_prompt=True
    )
    ids, scores = oracle.generate(prompt, [image], chat=True)
    client = served.openai()

    def check(content: str, items: list[Any]) -> None:
        assert content == oracle.decode(ids)
        assert b"".join(bytes(item.bytes or []) for item in items) == content.encode()
        for item, row, i in zip(items, scores, ids, strict=True):
            assert item.logprob == pytest.approx(float(row[i]), abs=TOLERANCE)
            values, top = row.topk(2)
            assert [a.logprob for a in item.top_logprobs] == pytest.approx(
                values.tolist(), abs=TOLERANCE
            )
            assert [a.token for a in item.top_logprobs] == [
                oracle.tokenizer.decode([t]) for t in top.tolist()
            ]

    ask: dict[str, Any] = {
        "model": "tgis", "messages": messages, "max_tokens": NEW_TOKENS, "temperature": 0,
        "logprobs": True, "top_logprobs": 2,
    }  # fmt: skip
    reply = client.chat.completions.create(**ask)
    choice = reply.choices[0]
    assert choice.logprobs is not None and choice.logprobs.content is not None
    check(str(choice.message.content), choice.logprobs.content)
    chunks = list(client.chat.completions.create(**ask, stream=True))
    deltas = [c.choices[0] for c in chunks if c.choices]
    items = [
        item for d in deltas if d.logprobs and d.logprobs.content for item in d.logprobs.content
    ]
    check("".join(d.delta.content or "" for d in deltas), items)


# Speculative decoding


@pytest.mark.parametrize("arch", ARCHS)
def test_prompt_lookup_speculation_with_an_image(
    serve: Callable[..., Served], arch: VisionArch
) -> None:
    """--speculate 3 with a prompt whose text repeats: drafts are proposed and accepted (the
    /metrics counters grow), and two images at once give each generate()'s greedy tokens,
    their logprobs and top-n, through verified steps."""
    served = serve(arch, speculate=3)
    oracle = served.oracle
    images = [random_image(40, 60, 9), random_image(64, 30, 9)]
    new_tokens = 24
    drafted = served.metric("tgis_speculative_draft_tokens")
    accepted = served.metric("tgis_speculative_accepted_tokens")

    def ask(image: Any) -> dict[str, Any]:
        return _generate(
            served,
            f"Look {served.markdown(image)}{TAIL}{TAIL}{TAIL}",
            max_new_tokens=new_tokens,
            details=True,
            top_n_tokens=2,
        )

    with ThreadPoolExecutor(2) as pool:
        answers = list(pool.map(ask, images))
    for image, answer in zip(images, answers, strict=True):
        ids, scores = oracle.generate(
            f"Look {oracle.placeholder}{TAIL}{TAIL}{TAIL}", [image], new_tokens
        )
        _assert_tokens_match(answer["details"]["tokens"], ids, scores)
        _assert_top_tokens(answer["details"]["top_tokens"], scores, 2)
    assert served.metric("tgis_speculative_draft_tokens") > drafted
    assert served.metric("tgis_speculative_accepted_tokens") > accepted
    # Streamed, one verified step's tokens come out one by one.
    client = Client(served.url, timeout=60)
    prompt = f"Look {served.markdown(images[0])}{TAIL}{TAIL}{TAIL}"
    streamed = [r.token.id for r in client.generate_stream(prompt, max_new_tokens=new_tokens)]
    assert streamed == [t["id"] for t in answers[0]["details"]["tokens"]]


# Streaming


@pytest.mark.parametrize("arch", ARCHS)
def test_streams_with_an_image_give_the_oracles_tokens(
    serve: Callable[..., Served], arch: VisionArch
) -> None:
    """/generate_stream through the text-generation client (with top-n tokens) and an OpenAI
    streamed chat turn, each with an image: generate()'s tokens, one event each."""
    served = serve(arch)
    oracle = served.oracle
    image = random_image(48, 48, 5)
    client = Client(served.url, timeout=60)
    events = list(
        client.generate_stream(
            f"Hello {served.markdown(image)}{TAIL}", max_new_tokens=NEW_TOKENS, top_n_tokens=2
        )
    )
    ids, scores = oracle.generate(f"Hello {oracle.placeholder}{TAIL}", [image])
    assert [e.token.id for e in events] == ids
    for event, row in zip(events, scores, strict=True):
        assert [t.id for t in event.top_tokens or []] == row.topk(2).indices.tolist()
    assert events[-1].generated_text == oracle.decode(ids)
    assert events[-1].details is not None
    assert events[-1].details.generated_tokens == NEW_TOKENS

    messages: Any = image_chat(image, "Describe it.")
    chunks = served.openai().chat.completions.create(
        model="tgis", messages=messages, max_tokens=NEW_TOKENS, temperature=0, stream=True
    )
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    expected, _ = oracle.generate(oracle.chat_prompt("Describe it."), [image], chat=True)
    assert content == oracle.decode(expected)
    # The image is seen.
    assert (
        expected
        != oracle.generate(
            oracle.chat_prompt("Describe it."), [random_image(48, 48, 6)], chat=True
        )[0]
    )


@pytest.mark.parametrize("speculate", [0, 3])
@pytest.mark.parametrize("arch", ARCHS)
def test_generated_placeholder_tokens_are_text(
    serve: Callable[..., Served], arch: VisionArch, speculate: int
) -> None:
    """OpenAI's logit_bias pushes the image placeholder tokens into the answer: generated (or
    drafted from the prompt's image rows), they are tokens like any other, embedded as text
    with text positions, as generate() treats them after the prompt."""
    from transformers import LogitsProcessor

    served = serve(arch, speculate)
    oracle = served.oracle
    names = ["<|vision_start|>", "<|image_pad|>"] if arch.startswith("qwen") else ["<image>"]
    ids = [int(oracle.tokenizer.convert_tokens_to_ids(name)) for name in names]
    bias = 4.0

    class Biased(LogitsProcessor):
        def __call__(self, input_ids: torch.LongTensor, scores: torch.Tensor) -> torch.Tensor:
            scores = scores.clone()
            scores[:, ids] += bias
            return scores

    image = random_image(40, 60, 1)
    inputs = oracle.inputs(oracle.chat_prompt("Describe it."), [image], chat=True)
    with torch.no_grad():
        out = oracle.model.generate(
            **inputs, max_new_tokens=12, do_sample=False, logits_processor=[Biased()]
        )
    expected = out[0, inputs["input_ids"].shape[1] :].tolist()
    assert set(expected) <= set(ids)  # placeholders only: each token's text is its name
    messages: Any = image_chat(image, "Describe it.")
    reply = served.openai().chat.completions.create(
        model="tgis",
        messages=messages,
        max_tokens=12,
        temperature=0,
        logprobs=True,
        logit_bias={str(i): bias for i in ids},
    )
    logprobs = reply.choices[0].logprobs
    assert logprobs is not None and logprobs.content is not None
    assert [item.token for item in logprobs.content] == [
        oracle.tokenizer.decode([i]) for i in expected
    ]
