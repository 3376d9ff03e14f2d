"""The causal forward's schedule (schedule.py and the backend's choice of it): every tile once, the end balanced,
and never a split that the costs' count puts behind the kernel's own pairs."""

import pytest
import torch

from flashtriton import schedule, triton_backend
from flashtriton.kernels import config


def _lists(table: list[int], programs: int) -> list[list[tuple[int, int]]]:
    """Each program's tiles as (head * n_m + longest-first position in the head, r)."""
    offsets, entries = table[: programs + 1], table[programs + 1 :]
    assert offsets[0] == 0 and offsets[-1] == len(entries) and offsets == sorted(offsets)
    return [[(e >> 1, e & 1) for e in entries[offsets[p] : offsets[p + 1]]] for p in range(programs)]


def _abstract(table: torch.Tensor, programs: int, n_m: int, heads: int, bits: tuple[int, int]) -> list[int]:
    """The backend's table with its entries decoded as the kernel decodes them (_forward_tile's bit fields) and put
    back in schedule.py's form ((b * heads + h) * n_m + p) << 1 | r."""
    m_bits, h_bits = bits
    listed = table.tolist()
    decoded = []
    for e in listed[programs + 1 :]:
        p, h, b = (e >> 1) & ((1 << m_bits) - 1), (e >> (1 + m_bits)) & ((1 << h_bits) - 1), e >> (1 + m_bits + h_bits)
        assert p < n_m and h < heads
        decoded.append((((b * heads + h) * n_m + p) << 1) | (e & 1))
    return listed[: programs + 1] + decoded


