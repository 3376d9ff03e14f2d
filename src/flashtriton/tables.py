"""Process-wide tables of host-side decisions (checked parameters, routes, plans, shared zeros), bounded in size."""

from __future__ import annotations


def put(table: dict, key, value, limit: int):
    """table[key] = value, returned; past ``limit`` entries the oldest go first. Autograd's device threads fill these
    tables too: another thread may take the oldest first, or change the table between iter() and next() (which then
    raises): the oldest is looked up again."""
    while len(table) >= limit:
        try:
            oldest = next(iter(table))
        except StopIteration:
            break
        except RuntimeError:
            continue
        table.pop(oldest, None)
    table[key] = value
    return value
