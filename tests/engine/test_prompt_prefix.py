"""Tuned prompt prefixes through the engine: generation with a prefix equals transformers'
generate over `inputs_embeds` built by hand from the same tensor, on the paged engine and on
both forward paths of the slot engine, alone and in batches that mix prefixes."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch
from transformers import PreTrainedModel

from tests.engine.test_engine import PROMPTS, collect, hf_model, request, run, tokenizer
from tests.engine.test_engine_paged import make_engine as make_paged_engine
from tgis.backends.fallback.backend import TorchDynamicBackend
from tgis.engine.engine import Engine
from tgis.engine.scheduler import SchedulerLimits
from tgis.engine.types import GenerationRequest, PromptPrefix
from tgis.launch import eos_token_ids

__all__ = ["hf_model", "tokenizer"]  # fixtures shared with test_engine

NEW_TOKENS = 10


def prefix_of(hf_model, length: int, seed: int, name: str) -> PromptPrefix:
    """Random virtual tokens at the scale of the model's own embeddings."""
    embed = hf_model.get_input_embeddings().weight
    generator = torch.Generator().manual_seed(seed)
    rows = torch.randn(length, embed.shape[1], generator=generator) * embed.std().item()
    return PromptPrefix(name, rows, name.encode())


def generate_over_embeds(
    model: PreTrainedModel, ids: Sequence[int], prefix: torch.Tensor | None, new_tokens: int
) -> tuple[list[int], list[torch.Tensor]]:
    """transformers' greedy generate over [prefix rows; the embeddings of `ids`] (no EOS
    stop): the new tokens, and the log-softmax of each step's logits."""
    with torch.no_grad():
        embeds = model.get_input_embeddings()(torch.tensor([list(ids)]))
        if prefix is not None:
            embeds = torch.cat([prefix[None], embeds], dim=1)
        out = model.generate(
            inputs_embeds=embeds,
            attention_mask=torch.ones(embeds.shape[:2], dtype=torch.long),
            max_new_tokens=new_tokens,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
            output_scores=True,
            return_dict_in_generate=True,
        )
    logprobs = [torch.log_softmax(s[0].float(), dim=-1) for s in out.scores]
    return out.sequences[0].tolist()[-new_tokens:], logprobs


def reference(hf_model, req: GenerationRequest) -> list[int]:
    """Greedy tokens of transformers' generate over [prefix embeddings; input embeddings]."""
    prefix = req.prefix.embeddings if req.prefix is not None else None
    return generate_over_embeds(hf_model, req.input_ids, prefix, NEW_TOKENS)[0]


def slot_engine(demo_model_dir: Path, tokenizer) -> Engine:
    backend = TorchDynamicBackend.load(
        demo_model_dir, "cpu", "float32", max_sequences=8, max_sequence_tokens=256,
        prefill_chunk_tokens=8,
    )  # fmt: skip
    limits = SchedulerLimits(
        max_batch_prefill_tokens=2048, max_batch_total_tokens=8 * 256, max_sequences=8
    )
    engine = Engine(backend, tokenizer, limits, 16, eos_token_ids(demo_model_dir, tokenizer))
    engine.start()
    return engine


ENGINES = {
    # Prefill chunks of 8 tokens: a 12-token prefix spans chunks.
    "paged": lambda d, t: make_paged_engine(d, t, prefill_tokens=8),
    "slot": slot_engine,
}


def requests_with_prefixes(tokenizer, hf_model) -> list[GenerationRequest]:
    first, second = prefix_of(hf_model, 12, 1, "tuned-a"), prefix_of(hf_model, 5, 2, "tuned-b")
    plain = [request(tokenizer, PROMPTS[i], f"r{i}", max_new_tokens=NEW_TOKENS, ignore_eos=True)
             for i in range(3)]  # fmt: skip
    return [
        GenerationRequest("a0", plain[0].input_ids, plain[0].params, prefix=first),
        GenerationRequest("a1", plain[1].input_ids, plain[1].params, prefix=first),
        GenerationRequest("b0", plain[0].input_ids, plain[0].params, prefix=second),
        plain[0],
        plain[2],
    ]


@pytest.mark.parametrize("kind", sorted(ENGINES))
def test_a_prefix_is_the_same_as_inputs_embeds(
    kind: str, demo_model_dir: Path, tokenizer, hf_model
) -> None:
    reqs = requests_with_prefixes(tokenizer, hf_model)
    expected = [reference(hf_model, r) for r in reqs]
    # The same input under different prefixes (or none) really continues differently.
    assert len({tuple(expected[i]) for i in (0, 2, 3)}) == 3
    engine = ENGINES[kind](demo_model_dir, tokenizer)
    try:
        alone = [[e.token.id for e in run(collect(engine.generate(r)))] for r in reqs]
        assert alone == expected

        async def together() -> list[list[int]]:
            results = await asyncio.gather(*(collect(engine.generate(r)) for r in reqs))
            return [[e.token.id for e in events] for events in results]

        assert run(together()) == expected  # prefixes, none, and the prefix cache mixed
    finally:
        engine.stop()


def test_prompt_details_cover_the_input_tokens_only(
    demo_model_dir: Path, tokenizer, hf_model
) -> None:
    prefixed = requests_with_prefixes(tokenizer, hf_model)[0]
    req = GenerationRequest(
        "d",
        prefixed.input_ids,
        prefixed.params.__class__(max_new_tokens=2, decoder_input_details=True, details=True),
        prefix=prefixed.prefix,
    )
    engine = ENGINES["paged"](demo_model_dir, tokenizer)
    try:
        events = run(collect(engine.generate(req)))
    finally:
        engine.stop()
    prefill = events[-1].completion.prefill
    assert [t.id for t in prefill] == list(req.input_ids)
    assert prefill[0].logprob is None and all(t.logprob is not None for t in prefill[1:])
    # The input's second token is predicted after the prefix and the first input token.
    with torch.no_grad():
        embeds = hf_model.get_input_embeddings()(torch.tensor([req.input_ids]))
        logits = hf_model(inputs_embeds=torch.cat([req.prefix.embeddings[None], embeds], 1)).logits
    logprobs = torch.log_softmax(logits[0].float(), -1)
    first = req.prefix.length
    assert prefill[1].logprob == pytest.approx(logprobs[first, req.input_ids[1]].item(), abs=1e-4)
