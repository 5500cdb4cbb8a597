"""Device KV in pages: the page allocator and the page budget.

A page holds `page_size` tokens' KV rows of every layer (`[L, page_size, W]` inside the pool
`[L, P, page_size, W]`); with `page_size = store.block_tokens` a page is exactly one Full Block,
so a block read from the store lands in a page as it is and a page filled by decode is the block
the decode engine persists. Page 0 is the *null page*: never handed out, it is where page
tables point past a request's pages and where padded writes go, so every table entry is a valid
page id and no write needs a bounds check.
"""

from __future__ import annotations

import collections

import jax


class PagesExhausted(RuntimeError):
    """Raised when an allocation needs more free pages than the pool has."""


class PageAllocator:
    """Free list over pages `1..num_pages` of a pool (page 0 is the null page) and the pages
    each owner holds, in order. A page may have several owners (`share`: forks of one prompt
    read its pages); it returns to the free list when the last one frees it. Freed pages are
    reused first-in-first-out."""

    def __init__(self, num_pages: int):
        if num_pages < 1:
            raise ValueError(f"a page pool needs at least one page, got {num_pages}")
        self.num_pages = num_pages
        self._free: collections.deque[int] = collections.deque(range(1, num_pages + 1))
        self._owned: dict[object, list[int]] = {}
        self._owners: dict[int, int] = {}  # page -> how many owners hold it

    @property
    def free_pages(self) -> int:
        return len(self._free)

    @property
    def used_pages(self) -> int:
        return self.num_pages - len(self._free)

    def can_allocate(self, n: int) -> bool:
        return n <= len(self._free)

    def pages(self, owner) -> list[int]:
        """The pages `owner` holds, in the order it got them (empty if none)."""
        return self._owned.get(owner, [])

    def allocate(self, owner, n: int) -> list[int]:
        """Gives `owner` `n` more pages (appended to the ones it holds) and returns them."""
        if n < 0:
            raise ValueError(f"cannot allocate {n} pages")
        if n > len(self._free):
            raise PagesExhausted(f"{n} KV pages needed, {len(self._free)} of {self.num_pages} free")
        got = [self._free.popleft() for _ in range(n)]
        self._owned.setdefault(owner, []).extend(got)
        self._owners.update((p, 1) for p in got)
        return got

    def share(self, owner, pages: list[int]) -> None:
        """Gives `owner` pages other owners hold (appended to its own, in order): each stays out
        of the free list until every owner freed it."""
        for p in pages:
            if self._owners.get(p, 0) < 1:
                raise ValueError(f"page {p} is not allocated: only held pages can be shared")
        self._owned.setdefault(owner, []).extend(pages)
        for p in pages:
            self._owners[p] += 1

    def owners(self, page: int) -> int:
        """How many owners hold `page` (0: it is free)."""
        return self._owners.get(page, 0)

    def free(self, owner) -> int:
        """Drops every page of `owner`; those it was the last to hold return to the pool. The
        number of pages returned."""
        back = []
        for p in self._owned.pop(owner, []):
            self._owners[p] -= 1
            if not self._owners[p]:
                del self._owners[p]
                back.append(p)
        self._free.extend(back)
        return len(back)


def pages_for(tokens: int, page_size: int) -> int:
    """Pages that hold `tokens` tokens."""
    return -(-tokens // page_size)


def budget_pages(
    page_bytes: int,
    *,
    budget_bytes: int = 0,
    fraction: float = 0.0,
    default_pages: int = 0,
    device: jax.Device | None = None,
    shards: int = 1,
) -> int:
    """The number of pages a KV budget buys: `budget_bytes` if given, else `fraction` of the
    device's memory (`memory_stats()["bytes_limit"]`; an error where the platform reports no
    limit, e.g. CPU), else `default_pages`. `shards`: the devices each page is split over (a
    pool split by KV head over a mesh): a fraction of each one's memory holds that many times
    the pages; `budget_bytes` counts the pool's bytes on all of them."""
    if budget_bytes < 0 or not 0.0 <= fraction <= 1.0:
        raise ValueError(f"bad KV budget: {budget_bytes} bytes, fraction {fraction}")
    if budget_bytes:
        n = budget_bytes // page_bytes
    elif fraction:
        device = device or jax.devices()[0]
        stats = device.memory_stats() or {}
        limit = stats.get("bytes_limit")
        if not limit:
            raise ValueError(
                f"a KV budget as a fraction of device memory needs the device's memory size, and"
                f" {device} reports none: give the budget in bytes"
            )
        n = int(limit * fraction) * shards // page_bytes
    else:
        n = default_pages
    if n < 1:
        raise ValueError(f"the KV budget holds no page of {page_bytes} bytes")
    return n
