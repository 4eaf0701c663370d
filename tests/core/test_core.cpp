// SPDX-License-Identifier: Apache-2.0
// Core vocabulary: views, Eigen interop without copies, errors, the thread pool, weight storage.
#include <atomic>
#include <catch2/catch.hpp>
#include <cstdint>
#include <fstream>
#include <limits>
#include <new>
#include <set>
#include <stdexcept>
#include <string>
#include <system_error>

#include "moe/core/eigen_interop.hpp"
#include "moe/core/error.hpp"
#include "moe/core/memory.hpp"
#include "moe/core/thread_pool.hpp"
#include "moe/core/views.hpp"

using moe::Index;

TEST_CASE("MatrixView addresses rows with its stride and converts to const", "[core][views]") {
  float data[12];
  for (int i = 0; i < 12; ++i) data[i] = static_cast<float>(i);
  moe::MatrixView<float> v(data, 3, 3, 4);
  REQUIRE(v(1, 2) == 6.0f);
  REQUIRE(v.row(2) == data + 8);
  moe::ConstMatrixView<float> c = v;  // implicit, no copy
  REQUIRE(c.data == data);
  REQUIRE(c.row_stride == 4);
  auto m = v.middle_rows(1, 2);
  REQUIRE(m(0, 0) == 4.0f);
  REQUIRE(m.rows == 2);
  static_assert(!std::is_convertible_v<moe::ConstMatrixView<float>, moe::MatrixView<float>>);
}

TEST_CASE("Eigen interop shares memory in both directions", "[core][eigen]") {
  moe::RowMatrixX<float> a(3, 5);
  a.setZero();
  auto v = moe::view(a);
  REQUIRE(v.data == a.data());
  v(2, 4) = 7.0f;
  REQUIRE(a(2, 4) == 7.0f);
  float raw[8] = {1, 2, 3, 4, 5, 6, 7, 8};
  auto map = moe::as_eigen(moe::ConstMatrixView<float>(raw, 2, 3, 4));  // strided
  REQUIRE(map.data() == raw);
  REQUIRE(map(1, 2) == 7.0f);
  REQUIRE(map.rows() == 2);
}

TEST_CASE("moe::Error says where, what and how to fix", "[core][errors]") {
  try {
    moe::detail::check(false, "Where: ", 3, " is wrong; do this");
    FAIL("no throw");
  } catch (moe::Error const& e) {
    REQUIRE(std::string(e.what()) == "moe: Where: 3 is wrong; do this");
  }
  REQUIRE_NOTHROW(moe::detail::check(true, "never"));
  REQUIRE_THROWS_AS(moe::ThreadPool(0), moe::Error);
}

TEST_CASE("ThreadPool runs every item exactly once on every pool size", "[core][threads]") {
  for (int threads : {1, 2, 3}) {
    moe::ThreadPool pool(threads);
    REQUIRE(pool.size() == threads);
    for (Index n : {0, 1, 2, 7, 1000}) {
      std::vector<std::atomic<int>> hits(static_cast<std::size_t>(n));
      std::atomic<int> bad_thread{0};
      pool.parallel_for(n, [&](Index i, int t) {
        hits[i].fetch_add(1);
        if (t < 0 || t >= threads) bad_thread = 1;
      });
      for (auto& h : hits) REQUIRE(h.load() == 1);
      REQUIRE(bad_thread == 0);
    }
  }
}

TEST_CASE("ThreadPool rethrows the first exception after all items finish", "[core][threads]") {
  moe::ThreadPool pool(2);
  std::atomic<int> done{0};
  REQUIRE_THROWS_WITH(pool.parallel_for(100,
                                        [&](Index i, int) {
                                          done.fetch_add(1);
                                          if (i == 37) throw std::runtime_error("item 37 failed");
                                        }),
                      "item 37 failed");
  REQUIRE(done == 100);
  // The pool is still usable, and nested calls run serially instead of deadlocking.
  std::atomic<int> inner{0};
  pool.parallel_for(
      4, [&](Index, int) { pool.parallel_for(3, [&](Index, int) { inner.fetch_add(1); }); });
  REQUIRE(inner == 12);
}

namespace {
// Threads of this process, from /proc/self/status (-1 where that is not available).
int process_threads() {
  std::ifstream status("/proc/self/status");
  std::string line;
  while (std::getline(status, line)) {
    if (line.rfind("Threads:", 0) == 0) return std::stoi(line.substr(8));
  }
  return -1;
}
}  // namespace

TEST_CASE("ThreadPool: a worker that cannot start makes the constructor join the others and throw",
          "[core][threads]") {
  REQUIRE_THROWS_AS(moe::ThreadPool(moe::ThreadPool::kMaxThreads + 1), moe::Error);
  int const before = process_threads();
  moe::detail::thread_start_hook = [](int index) {
    if (index == 3)
      throw std::system_error(std::make_error_code(std::errc::resource_unavailable_try_again));
  };
  try {
    moe::ThreadPool pool(6);
    moe::detail::thread_start_hook = nullptr;
    FAIL("no throw");
  } catch (moe::Error const& e) {
    moe::detail::thread_start_hook = nullptr;
    std::string const what = e.what();
    INFO(what);
    REQUIRE(what.find("could not start worker thread 3 of 5") != std::string::npos);
    REQUIRE(what.find("ask for fewer threads") != std::string::npos);
  }
  REQUIRE(process_threads() == before);  // workers 1 and 2 were stopped and joined
  moe::ThreadPool pool(3);               // and pools still work afterwards
  std::atomic<int> n{0};
  pool.parallel_for(10, [&](Index, int) { n.fetch_add(1); });
  REQUIRE(n == 10);
}

TEST_CASE("HugePageAllocator: 64-byte aligned blocks, 2 MiB aligned and padded at 2 MiB and up",
          "[core][memory]") {
  auto addr = [](void const* p) { return reinterpret_cast<std::uintptr_t>(p); };
  for (std::size_t n : {std::size_t{1}, std::size_t{17}, std::size_t{100000}}) {
    moe::HugePageVector<float> v(n, 1.5f);
    REQUIRE(addr(v.data()) % 64 == 0);
    REQUIRE(v[n - 1] == 1.5f);
  }
  std::size_t const big = moe::kHugePageBytes / sizeof(float) + 3;  // one page and a bit
  moe::HugePageVector<float> v(big, 0.0f);
  REQUIRE(addr(v.data()) % moe::kHugePageBytes == 0);
  REQUIRE(moe::HugePageAllocator<float>::block_bytes(big) == 2 * moe::kHugePageBytes);
  v.back() = 2.0f;                   // the whole block is usable
  moe::HugePageVector<float> w = v;  // copies through the (stateless) allocator
  REQUIRE(w.back() == 2.0f);
  REQUIRE(w.get_allocator() == v.get_allocator());
  moe::HugePageAllocator<std::uint32_t> alloc;
  REQUIRE_THROWS_AS(alloc.allocate(std::numeric_limits<std::size_t>::max() / 2), std::bad_alloc);
}
