"""Property tests of the page allocator under random admit / append / abort / finish / preempt."""

from hypothesis import given, settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from orca_jax.engine.kv_manager import KVCacheManager
from orca_jax.engine.request import Request
from orca_jax.outputs import RequestMetrics
from orca_jax.sampling_params import SamplingParams

PAGE = 4


def make_request(i: int, tokens: list[int]) -> Request:
    return Request(str(i), list(tokens), SamplingParams(max_tokens=64), 0, frozenset(),
                   RequestMetrics(arrival_time=float(i)))


class KVManagerMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.kv = KVCacheManager(num_pages=24, page_size=PAGE, enable_prefix_caching=True)
        self.live: dict[str, Request] = {}
        self.next_id = 0

    @rule(prefix=st.sampled_from([[1, 2, 3, 4, 5, 6, 7, 8], [9, 9, 9, 9], []]),
          tail=st.lists(st.integers(0, 5), min_size=1, max_size=12))
    def admit(self, prefix, tail):
        request = make_request(self.next_id, prefix + tail)
        self.next_id += 1
        cached = self.kv.match_prefix(request)
        assert cached % PAGE == 0 and cached < request.num_tokens
        if self.kv.allocate(request, request.num_tokens):
            request.num_computed_tokens = request.num_tokens
            self.kv.cache_full_pages(request, request.num_tokens)
            self.live[request.request_id] = request
        else:
            self.kv.free(request)

    @precondition(lambda self: self.live)
    @rule(data=st.data(), count=st.integers(1, 6))
    def append(self, data, count):
        request = data.draw(st.sampled_from(sorted(self.live.values(), key=lambda r: r.request_id)))
        before = list(request.block_table)
        grown = self.kv.allocate(request, request.num_tokens + count)
        if grown:
            request.output_token_ids += [7] * count
            request.num_computed_tokens = request.num_tokens
            self.kv.cache_full_pages(request, request.num_tokens)
            assert request.block_table[:len(before)] == before
        else:
            assert request.block_table == before  # all or nothing

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def release(self, data):
        """Finish, abort and preemption all return every page of the request at once."""
        request = data.draw(st.sampled_from(sorted(self.live.values(), key=lambda r: r.request_id)))
        free_before = self.kv.num_free_pages
        exclusive = sum(1 for p in request.block_table if self.kv.ref_counts[p] == 1)
        self.kv.free(request)
        del self.live[request.request_id]
        assert request.block_table == []
        assert self.kv.num_free_pages == free_before + exclusive

    @invariant()
    def counts_are_consistent(self):
        kv = self.kv
        holders = [0] * kv.num_pages
        for request in self.live.values():
            assert len(set(request.block_table)) == len(request.block_table)  # no page twice in one table
            for page in request.block_table:
                holders[page] += 1
        assert holders == kv.ref_counts  # ref counts are exactly the number of tables holding a page
        free = set(kv.free_pages)
        assert free == {p for p in range(kv.num_pages) if holders[p] == 0}  # no leak, no double free
        assert kv.num_free_pages + kv.num_used_pages == kv.num_pages
        for page_hash, page in kv.hash_to_page.items():
            assert kv.page_to_hash[page] == page_hash


KVManagerMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
test_kv_manager_state_machine = KVManagerMachine.TestCase


@given(st.lists(st.integers(0, 50), min_size=1, max_size=40))
def test_shared_prefix_is_served_from_cache(tokens):
    kv = KVCacheManager(num_pages=64, page_size=PAGE, enable_prefix_caching=True)
    first = make_request(0, tokens)
    assert kv.match_prefix(first) == 0
    assert kv.allocate(first, len(tokens))
    kv.cache_full_pages(first, len(tokens))
    second = make_request(1, tokens + [1, 2])
    cached = kv.match_prefix(second)
    assert cached == (len(tokens) // PAGE) * PAGE  # every full page of the shared part
    assert second.block_table == first.block_table[: cached // PAGE]
    kv.free(first)
    kv.free(second)
    assert kv.num_free_pages == 64


def test_cached_pages_survive_their_owner_and_are_evicted_last():
    kv = KVCacheManager(num_pages=4, page_size=PAGE, enable_prefix_caching=True)
    owner = make_request(0, list(range(9)))  # two full pages + 1 token
    kv.allocate(owner, 9)
    kv.cache_full_pages(owner, 9)
    kv.free(owner)
    again = make_request(1, list(range(9)))
    assert kv.match_prefix(again) == 8  # still cached after the owner finished
    kv.free(again)
    other = make_request(2, [99] * 4)
    kv.allocate(other, 4)  # takes a page that never held the cached prefix
    third = make_request(3, list(range(9)))
    assert kv.match_prefix(third) == 8


@given(st.lists(st.integers(0, 9), min_size=1, max_size=12), st.lists(st.integers(0, 9), max_size=12),
       st.integers(0, 24), st.integers(0, 24))
def test_token_ids_between_slices_prompt_plus_outputs(prompt, outputs, start, end):
    request = make_request(0, prompt)
    request.output_token_ids = list(outputs)
    assert request.token_ids_between(start, end) == (prompt + outputs)[start:end]


def test_caching_off_shares_nothing():
    kv = KVCacheManager(num_pages=8, page_size=PAGE, enable_prefix_caching=False)
    first = make_request(0, list(range(8)))
    kv.allocate(first, 8)
    kv.cache_full_pages(first, 8)
    assert kv.match_prefix(make_request(1, list(range(9)))) == 0


def test_a_page_is_shared_only_after_the_same_prefix():
    """A page's hash is chained with its parent's, so equal tokens at another position (after another
    prefix) are not a hit: their K/V were computed at other positions, attending to other tokens."""
    kv = KVCacheManager(num_pages=8, page_size=PAGE, enable_prefix_caching=True)
    cached = make_request(0, [1, 2, 3, 4, 9, 9, 9, 9, 7])  # its second page is [9, 9, 9, 9]
    assert kv.allocate(cached, 9)
    kv.cache_full_pages(cached, 9)
    kv.free(cached)
    later = make_request(1, [9, 9, 9, 9, 5])  # the same tokens as its first page
    assert kv.match_prefix(later) == 0
    assert later.block_table == []
    same_prefix = make_request(2, [1, 2, 3, 4, 9, 9, 9, 9, 5])  # after the same prefix: both pages hit
    assert kv.match_prefix(same_prefix) == 8
