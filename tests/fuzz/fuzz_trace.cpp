// SPDX-License-Identifier: Apache-2.0
// libFuzzer target for the routing-trace reader (moe::offload::parse_trace): arbitrary bytes
// must either be rejected with moe::Error or give a trace that writes back to the same bytes
// (the format has one encoding per trace), whose locality statistics are fractions, and that
// replays through LRU and Belady's MIN with Belady hitting at least as often. Any other outcome
// (a crash, a sanitizer report, another exception, a broken invariant) is a bug. Built with
// clang -fsanitize=fuzzer,address,undefined by the "fuzz: trace libFuzzer" test, and with the
// normal compiler into moe_fuzz_replay_trace (tests/fuzz/replay_main.cpp).
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <span>
#include <string>

#include "moe/core/error.hpp"
#include "moe/offload/simulator.hpp"
#include "moe/offload/synthetic.hpp"
#include "moe/offload/trace.hpp"

namespace {

// A broken invariant: abort, so that libFuzzer and the sanitizers record the input.
void require(bool ok) {
  if (!ok) std::abort();
}

}  // namespace

/// Parses `data` as a trace file; returns 1 if it was accepted, 0 if it was rejected.
extern "C" int moe_fuzz_one(std::uint8_t const* data, std::size_t size) {
  namespace off = moe::offload;
  off::Trace trace;
  try {
    trace = off::parse_trace(std::span<unsigned char const>(data, size), "fuzz.trace");
  } catch (moe::Error const&) {
    return 0;
  }
  std::string const again = off::trace_bytes(trace);
  require(again.size() == size &&
          (size == 0 || again.compare(0, size, reinterpret_cast<char const*>(data), size) == 0));
  off::LocalityStats const s = off::measure_locality(trace);
  require(s.next_token_repeat >= 0.0 && s.next_token_repeat <= 1.0);
  require(s.within_8_repeat >= 0.0 && s.within_8_repeat <= 1.0);
  off::TraceShape const& shape = trace.shape();
  // Replays (bounded work: the fuzzer's inputs are small, a hostile header cannot inflate them).
  if (trace.num_tokens() >= 1 && shape.num_layers * shape.num_experts <= 4096) {
    auto const g = off::CacheGeometry::uniform(shape.num_layers, shape.num_experts, 1,
                                               static_cast<std::uint64_t>(shape.top_k + 1));
    off::SimulationOptions o;
    o.warmup_tokens = 0;
    auto const lru = off::simulate(trace, g, off::Lru{}, o);
    auto const min = off::simulate(trace, g, off::Belady{}, o);
    require(lru.hits <= min.hits);
    require(lru.accesses == trace.num_steps() * shape.top_k);
  }
  return 1;
}

extern "C" int LLVMFuzzerTestOneInput(std::uint8_t const* data, std::size_t size) {
  (void)moe_fuzz_one(data, size);
  return 0;
}
