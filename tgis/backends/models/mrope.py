"""Multimodal rope (Qwen2-VL, Qwen2.5-VL): where each row of a sequence rotates.

The model rotates with three position streams (temporal, height, width), each over its own
section of the rotary dimensions (`mrope_section`). A text row has one position in all three.
An image's rows fill a (t, h, w) grid: the row at (i, j, k) of an image that starts where
position p would be takes (p + i, p + j, p + k), and the text after the image goes on from
p + max(t, h, w). So every row after an image sits max(t, h, w) - t * h * w positions before
its index (the sequence's "rope delta"), which is what a decode step needs: the positions of
its rows follow from the images' grids alone, whichever steps computed the rows before.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from tgis.engine.backend import PackedItem

# (first row, t, h, w) of one image in a sequence (PackedItem.grids).
Grid = tuple[int, int, int, int]


def grid_positions(
    start: int, count: int, grids: Sequence[Grid]
) -> tuple[list[int], list[int], list[int]]:
    """The (temporal, height, width) positions of rows start.. start + count - 1 of a
    sequence whose images lie at `grids` (module doc)."""
    streams: tuple[list[int], list[int], list[int]] = ([], [], [])
    end = start + count
    delta = 0
    at = start
    for first, t, h, w in sorted(grids):
        size = t * h * w
        if first >= end:
            break
        # Text rows before the image.
        for row in range(at, min(first, end)):
            for stream in streams:
                stream.append(row + delta)
        base = first + delta
        for row in range(max(at, first), min(first + size, end)):
            r = row - first
            streams[0].append(base + r // (h * w))
            streams[1].append(base + (r // w) % h)
            streams[2].append(base + r % w)
        at = max(at, first + size)
        delta += max(t, h, w) - size
    for row in range(at, end):
        for stream in streams:
            stream.append(row + delta)
    return streams


def sections(mrope_section: Sequence[int], rotary_dim: int) -> torch.Tensor:
    """The stream (0, 1 or 2) each of the `rotary_dim` rotary dimensions takes its position
    from: the sections cycle temporal, height, width over each half of the dimensions."""
    half = [i % 3 for i, width in enumerate(mrope_section) for _ in range(width)]
    if 2 * len(half) != rotary_dim:
        raise ValueError(
            f"mrope_section {list(mrope_section)} covers {len(half)} of the {rotary_dim // 2} "
            "rotary frequencies"
        )
    return torch.tensor(half + half, dtype=torch.long)


def rotate_tables(
    cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor, stream_of: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [tokens, 1, rotary_dim] of rows at three-stream `positions` [3, tokens]: each
    dimension's value from its own stream's position (`stream_of`, from `sections`)."""
    rows = torch.arange(positions.shape[1], device=positions.device)
    # [tokens, rotary_dim]: the position of each row in each dimension's stream.
    at = positions[stream_of.to(positions.device)[None, :], rows[:, None]]
    dims = torch.arange(cos.shape[1], device=positions.device)[None, :]
    return cos[at, dims].unsqueeze(1), sin[at, dims].unsqueeze(1)


def rope_positions(items: Sequence[PackedItem], counts: Sequence[int]) -> list[int]:
    """The rotary positions of a packed step's rows (`counts[i]` rows of item i), flat:
    [tokens] while every row has one position (text rows, items without grids), else the
    three streams one after the other, [3 * tokens]."""
    rows: list[Sequence[int] | tuple[list[int], list[int], list[int]]] = []
    three = False
    for item, n in zip(items, counts, strict=True):
        if not item.grids:
            rows.append(range(item.start, item.start + n))
            continue
        t, h, w = grid_positions(item.start, n, item.grids)
        if t == h == w:
            rows.append(t)
        else:
            rows.append((t, h, w))
            three = True
    if not three:
        return [p for r in rows for p in r]  # type: ignore[misc]
    streams: list[int] = []
    for stream in range(3):
        for r in rows:
            streams.extend(r[stream] if isinstance(r, tuple) else r)
    return streams
