"""tgis.pooling.decoder: a decoder's hidden states and yes/no scores over packed rows on the
paged engine's layers, against transformers' model run on each row alone (every family's
traits: sliding windows, soft-capping, multipliers, LongRoPE, experts), the same alone and in any
batch, and flash attention's varlen call driven through a double of its documented contract."""

from __future__ import annotations

import copy
import itertools

import pytest
import torch
import torch.nn.functional as F

from tests.backends.models.test_families import family_model
from tgis.pooling.decoder import PackedDecoder, PackedRows, packed_attention_path

ROWS = [[5, 9, 17, 33, 2, 8, 100, 7, 41, 12, 60, 3], [44], [6, 6, 7, 200, 19, 31, 90]]
TOLERANCE = 2e-5


def _windows(decoder: PackedDecoder) -> list[int | None]:
    return [layer.window for layer in decoder.weights.layers]


def _hf_hidden(model: torch.nn.Module, row: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model.model(torch.tensor([row])).last_hidden_state[0].float()


@pytest.mark.parametrize("family", ["qwen3", "gemma2", "gemma3", "phi3", "granite", "qwen3_moe"])
def test_hidden_states_equal_transformers_on_each_row_alone(family: str) -> None:
    model = family_model(family)
    oracle = copy.deepcopy(model)
    decoder = PackedDecoder(model, 64)
    rows = PackedRows(ROWS, decoder.device, _windows(decoder))
    got = decoder.hidden(rows)
    assert got.shape == (sum(len(r) for r in ROWS), 64)
    for (start, end), row in zip(rows.spans, ROWS, strict=True):
        torch.testing.assert_close(
            got[start:end].float(), _hf_hidden(oracle, row), atol=TOLERANCE, rtol=0
        )


def test_a_row_is_the_same_alone_and_in_any_batch() -> None:
    decoder = PackedDecoder(family_model("gemma2"), 64)
    windows = _windows(decoder)
    together = decoder.hidden(PackedRows(ROWS[::-1], decoder.device, windows))
    spans = PackedRows(ROWS[::-1], decoder.device, windows).spans
    for (start, end), row in zip(spans, ROWS[::-1], strict=True):
        alone = decoder.hidden(PackedRows([row], decoder.device, windows))
        torch.testing.assert_close(together[start:end], alone, atol=TOLERANCE, rtol=0)


def test_yes_no_scores_are_the_last_tokens_logit_difference() -> None:
    model = family_model("granite")  # logits divided by its scaling: the score is too
    oracle = copy.deepcopy(model)
    yes, no = 77, 57
    decoder = PackedDecoder(model, 64, (yes, no))
    assert decoder.weights.lm_head.shape[0] == 2  # the rest of the head is let go
    scores = decoder.scores(PackedRows(ROWS, decoder.device, _windows(decoder)))
    assert scores.shape == (len(ROWS), 1) and scores.dtype == torch.float32
    for score, row in zip(scores, ROWS, strict=True):
        with torch.no_grad():
            logits = oracle(torch.tensor([row])).logits[0, -1].float()
        torch.testing.assert_close(score[0], logits[yes] - logits[no], atol=TOLERANCE, rtol=0)
        probability = torch.softmax(logits[[yes, no]], 0)[0]
        torch.testing.assert_close(torch.sigmoid(score[0]), probability, atol=1e-6, rtol=0)


def test_an_embedder_has_no_scores() -> None:
    decoder = PackedDecoder(family_model("qwen3"), 64)
    with pytest.raises(ValueError, match="scores no tokens"):
        decoder.scores(PackedRows(ROWS, decoder.device, _windows(decoder)))


def test_packed_rows_refuse_an_empty_row() -> None:
    with pytest.raises(ValueError, match="at least one token"):
        PackedRows([[1, 2], []], torch.device("cpu"), [None])


def test_the_varlen_path_is_taken_only_where_flash_attention_can_run() -> None:
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    every = frozenset({"scale", "window_size", "enable_gqa", "seqused_k"})
    assert packed_attention_path(cuda, torch.bfloat16, None, every) == "varlen"
    assert packed_attention_path(cuda, torch.float16, None, every) == "varlen"
    assert packed_attention_path(cuda, torch.float32, None, every) == "sdpa"
    assert packed_attention_path(cuda, torch.bfloat16, 50.0, every) == "sdpa"  # soft-capped
    assert packed_attention_path(cuda, torch.bfloat16, None, frozenset({"scale"})) == "sdpa"
    assert packed_attention_path(cpu, torch.bfloat16, None, every) == "sdpa"


def _varlen_double(calls: list[dict[str, object]]):  # type: ignore[no-untyped-def]
    """varlen_attn as torch documents it, in plain torch: causal attention of each sequence's
    queries over its keys (cu_seq_q / cu_seq_k), window_size (left, right) keys either side
    (-1: unbounded), grouped heads when enable_gqa."""

    def varlen_attn(q, k, v, cu_seq_q, cu_seq_k, max_q, max_k, *, scale, window_size, enable_gqa):  # type: ignore[no-untyped-def]
        calls.append({"max_q": max_q, "max_k": max_k, "window_size": window_size})
        assert cu_seq_q.dtype == torch.int32 and torch.equal(cu_seq_q, cu_seq_k)
        out = torch.empty_like(q)
        bounds = cu_seq_q.tolist()
        for start, end in itertools.pairwise(bounds):
            n = end - start
            i = torch.arange(n)
            visible = i[None] <= i[:, None]
            if window_size[0] >= 0:
                visible &= i[None] >= i[:, None] - window_size[0]
            out[start:end] = F.scaled_dot_product_attention(
                q[start:end].transpose(0, 1),
                k[start:end].transpose(0, 1),
                v[start:end].transpose(0, 1),
                attn_mask=visible,
                scale=scale,
                enable_gqa=enable_gqa,
            ).transpose(0, 1)
        return out

    return varlen_attn


def test_the_varlen_call_gives_the_per_row_attention(monkeypatch: pytest.MonkeyPatch) -> None:
    from torch.nn.attention import varlen

    calls: list[dict[str, object]] = []
    monkeypatch.setattr(varlen, "varlen_attn", _varlen_double(calls))
    # Gemma 3: sliding and full layers, no soft-capping of its attention.
    decoder = PackedDecoder(family_model("gemma3"), 64)
    rows = PackedRows(ROWS, decoder.device, _windows(decoder))
    per_row = decoder.hidden(rows)
    decoder.path = "varlen"
    packed = decoder.hidden(rows)
    assert len(calls) == len(decoder.weights.layers)
    assert {c["window_size"] for c in calls} == {(5, 0), (-1, 0)}
    assert {c["max_q"] for c in calls} == {max(len(r) for r in ROWS)}
    torch.testing.assert_close(packed, per_row, atol=TOLERANCE, rtol=0)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_in_bfloat16_the_packed_decoder_gives_transformers_hidden_states() -> None:
    model = family_model("qwen3").to("cuda", torch.bfloat16)
    oracle = copy.deepcopy(model)
    decoder = PackedDecoder(model, 64)
    rows = PackedRows(ROWS, decoder.device, _windows(decoder))
    got = decoder.hidden(rows).float()
    for (start, end), row in zip(rows.spans, ROWS, strict=True):
        with torch.no_grad():
            expected = oracle.model(torch.tensor([row], device="cuda")).last_hidden_state[0]
        cosine = F.cosine_similarity(got[start:end], expected.float(), dim=-1)
        assert cosine.min() > 0.999, (decoder.path, cosine)
