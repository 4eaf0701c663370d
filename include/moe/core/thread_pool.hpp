// SPDX-License-Identifier: Apache-2.0
// This file is part of moe, a header-only library of sparse Mixture-of-Experts layers.
/// \file
/// ThreadPool: a small fork-join pool that runs independent work items.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <exception>
#include <mutex>
#include <thread>
#include <vector>

#include "moe/core/error.hpp"
#include "moe/core/types.hpp"

namespace moe {

namespace detail {
/// Test hook: when set, called before the ThreadPool constructor starts worker `index` (1-based);
/// a hook that throws simulates a thread that cannot start. Not for production use; set and reset
/// it from one thread while no pool is being built.
inline void (*thread_start_hook)(int index) = nullptr;
}  // namespace detail

/// A fork-join pool of `num_threads - 1` workers plus the calling thread.
///
/// `parallel_for(n, f)` calls f(item, thread) once for every item in [0, n), hands items out
/// dynamically, and returns when all are done. moe's determinism rule: an item's result may
/// depend only on the item, never on which thread ran it or in which order, so every layer's
/// output is bitwise identical for 1 and N threads. The first exception thrown by an item is
/// rethrown in the caller after all items have finished.
///
/// One parallel_for at a time per pool (calls from several threads are serialised); nested calls
/// from inside an item run serially on the calling thread.
///
/// Waiting: a worker that finished its items spins (with the CPU's pause hint) for up to
/// kSpinMicroseconds for the next parallel_for before it sleeps on a condition variable, and
/// the caller spins as long for the workers to finish before it sleeps. A decode step calls
/// parallel_for tens of times a layer, each a fraction of a millisecond: waking a sleeping
/// thread costs tens of microseconds (a futex call and, in a VM, an inter-processor interrupt)
/// each time, spinning a few. An idle pool sleeps after that, using no CPU.
class ThreadPool {
 public:
  /// Most threads a pool may have (kMaxThreads, 1024): far above any core count this library
  /// targets, low enough that a mistyped count fails at once instead of exhausting the system's
  /// process limit.
  static constexpr int kMaxThreads = 1024;
  /// How long a worker (or the caller) spins for the next job (or the workers' end) before it
  /// sleeps.
  static constexpr int kSpinMicroseconds = 100;

  /// 1 <= num_threads <= kMaxThreads (1 runs everything on the caller). Throws moe::Error if a
  /// worker thread cannot be started (std::thread failed: process or memory limit); the workers
  /// already started are stopped and joined first, so nothing is left running.
  explicit ThreadPool(int num_threads) {
    detail::check(num_threads >= 1 && num_threads <= kMaxThreads,
                  "ThreadPool: num_threads = ", num_threads, "; pass 1 to ", kMaxThreads,
                  " (1 runs everything on the calling thread)");
    try {
      workers_.reserve(static_cast<std::size_t>(num_threads - 1));
      for (int i = 1; i < num_threads; ++i) {
        if (detail::thread_start_hook) detail::thread_start_hook(i);
        workers_.emplace_back([this, i] { worker_loop(i); });
      }
    } catch (std::exception const& e) {
      stop_and_join();
      detail::fail("ThreadPool: could not start worker thread ", workers_.size() + 1, " of ",
                   num_threads - 1, " (", e.what(),
                   "); ask for fewer threads or raise the process or memory limit");
    }
  }
  ThreadPool(ThreadPool const&) = delete;
  ThreadPool& operator=(ThreadPool const&) = delete;
  ~ThreadPool() { stop_and_join(); }

  /// Threads taking part in a parallel_for, the caller included.
  int size() const { return static_cast<int>(workers_.size()) + 1; }

