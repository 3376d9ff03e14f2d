"""The causal forward's schedule (schedule.py): every tile once, pairs kept, the end balanced."""

import pytest
import torch

from flashtriton import schedule, triton_backend
from flashtriton.kernels import config


def _lists(table: list[int], programs: int) -> list[list[tuple[int, int]]]:
    """Each program's tiles as (head * n_m + longest-first position in the head, r)."""
    offsets, entries = table[: programs + 1], table[programs + 1 :]
    assert offsets[0] == 0 and offsets[-1] == len(entries) and offsets == sorted(offsets)
    return [[(e >> 1, e & 1) for e in entries[offsets[p] : offsets[p + 1]]] for p in range(programs)]


def _causal_costs(n_m: int) -> list[int]:
    return [n_m - p + 1 for p in range(n_m)]  # tile p (longest first) sees n_m - p key tiles, plus a start and end


@pytest.mark.parametrize(
    "heads, n_m, programs, batch_tiles",
    [
        (512, 8, 132, 264),
        (1024, 4, 132, 264),
        (16, 128, 132, 264),
        (3, 7, 5, 1),
        (2, 1, 2, 3),
        (1, 5, 5, 3),
        (7, 9, 4, 9),
    ],
    ids=lambda x: str(x),
)
def test_every_tile_runs_once(heads, n_m, programs, batch_tiles):
    costs = _causal_costs(n_m)
    lists = _lists(schedule.causal_forward(heads, costs, programs, batch_tiles), programs)
    tiles = sorted(t for tiles in lists for t, _ in tiles)
    assert tiles == list(range(heads * n_m))
    assert all(lists)  # programs <= tiles (the launcher's grid): none idles
    work = [sum(costs[t % n_m] for t, _ in tiles) for tiles in lists]
    assert max(work) <= sum(work) / programs + max(costs)  # within a tile of an even split


@pytest.mark.parametrize("heads, n_m", [(512, 8), (1024, 4), (256, 16), (16, 128)])
def test_the_end_is_more_even_than_round_robin_pairs(heads, n_m):
    """The bench's causal shapes (2048 or 1024 pairs over 132 SMs): the kernel's own order gives some programs a
    pair more than others; the table ends closer to an even split."""
    programs, costs = 132, _causal_costs(n_m)
    pairs = heads * n_m // 2
    round_robin = -(-pairs // programs) * (costs[0] + costs[-1])
    lists = _lists(schedule.causal_forward(heads, costs, programs, 2 * programs), programs)
    work = [sum(costs[t % n_m] for t, _ in tiles) for tiles in lists]
    assert max(work) < round_robin
    assert max(work) <= sum(work) / programs + 2 * costs[-1]


def test_heads_are_balanced_in_batches():
    """A batch's heads run before the next batch's on every program (its keys stay in L2 while they do), and the
    r bits of a program's tiles alternate (warpgroups that see unequal numbers of keys take turns)."""
    heads, n_m, programs = 512, 8, 132
    lists = _lists(schedule.causal_forward(heads, _causal_costs(n_m), programs, 2 * programs), programs)
    per_batch = 2 * programs // n_m
    for tiles in lists:
        batches = [t // n_m // per_batch for t, _ in tiles]
        assert batches == sorted(batches)
        assert [r for _, r in tiles] == [i % 2 for i in range(len(tiles))]
    first = [tiles[0][0] // n_m for tiles in lists]
    assert max(first) < per_batch  # every program starts in the first batch


def test_bad_requests_are_refused():
    with pytest.raises(ValueError, match="no schedule"):
        schedule.causal_forward(0, [1], 4, 8)
    with pytest.raises(ValueError, match="no schedule"):
        schedule.causal_forward(2, [1, 2], 0, 8)


@pytest.mark.parametrize("window_left", [None, 0, 100, 300])
@pytest.mark.parametrize(
    "cfg",
    [
        config.HopperForwardConfig(64, 128, 3),
        config.HopperForwardConfig(64, 64, 6),
        config.HopperForwardConfig(64, 128, 3, consumers=3),
    ],
    ids=["128-key tiles", "64-key tiles", "three warpgroups"],
)
def test_tile_costs_count_the_key_tiles_each_warpgroup_sees(cfg, window_left):
    """Against a count over the mask itself: a warpgroup streams every key tile that holds a key one of its rows
    sees (causal; with a window, not more than window_left behind)."""
    n = 1152 if cfg.consumers == 3 else 1024
    rows = cfg.consumers * cfg.block_m
    tiles = n // rows
    costs = triton_backend._tile_costs(n, tiles, cfg, window_left)
    q = torch.arange(n)[:, None]
    k = torch.arange(n)[None, :]
    seen = k <= q
    if window_left is not None:
        seen &= k >= q - window_left
    for p in range(tiles):
        m = tiles - 1 - p
        streamed = []
        for w in range(cfg.consumers):
            first = (m * cfg.consumers + w) * cfg.block_m
            keys = seen[first : first + cfg.block_m].any(0).nonzero().flatten()
            key_tiles = torch.unique(keys // cfg.block_n)
            streamed.append((key_tiles.max() - key_tiles.min() + 1).item() * cfg.block_n)
        assert costs[p] == max(streamed) + config.SCHEDULE_TILE_KEYS, (p, streamed)
