// SPDX-License-Identifier: Apache-2.0
// Traces and the trace file format (moe/offload/trace.hpp): round trips, and every malformed
// file rejected with moe::Error naming what is wrong.
#include <catch2/catch.hpp>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <limits>
#include <string>
#include <vector>

#include "moe/offload/synthetic.hpp"
#include "moe/offload/trace.hpp"

namespace {

using moe::offload::Trace;

std::vector<unsigned char> bytes_of(std::string const& s) { return {s.begin(), s.end()}; }

void put_u32(std::vector<unsigned char>& b, std::size_t at, std::uint32_t v) {
  for (int i = 0; i < 4; ++i)
    b[at + static_cast<std::size_t>(i)] = static_cast<unsigned char>(v >> (8 * i));
}

Trace small_trace(moe::Index candidates) {
  return moe::offload::make_synthetic_trace({.num_layers = 3,
                                             .num_experts = 10,
                                             .top_k = 2,
                                             .num_candidates = candidates,
                                             .num_tokens = 7,
                                             .persistence = 0.5,
                                             .seed = 42});
}

std::string error_of(std::vector<unsigned char> const& b) {
  try {
    (void)moe::offload::parse_trace(b, "t.trace");
  } catch (moe::Error const& e) {
    return e.what();
  }
  return "";
}

}  // namespace

TEST_CASE("A trace's steps are token-major and keep ranks, gates and candidates",
          "[offload][trace]") {
  Trace t({2, 5, 2, 3});
  std::int32_t const a[] = {4, 1}, b[] = {0, 2}, ca[] = {4, 1, 3}, cb[] = {0, 2, 4};
  float const ga[] = {0.5f, 0.25f}, gb[] = {0.7f, 0.1f}, sa[] = {0.5f, 0.25f, 0.1f},
              sb[] = {0.7f, 0.1f, 0.05f};
  t.append(a, ga, ca, sa);
  t.append(b, gb, cb, sb);
  t.append(b, gb, cb, sb);
  CHECK(t.num_steps() == 3);
  CHECK(t.num_tokens() == 1);
  auto const r = t.step(2);
  CHECK(r.token == 1);
  CHECK(r.layer == 0);
  CHECK(r.experts[0] == 0);
  CHECK(r.gates[1] == 0.1f);
  CHECK(r.candidates[2] == 4);
  t.drop_partial_token();
  CHECK(t.num_steps() == 2);
  CHECK(t.at(0, 1).experts[1] == 2);
}

TEST_CASE("Trace::append rejects bad steps", "[offload][trace]") {
  Trace t({1, 4, 2, 0});
  float const g[] = {1.0f, 0.5f};
  std::int32_t const dup[] = {1, 1}, out[] = {1, 4}, neg[] = {-1, 0}, ok[] = {0, 3};
  CHECK_THROWS_WITH(t.append(dup, g), Catch::Contains("appears twice"));
  CHECK_THROWS_WITH(t.append(out, g), Catch::Contains("not in [0, num_experts = 4)"));
  CHECK_THROWS_WITH(t.append(neg, g), Catch::Contains("not in [0"));
  float const nan[] = {std::numeric_limits<float>::quiet_NaN(), 0.0f};
  CHECK_THROWS_WITH(t.append(ok, nan), Catch::Contains("not finite"));
  std::int32_t const one[] = {0};
  CHECK_THROWS_WITH(t.append(one, std::span<float const>(g).first(1)),
                    Catch::Contains("expected 2 experts"));
  CHECK(t.num_steps() == 0);
  t.append(ok, g);  // a rejected step leaves no scratch state behind
  CHECK(t.num_steps() == 1);
  CHECK_THROWS_WITH(Trace({1, 4, 5, 0}), Catch::Contains("top_k 5"));
  CHECK_THROWS_WITH(Trace({1, 4, 2, 1}), Catch::Contains("num_candidates 1"));
}

