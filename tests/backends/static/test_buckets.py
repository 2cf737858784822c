"""Shape buckets (tgis/backends/static/buckets.py): the static policy of tpu/neuron, seed 003's gaudi
buckets, the warmup plan, and refusals of shapes outside them."""

from __future__ import annotations

import pytest

from tests.config.test_resolve import build
from tgis.backends.common.warmup import powers_of_two
from tgis.backends.static.buckets import ShapePolicy, gaudi_policy, static_policy
from tgis.config import ModelFacts
from tgis.engine.backend import Shape


def test_powers_of_two_end_at_the_maximum() -> None:
    assert powers_of_two(16, 1023) == (16, 32, 64, 128, 256, 512, 1023)
    assert powers_of_two(16, 16) == (16,)
    assert powers_of_two(1, 6) == (1, 2, 4, 6)
    assert powers_of_two(16, 10) == (10,)


def test_static_policy_insert_and_rebuild() -> None:
    insert = static_policy(4, 1024, 1000)
    assert insert.prefill_lengths == (16, 32, 64, 128, 256, 512, 1000)
    assert insert.prefill_rows == (1, 2, 4)
    assert insert.decode_batches == (4,)
    assert insert.length_bucket(17) == 32 and insert.length_bucket(1000) == 1000
    assert insert.prefill_batch(3) == 4 and insert.decode_rows(1) == 4
    # Rebuild re-runs whole sequences (up to max_length - 1) over every slot.
    rebuild = static_policy(4, 1024, 1000, "rebuild")
    assert rebuild.prefill_lengths[-1] == 1023 and rebuild.prefill_rows == (4,)
    assert rebuild.prefill_batch(1) == 4


def test_warmup_plan_lists_every_bucket_once() -> None:
    policy = static_policy(2, 128, 100)
    plan = policy.warmup_plan()
    assert plan == [
        *(Shape("prefill", rows, n) for rows in (1, 2) for n in (16, 32, 64, 100)),
        Shape("decode", 2, 1),
    ]
    # Length buckets past the longest prompt are dropped (insert mode only).
    assert [s.length for s in policy.warmup_plan(30) if s.rows == 1] == [16, 32]
    assert Shape("prefill", 4, 128).label() == "prefill 4x128"
    assert Shape("decode", 8, 1).label() == "decode 8"


def test_seed003_buckets_are_the_ones_serve_check_explains() -> None:
    """Seed 003's first example (max input 1024, max total 2048, batch 64 from the launcher's
    defaults): the gaudi policy runs exactly the buckets GaudiSettings derives and counts in
    its note."""
    config = build(
        ModelFacts("llama", 4096),
        {"BATCH_BUCKET_SIZE": "16", "PREFILL_BATCH_BUCKET_SIZE": "4"},
        backend="gaudi",
        max_input_tokens=1024,
        max_total_tokens=2048,
        max_batch_prefill_tokens=4096,
        max_batch_size=64,
    )
    settings = config.gaudi
    assert settings is not None
    policy = gaudi_policy(settings, config.max_total_tokens)
    assert policy.decode_batches == (16, 32, 48, 64) == settings.decode_buckets
    assert policy.prefill_rows == (4,)  # 4096 // 1024 = 4 prompts of the longest length
    assert policy.prefill_lengths == tuple(range(128, 1025, 128)) == settings.length_buckets
    plan = policy.warmup_plan()
    prefills = [(s.rows, s.length) for s in plan if s.phase == "prefill"]
    assert prefills == [(4, length) for length in range(128, 1025, 128)]
    assert tuple(prefills) == settings.prefill_buckets
    assert [s.rows for s in plan if s.phase == "decode"] == [16, 32, 48, 64]
    note = next(n for n in config.notes if n.startswith("gaudi:"))
    assert f"warmup covers {len(prefills)} prefill and 4 decode buckets" in note
    assert policy.decode_rows(17) == 32 and policy.prefill_batch(3) == 4
    assert policy.length_bucket(129) == 256


def test_prefill_rows_never_exceed_the_decode_batch() -> None:
    config = build(
        ModelFacts("llama", 4096),
        {
            "BATCH_BUCKET_SIZE": "6",
            "PREFILL_BATCH_BUCKET_SIZE": "4",
            "PAD_SEQUENCE_TO_MULTIPLE_OF": "32",
        },
        backend="gaudi",
        max_input_tokens=100,
        max_total_tokens=200,
        max_batch_prefill_tokens=1000,
        max_batch_size=6,
    )
    assert config.gaudi is not None
    assert config.gaudi.prefill_rows == (4, 6)
    assert gaudi_policy(config.gaudi, 200).prefill_rows == (4, 6)


def test_shapes_outside_the_buckets_are_refused() -> None:
    policy = static_policy(4, 128, 100)
    with pytest.raises(ValueError, match="prefill length 101 is outside the buckets"):
        policy.length_bucket(101)
    with pytest.raises(ValueError, match="decode batch 5 is outside"):
        policy.decode_rows(5)
    with pytest.raises(ValueError, match=r"max_input_tokens 128 must be within 1\.\.127"):
        static_policy(4, 128, 128)
    with pytest.raises(ValueError, match="prefill mode 'all' is not one of rebuild, insert"):
        ShapePolicy(4, 128, "all", (16,), (4,), (4,))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="decode_batches"):
        ShapePolicy(4, 128, "insert", (16,), (4,), (8,))
