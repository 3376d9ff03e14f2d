"""Process-wide tables of host-side decisions (checked parameters, routes, plans, shared zeros), bounded in size."""

from __future__ import annotations


def put(table: dict, key, value, limit: int):
    """table[key] = value, returned; past ``limit`` entries the oldest goes first. Autograd's device threads fill
    these tables too: another thread may empty or change the table between the two steps of finding the oldest (the
    latter raises in the iterator), or take it first; then nothing goes, and nothing is raised."""
    if len(table) >= limit:
        try:
            oldest = next(iter(table))
        except (StopIteration, RuntimeError):
            oldest = None
        table.pop(oldest, None)
    table[key] = value
    return value