TEST_CASE("A trace file round-trips bit for bit, with and without candidates", "[offload][trace]") {
  for (moe::Index m : {moe::Index{0}, moe::Index{4}}) {
    Trace const t = small_trace(m);
    std::string const bytes = moe::offload::trace_bytes(t);
    CHECK(bytes.size() == 40 + 6 * (2 + static_cast<std::size_t>(m)) * 3 * 7);
    Trace const back = moe::offload::parse_trace(bytes_of(bytes));
    CHECK(back == t);
    CHECK(moe::offload::trace_bytes(back) == bytes);
    std::filesystem::create_directories(MOE_OFFLOAD_TEST_TMP);
    std::string const path = std::string(MOE_OFFLOAD_TEST_TMP) + "/round_trip.trace";
    moe::offload::write_trace(path, t);
    CHECK(moe::offload::read_trace(path) == t);
  }
  Trace const empty({2, 3, 1, 0});
  CHECK(moe::offload::parse_trace(bytes_of(moe::offload::trace_bytes(empty))) == empty);
}

TEST_CASE("Malformed trace files are rejected with a clear error", "[offload][trace]") {
  std::vector<unsigned char> const good = bytes_of(moe::offload::trace_bytes(small_trace(4)));
  REQUIRE(error_of(good).empty());
  auto with = [&](auto&& edit) {
    std::vector<unsigned char> b = good;
    edit(b);
    return error_of(b);
  };
  CHECK_THAT(error_of({}), Catch::Contains("shorter than the 40-byte trace header"));
  CHECK_THAT(with([](auto& b) { b[0] = 'X'; }), Catch::Contains("bad magic"));
  CHECK_THAT(with([](auto& b) { put_u32(b, 8, 2); }), Catch::Contains("version 2"));
  CHECK_THAT(with([](auto& b) { put_u32(b, 12, 0); }), Catch::Contains("num_layers 0"));
  CHECK_THAT(with([](auto& b) { put_u32(b, 16, 70000); }), Catch::Contains("num_experts 70000"));
  CHECK_THAT(with([](auto& b) { put_u32(b, 20, 11); }), Catch::Contains("top_k 11"));
  CHECK_THAT(with([](auto& b) {
               put_u32(b, 12, 12584);
               put_u32(b, 16, 63744);
             }),
             Catch::Contains("above the limit of 4194304"));  // found by the fuzzer
  CHECK_THAT(with([](auto& b) { put_u32(b, 24, 1); }), Catch::Contains("num_candidates 1"));
  CHECK_THAT(with([](auto& b) { put_u32(b, 28, 1); }), Catch::Contains("reserved"));
  CHECK_THAT(with([](auto& b) { b.pop_back(); }), Catch::Contains("truncated or corrupt"));
  CHECK_THAT(with([](auto& b) { b.push_back(0); }), Catch::Contains("truncated or corrupt"));
  CHECK_THAT(with([](auto& b) { put_u32(b, 32, 8); }), Catch::Contains("header says 8 tokens"));
  CHECK_THAT(with([](auto& b) { put_u32(b, 36, 0xffffffffu); }),
             Catch::Contains("truncated or corrupt"));
  // The first step's first expert id (u16 at 40) out of range, then equal to the second's.
  CHECK_THAT(
      with([](auto& b) { b[40] = 10; }),
      Catch::Contains("step 0 (token 0, layer 0): moe::offload::Trace::append: expert id 10"));
  CHECK_THAT(with([&](auto& b) {
               b[40] = b[46];
               b[41] = b[47];
             }),
             Catch::Contains("appears twice"));
  // Its gate (f32 at 42) NaN; a candidate score (step 0's first candidate at 40 + 12 + 2) inf.
  CHECK_THAT(with([](auto& b) { put_u32(b, 42, 0x7fc00000u); }), Catch::Contains("not finite"));
  CHECK_THAT(with([](auto& b) { put_u32(b, 54, 0x7f800000u); }),
             Catch::Contains("candidate score is not finite"));
  CHECK_THROWS_WITH(moe::offload::read_trace(std::string(MOE_OFFLOAD_TEST_TMP) + "/no/such.trace"),
                    Catch::Contains("cannot open"));
}
