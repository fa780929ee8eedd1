"""Bookkeeping of the KV pages the engine hands out to sequences."""


class PageAllocator:
    """A free list of page ids `0 .. num_pages - 1`.

    Pages go back to the list when a sequence finishes, is aborted or is
    preempted; `free` is how many are left.
    """

    def __init__(self, num_pages: int):
        if num_pages < 1:
            raise ValueError(f"The KV cache needs at least one page, got num_pages={num_pages}.")
        self.num_pages = num_pages
        self._free = list(range(num_pages - 1, -1, -1))  # pop() hands out low ids first

    @property
    def free(self) -> int:
        return len(self._free)

    def allocate(self, count: int) -> list[int] | None:
        """`count` pages, or None (and nothing taken) when fewer are free."""
        if count > len(self._free):
            return None
        return [self._free.pop() for _ in range(count)]

    def release(self, pages: list[int]) -> None:
        self._free.extend(reversed(pages))
