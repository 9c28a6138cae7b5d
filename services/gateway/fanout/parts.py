"""What a fan-out plan is: the parts' jobs in order, and the error of answers that do not merge."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Plan:
    """The sub-jobs in part order, and each part's start in seconds in the original (0.0 where meaningless)."""

    jobs: list
    offsets: list[float]


class MergeError(ValueError):
    """The parts' answers cannot be put together (wrong type or count, mismatched dims or audio formats)."""


def chunk_sizes(items: int, parts: int) -> list[int]:
    """Sizes of `parts` contiguous chunks covering `items`, differing by at most one (the larger ones first)."""
    q, r = divmod(items, parts)
    return [q + 1] * r + [q] * (parts - r)
