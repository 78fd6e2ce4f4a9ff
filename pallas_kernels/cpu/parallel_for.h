// Spreading a kernel's work items over XLA's intra-op thread pool (shared by the native kernels).
#pragma once

#include <algorithm>
#include <atomic>
#include <climits>
#include <cstdint>
#include <memory>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace orca_native {

// Items [front, back) of one worker's share, packed in one word so that the owner taking from the
// front and a thief taking from the back never both get the same item.
class Share {
 public:
  void set(int64_t front, int64_t back) { bounds_.store(pack(front, back), std::memory_order_relaxed); }
  int64_t take_front() { return take(true); }
  int64_t take_back() { return take(false); }

 private:
  static uint64_t pack(int64_t front, int64_t back) { return static_cast<uint64_t>(back) << 32 | static_cast<uint32_t>(front); }
  int64_t take(bool from_front) {  // an item, or -1 when the share is empty
    uint64_t bounds = bounds_.load(std::memory_order_relaxed);
    for (;;) {
      const int64_t front = static_cast<uint32_t>(bounds), back = static_cast<int64_t>(bounds >> 32);
      if (front >= back) return -1;
      const uint64_t taken = from_front ? pack(front + 1, back) : pack(front, back - 1);
      if (bounds_.compare_exchange_weak(bounds, taken, std::memory_order_relaxed)) return from_front ? front : back - 1;
    }
  }
  std::atomic<uint64_t> bounds_{0};
};

// Runs body(0) .. body(count - 1) over the pool's threads and the calling thread. The items are cut
// into one contiguous share per thread, each worked through in order by its owner, and a thread with
// nothing left takes items from the back of the others' shares. In order, because a decode step's
// matmul streams its weights from memory: a thread reading one contiguous run of rows keeps the
// hardware prefetcher ahead of it, while items dealt out one at a time (as this did before) gave each
// thread a run of a few KB and a restart every item; two threads then streamed one matrix barely
// faster than one. A pool thread that starts late (it was parked: tens of microseconds) finds its
// share partly taken from the back and does the rest, so the caller waits only for items actually
// claimed. The state outlives the call (tasks may still hold it), hence the shared_ptr.
template <typename F>
void parallel_for(xla::ffi::ThreadPool& pool, int64_t count, F&& body) {
  const int64_t workers = std::clamp<int64_t>(pool.num_threads(), 1, std::max<int64_t>(count, 1));
  if (workers == 1 || count > INT32_MAX) {  // one thread's work (or more items than a Share holds)
    for (int64_t i = 0; i < count; ++i) body(i);
    return;
  }
  struct State {
    explicit State(int64_t workers) : shares(workers) {}
    std::vector<Share> shares;
    std::atomic<int64_t> arrived{0}, done{0};
  };
  auto state = std::make_shared<State>(workers);
  for (int64_t w = 0; w < workers; ++w) state->shares[w].set(count * w / workers, count * (w + 1) / workers);
  // Exactly `workers` calls of `work` (the caller's and workers - 1 pool tasks'): each owns a share.
  auto work = [state, count, workers, &body] {
    const int64_t me = state->arrived.fetch_add(1, std::memory_order_relaxed);
    int64_t finished = 0;
    for (int64_t i; (i = state->shares[me].take_front()) >= 0; ++finished) body(i);
    for (int64_t other = 1; other < workers; ++other)  // own share is empty now: the others', from the back
      for (int64_t i; (i = state->shares[(me + other) % workers].take_back()) >= 0; ++finished) body(i);
    if (finished && state->done.fetch_add(finished, std::memory_order_acq_rel) + finished == count)
      state->done.notify_all();
  };
  for (int64_t t = 1; t < workers; ++t) pool.Schedule(decltype(work)(work));
  work();
  for (int64_t done; (done = state->done.load(std::memory_order_acquire)) < count;) state->done.wait(done);
}

}  // namespace orca_native
