// Spreading a kernel's work items over XLA's intra-op thread pool (shared by the native kernels).
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>

#include "xla/ffi/api/ffi.h"

namespace orca_native {

// Runs body(0) .. body(count - 1) over the pool's threads and the calling thread. Items are claimed
// one at a time from a shared counter, so a pool task that starts late finds no work and returns;
// the caller waits only for items actually claimed. The state outlives the call (tasks may still
// hold it), hence the shared_ptr.
template <typename F>
void parallel_for(xla::ffi::ThreadPool& pool, int64_t count, F&& body) {
  struct State {
    std::atomic<int64_t> next{0}, done{0};
  };
  auto state = std::make_shared<State>();
  auto work = [state, count, &body] {
    int64_t finished = 0;
    for (int64_t i; (i = state->next.fetch_add(1, std::memory_order_relaxed)) < count; ++finished) body(i);
    if (finished && state->done.fetch_add(finished, std::memory_order_acq_rel) + finished == count)
      state->done.notify_all();
  };
  const int64_t helpers = std::min<int64_t>(pool.num_threads(), count) - 1;
  for (int64_t t = 0; t < helpers; ++t) pool.Schedule(decltype(work)(work));
  work();
  for (int64_t done; (done = state->done.load(std::memory_order_acquire)) < count;) state->done.wait(done);
}

}  // namespace orca_native
