"""Process-wide tables of host-side decisions (checked parameters, routes, plans, shared zeros), bounded in size."""

from __future__ import annotations


def put(table: dict, key, value, limit: int):
    """table[key] = value, returned; past ``limit`` entries the oldest goes first (another thread may have taken it
    already: nothing is raised)."""
    if len(table) >= limit:
        table.pop(next(iter(table), None), None)
    table[key] = value
    return value
