// SPDX-License-Identifier: Apache-2.0
// This file is part of moe, a header-only library of sparse Mixture-of-Experts layers.
/// \file
/// Routing traces for expert-cache studies: moe::offload::Trace (which experts each token chose
/// at each MoE layer, with gate scores, ranks and optionally the router's top-M candidates) and
/// its binary file format (parse_trace / read_trace, trace_bytes / write_trace; docs/offload.md).
#pragma once

#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <iterator>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "moe/core/error.hpp"
#include "moe/core/types.hpp"

namespace moe::offload {

/// The most (layer, expert) pairs a trace may have, L x E <= 2^22 (DeepSeek-V3 has 58 x 256 =
/// 14848): per-expert state of the tools that read traces is O(L E), so a hostile header cannot
/// make them allocate more than a few tens of MB.
inline constexpr Index kMaxTraceSlots = Index{1} << 22;

/// The fixed sizes of a trace. Every step (token t, layer l) selects exactly `top_k` distinct
/// experts among `num_experts`; `num_candidates` (M, 0 = not recorded, else top_k <= M <=
/// num_experts) is how many of the router's highest-scoring experts each step also records.
struct TraceShape {
  Index num_layers = 0;      ///< L, MoE layers per token (>= 1)
  Index num_experts = 0;     ///< E, routed experts per layer (>= 1)
  Index top_k = 0;           ///< K, experts selected per token and layer (1 <= K <= E)
  Index num_candidates = 0;  ///< M, router candidates recorded per step (0, or K <= M <= E)

  /// moe::Error naming `where` unless the sizes are within the format's limits (L <= 65536,
  /// E <= 65536, L E <= kMaxTraceSlots; K and M as above).
  void check(std::string_view where) const {
    moe::detail::check(num_layers >= 1 && num_layers <= 65536, where, ": num_layers ", num_layers,
                       " is not in [1, 65536]");
    moe::detail::check(num_experts >= 1 && num_experts <= 65536, where, ": num_experts ",
                       num_experts, " is not in [1, 65536]");
    moe::detail::check(num_layers * num_experts <= kMaxTraceSlots, where,
                       ": num_layers x num_experts = ", num_layers * num_experts,
                       " is above the limit of ", kMaxTraceSlots, " (layer, expert) pairs");
    moe::detail::check(top_k >= 1 && top_k <= num_experts, where, ": top_k ", top_k,
                       " is not in [1, num_experts = ", num_experts, "]");
    moe::detail::check(
        num_candidates == 0 || (num_candidates >= top_k && num_candidates <= num_experts), where,
        ": num_candidates ", num_candidates, " is neither 0 nor in [top_k = ", top_k,
        ", num_experts = ", num_experts, "]");
  }
  friend bool operator==(TraceShape const&, TraceShape const&) = default;
};

/// One step of a trace: what the router of MoE layer `layer` chose for token `token`.
/// `experts[r]` is the expert of rank r (r = 0 the router's first choice) and `gates[r]` its gate
/// score (the router's score, e.g. softmax probability); both have K entries. `candidates` /
/// `candidate_scores` hold the router's M highest-scoring experts and their scores (empty when
/// the trace records none). Views into the owning Trace: valid while it is not modified.
struct TraceRecord {
  Index token = 0;
  Index layer = 0;
  std::span<std::int32_t const> experts;     // [K]
  std::span<float const> gates;              // [K]
  std::span<std::int32_t const> candidates;  // [M]
  std::span<float const> candidate_scores;   // [M]
};

/// An in-memory routing trace: steps in decoding order, token-major (token 0 layers 0..L-1, then
/// token 1, ...), i.e. the order in which a decoder touches the experts. Step s is token s / L,
/// layer s % L. Storage is flat: [T, L, K] expert ids and gates, [T, L, M] candidates.
class Trace {
 public:
  Trace() = default;
  /// An empty trace of the given sizes (checked: TraceShape::check).
  explicit Trace(TraceShape const& shape) : shape_(shape) { shape_.check("moe::offload::Trace"); }

  TraceShape const& shape() const { return shape_; }
  /// Complete tokens recorded (a trace always holds whole tokens once finished; see append).
  Index num_tokens() const { return num_steps() / shape_.num_layers; }
  /// Steps recorded (token, layer pairs).
  Index num_steps() const {
    return shape_.top_k == 0 ? 0 : static_cast<Index>(experts_.size()) / shape_.top_k;
  }

