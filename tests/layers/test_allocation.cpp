// SPDX-License-Identifier: Apache-2.0
// MoeFfn allocates nothing in the steady state: global operator new is counted while a layer
// runs with a workspace that has already seen the batch size (or was reserved).
#include <atomic>
#include <catch2/catch.hpp>
#include <cstdlib>
#include <new>

#include "moe/layers/moe_ffn.hpp"
#include "moe/layers/presets.hpp"
#include "support/helpers.hpp"

namespace {
std::atomic<long> g_allocations{0};
std::atomic<bool> g_counting{false};
}  // namespace

#if defined(__SANITIZE_ADDRESS__)
// Under AddressSanitizer, operator new belongs to the sanitizer runtime: count through its
// allocation hook instead of replacing operator new (which ASan would report as a mismatch).
// Declared by hand: GCC ships the runtime but not <sanitizer/allocator_interface.h>.
extern "C" int __sanitizer_install_malloc_and_free_hooks(void (*malloc_hook)(void const volatile*,
                                                                             std::size_t),
                                                         void (*free_hook)(void const volatile*));
namespace {
void count_malloc(void const volatile*, std::size_t) {
  if (g_counting.load(std::memory_order_relaxed)) g_allocations.fetch_add(1);
}
void ignore_free(void const volatile*) {}
[[maybe_unused]] int const g_hooks_installed =
    __sanitizer_install_malloc_and_free_hooks(count_malloc, ignore_free);
}  // namespace
#else
// malloc itself (Eigen's aligned_malloc, C code) is counted through the linker's --wrap=malloc,
// set for this binary in tests/CMakeLists.txt.
extern "C" void* __real_malloc(std::size_t size);
extern "C" void* __wrap_malloc(std::size_t size) {
  if (g_counting.load(std::memory_order_relaxed)) g_allocations.fetch_add(1);
  return __real_malloc(size);
}
// Replacing operator new is a whole-program decision: this TU lives in its own test binary.
// GCC cannot see that these replacements pair malloc with free consistently.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmismatched-new-delete"
#endif
void* operator new(std::size_t size) {
  if (g_counting.load(std::memory_order_relaxed)) g_allocations.fetch_add(1);
  if (void* p = __real_malloc(size ? size : 1)) return p;
  throw std::bad_alloc();
}
void* operator new[](std::size_t size) { return ::operator new(size); }
void operator delete(void* p) noexcept { std::free(p); }
void operator delete(void* p, std::size_t) noexcept { std::free(p); }
void operator delete[](void* p) noexcept { std::free(p); }
void operator delete[](void* p, std::size_t) noexcept { std::free(p); }
#endif

TEST_CASE("MoeFfn forward allocates nothing once the workspace has seen the batch",
          "[layers][allocation]") {
  using moe::Index;
  auto layer = moe::presets::make_qwen2_moe({32, 16, 24, 8, 2, false});
  moe::fill_uniform(layer.experts().parameters(), -0.2f, 0.2f, 1);
  Index const T = 200, D = 32;
  auto x = test::random_vector(T * D, 2);
  std::vector<float> y(x.size());
  moe::ThreadPool pool(2);
  SECTION("the counter works: a fresh workspace does allocate") {
    moe::MoeFfnWorkspace ws;
    g_allocations = 0;
    g_counting = true;
    layer.forward({x.data(), T, D}, {y.data(), T, D}, ws, {nullptr, &pool});
    g_counting = false;
    REQUIRE(g_allocations > 0);
  }
  SECTION("after a first call at the largest size") {
    moe::MoeFfnWorkspace ws;
    layer.forward({x.data(), T, D}, {y.data(), T, D}, ws, {nullptr, &pool});
    g_allocations = 0;
    g_counting = true;
    layer.forward({x.data(), T, D}, {y.data(), T, D}, ws, {nullptr, &pool});
    layer.forward({x.data(), T / 2, D}, {y.data(), T / 2, D}, ws, {nullptr, &pool});
    g_counting = false;
    REQUIRE(g_allocations == 0);
  }
  SECTION("with packed weights (fp32 and bf16), after a first call") {
    for (auto format : {moe::experts::WeightFormat::kF32, moe::experts::WeightFormat::kBf16}) {
      layer.pack_weights(format);
      moe::MoeFfnWorkspace ws;
      layer.forward({x.data(), T, D}, {y.data(), T, D}, ws, {nullptr, &pool});
      g_allocations = 0;
      g_counting = true;
      layer.forward({x.data(), T, D}, {y.data(), T, D}, ws, {nullptr, &pool});
      layer.forward({x.data(), 3, D}, {y.data(), 3, D}, ws, {nullptr, &pool});
      g_counting = false;
      REQUIRE(g_allocations == 0);
    }
  }
  SECTION("after reserve") {
    moe::MoeFfnWorkspace ws;
    layer.reserve(ws, T, pool.size());
    // Let the pool's worker thread start first: a thread's own start-up (TLS, sanitizer state)
    // may allocate, and on a loaded machine it can start late, inside the counted region.
    pool.parallel_for(2, [](moe::Index, int) {});
    g_allocations = 0;
    g_counting = true;
    layer.forward({x.data(), 1, D}, {y.data(), 1, D}, ws, {nullptr, &pool});
    layer.forward({x.data(), T, D}, {y.data(), T, D}, ws, {nullptr, &pool});
    g_counting = false;
    REQUIRE(g_allocations == 0);
  }
}
