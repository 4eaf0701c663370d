// SPDX-License-Identifier: Apache-2.0
// The layers allocate nothing in the steady state: global operator new (and malloc) is counted
// while a layer runs with a workspace that has already seen the batch size (or was reserved):
// MoeFfn forward, GatedAttention and MoeAttention forward and forward_train + backward.
#include <atomic>
#include <catch2/catch.hpp>
#include <cstdlib>
#include <new>

#include "moe/layers/gated_attention.hpp"
#include "moe/layers/moe_attention.hpp"
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
  moe::fill_uniform(layer.experts().edit().parameters(), -0.2f, 0.2f, 1);
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

namespace {

/// Counts the allocations of f().
template <class F>
long allocations_of(F&& f) {
  g_allocations = 0;
  g_counting = true;
  f();
  g_counting = false;
  return g_allocations.load();
}

/// A fresh workspace allocates during `step` (the counter works), and after a first step at the
/// largest size neither `step` (forward_train + backward) nor `forward` allocates.
template <class Step, class Forward>
void require_steady_state_allocation_free(Step&& step, Forward&& forward) {
  SECTION("the counter works: a fresh workspace does allocate") {
    REQUIRE(allocations_of(step) > 0);
  }
  SECTION("after a first step at the largest size") {
    step();
    REQUIRE(allocations_of(step) == 0);
    REQUIRE(allocations_of(forward) == 0);
  }
}

/// Every parameter group of an attention layer uniform in [-0.1, 0.1].
template <class Layer>
void randomize(Layer& layer, std::uint64_t seed) {
  auto params = layer.parameters();
  for (std::size_t i = 0; i < params.size(); ++i) {
    moe::fill_uniform(params[i].values, -0.1f, 0.1f, seed + i);
  }
}

/// The batch both attention cases run: 2 sequences of 48 tokens of width 64, 2 threads.
struct AttentionBatch {
  static constexpr moe::Index T = 96, D = 64;
  std::vector<float> x = test::random_vector(T * D, 4), dy = test::random_vector(T * D, 5);
  std::vector<float> y = std::vector<float>(T * D), dx = std::vector<float>(T * D);
  moe::ThreadPool pool{2};
  moe::AttentionOptions opt{&pool, 2, {}, {}};
  moe::ConstMatrixView<float> in() const { return {x.data(), T, D}; }
  moe::MatrixView<float> out() { return {y.data(), T, D}; }
  moe::ConstMatrixView<float> dout() const { return {dy.data(), T, D}; }
  moe::MatrixView<float> din() { return {dx.data(), T, D}; }
};

}  // namespace

TEST_CASE("GatedAttention forward and backward allocate nothing once the workspace has grown",
          "[attention][allocation]") {
  moe::GatedAttentionConfig c;
  c.d_model = AttentionBatch::D;
  c.num_heads = 4;
  c.num_kv_heads = 2;
  c.head_dim = 16;
  c.gate_layout = moe::GateLayout::kPackedPerHead;
  c.qk_norm = moe::QkNorm::kRmsNormOnePlus;
  c.rope = true;
  moe::GatedAttention<moe::gating::ElementwiseGate> layer(c);
  randomize(layer, 3);
  AttentionBatch b;
  auto grads = layer.make_gradients();
  moe::GatedAttentionWorkspace ws;
  auto step = [&] {
    layer.forward_train(b.in(), b.out(), ws, b.opt);
    layer.backward(ws, b.dout(), b.din(), grads, &b.pool);
  };
  require_steady_state_allocation_free(step, [&] { layer.forward(b.in(), b.out(), ws, b.opt); });
}

TEST_CASE("MoeAttention forward and backward allocate nothing once the workspace has grown",
          "[attention][allocation]") {
  using moe::Index;
  namespace experts = moe::experts;
  Index const D = AttentionBatch::D, F = 48;
  experts::ExpertBank<experts::SwiGlu> bank(4, D, F);
  moe::fill_uniform(bank.edit().parameters(), -0.1f, 0.1f, 6);
  using Sh = experts::GatedSharedExperts<experts::SwiGlu>;
  moe::MoeAttentionConfig c;
  c.d_model = D;
  c.qk_dim = 32;
  c.q_rank = 16;
  c.residual_query = true;
  c.rope = true;
  moe::MoeAttention<moe::routing::SoftmaxTopK, experts::SwiGlu, Sh, moe::gating::HeadwiseGate>
      layer(c, {4, 2, false, 1.0f}, bank, Sh(1, D, 32));
  randomize(layer, 7);
  AttentionBatch b;
  auto grads = layer.make_gradients();
  experts::ExpertBank<experts::SwiGlu> bank_grads(4, D, F);
  moe::MoeAttentionWorkspace ws;
  auto step = [&] {
    layer.forward_train(b.in(), b.out(), ws, b.opt);
    layer.backward(ws, b.dout(), b.din(), grads, bank_grads, &b.pool);
  };
  require_steady_state_allocation_free(step, [&] { layer.forward(b.in(), b.out(), ws, b.opt); });
}