  /// Appends the next step: token num_steps() / L, layer num_steps() % L. `experts` and `gates`
  /// have K entries, experts distinct and in [0, E), gates finite; `candidates` and
  /// `candidate_scores` have M entries (distinct experts, finite scores) or are empty when M = 0.
  /// moe::Error otherwise.
  void append(std::span<std::int32_t const> experts, std::span<float const> gates,
              std::span<std::int32_t const> candidates = {},
              std::span<float const> candidate_scores = {}) {
    char const* where = "moe::offload::Trace::append";
    moe::detail::check(shape_.num_layers >= 1, where,
                       ": the trace has no shape; construct it with one");
    auto const k = static_cast<std::size_t>(shape_.top_k);
    auto const m = static_cast<std::size_t>(shape_.num_candidates);
    moe::detail::check(experts.size() == k && gates.size() == k, where, ": expected ", k,
                       " experts and gates, got ", experts.size(), " and ", gates.size());
    moe::detail::check(candidates.size() == m && candidate_scores.size() == m, where, ": expected ",
                       m, " candidates and scores, got ", candidates.size(), " and ",
                       candidate_scores.size());
    check_ids(experts, where, "expert");
    check_ids(candidates, where, "candidate");
    for (float const g : gates)
      moe::detail::check(std::isfinite(g), where, ": a gate is not finite");
    for (float const g : candidate_scores)
      moe::detail::check(std::isfinite(g), where, ": a candidate score is not finite");
    experts_.insert(experts_.end(), experts.begin(), experts.end());
    gates_.insert(gates_.end(), gates.begin(), gates.end());
    candidates_.insert(candidates_.end(), candidates.begin(), candidates.end());
    candidate_scores_.insert(candidate_scores_.end(), candidate_scores.begin(),
                             candidate_scores.end());
  }

  /// Step `s` (0 <= s < num_steps()).
  TraceRecord step(Index s) const {
    auto const k = static_cast<std::size_t>(shape_.top_k);
    auto const m = static_cast<std::size_t>(shape_.num_candidates);
    auto const i = static_cast<std::size_t>(s);
    return {s / shape_.num_layers,
            s % shape_.num_layers,
            std::span<std::int32_t const>(experts_).subspan(i * k, k),
            std::span<float const>(gates_).subspan(i * k, k),
            std::span<std::int32_t const>(candidates_).subspan(i * m, m),
            std::span<float const>(candidate_scores_).subspan(i * m, m)};
  }
  /// Token `t`, layer `l`.
  TraceRecord at(Index t, Index l) const { return step(t * shape_.num_layers + l); }

  /// All expert ids, [steps, K], and gates, [steps, K]; candidates [steps, M].
  std::span<std::int32_t const> expert_ids() const { return experts_; }
  std::span<float const> gate_scores() const { return gates_; }
  std::span<std::int32_t const> candidate_ids() const { return candidates_; }
  std::span<float const> candidate_score_values() const { return candidate_scores_; }

  /// Drops a trailing partial token (steps of a token whose layers are not all recorded).
  void drop_partial_token() {
    auto const whole = static_cast<std::size_t>(num_tokens() * shape_.num_layers);
    experts_.resize(whole * static_cast<std::size_t>(shape_.top_k));
    gates_.resize(whole * static_cast<std::size_t>(shape_.top_k));
    candidates_.resize(whole * static_cast<std::size_t>(shape_.num_candidates));
    candidate_scores_.resize(whole * static_cast<std::size_t>(shape_.num_candidates));
  }
  void reserve_tokens(Index tokens) {
    auto const steps = static_cast<std::size_t>(tokens * shape_.num_layers);
    experts_.reserve(steps * static_cast<std::size_t>(shape_.top_k));
    gates_.reserve(steps * static_cast<std::size_t>(shape_.top_k));
    candidates_.reserve(steps * static_cast<std::size_t>(shape_.num_candidates));
    candidate_scores_.reserve(steps * static_cast<std::size_t>(shape_.num_candidates));
  }

  /// Same shape and the same steps (bitwise equal scores).
  friend bool operator==(Trace const& a, Trace const& b) {
    return a.shape_ == b.shape_ && a.experts_ == b.experts_ && a.gates_ == b.gates_ &&
           a.candidates_ == b.candidates_ && a.candidate_scores_ == b.candidate_scores_;
  }

