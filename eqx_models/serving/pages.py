"""Bookkeeping of the KV pages the engine hands out to sequences, and the prefix
cache over them.

A full page's keys and values depend only on its tokens and every token before
them, so a page is named by a key chained from its tokens and the key of the page
before it (`page_keys`). With prefix caching on, a full page is registered under
its key; sequences whose tokens start the same way take references to the same
pages instead of computing them again. A page nobody holds but that is registered
stays cached, in least-recently-released order, until a page is needed and none is
free: then the oldest is evicted.
"""

import collections
import hashlib
from collections.abc import Sequence

import numpy as np

PageKey = bytes


def page_keys(tokens: Sequence[int], page_size: int, parent: PageKey = b"") -> list[PageKey]:
    """The keys of the full pages of `tokens`, each chained from the key of the
    page before it (`parent` for the first: the key of the page before `tokens`,
    empty at the start of a sequence).

    A 16-byte BLAKE2b of the parent key and the page's tokens (a collision between
    two prefixes would hand one request the other's keys and values; at 128 bits
    that is out of reach, where Python's 64-bit `hash` is not).
    """
    keys = []
    for first in range(0, len(tokens) - page_size + 1, page_size):
        page = np.asarray(tokens[first : first + page_size], np.int64).tobytes()
        parent = hashlib.blake2b(parent + page, digest_size=16).digest()
        keys.append(parent)
    return keys


class PageAllocator:
    """Page ids `0 .. num_pages - 1`: a free list, references, and the prefix cache.

    `allocate` hands out pages with one reference each; `release` drops a
    reference, and a page with none goes back to the free list, or, if it is
    registered in the prefix cache, to the cached pages that `allocate` evicts
    oldest first when the free list runs dry. `free` counts both (every page a
    request could be given now).
    """

    def __init__(self, num_pages: int, prefix_caching: bool = False):
        if num_pages < 1:
            raise ValueError(f"The KV cache needs at least one page, got num_pages={num_pages}.")
        self.num_pages = num_pages
        self.prefix_caching = prefix_caching
        self._free = list(range(num_pages - 1, -1, -1))  # pop() hands out low ids first
        self._references = [0] * num_pages
        self._page_of: dict[PageKey, int] = {}
        self._key_of: dict[int, PageKey] = {}
        self._cached: collections.OrderedDict[int, None] = collections.OrderedDict()  # unreferenced, oldest first

    @property
    def free(self) -> int:
        return len(self._free) + len(self._cached)

    @property
    def cached(self) -> int:
        """Registered pages that no sequence holds (kept for reuse, evicted first come)."""
        return len(self._cached)

    def references(self, page: int) -> int:
        return self._references[page]

    def allocate(self, count: int) -> list[int] | None:
        """`count` pages, or None (and nothing taken) when fewer are free."""
        if count > self.free:
            return None
        pages = []
        for _ in range(count):
            if self._free:
                page = self._free.pop()
            else:
                page, _ = self._cached.popitem(last=False)
                del self._page_of[self._key_of.pop(page)]
            self._references[page] = 1
            pages.append(page)
        return pages

    def release(self, pages: Sequence[int]) -> None:
        """Drops one reference to each page; the last pages go first, so that a
        sequence's tail is evicted before the prefix other requests may share."""
        for page in reversed(pages):
            self._references[page] -= 1
            if self._references[page] < 0:
                raise RuntimeError(f"KV page {page} was released more often than it was handed out.")
            if self._references[page] == 0:
                if page in self._key_of:
                    self._cached[page] = None
                else:
                    self._free.append(page)

    def register(self, page: int, key: PageKey) -> None:
        """Names a full page held by a sequence by its key, so that later requests
        can share it. A key already cached keeps its page (this one stays private)."""
        if self.prefix_caching and key not in self._page_of and page not in self._key_of:
            self._page_of[key] = page
            self._key_of[page] = key

    def match(self, keys: Sequence[PageKey]) -> list[int]:
        """The cached pages of the longest run of `keys` from the first, each with
        a reference taken for the caller (give them back with `release`)."""
        pages = []
        for key in keys if self.prefix_caching else ():
            page = self._page_of.get(key)
            if page is None:
                break
            self._cached.pop(page, None)
            self._references[page] += 1
            pages.append(page)
        return pages

    def forget_cached(self) -> None:
        """Empties the prefix cache (the pages' contents were lost): cached pages
        become free, held ones private."""
        self._free += reversed(self._cached)
        self._cached.clear()
        self._page_of.clear()
        self._key_of.clear()
