"""Multimodal rope's positions (Qwen2-VL): `grid_positions` equals transformers'
`get_rope_index` over prompts with images anywhere, for any chunk of rows, and decode rows
follow from the images' grids alone."""

from __future__ import annotations

import random

import pytest
import torch

from tgis.backends.models.mrope import grid_positions, rope_positions, rotate_tables, sections
from tgis.engine.backend import PackedItem

IMAGE, START, TEXT = 5, 4, 7


def _prompt(rng: random.Random) -> tuple[list[int], list[tuple[int, int, int]]]:
    """Token ids with 0-3 images (vision_start, then t*h*w image tokens), and their grids."""
    ids: list[int] = []
    grids = []
    for _ in range(rng.randint(0, 3)):
        ids += [TEXT] * rng.randint(0, 5) + [START]
        t, h, w = 1, rng.randint(1, 4), rng.randint(1, 4)
        grids.append((t, h, w))
        ids += [IMAGE] * (t * h * w)
    ids += [TEXT] * rng.randint(1, 5)
    return ids, grids


def _oracle(ids: list[int], grids: list[tuple[int, int, int]]) -> torch.Tensor:
    from transformers import Qwen2VLConfig
    from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VLModel

    config = Qwen2VLConfig(
        image_token_id=IMAGE, video_token_id=99, vision_start_token_id=START,
        vision_config={"spatial_merge_size": 1},
    )  # fmt: skip
    model = Qwen2VLModel.__new__(Qwen2VLModel)
    model.config = config
    positions, _ = model.get_rope_index(torch.tensor([ids]), torch.tensor(grids) if grids else None)
    return positions[:, 0]  # [3, len]


@pytest.mark.parametrize("seed", range(20))
def test_grid_positions_equal_transformers_rope_index(seed: int) -> None:
    rng = random.Random(seed)
    ids, grids = _prompt(rng)
    expected = _oracle(ids, grids)
    firsts = [i for i, token in enumerate(ids) if token == IMAGE and ids[i - 1] == START]
    layout = [(first, *grid) for first, grid in zip(firsts, grids, strict=True)]
    assert torch.equal(torch.tensor(grid_positions(0, len(ids), layout)), expected)
    # Any chunk gives the same rows, and rows past the prompt go on one apart.
    start = rng.randrange(len(ids))
    count = rng.randint(1, len(ids) - start + 3)
    chunk = torch.tensor(grid_positions(start, count, layout))
    last = int(expected[:, -1].max())
    past = max(0, start + count - len(ids))
    tail = torch.arange(last + 1, last + 1 + past).expand(3, -1)
    assert torch.equal(chunk, torch.cat([expected[:, start : start + count], tail], dim=1))


def test_rope_positions_flatten_three_streams_only_when_needed() -> None:
    grids = ((2, 1, 2, 2),)
    text_only = PackedItem(1, (1, 1), 10, (0,), grids=grids)  # after the image: delta -2
    plain = PackedItem(2, (1,), 3, (0,))
    assert rope_positions([text_only, plain], [2, 1]) == [8, 9, 3]
    image = PackedItem(1, (1,) * 4, 1, (0,), grids=grids)
    # Rows 1..4: text at 1, then the 2x2 image's first three rows from base 2.
    assert rope_positions([image, plain], [4, 1]) == [
        *[1, 2, 2, 2], 3, *[1, 2, 2, 3], 3, *[1, 2, 3, 2], 3,
    ]  # fmt: skip


def test_rotate_tables_take_each_dimension_from_its_stream() -> None:
    cos = torch.arange(40.0).view(10, 4)  # 10 positions, rotary_dim 4
    sin = -cos
    stream_of = sections([1, 1], 4)  # dims: t, h, t, h
    assert stream_of.tolist() == [0, 1, 0, 1]
    positions = torch.tensor([[1, 2], [3, 4], [5, 6]])
    c, s = rotate_tables(cos, sin, positions, stream_of)
    assert c.shape == (2, 1, 4)
    assert c[0, 0].tolist() == [cos[1, 0], cos[3, 1], cos[1, 2], cos[3, 3]]
    assert c[1, 0].tolist() == [cos[2, 0], cos[4, 1], cos[2, 2], cos[4, 3]]
    assert torch.equal(s, -c)
    with pytest.raises(ValueError, match="covers 3 of the 4"):
        sections([1, 1, 1], 8)