  /// Runs f(item, thread_index) for item in [0, n); thread_index is in [0, size()).
  template <class F>
  void parallel_for(Index n, F&& f) {
    if (n <= 0) return;
    if (workers_.empty() || n == 1 || in_item_) {
      for (Index i = 0; i < n; ++i) f(i, 0);
      return;
    }
    std::lock_guard serial(call_mutex_);
    using Fn = std::remove_reference_t<F>;
    job_ = Job{&invoke<Fn>, static_cast<void*>(&f), n};
    next_.store(0, std::memory_order_relaxed);
    error_ = nullptr;
    busy_.store(static_cast<int>(workers_.size()), std::memory_order_relaxed);
    {
      // Under the mutex, so a worker that checked generation_ and is about to sleep cannot
      // miss the notification; spinning workers see the release store at once.
      std::lock_guard lock(mutex_);
      generation_.fetch_add(1, std::memory_order_release);
    }
    wake_.notify_all();  // no system call when every worker is spinning
    run_items(0);
    if (!spin_until([this] { return busy_.load(std::memory_order_acquire) == 0; })) {
      std::unique_lock lock(mutex_);
      done_.wait(lock, [this] { return busy_.load(std::memory_order_acquire) == 0; });
    }
    if (error_) std::rethrow_exception(error_);
  }

 private:
  struct Job {
    void (*call)(void*, Index, int) = nullptr;
    void* context = nullptr;
    Index count = 0;
  };
  template <class Fn>
  static void invoke(void* context, Index item, int thread) {
    (*static_cast<Fn*>(context))(item, thread);
  }

  void stop_and_join() noexcept {
    {
      std::lock_guard lock(mutex_);
      stop_.store(true, std::memory_order_release);
    }
    wake_.notify_all();
    for (auto& w : workers_) w.join();
  }

  void run_items(int thread) {
    in_item_ = true;
    for (;;) {
      Index const i = next_.fetch_add(1, std::memory_order_relaxed);
      if (i >= job_.count) break;
      try {
        job_.call(job_.context, i, thread);
      } catch (...) {
        std::lock_guard lock(mutex_);
        if (!error_) error_ = std::current_exception();
      }
    }
    in_item_ = false;
  }

  /// Spins until ready() (true) or kSpinMicroseconds have passed (false).
  template <class Ready>
  static bool spin_until(Ready const& ready) {
    auto const until =
        std::chrono::steady_clock::now() + std::chrono::microseconds(kSpinMicroseconds);
    for (;;) {
      for (int i = 0; i < 64; ++i) {
        if (ready()) return true;
#if defined(__x86_64__) || defined(__i386__)
        __builtin_ia32_pause();
#endif
      }
      if (std::chrono::steady_clock::now() >= until) return ready();
    }
  }

  void worker_loop(int thread) {
    std::uint64_t seen = 0;
    for (;;) {
      auto const fresh = [&] {
        return stop_.load(std::memory_order_acquire) ||
               generation_.load(std::memory_order_acquire) != seen;
      };
      if (!spin_until(fresh)) {
        std::unique_lock lock(mutex_);
        wake_.wait(lock, fresh);
      }
      if (stop_.load(std::memory_order_acquire)) return;
      seen = generation_.load(std::memory_order_acquire);
      run_items(thread);
      if (busy_.fetch_sub(1, std::memory_order_acq_rel) == 1) {
        // The caller may be asleep on done_: notify under the mutex, so it cannot check
        // busy_ and then sleep past this notification.
        std::lock_guard lock(mutex_);
        done_.notify_one();
      }
    }
  }

  static inline thread_local bool in_item_ = false;
  std::vector<std::thread> workers_;
  std::mutex call_mutex_;
  std::mutex mutex_;
  std::condition_variable wake_;
  std::condition_variable done_;
  Job job_;
  std::atomic<Index> next_{0};
  std::exception_ptr error_;
  std::atomic<std::uint64_t> generation_{0};  ///< written under mutex_; read spinning or under it
  std::atomic<int> busy_{0};                  ///< workers still running the current job
  std::atomic<bool> stop_{false};             ///< written under mutex_
};

/// Runs f(item, thread) over [0, n) on `pool`, or serially on the caller when pool is null.
template <class F>
void parallel_for(ThreadPool* pool, Index n, F&& f) {
  if (pool) {
    pool->parallel_for(n, f);
  } else {
    for (Index i = 0; i < n; ++i) f(i, 0);
  }
}

}  // namespace moe
