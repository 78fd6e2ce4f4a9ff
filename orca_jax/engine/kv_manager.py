"""KV page allocator: free list, reference counts, prefix caching. Pure Python, no jax.

The KV cache is `num_pages` pages of `page_size` token slots. A request's `block_table` lists its
pages in order; token i lives in page block_table[i // page_size], slot i % page_size.

Prefix caching (optional): a full page is identified by a hash of its tokens chained with its
parent page's hash, so equal hashes mean equal prefixes. Pages of finished requests keep their
hash while free; a new request whose prompt starts with the same pages takes them (ref count up)
instead of recomputing. Free pages are reused least-recently-freed first, which keeps recently
cached prefixes alive longest.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict

from orca_jax.engine.request import Request


class KVCacheManager:
    def __init__(self, num_pages: int, page_size: int, enable_prefix_caching: bool = False):
        if num_pages < 1 or page_size < 1:
            raise ValueError(f"need num_pages >= 1 and page_size >= 1, got {num_pages}, {page_size}")
        self.num_pages = num_pages
        self.page_size = page_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts = [0] * num_pages
        self.free_pages: OrderedDict[int, None] = OrderedDict((p, None) for p in range(num_pages))
        self.page_to_hash: dict[int, bytes] = {}
        self.hash_to_page: dict[bytes, int] = {}
        self.page_hashes: dict[str, list[bytes]] = {}  # request id -> hashes of its full pages
        self.prefix_cache_queries = 0  # prompt tokens looked up
        self.prefix_cache_hits = 0  # of those, tokens served from cache

    # ---- figures ---------------------------------------------------------------------------
    @property
    def num_free_pages(self) -> int:
        return len(self.free_pages)

    @property
    def num_used_pages(self) -> int:
        return self.num_pages - len(self.free_pages)

    @property
    def usage(self) -> float:
        return self.num_used_pages / self.num_pages

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    # ---- allocation ------------------------------------------------------------------------
    def num_pages_to_allocate(self, request: Request, num_tokens: int) -> int:
        return max(0, self.pages_for(num_tokens) - len(request.block_table))

    def allocate(self, request: Request, num_tokens: int) -> bool:
        """Grows `request.block_table` to hold `num_tokens` tokens. All or nothing: returns False
        (and changes nothing) when too few pages are free."""
        needed = self.num_pages_to_allocate(request, num_tokens)
        if needed > len(self.free_pages):
            return False
        for _ in range(needed):
            page, _ = self.free_pages.popitem(last=False)
            self._forget_hash(page)
            self.ref_counts[page] = 1
            request.block_table.append(page)
        return True

    def free(self, request: Request) -> None:
        """Returns the request's pages (finish, abort or preemption). Tail pages are freed first so
        they are also reused first, keeping the shareable head of a prefix cached longest."""
        for page in reversed(request.block_table):
            self.ref_counts[page] -= 1
            assert self.ref_counts[page] >= 0, f"page {page} freed twice"
            if self.ref_counts[page] == 0:
                self.free_pages[page] = None
        request.block_table = []
        self.page_hashes.pop(request.request_id, None)

    def shrink(self, request: Request, num_tokens: int) -> None:
        """Gives back the request's pages past the first `num_tokens` tokens (pages of rejected
        draft tokens). They were allocated for this request alone and never hashed: a page is
        hashed only once all its tokens are computed, and these hold none that are."""
        keep = self.pages_for(num_tokens)
        while len(request.block_table) > keep:
            page = request.block_table.pop()
            assert self.ref_counts[page] == 1 and page not in self.page_to_hash, f"page {page} is shared"
            self.ref_counts[page] = 0
            self.free_pages[page] = None

    # ---- prefix caching --------------------------------------------------------------------
    def match_prefix(self, request: Request) -> int:
        """Takes the cached pages that hold a prefix of the request's tokens; returns how many tokens
        they cover (0 when caching is off). At least one token is always left to compute, since
        its logits are needed to sample."""
        if not self.enable_prefix_caching or request.block_table:
            return 0
        tokens = request.all_token_ids
        max_pages = (len(tokens) - 1) // self.page_size
        hashes = self._page_hashes(request, max_pages)
        self.prefix_cache_queries += len(request.prompt_token_ids)
        for page_hash in hashes:
            page = self.hash_to_page.get(page_hash)
            if page is None:
                break
            if self.ref_counts[page] == 0:
                del self.free_pages[page]
            self.ref_counts[page] += 1
            request.block_table.append(page)
        cached = len(request.block_table) * self.page_size
        self.prefix_cache_hits += min(cached, len(request.prompt_token_ids))
        return cached

    def cache_full_pages(self, request: Request, num_tokens: int) -> None:
        """Registers the full pages among the first `num_tokens` tokens (whose K/V the current step
        writes) so later requests can share them. A page is hashed only once the request holds all
        of its tokens: accepted drafts are computed before the engine appends them as output, and a
        page hashed from fewer tokens would never match (its hash is kept for the request)."""
        if not self.enable_prefix_caching:
            return
        num_full = min(min(num_tokens, request.num_tokens) // self.page_size, len(request.block_table))
        hashes = self._page_hashes(request, num_full)
        for page, page_hash in zip(request.block_table[:num_full], hashes):
            if page in self.page_to_hash or page_hash in self.hash_to_page:
                continue
            self.page_to_hash[page] = page_hash
            self.hash_to_page[page_hash] = page

    def _page_hashes(self, request: Request, num_pages: int) -> list[bytes]:
        hashes = self.page_hashes.setdefault(request.request_id, [])
        while len(hashes) < num_pages:  # hashes are cached per request: each page is hashed once
            i = len(hashes)
            parent = hashes[-1] if hashes else b""
            page_tokens = array("q", request.token_ids_between(i * self.page_size, (i + 1) * self.page_size)).tobytes()
            hashes.append(hashlib.blake2b(parent + page_tokens, digest_size=16).digest())
        return hashes[:num_pages]

    def _forget_hash(self, page: int) -> None:
        page_hash = self.page_to_hash.pop(page, None)
        if page_hash is not None:
            del self.hash_to_page[page_hash]

    def reset_prefix_cache(self) -> None:
        self.page_to_hash.clear()
        self.hash_to_page.clear()