 private:
  void check_ids(std::span<std::int32_t const> ids, char const* where, char const* what) const {
    // Distinctness by a small bitmap (E <= 65536): no quadratic scan for large M.
    seen_.resize(static_cast<std::size_t>(shape_.num_experts), 0);
    std::size_t marked = 0;
    auto const unmark = [&] {
      for (std::size_t i = 0; i < marked; ++i) seen_[static_cast<std::size_t>(ids[i])] = 0;
    };
    for (std::int32_t const e : ids) {
      if (e < 0 || e >= shape_.num_experts || seen_[static_cast<std::size_t>(e)] != 0) {
        unmark();
        moe::detail::check(e >= 0 && e < shape_.num_experts, where, ": ", what, " id ", e,
                           " is not in [0, num_experts = ", shape_.num_experts, ")");
        moe::detail::fail(where, ": ", what, " id ", e, " appears twice in one step");
      }
      seen_[static_cast<std::size_t>(e)] = 1;
      ++marked;
    }
    unmark();
  }

  TraceShape shape_{};
  std::vector<std::int32_t> experts_;        // [steps, K]
  std::vector<float> gates_;                 // [steps, K]
  std::vector<std::int32_t> candidates_;     // [steps, M]
  std::vector<float> candidate_scores_;      // [steps, M]
  mutable std::vector<unsigned char> seen_;  // scratch of check_ids
};

/// The trace file format, version 1 (little-endian; docs/offload.md, "Trace files"):
///
///   offset  size  field
///   0       8     magic "MOETRACE"
///   8       4     u32 version = 1
///   12      4     u32 num_layers L     (1..65536)
///   16      4     u32 num_experts E    (1..65536)
///   20      4     u32 top_k K          (1..E)
///   24      4     u32 num_candidates M (0, or K..E)
///   28      4     u32 reserved = 0
///   32      8     u64 num_tokens T
///   40      ...   T * L steps, token-major; each step K x (u16 expert, f32 gate) then
///                 M x (u16 candidate, f32 score), i.e. 6 * (K + M) bytes
///
/// L x E is at most kMaxTraceSlots. The file's size must be exactly 40 + 6 (K + M) L T bytes;
/// expert ids are < E and distinct within a step's selection (and within its candidates); scores
/// are finite.
inline constexpr char kTraceMagic[8] = {'M', 'O', 'E', 'T', 'R', 'A', 'C', 'E'};
inline constexpr std::uint32_t kTraceVersion = 1;
inline constexpr std::size_t kTraceHeaderBytes = 40;

namespace detail {

inline std::uint32_t trace_u32(unsigned char const* p) {
  return static_cast<std::uint32_t>(p[0]) | static_cast<std::uint32_t>(p[1]) << 8 |
         static_cast<std::uint32_t>(p[2]) << 16 | static_cast<std::uint32_t>(p[3]) << 24;
}
inline void trace_put_u32(std::string& out, std::uint32_t v) {
  for (int i = 0; i < 4; ++i) out.push_back(static_cast<char>((v >> (8 * i)) & 0xffu));
}
inline void trace_put_u16(std::string& out, std::uint32_t v) {
  out.push_back(static_cast<char>(v & 0xffu));
  out.push_back(static_cast<char>((v >> 8) & 0xffu));
}
inline void trace_put_f32(std::string& out, float f) {
  trace_put_u32(out, std::bit_cast<std::uint32_t>(f));
}

}  // namespace detail

/// Parses a trace file's bytes (format: kTraceMagic above). `name` names the input in errors.
/// Throws moe::Error ("moe: <name>: <what is wrong>") on any malformed input: short or long
/// file, bad magic or version, sizes out of range, an expert id out of range or repeated in a
/// step, a non-finite score. Never reads out of bounds.
inline Trace parse_trace(std::span<unsigned char const> bytes, std::string_view name = "trace") {
  std::string const where(name);
  moe::detail::check(bytes.size() >= kTraceHeaderBytes, where, ": ", bytes.size(),
                     " bytes is shorter than the 40-byte trace header; not a moe trace file");
  moe::detail::check(std::memcmp(bytes.data(), kTraceMagic, 8) == 0, where,
                     ": bad magic (expected \"MOETRACE\"); not a moe trace file");
  unsigned char const* p = bytes.data();
  std::uint32_t const version = detail::trace_u32(p + 8);
  moe::detail::check(version == kTraceVersion, where, ": trace format version ", version,
                     " is not supported (this reader knows version 1)");
  TraceShape shape{detail::trace_u32(p + 12), detail::trace_u32(p + 16), detail::trace_u32(p + 20),
                   detail::trace_u32(p + 24)};
  shape.check(where);
  moe::detail::check(detail::trace_u32(p + 28) == 0, where, ": reserved header field is not 0");
  std::uint64_t const tokens = static_cast<std::uint64_t>(detail::trace_u32(p + 32)) |
                               static_cast<std::uint64_t>(detail::trace_u32(p + 36)) << 32;
  auto const step_bytes = static_cast<std::uint64_t>(6 * (shape.top_k + shape.num_candidates));
  std::uint64_t const payload = bytes.size() - kTraceHeaderBytes;
  auto const per_token = step_bytes * static_cast<std::uint64_t>(shape.num_layers);
  // Compare by division: T * per_token may overflow for a hostile T.
  moe::detail::check(payload % per_token == 0 && payload / per_token == tokens, where,
                     ": header says ", tokens, " tokens (", per_token,
                     " bytes each) but the file holds ", payload,
                     " bytes after the header; truncated or corrupt");
  Trace trace(shape);
  trace.reserve_tokens(static_cast<Index>(tokens));
  auto const k = static_cast<std::size_t>(shape.top_k);
  auto const m = static_cast<std::size_t>(shape.num_candidates);
  std::vector<std::int32_t> ids(k), cids(m);
  std::vector<float> gates(k), scores(m);
  unsigned char const* q = p + kTraceHeaderBytes;
  auto const read = [&q](std::int32_t& id, float& f) {
    id = static_cast<std::int32_t>(static_cast<std::uint32_t>(q[0]) |
                                   static_cast<std::uint32_t>(q[1]) << 8);
    f = std::bit_cast<float>(detail::trace_u32(q + 2));
    q += 6;
  };
  auto const steps = tokens * static_cast<std::uint64_t>(shape.num_layers);
  for (std::uint64_t s = 0; s < steps; ++s) {
    for (std::size_t i = 0; i < k; ++i) read(ids[i], gates[i]);
    for (std::size_t i = 0; i < m; ++i) read(cids[i], scores[i]);
    try {
      trace.append(ids, gates, cids, scores);
    } catch (Error const& e) {
      moe::detail::fail(where, ": step ", s, " (token ",
                        s / static_cast<std::uint64_t>(shape.num_layers), ", layer ",
                        s % static_cast<std::uint64_t>(shape.num_layers),
                        "): ", std::string_view(e.what()).substr(std::string_view("moe: ").size()));
    }
  }
  return trace;
}

/// The bytes of `trace` in the trace file format (whole tokens only: a trailing partial token is
/// an error).
inline std::string trace_bytes(Trace const& trace) {
  TraceShape const& s = trace.shape();
  s.check("moe::offload::trace_bytes");
  moe::detail::check(trace.num_steps() == trace.num_tokens() * s.num_layers,
                     "moe::offload::trace_bytes: the trace ends inside a token; call "
                     "drop_partial_token() first");
  std::string out(kTraceMagic, 8);
  detail::trace_put_u32(out, kTraceVersion);
  for (Index v : {s.num_layers, s.num_experts, s.top_k, s.num_candidates, Index{0}})
    detail::trace_put_u32(out, static_cast<std::uint32_t>(v));
  auto const tokens = static_cast<std::uint64_t>(trace.num_tokens());
  detail::trace_put_u32(out, static_cast<std::uint32_t>(tokens & 0xffffffffu));
  detail::trace_put_u32(out, static_cast<std::uint32_t>(tokens >> 32));
  out.reserve(out.size() +
              static_cast<std::size_t>(trace.num_steps() * 6 * (s.top_k + s.num_candidates)));
  for (Index i = 0; i < trace.num_steps(); ++i) {
    TraceRecord const r = trace.step(i);
    for (std::size_t j = 0; j < r.experts.size(); ++j) {
      detail::trace_put_u16(out, static_cast<std::uint32_t>(r.experts[j]));
      detail::trace_put_f32(out, r.gates[j]);
    }
    for (std::size_t j = 0; j < r.candidates.size(); ++j) {
      detail::trace_put_u16(out, static_cast<std::uint32_t>(r.candidates[j]));
      detail::trace_put_f32(out, r.candidate_scores[j]);
    }
  }
  return out;
}

/// Writes `trace` to `path` (trace_bytes); moe::Error if the file cannot be written.
inline void write_trace(std::string const& path, Trace const& trace) {
  std::string const bytes = trace_bytes(trace);
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  moe::detail::check(static_cast<bool>(out), path, ": cannot open for writing");
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  out.flush();
  moe::detail::check(static_cast<bool>(out), path, ": write failed");
}

/// Reads the trace file at `path` (parse_trace); moe::Error if it cannot be read or is malformed.
inline Trace read_trace(std::string const& path) {
  std::ifstream in(path, std::ios::binary);
  moe::detail::check(static_cast<bool>(in), path, ": cannot open the trace file");
  std::vector<unsigned char> bytes((std::istreambuf_iterator<char>(in)),
                                   std::istreambuf_iterator<char>());
  moe::detail::check(!in.bad(), path, ": read failed");
  return parse_trace(bytes, path);
}

}  // namespace moe::offload
