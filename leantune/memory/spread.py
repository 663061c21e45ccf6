"""Spreading a choice of units evenly through a list: which blocks stream, which streamed blocks
go to disk. Resident (or RAM) blocks between the chosen ones are what hides the chosen ones'
copies (or reads)."""

from __future__ import annotations


def even_spread(names: list, count: int) -> list:
    """`count` of `names`, evenly spaced through the list (the middle of each of `count` equal
    stretches), so resident blocks sit between streamed ones and hide their copies."""
    n = len(names)
    if count <= 0:
        return []
    if count >= n:
        return list(names)
    return [names[(2 * i + 1) * n // (2 * count)] for i in range(count)]