def _costs(head_dim: int, n: int, window_left: int | None = None) -> tuple[int, ...]:
    """The backend's costs of a causal head's tiles, with the config it runs at this length on sm90."""
    span = n - n // 2 if window_left is None else window_left + 1
    cfg = config.hopper_forward_config(
        "sm90", head_dim, torch.bfloat16, banded=True, left_bounded=window_left is not None, span=span
    )
    return triton_backend._tile_costs(n, -(-n // (cfg.consumers * cfg.block_m)), cfg, window_left)


@pytest.mark.parametrize(
    "heads, head_dim, n, programs",
    [
        (512, 128, 1024, 132),
        (1024, 64, 512, 132),
        (16, 128, 16384, 132),
        (3, 64, 8192, 5),
        (2, 128, 128, 2),
        (1, 64, 640, 5),
        (7, 256, 1152, 4),
    ],
    ids=lambda x: str(x),
)
def test_every_tile_runs_once(heads, head_dim, n, programs):
    costs = _costs(head_dim, n)
    table = schedule.causal_forward(heads, costs, programs, config.SCHEDULE_BATCH_ROUNDS * programs)
    lists = _lists(table, programs)
    assert sorted(t for tiles in lists for t, _ in tiles) == list(range(heads * len(costs)))
    assert all(lists)  # programs <= tiles (the launcher's grid): none idles
    work = [sum(costs[t % len(costs)] for t, _ in tiles) for tiles in lists]
    assert max(work) == schedule.makespan(table, costs, programs)
    assert max(work) <= sum(work) / programs + max(costs)  # greedy's bound: the last tile went to the least loaded


@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("n", [512, 1024, 2048, 4096, 8192, 16384])
def test_the_bench_shapes_take_the_table_and_end_sooner(head_dim, n):
    """16k tokens, hidden 2048: the table's end is at or under the pairs' by the costs' count, and the backend takes it
    (a tie too: at D=256 N=512, where the count ties, the table ran faster)."""
    batch, heads, costs = 16384 // n, 2048 // head_dim, _costs(head_dim, n)
    cpu = torch.device("cpu")
    programs, table, bits = triton_backend._schedule(batch, heads, costs, 132, config.SCHEDULE_BATCH_ROUNDS, cpu)
    assert table is not None and programs == 132
    listed = _abstract(table, programs, len(costs), heads, bits)
    assert listed == schedule.causal_forward(batch * heads, costs, 132, config.SCHEDULE_BATCH_ROUNDS * 132)
    assert schedule.makespan(listed, costs, 132) <= schedule.pairs_makespan(batch * heads, costs, 132)


@pytest.mark.parametrize("heads", [66, 130, 264, 75, 8, 384])
def test_the_backend_keeps_the_pairs_where_they_split_better(heads):
    """66 heads of 8 tiles: 264 pairs over 132 programs divide exactly, where the table's batches end later. At 130
    heads the balanced table ties the pairs, and a tie takes the table."""
    costs = _costs(128, 1024)
    cpu = torch.device("cpu")
    programs, table, bits = triton_backend._schedule(1, heads, costs, 132, config.SCHEDULE_BATCH_ROUNDS, cpu)
    pairs = schedule.pairs_makespan(heads, costs, min(heads * 4, 132))
    if table is None:
        assert programs == min(heads * 4, 132)
        split = schedule.causal_forward(heads, costs, min(heads * 8, 132), min(heads * 8, 132))
        assert schedule.makespan(split, costs, min(heads * 8, 132)) > pairs
    else:
        assert schedule.makespan(_abstract(table, programs, len(costs), heads, bits), costs, programs) <= pairs
    assert (table is None) == (heads in (66, 264))


@pytest.mark.parametrize("head_dim, n", [(128, 512), (64, 512), (128, 1024), (256, 2048), (64, 16384)])
def test_balance_ends_sooner(head_dim, n):
    """The bench's shapes whose greedy split ends more than 1.2% past the mean work: balanced, within 1.2% of it, every
    tile still run once (test_heads_are_balanced_in_batches checks the order)."""
    heads, costs, programs = 16384 // n * (2048 // head_dim), _costs(head_dim, n), 132
    greedy = schedule.causal_forward(heads, costs, programs, programs, balance=False)
    table = schedule.causal_forward(heads, costs, programs, programs)
    mean = heads * sum(costs) / programs
    assert schedule.makespan(greedy, costs, programs) > 1.012 * mean
    assert schedule.makespan(table, costs, programs) <= 1.012 * mean
    lists = _lists(table, programs)
    assert sorted(t for tiles in lists for t, _ in tiles) == list(range(heads * len(costs)))
    was = {t: i for i, tiles in enumerate(_lists(greedy, programs)) for t, _ in tiles}
    moved = [t for i, tiles in enumerate(lists) for t, _ in tiles if was[t] != i]
    assert moved  # not the greedy's split


@pytest.mark.parametrize(
    "batch, heads, n_m",
    [(3, 5, 7), (1, 1, 1), (2, 16, 4), (1, 48, 128), (5, 1, 3), (3, 5, 8738)],  # last: ~MAX_TILES
)
def test_the_kernels_fields_hold_every_tile(batch, heads, n_m):
    """The entries the kernel reads (bit fields for batch, head and tile: no division at a tile's start) decode to the
    tiles schedule.py listed, each once, with its r."""
    entries = [(t << 1) | (t % 2) for t in range(batch * heads * n_m)]
    fields, bits = triton_backend._fields(entries, n_m, heads, batch)
    offsets = [0, len(fields)]
    assert _abstract(torch.tensor(offsets + fields), 1, n_m, heads, bits)[2:] == entries


@pytest.mark.parametrize("head_dim, n", [(128, 1024), (128, 512), (256, 512), (64, 16384)])
@pytest.mark.parametrize("balance", [False, True], ids=["greedy", "balanced"])
def test_heads_are_balanced_in_batches(head_dim, n, balance):
    """A batch's heads run before the next batch's on every program, a batch's longest tiles first (its keys stay
    in L2 while they do), and the r bits of a program's tiles alternate (warpgroups that see unequal numbers of
    keys take turns). Greedy, the first batch starts at once; balancing may put a tile of it behind another."""
    heads, costs, programs = 16384 // n * (2048 // head_dim), _costs(head_dim, n), 132
    n_m = len(costs)
    lists = _lists(schedule.causal_forward(heads, costs, programs, programs, balance), programs)
    per_batch = programs // n_m
    for tiles in lists:
        order = [(t // n_m // per_batch, -costs[t % n_m]) for t, _ in tiles]
        assert order == sorted(order)
        assert [r for _, r in tiles] == [i % 2 for i in range(len(tiles))]
    if not balance:
        assert set(range(per_batch * n_m)) <= {tiles[0][0] for tiles in lists}


def test_bad_requests_are_refused():
    with pytest.raises(ValueError, match="no schedule"):
        schedule.causal_forward(0, [1], 4, 8)
    with pytest.raises(ValueError, match="no schedule"):
        schedule.causal_forward(2, [1, 2], 0, 8)


@pytest.mark.parametrize("window_left", [None, 0, 100, 300])
@pytest.mark.parametrize(
    "cfg, n",
    [
        (config.HopperForwardConfig(64, 128, 3), 1024),
        (config.HopperForwardConfig(64, 128, 3), 320),  # the last tile's second warpgroup is past the end
        (config.HopperForwardConfig(64, 64, 6), 1024),
        (config.HopperForwardConfig(64, 128, 3, consumers=3), 1152),
        (config.HopperForwardConfig(64, 128, 3, consumers=3), 1088),  # the last tile's third warpgroup is past it
    ],
    ids=["128-key tiles", "a partial last tile", "64-key tiles", "three warpgroups", "three, a partial last tile"],
)
def test_tile_costs_count_the_key_tiles_each_warpgroup_sees(cfg, n, window_left):
    """Against a count over the mask itself: a warpgroup streams every key tile that holds a key one of its rows
    sees (causal; with a window, not more than window_left behind), from the first such tile on."""
    rows = cfg.consumers * cfg.block_m
    tiles = -(-n // rows)
    costs = triton_backend._tile_costs(n, tiles, cfg, window_left)
    q = torch.arange(n)[:, None]
    k = torch.arange(n)[None, :]
    seen = k <= q
    if window_left is not None:
        seen &= k >= q - window_left
    for p in range(tiles):
        m = tiles - 1 - p
        streamed = [0]
        for w in range(cfg.consumers):
            first = (m * cfg.consumers + w) * cfg.block_m
            keys = seen[first : first + cfg.block_m].any(0).nonzero().flatten()
            if len(keys):
                key_tiles = keys // cfg.block_n
                streamed.append((key_tiles.max() - key_tiles.min() + 1).item() * cfg.block_n)
        assert costs[p] == max(streamed) + config.SCHEDULE_TILE_KEYS, (p, streamed)
