// SPDX-License-Identifier: Apache-2.0
// The GGUF reader, writer and split models (moe/io/gguf.hpp): round trips of every metadata
// type and of tensors, a file built byte by byte, every prefix of a valid file, a table of
// malformed files, split models.
#include <bit>
#include <catch2/catch.hpp>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <limits>
#include <span>
#include <string>
#include <vector>

#include "io/gguf_bytes.hpp"
#include "io/io_test_support.hpp"
#include "moe/io/gguf.hpp"

namespace {

using Catch::Contains;
using moe::io::GgufFile;
using moe::io::GgufMetadataValue;
using moe::io::GgufModel;
using moe::io::GgufValueType;
using moe::io::GgufWriter;
using moe::quant::GgmlType;

std::string error_of(std::vector<std::byte> const& bytes) {
  try {
    GgufFile const file(std::span<std::byte const>(bytes), "f.gguf");
  } catch (moe::Error const& e) {
    return e.what();
  }
  return "(accepted)";
}

template <class F>
std::string error_of_call(F&& f) {
  try {
    f();
  } catch (moe::Error const& e) {
    return e.what();
  }
  return "(no error)";
}

std::vector<std::byte> filled(std::size_t n, unsigned seed = 1) {
  std::vector<std::byte> out(n);
  for (std::size_t i = 0; i < n; ++i) out[i] = static_cast<std::byte>((i * 7 + seed) & 0xFF);
  return out;
}

// A small valid image: 2 metadata entries, one F32 tensor of 2 elements.
iotest::GgufBytes minimal(std::uint32_t version = 3) {
  iotest::GgufBytes b;
  b.header(version, 1, 2);
  b.str("general.architecture").u32(8).str("test");
  b.str("test.n").u32(4).u32(7);
  b.tensor("w", {2}, 0, 0);
  b.pad(32).f32(1.0f).f32(-2.0f);
  return b;
}

}  // namespace

TEST_CASE("GgmlType ids, names and block sizes are ggml's", "[io][gguf]") {
  using moe::quant::ggml_type_info;
  CHECK(static_cast<std::uint32_t>(GgmlType::kF32) == 0);
  CHECK(static_cast<std::uint32_t>(GgmlType::kQ4_K) == 12);
  CHECK(static_cast<std::uint32_t>(GgmlType::kBF16) == 30);
  CHECK(static_cast<std::uint32_t>(GgmlType::kMXFP4) == 39);
  for (std::uint32_t const removed : {4u, 5u, 31u, 32u, 33u, 36u, 37u, 38u, 43u, 1000u}) {
    CHECK(ggml_type_info(removed) == nullptr);
  }
  struct Expected {
    GgmlType type;
    char const* name;
    std::uint32_t elements, bytes;
  };
  // gguf-py GGML_QUANT_SIZES.
  Expected const table[] = {
      {GgmlType::kF32, "F32", 1, 4},
      {GgmlType::kF16, "F16", 1, 2},
      {GgmlType::kQ4_0, "Q4_0", 32, 18},
      {GgmlType::kQ4_1, "Q4_1", 32, 20},
      {GgmlType::kQ5_0, "Q5_0", 32, 22},
      {GgmlType::kQ5_1, "Q5_1", 32, 24},
      {GgmlType::kQ8_0, "Q8_0", 32, 34},
      {GgmlType::kQ8_1, "Q8_1", 32, 36},
      {GgmlType::kQ2_K, "Q2_K", 256, 84},
      {GgmlType::kQ3_K, "Q3_K", 256, 110},
      {GgmlType::kQ4_K, "Q4_K", 256, 144},
      {GgmlType::kQ5_K, "Q5_K", 256, 176},
      {GgmlType::kQ6_K, "Q6_K", 256, 210},
      {GgmlType::kQ8_K, "Q8_K", 256, 292},
      {GgmlType::kIQ2_XXS, "IQ2_XXS", 256, 66},
      {GgmlType::kIQ2_XS, "IQ2_XS", 256, 74},
      {GgmlType::kIQ3_XXS, "IQ3_XXS", 256, 98},
      {GgmlType::kIQ1_S, "IQ1_S", 256, 50},
      {GgmlType::kIQ4_NL, "IQ4_NL", 32, 18},
      {GgmlType::kIQ3_S, "IQ3_S", 256, 110},
      {GgmlType::kIQ2_S, "IQ2_S", 256, 82},
      {GgmlType::kIQ4_XS, "IQ4_XS", 256, 136},
      {GgmlType::kI8, "I8", 1, 1},
      {GgmlType::kI16, "I16", 1, 2},
      {GgmlType::kI32, "I32", 1, 4},
      {GgmlType::kI64, "I64", 1, 8},
      {GgmlType::kF64, "F64", 1, 8},
      {GgmlType::kIQ1_M, "IQ1_M", 256, 56},
      {GgmlType::kBF16, "BF16", 1, 2},
      {GgmlType::kTQ1_0, "TQ1_0", 256, 54},
      {GgmlType::kTQ2_0, "TQ2_0", 256, 66},
      {GgmlType::kMXFP4, "MXFP4", 32, 17},
      {GgmlType::kNVFP4, "NVFP4", 64, 36},
      {GgmlType::kQ1_0, "Q1_0", 128, 18},
      {GgmlType::kQ2_0, "Q2_0", 64, 18},
  };
  CHECK(std::size(table) == moe::quant::kGgmlTypes.size());
  for (Expected const& e : table) {
    INFO(e.name);
    auto const* info = ggml_type_info(static_cast<std::uint32_t>(e.type));
    REQUIRE(info != nullptr);
    CHECK(info->name == e.name);
    CHECK(info->block_elements == e.elements);
    CHECK(info->block_bytes == e.bytes);
    CHECK(moe::quant::parse_ggml_type(e.name) == e.type);
  }
  CHECK_FALSE(moe::quant::parse_ggml_type("q4_k").has_value());
}

TEST_CASE("Every metadata type round-trips through GgufWriter and GgufFile", "[io][gguf]") {
  float const nan = std::numeric_limits<float>::quiet_NaN();
  GgufWriter w;
  w.set("u8", std::uint8_t{255})
      .set("i8", std::int8_t{-128})
      .set("u16", std::uint16_t{65535})
      .set("i16", std::int16_t{-32768})
      .set("u32", std::uint32_t{4294967295u})
      .set("i32", std::int32_t{-2147483647 - 1})
      .set("f32", 1.5f)
      .set("nan", nan)
      .set("yes", true)
      .set("no", false)
      .set("str", std::string("h\xC3\xA9llo\n\0x", 9))
      .set("empty", "")
      .set("u64", std::numeric_limits<std::uint64_t>::max())
      .set("i64", std::numeric_limits<std::int64_t>::min())
      .set("f64", -0.25)
      .set("arr.u8", GgufMetadataValue::array<std::uint8_t>({1, 2, 3}))
      .set("arr.i8", GgufMetadataValue::array<std::int8_t>({-1, 2}))
      .set("arr.u16", GgufMetadataValue::array<std::uint16_t>({65535}))
      .set("arr.i16", GgufMetadataValue::array<std::int16_t>({-7, 7}))
      .set("arr.u32", GgufMetadataValue::array<std::uint32_t>({0, 4000000000u}))
      .set("arr.i32", GgufMetadataValue::array<std::int32_t>({-1, 0, 1}))
      .set("arr.f32", GgufMetadataValue::array<float>({0.5f, -1.0f, nan}))
      .set("arr.bool", GgufMetadataValue::bools({true, false, true}))
      .set("arr.u64", GgufMetadataValue::array<std::uint64_t>({1ull << 63}))
      .set("arr.i64", GgufMetadataValue::array<std::int64_t>({-(1ll << 40)}))
      .set("arr.f64", GgufMetadataValue::array<double>({1e300, -2.5}))
      .set("arr.str",
           GgufMetadataValue::array(std::vector<std::string>{"<s>", "", "\xE2\x96\x81the"}))
      .set("arr.empty", GgufMetadataValue::empty_array(GgufValueType::kString))
      .set("arr.nested", GgufMetadataValue::array(std::vector<GgufMetadataValue>{
                             GgufMetadataValue::array<std::int32_t>({1, 2}),
                             GgufMetadataValue::array(std::vector<std::string>{"a", "bc"}),
                             GgufMetadataValue::array(std::vector<GgufMetadataValue>{
                                 GgufMetadataValue::array<double>({3.0})}),
                             GgufMetadataValue::empty_array(GgufValueType::kArray)}));
  GgufFile const f(w.serialize());
  CHECK(f.metadata().size() == 29);
  CHECK(f.metadata()[0].key == "u8");
  CHECK(f.value("u8").type() == GgufValueType::kUint8);
  CHECK(f.integer("u8") == 255);
  CHECK(f.signed_integer("i8") == -128);
  CHECK(f.integer("u16") == 65535);
  CHECK(f.signed_integer("i16") == -32768);
  CHECK(f.integer("u32") == 4294967295u);
  CHECK(f.signed_integer("i32") == std::numeric_limits<std::int32_t>::min());
  CHECK(f.number("f32") == 1.5);
  CHECK(std::isnan(f.number("nan")));  // values are not scanned
  CHECK(f.boolean("yes"));
  CHECK_FALSE(f.boolean("no"));
  CHECK(f.string("str") == std::string_view("h\xC3\xA9llo\n\0x", 9));
  CHECK(f.string("empty").empty());
  CHECK(f.integer("u64") == std::numeric_limits<std::uint64_t>::max());
  CHECK(f.signed_integer("i64") == std::numeric_limits<std::int64_t>::min());
  CHECK(f.number("f64") == -0.25);
  CHECK(f.value("f64").type() == GgufValueType::kFloat64);
  CHECK(f.integers("arr.u8") == std::vector<std::int64_t>{1, 2, 3});
  CHECK(f.integers("arr.i8") == std::vector<std::int64_t>{-1, 2});
  CHECK(f.integers("arr.u16") == std::vector<std::int64_t>{65535});
  CHECK(f.integers("arr.i16") == std::vector<std::int64_t>{-7, 7});
  CHECK(f.integers("arr.u32") == std::vector<std::int64_t>{0, 4000000000});
  CHECK(f.integers("arr.i32") == std::vector<std::int64_t>{-1, 0, 1});
  std::vector<float> const floats = f.floats("arr.f32");
  REQUIRE(floats.size() == 3);
  CHECK(floats[0] == 0.5f);
  CHECK(floats[1] == -1.0f);
  CHECK(std::isnan(floats[2]));
  moe::io::GgufValue const& bools = f.value("arr.bool");
  CHECK(bools.describe() == "array of 3 bool");
  CHECK(*bools[0].to_bool());
  CHECK_FALSE(*bools[1].to_bool());
  CHECK(*f.value("arr.u64")[0].to_uint64() == (1ull << 63));
  CHECK_THAT(error_of_call([&] { (void)f.integers("arr.u64"); }),
             Contains("metadata key 'arr.u64': element 0 is 9223372036854775808, above int64's "
                      "range"));
  CHECK(f.integers("arr.i64") == std::vector<std::int64_t>{-(1ll << 40)});
  CHECK(f.floats("arr.f64") == std::vector<float>{static_cast<float>(1e300), -2.5f});
  CHECK(*f.value("arr.f64")[0].to_double() == 1e300);
  std::span<std::string_view const> const strs = f.strings("arr.str");
  REQUIRE(strs.size() == 3);
  CHECK(strs[0] == "<s>");
  CHECK(strs[1].empty());
  CHECK(strs[2] == "\xE2\x96\x81the");
  CHECK(*f.value("arr.str")[2].to_string() == "\xE2\x96\x81the");
  CHECK(f.strings("arr.empty").empty());
  CHECK(f.value("arr.empty").describe() == "array of 0 string");

  moe::io::GgufValue const& nested = f.value("arr.nested");
  CHECK(nested.describe() == "array of 4 array");
  CHECK(nested[0].describe() == "array of 2 int32");
  CHECK(*nested[0][1].to_int64() == 2);
  CHECK(nested[1].strings()[1] == "bc");
  CHECK(*nested[2][0][0].to_double() == 3.0);
  CHECK(nested[3].size() == 0);
  CHECK_THAT(error_of_call([&] { (void)nested[4]; }),
             Contains("element 4 of array of 4 array does not exist"));

  // The writer copies what the reader gives it (GgufMetadataValue::from): same bytes again.
  GgufWriter copy;
  for (moe::io::GgufKeyValue const& kv : f.metadata()) {
    copy.set(std::string(kv.key), GgufMetadataValue::from(kv.value));
  }
  CHECK(copy.serialize() == w.serialize());
}

TEST_CASE("GgufFile's typed getters convert within range and name key and types otherwise",
          "[io][gguf]") {
  GgufWriter w;
  w.set("neg", std::int32_t{-5})
      .set("small", std::int16_t{12})
      .set("big", std::numeric_limits<std::uint64_t>::max())
      .set("text", "abc")
      .set("flag", true)
      .set("half", 0.5f)
      .set("ints", GgufMetadataValue::array<std::int32_t>({1}));
  GgufFile const f(w.serialize(), "m.gguf");
  CHECK(f.integer("small") == 12);  // any integer type
  CHECK(f.signed_integer("small") == 12);
  CHECK(f.number("neg") == -5.0);
  CHECK(f.number("big") == 18446744073709551615.0);
  CHECK(f.has("text"));
  CHECK_FALSE(f.has("absent"));
  CHECK(f.find("absent") == nullptr);
  CHECK(f.integer_or("absent", 9) == 9);
  CHECK(f.integer_or("small", 9) == 12);
  CHECK(f.number_or("absent", 1.25) == 1.25);
  CHECK(f.string_or("absent", "d") == "d");
  CHECK(f.boolean_or("flag", false));

  CHECK(error_of_call([&] { (void)f.integer("neg"); }) ==
        "moe: gguf: m.gguf: metadata key 'neg': expected a non-negative integer, but the value "
        "is int32 -5; the file does not follow the convention for this key, or the key means "
        "something else here");
  CHECK_THAT(error_of_call([&] { (void)f.signed_integer("big"); }),
             Contains("'big': expected an integer in int64's range, but the value is uint64 "
                      "18446744073709551615"));
  CHECK_THAT(error_of_call([&] { (void)f.integer("half"); }),
             Contains("expected a non-negative integer, but the value is float32 0.5"));
  CHECK_THAT(error_of_call([&] { (void)f.string("flag"); }),
             Contains("'flag': expected a string, but the value is bool"));
  CHECK_THAT(error_of_call([&] { (void)f.boolean("text"); }),
             Contains("'text': expected a bool, but the value is string"));
  CHECK_THAT(error_of_call([&] { (void)f.number("text"); }), Contains("expected a number"));
  CHECK_THAT(error_of_call([&] { (void)f.strings("ints"); }),
             Contains("'ints': expected an array of strings, but the value is array of 1 int32"));
  CHECK_THAT(error_of_call([&] { (void)f.integers("text"); }),
             Contains("expected an array of integers, but the value is string"));
  CHECK_THAT(error_of_call([&] { (void)f.floats("text"); }),
             Contains("expected an array of numbers"));
  CHECK_THAT(error_of_call([&] { (void)f.string_or("flag", "x"); }),
             Contains("expected a string"));  // present with another type: not the fallback
  CHECK_THAT(error_of_call([&] { (void)f.string("general.name"); }),
             Contains("m.gguf: no metadata key 'general.name' (the file has 7 keys: 'neg', "
                      "'small', 'big', 'text', 'flag', ...)"));
}

TEST_CASE("Tensors of several ggml types and 1 to 4 dimensions round-trip", "[io][gguf]") {
  struct Case {
    char const* name;
    GgmlType type;
    std::vector<std::int64_t> ne;
    std::size_t bytes;
  };
  std::vector<Case> const cases = {
      {"f32.1d", GgmlType::kF32, {5}, 20},
      {"f16.2d", GgmlType::kF16, {3, 2}, 12},
      {"bf16.3d", GgmlType::kBF16, {2, 1, 3}, 12},
      {"q8_0.4d", GgmlType::kQ8_0, {64, 2, 1, 2}, 4 * 2 * 34},
      {"q4_k.2d", GgmlType::kQ4_K, {512, 3}, 3 * 2 * 144},
      {"q6_k.3d", GgmlType::kQ6_K, {256, 1, 2}, 2 * 210},
      {"mxfp4", GgmlType::kMXFP4, {32, 2}, 2 * 17},
      {"i32", GgmlType::kI32, {7}, 28},
      {"empty", GgmlType::kQ4_0, {64, 0}, 0},
      {"f64.4d", GgmlType::kF64, {1, 1, 1, 1}, 8},
  };
  for (std::uint32_t const alignment : {32u, 64u, 1u, 4096u}) {
    INFO("alignment " << alignment);
    GgufWriter w;
    if (alignment != 32) w.set_alignment(alignment);
    for (std::size_t i = 0; i < cases.size(); ++i) {
      w.add_tensor(cases[i].name, cases[i].type, cases[i].ne,
                   filled(cases[i].bytes, static_cast<unsigned>(i)));
    }
    GgufFile const f(w.serialize());
    CHECK(f.alignment() == alignment);
    CHECK(f.data_offset() % alignment == 0);
    REQUIRE(f.size() == cases.size());
    std::uint64_t previous_end = 0;
    for (std::size_t i = 0; i < cases.size(); ++i) {
      Case const& c = cases[i];
      INFO(c.name);
      moe::io::GgufTensorInfo const& t = f.tensor(c.name);
      CHECK(&t == &f.tensors()[i]);  // file order
      CHECK(t.type == c.type);
      CHECK(t.n_dims == c.ne.size());
      CHECK(std::vector<std::int64_t>(t.dims().begin(), t.dims().end()) == c.ne);
      std::vector<std::int64_t> const row_major(c.ne.rbegin(), c.ne.rend());
      CHECK(t.shape() == row_major);
      CHECK(t.offset % alignment == 0);
      CHECK(t.offset >= previous_end);
      previous_end = t.offset + t.data.size();
      REQUIRE(t.data.size() == c.bytes);
      CHECK(std::vector<std::byte>(t.data.begin(), t.data.end()) ==
            filled(c.bytes, static_cast<unsigned>(i)));
      CHECK(t.data.data() == f.bytes().data() + f.data_offset() + t.offset);
      CHECK(t.num_rows() * static_cast<std::int64_t>(t.row_bytes()) ==
            static_cast<std::int64_t>(c.bytes));
    }
    CHECK(f.tensor("q4_k.2d").row_bytes() == 2 * 144);
    CHECK(f.tensor("q8_0.4d").num_elements() == 256);
    CHECK(f.find_tensor("nope") == nullptr);
    CHECK_THAT(error_of_call([&] { (void)f.tensor("nope"); }),
               Contains("no tensor named 'nope' (the file has 10 tensors: 'f32.1d', 'f16.2d', "
                        "'bf16.3d', 'q8_0.4d', 'q4_k.2d', ...)"));
  }
}

TEST_CASE("GGUF versions 2 and 3 are read, and the writer writes either", "[io][gguf]") {
  for (std::uint32_t const version : {2u, 3u}) {
    GgufWriter w;
    w.set_version(version).set("k", "v");
    w.add_tensor("t", GgmlType::kF32, {1}, filled(4));
    GgufFile const f(w.serialize());
    CHECK(f.version() == version);
    CHECK(f.string("k") == "v");
    GgufFile const hand(minimal(version).bytes);
    CHECK(hand.version() == version);
  }
  CHECK_THAT(error_of_call([] { GgufWriter().set_version(1); }),
             Contains("version 1 cannot be written; pass 2 or 3"));
}

TEST_CASE("A GGUF file built byte by byte reads as written, and the writer writes the same bytes",
          "[io][gguf]") {
  iotest::GgufBytes b;
  b.header(3, 2, 4);
  b.str("general.architecture").u32(8).str("llama");
  b.str("llama.block_count").u32(4).u32(2);
  b.str("tokenizer.ggml.tokens").u32(9).u32(8).u64(3).str("a").str("bc").str("");
  b.str("tokenizer.ggml.scores").u32(9).u32(6).u64(2).f32(-1.0f).f32(0.5f);
  b.tensor("token_embd.weight", {4, 2}, 0, 0);      // F32 [2, 4] row-major: 32 bytes
  b.tensor("blk.0.attn_q.weight", {32, 1}, 8, 32);  // Q8_0: one block of 34 bytes
  std::size_t const infos_end = b.bytes.size();
  b.pad(32);
  for (int i = 0; i < 8; ++i) b.f32(static_cast<float>(i) - 3.5f);
  b.u16(0x3C00);  // Q8_0 scale: fp16 1.0
  for (int i = 0; i < 32; ++i) b.u8(static_cast<std::uint8_t>(i));
  b.pad(32);

  GgufFile const f(b.bytes, "hand.gguf");
  CHECK(f.version() == 3);
  CHECK(f.alignment() == 32);
  CHECK(f.data_offset() == (infos_end + 31) / 32 * 32);
  CHECK(f.string("general.architecture") == "llama");
  CHECK(f.integer("llama.block_count") == 2);
  CHECK(f.value("llama.block_count").type() == GgufValueType::kUint32);
  std::span<std::string_view const> const tokens = f.strings("tokenizer.ggml.tokens");
  REQUIRE(tokens.size() == 3);
  CHECK(tokens[0] == "a");
  CHECK(tokens[1] == "bc");
  CHECK(tokens[2].empty());
  CHECK(f.floats("tokenizer.ggml.scores") == std::vector<float>{-1.0f, 0.5f});
  REQUIRE(f.size() == 2);
  moe::io::GgufTensorInfo const& e = f.tensors()[0];
  CHECK(e.name == "token_embd.weight");
  CHECK(e.type == GgmlType::kF32);
  CHECK(e.shape() == std::vector<std::int64_t>{2, 4});
  CHECK(e.offset == 0);
  REQUIRE(e.data.size() == 32);
  float v = 0;
  std::memcpy(&v, e.data.data() + 4 * 5, 4);
  CHECK(v == 1.5f);
  moe::io::GgufTensorInfo const& q = f.tensor("blk.0.attn_q.weight");
  CHECK(q.type == GgmlType::kQ8_0);
  CHECK(q.offset == 32);
  REQUIRE(q.data.size() == 34);
  CHECK(std::to_integer<int>(q.data[0]) == 0x00);
  CHECK(std::to_integer<int>(q.data[1]) == 0x3C);
  CHECK(std::to_integer<int>(q.data[33]) == 31);

  // GgufWriter lays the same content out byte for byte as the hand-built image.
  GgufWriter w;
  w.set("general.architecture", "llama")
      .set("llama.block_count", std::uint32_t{2})
      .set("tokenizer.ggml.tokens",
           GgufMetadataValue::array(std::vector<std::string>{"a", "bc", ""}))
      .set("tokenizer.ggml.scores", GgufMetadataValue::array<float>({-1.0f, 0.5f}));
  w.add_tensor("token_embd.weight", GgmlType::kF32, {4, 2}, e.data);
  w.add_tensor("blk.0.attn_q.weight", GgmlType::kQ8_0, {32, 1}, q.data);
  CHECK(w.serialize() == b.bytes);
}

TEST_CASE("Every truncation of a valid GGUF file is refused with moe::Error", "[io][gguf]") {
  GgufWriter w;
  w.set("general.architecture", "qwen3moe")
      .set("arr", GgufMetadataValue::array<std::uint16_t>({1, 2, 3}))
      .set("toks", GgufMetadataValue::array(std::vector<std::string>{"x", "yz"}))
      .set("nest", GgufMetadataValue::array(std::vector<GgufMetadataValue>{
                       GgufMetadataValue::array<float>({1.0f}), GgufMetadataValue::bools({true})}))
      .set("flag", true)
      .set("pi", 3.14);
  w.add_tensor("a", GgmlType::kQ4_0, {32, 2}, filled(36));
  w.add_tensor("b", GgmlType::kF32, {4, 2}, filled(32));  // 32 bytes: no padding at the end
  std::vector<std::byte> const bytes = w.serialize();
  REQUIRE_NOTHROW(GgufFile(std::span<std::byte const>(bytes)));
  for (std::size_t n = 0; n < bytes.size(); ++n) {
    INFO("prefix of " << n << " bytes");
    std::vector<std::byte> const prefix(bytes.begin(),
                                        bytes.begin() + static_cast<std::ptrdiff_t>(n));
    CHECK_THROWS_AS(GgufFile(std::span<std::byte const>(prefix)), moe::Error);
  }
  CHECK_THAT(error_of({}),
             Contains("f.gguf: reading the magic \"GGUF\" at byte 0 needs 4 bytes but "
                      "the file has 0 left; the file is truncated"));
  std::vector<std::byte> const cut(bytes.begin(), bytes.end() - 1);
  CHECK_THAT(error_of(cut), Contains("tensor 'b': its data [64, 64 + 32) of the data section runs "
                                     "past the end of the file (the data section has 95 bytes)"));
}

TEST_CASE("Malformed GGUF files are refused with a message naming the problem", "[io][gguf]") {
  using iotest::GgufBytes;
  auto const with_kv = [](auto&& add_value) {
    GgufBytes b;
    b.header(3, 0, 1);
    add_value(b);
    return b.bytes;
  };
  auto const with_tensor = [](std::vector<std::int64_t> const& ne, std::uint32_t type,
                              std::uint64_t offset, std::size_t data_bytes) {
    GgufBytes b;
    b.header(3, 1, 0).tensor("t", ne, type, offset).pad(32);
    for (std::size_t i = 0; i < data_bytes; ++i) b.u8(0);
    return b.bytes;
  };

  SECTION("magic and version") {
    CHECK(error_of(GgufBytes().raw("GGUX").u32(3).u64(0).u64(0).bytes) ==
          "moe: gguf: f.gguf: the file starts with 'GGUX', not \"GGUF\"; it is not a GGUF file "
          "(a safetensors checkpoint is read with moe::io::SafetensorsFile)");
    CHECK_THAT(error_of(GgufBytes().raw(std::string_view("\x10\0\0\0", 4)).bytes),
               Contains("starts with '?"));
    CHECK_THAT(error_of(GgufBytes().header(1, 0, 0).bytes),
               Contains("GGUF version 1 (the 2023 pre-release layout with 32-bit counts) is not "
                        "supported; reconvert the model"));
    CHECK_THAT(error_of(GgufBytes().header(4, 0, 0).bytes),
               Contains("GGUF version 4 is newer than this reader, which reads versions 2 and 3"));
    CHECK_THAT(error_of(GgufBytes().header(0, 0, 0).bytes), Contains("the version field is 0"));
    CHECK_THAT(error_of(GgufBytes().raw("GGUF").u8(0).u8(0).u8(0).u8(3).u64(0).u64(0).bytes),
               Contains("the version field reads 50331648 (0x03000000): this is a big-endian "
                        "GGUF file (version 3 in big-endian byte order); moe reads little-endian "
                        "GGUF only, convert it with gguf-py's gguf_convert_endian.py"));
  }
  SECTION("counts that cannot fit the file") {
    CHECK_THAT(error_of(GgufBytes().header(3, 0, 1ull << 62).bytes),
               Contains("the header says 4611686018427387904 metadata entries but the 0 bytes "
                        "after it hold at most 0"));
    CHECK_THAT(error_of(GgufBytes().header(3, UINT64_MAX, 0).u64(0).bytes),
               Contains("the header says 18446744073709551615 tensors and 0 metadata entries, "
                        "but the 8 bytes after it hold at most 0 tensor infos"));
    // Just enough bytes for the counts' lower bounds, then truncated.
    std::vector<std::byte> b = GgufBytes().header(3, 1, 1).bytes;
    b.resize(b.size() + 14 + 33);
    CHECK_THAT(error_of(b), Contains("metadata entry 0 has an empty key"));
  }
  SECTION("strings and arrays past the end") {
    CHECK_THAT(error_of(with_kv([](GgufBytes& b) { b.u64(1000).raw("abcdefghijklmn"); })),
               Contains("the key of metadata entry 0 at byte 24 says it is 1000 bytes long but "
                        "the file has only 14 bytes left; the file is truncated"));
    CHECK_THAT(error_of(with_kv([](GgufBytes& b) { b.str("k").u32(8).u64(UINT64_MAX); })),
               Contains("the value of metadata key 'k' at byte 37 says it is "
                        "18446744073709551615 bytes long"));
    CHECK_THAT(error_of(with_kv([](GgufBytes& b) { b.str("k").u32(9).u32(5).u64(1ull << 61); })),
               Contains("metadata key 'k': an array of 2305843009213693952 int32 at byte 37 needs "
                        "at least 4 bytes an element, but the file has only 0 bytes left"));
    CHECK_THAT(error_of(with_kv([](GgufBytes& b) { b.str("k").u32(9).u32(8).u64(2).str("a"); })),
               Contains("an array of 2 string at byte 37 needs at least 8 bytes an element"));
    CHECK_THAT(error_of(with_kv([](GgufBytes& b) {
                 b.str("k").u32(9).u32(8).u64(2).str("a").u64(50).raw("xxxxxxxx");
               })),
               Contains("string 1 of metadata key 'k' at byte 58 says it is 50 bytes long but the "
                        "file has only 8 bytes left"));
    CHECK_THAT(error_of(with_kv([](GgufBytes& b) { b.str("k").u32(4).u8(1).u8(2); })),
               Contains("reading the value of metadata key 'k' at byte 37 needs 4 bytes but the "
                        "file has 2 left"));
  }
  SECTION("keys and value types") {
    CHECK_THAT(error_of(with_kv([](GgufBytes& b) { b.str("").u32(2).u16(0); })),
               Contains("metadata entry 0 has an empty key"));
    CHECK_THAT(error_of(with_kv([](GgufBytes& b) { b.str("\xC0\x80").u32(0).u8(0); })),
               Contains("is not valid UTF-8 (at byte 0 of the key)"));
    CHECK_THAT(error_of(with_kv([](GgufBytes& b) { b.str("k").u32(13).u8(0); })),
               Contains("metadata key 'k': unknown value type 13 (GGUF types are 0..12)"));
    CHECK_THAT(error_of(with_kv([](GgufBytes& b) { b.str("k").u32(9).u32(99).u64(0); })),
               Contains("metadata key 'k': an array has the unknown element type 99"));
    CHECK_THAT(error_of(with_kv([](GgufBytes& b) { b.str("k").u32(7).u8(2); })),
               Contains("metadata key 'k': the bool value is the byte 2, not 0 or 1"));
    CHECK_THAT(error_of(with_kv([](GgufBytes& b) { b.str("k").u32(9).u32(7).u64(2).u8(1).u8(9); })),
               Contains("metadata key 'k': bool element 1 is the byte 9, not 0 or 1"));
    GgufBytes dup;
    dup.header(3, 0, 2).str("k").u32(0).u8(1).str("k").u32(0).u8(2);
    CHECK_THAT(error_of(dup.bytes),
               Contains("metadata key 'k': the key appears twice (entries 0 and 1); keys must be "
                        "unique"));
    // Arrays nested 17 deep.
    std::vector<std::byte> const deep = with_kv([](GgufBytes& b) {
      b.str("k").u32(9);
      for (int i = 0; i < 16; ++i) b.u32(9).u64(1);
      b.u32(0).u64(0);
    });
    CHECK_THAT(error_of(deep), Contains("metadata key 'k': arrays are nested more than 16 deep"));
    std::vector<std::byte> const sixteen = with_kv([](GgufBytes& b) {
      b.str("k").u32(9);
      for (int i = 0; i < 15; ++i) b.u32(9).u64(1);
      b.u32(0).u64(0);
    });
    CHECK(error_of(sixteen) == "(accepted)");
  }
  SECTION("general.alignment") {
    CHECK_THAT(error_of(with_kv([](GgufBytes& b) { b.str("general.alignment").u32(10).u64(32); })),
               Contains("metadata key 'general.alignment': must be a uint32 (as ggml requires), "
                        "but it is a uint64"));
    CHECK_THAT(error_of(with_kv([](GgufBytes& b) { b.str("general.alignment").u32(4).u32(48); })),
               Contains("'general.alignment': is 48, not a power of two"));
    CHECK_THAT(error_of(with_kv([](GgufBytes& b) { b.str("general.alignment").u32(4).u32(0); })),
               Contains("is 0, not a power of two"));
  }
  SECTION("tensor infos") {
    CHECK(error_of(with_tensor({8}, 0, 0, 32)) == "(accepted)");
    CHECK_THAT(error_of(with_tensor({8}, 4, 0, 32)),
               Contains("tensor 't': unknown ggml type 4 (known: 0..3, 6..30, 34, 35, 39..42; 4, "
                        "5, 31..33 and 36..38 were removed from ggml)"));
    CHECK_THAT(error_of(with_tensor({8}, 31, 0, 32)), Contains("unknown ggml type 31"));
    CHECK_THAT(error_of(with_tensor({8}, 43, 0, 32)), Contains("unknown ggml type 43"));
    CHECK_THAT(error_of(with_tensor({}, 0, 0, 32)),
               Contains("tensor 't': n_dims is 0, not 1 to 4"));
    CHECK_THAT(error_of(with_tensor({1, 1, 1, 1, 1}, 0, 0, 32)), Contains("n_dims is 5"));
    CHECK_THAT(error_of(with_tensor({8, -1}, 0, 0, 32)),
               Contains("tensor 't': ne[1] is -1, negative"));
    CHECK_THAT(
        error_of(with_tensor({100}, 12, 0, 144)),
        Contains("tensor 't': ne[0] = 100 is not a multiple of Q4_K's block of 256 elements"));
    CHECK_THAT(error_of(with_tensor({1ll << 32, 1ll << 31}, 0, 0, 0)),
               Contains("tensor 't': ne [4294967296, 2147483648] (ggml order) has 2^63 or more "
                        "elements"));
    // Zero elements, but the other dimensions still may not overflow.
    CHECK_THAT(error_of(with_tensor({1ll << 32, 0, 1ll << 32}, 0, 0, 0)),
               Contains("has 2^63 or more elements"));
    CHECK(error_of(with_tensor({1ll << 20, 0, 1ll << 20}, 0, 0, 0)) == "(accepted)");
    CHECK_THAT(error_of(with_tensor({1ll << 61}, 28, 0, 0)),
               Contains("tensor 't': F64 [2305843009213693952] (ggml order) takes more bytes than "
                        "fit 64 bits"));
    CHECK_THAT(error_of(with_tensor({8}, 0, 16, 64)),
               Contains("tensor 't': its data offset 16 is not a multiple of the alignment 32"));
    CHECK_THAT(error_of(with_tensor({8}, 0, 32, 32)),
               Contains("tensor 't': its data [32, 32 + 32) of the data section runs past the end "
                        "of the file (the data section has 32 bytes)"));
    CHECK_THAT(error_of(with_tensor({8}, 0, 1ull << 63, 32)), Contains("runs past the end"));
    GgufBytes empty_name;
    empty_name.header(3, 1, 0).tensor("", {8}, 0, 0).pad(32);
    CHECK_THAT(error_of(empty_name.bytes), Contains("tensor info 0 has an empty name"));
    GgufBytes long_name;
    long_name.header(3, 1, 0)
        .tensor(std::string(65, 'n'), {8}, 0, 0)
        .pad(32)
        .u64(0)
        .u64(0)
        .u64(0)
        .u64(0);
    CHECK_THAT(error_of(long_name.bytes),
               Contains("the name is 65 bytes, more than the format's 64"));
    GgufBytes dup;
    dup.header(3, 2, 0).tensor("t", {8}, 0, 0).tensor("t", {8}, 0, 32).pad(32);
    dup.bytes.resize(dup.bytes.size() + 64);
    CHECK_THAT(error_of(dup.bytes),
               Contains("tensor 't': the name appears twice (tensor infos 0 and 1); tensor names "
                        "must be unique"));
    GgufBytes overlap;
    overlap.header(3, 2, 0).tensor("a", {16}, 0, 0).tensor("b", {8}, 0, 32).pad(32);
    overlap.bytes.resize(overlap.bytes.size() + 64);
    CHECK_THAT(error_of(overlap.bytes),
               Contains("tensor 'b': its data at offset 32 overlaps tensor 'a' at [0, 64); tensors "
                        "must not share bytes"));
    GgufBytes same;
    same.header(3, 2, 0).tensor("a", {8}, 0, 0).tensor("b", {8}, 0, 0).pad(32);
    same.bytes.resize(same.bytes.size() + 32);
    CHECK_THAT(error_of(same.bytes), Contains("overlaps tensor 'a' at [0, 32)"));
    GgufBytes no_data;  // only an empty tensor, and the file ends before the aligned data start
    no_data.header(3, 1, 0).tensor("t", {0}, 0, 0);
    CHECK_THAT(error_of(no_data.bytes),
               Contains("the tensor infos end at byte 57 and the data section would start at 64 "
                        "(aligned to 32), past the end of the file (57 bytes)"));
  }
}

TEST_CASE("GgufFile maps a saved file, and its errors name the path", "[io][gguf]") {
  std::filesystem::path const dir = iotest::scratch_dir("gguf_save");
  GgufWriter w;
  w.set("general.architecture", "olmoe").set_alignment(64);
  w.add_tensor("t", GgmlType::kQ8_0, {32, 3}, filled(3 * 34));
  w.save(dir / "m.gguf");
  CHECK(iotest::read_file(dir / "m.gguf") == w.serialize());
  GgufFile const f(dir / "m.gguf");
  CHECK(f.display_name() == (dir / "m.gguf").string());
  CHECK(f.alignment() == 64);
  CHECK(f.tensor("t").data.size() == 102);
  CHECK_THAT(error_of_call([&] { GgufFile const g(dir / "absent.gguf"); }),
             Contains("moe: gguf: cannot open '" + (dir / "absent.gguf").string() +
                      "': No such file or directory"));
  CHECK_THAT(error_of_call([&] { GgufFile const g(dir); }),
             Contains("is not a regular file (a directory; moe maps whole files, it does not "
                      "read pipes or devices); pass the path of a .gguf file"));
  iotest::write_text(dir / "bad.gguf", "GGUF\x03");
  CHECK_THAT(error_of_call([&] { GgufFile const g(dir / "bad.gguf"); }),
             Contains("moe: gguf: " + (dir / "bad.gguf").string() + ": reading the version"));
}

TEST_CASE("GgufWriter refuses what GGUF readers would refuse", "[io][gguf]") {
  GgufWriter w;
  w.add_tensor("t", GgmlType::kF32, {2}, filled(8));
  CHECK_THAT(error_of_call([&] { w.add_tensor("t", GgmlType::kF32, {2}, filled(8)); }),
             Contains("tensor 't' is added twice"));
  CHECK_THAT(error_of_call([&] {
               w.add_tensor("u", GgmlType::kF32, {2, 2}, filled(8));
             }),
             Contains("tensor 'u': F32 with 2 dimensions needs 16 bytes but 8 were given"));
  CHECK_THAT(error_of_call([&] { w.add_tensor("u", GgmlType::kQ4_K, {128}, filled(72)); }),
             Contains("ne[0] = 128 is not a multiple of Q4_K's block of 256 elements"));
  CHECK_THAT(error_of_call([&] { w.add_tensor("u", GgmlType::kF32, {}, {}); }),
             Contains("has 0 dimensions; GGUF tensors have 1 to 4"));
  CHECK_THAT(error_of_call([&] {
               w.add_tensor("u", GgmlType::kF32, {1, 1, 1, 1, 1}, filled(4));
             }),
             Contains("has 5 dimensions"));
  CHECK_THAT(error_of_call([&] { w.add_tensor("u", GgmlType::kF32, {-1}, {}); }),
             Contains("ne[0] = -1 is negative"));
  CHECK_THAT(error_of_call([&] { w.add_tensor("u", static_cast<GgmlType>(4), {1}, filled(4)); }),
             Contains("ggml type 4 does not exist"));
  CHECK_THAT(
      error_of_call([&] { w.add_tensor(std::string(64, 'x'), GgmlType::kF32, {1}, filled(4)); }),
      Contains("the name is 64 bytes; ggml (llama.cpp) reads names of at most 63 bytes"));
  CHECK_THAT(error_of_call([&] { w.add_tensor("", GgmlType::kF32, {1}, filled(4)); }),
             Contains("a tensor name is empty"));
  CHECK_THAT(error_of_call([&] { w.set("", 1); }), Contains("a metadata key is empty"));
  CHECK_THAT(error_of_call([&] { w.set("general.alignment", std::uint64_t{32}); }),
             Contains("'general.alignment' must be a uint32 power of two"));
  CHECK_THAT(error_of_call([&] { w.set_alignment(24); }),
             Contains("must be a uint32 power of two"));
  CHECK_THAT(error_of_call([&] {
               (void)GgufMetadataValue::array(std::vector<GgufMetadataValue>{GgufMetadataValue(1)});
             }),
             Contains("an element is a int32; an array of values holds arrays only"));
  // set() replaces a value in place.
  w.set("a", 1).set("b", 2).set("a", "x");
  GgufFile const f(w.serialize());
  REQUIRE(f.metadata().size() == 2);
  CHECK(f.metadata()[0].key == "a");
  CHECK(f.string("a") == "x");
}

TEST_CASE("GgufModel opens split GGUF models from any shard and checks the shards agree",
          "[io][gguf][split]") {
  std::filesystem::path const dir = iotest::scratch_dir("gguf_split");
  // Three shards of 2, 1 and 0 tensors (gguf-split --no-tensor-first-split makes empty ones).
  auto const write_shards = [&](std::string const& prefix, std::uint16_t count_in_shard_2,
                                std::int32_t total) {
    for (std::uint16_t i = 0; i < 3; ++i) {
      GgufWriter w;
      if (i == 0) w.set("general.architecture", "qwen3moe");
      w.set_split(i, i == 1 ? count_in_shard_2 : 3, total);
      if (i == 0) {
        w.add_tensor("token_embd.weight", GgmlType::kF32, {4, 2}, filled(32));
        w.add_tensor("blk.0.ffn_gate_inp.weight", GgmlType::kF32, {4}, filled(16));
      }
      if (i == 1) w.add_tensor("output.weight", GgmlType::kQ8_0, {32, 2}, filled(68));
      w.save(dir / moe::io::gguf_split_path(prefix, i, 3));
    }
  };
  write_shards("m", 3, 3);
  CHECK(moe::io::gguf_split_path("m", 0, 3) == "m-00001-of-00003.gguf");
  for (char const* open : {"m-00001-of-00003.gguf", "m-00002-of-00003.gguf"}) {
    GgufModel const m(dir / open);
    REQUIRE(m.num_shards() == 3);
    CHECK(m.metadata().string("general.architecture") == "qwen3moe");
    CHECK(m.size() == 3);
    CHECK(m.shard_of("output.weight") == 1);
    CHECK(m.shard_of("token_embd.weight") == 0);
    moe::io::GgufTensorInfo const& out = m.tensor("output.weight");
    CHECK(out.type == GgmlType::kQ8_0);
    CHECK(out.data.data() >= m.shard(1).bytes().data());
    CHECK(out.data.data() + out.data.size() <=
          m.shard(1).bytes().data() + m.shard(1).bytes().size());
    CHECK(m.names() == std::vector<std::string_view>{"blk.0.ffn_gate_inp.weight", "output.weight",
                                                     "token_embd.weight"});
    CHECK(m.find_tensor("absent") == nullptr);
    CHECK_THAT(error_of_call([&] { (void)m.tensor("absent"); }),
               Contains("no tensor named 'absent' in the model's 3 shard(s) (3 tensors)"));
  }

  // A single file is a model of one shard.
  GgufWriter single;
  single.add_tensor("x", GgmlType::kF32, {1}, filled(4));
  single.save(dir / "single.gguf");
  GgufModel const one(dir / "single.gguf");
  CHECK(one.num_shards() == 1);
  CHECK(one.has_tensor("x"));

  // A missing shard.
  std::filesystem::remove(dir / "m-00003-of-00003.gguf");
  CHECK_THAT(error_of_call([&] { GgufModel const m(dir / "m-00001-of-00003.gguf"); }),
             Contains("m-00003-of-00003.gguf: shard 3 of 3 of the model is missing (opened from"));
  // A shard that disagrees on split.count.
  write_shards("d", 4, 3);
  CHECK_THAT(error_of_call([&] { GgufModel const m(dir / "d-00001-of-00003.gguf"); }),
             Contains("d-00002-of-00003.gguf: shard 2 of 3 says split.no = 1, split.count = 4 "
                      "(expected 1 and 3); the shards belong to different models"));
  // split.tensors.count that does not match the tensors found.
  write_shards("c", 3, 5);
  CHECK_THAT(error_of_call([&] { GgufModel const m(dir / "c-00001-of-00003.gguf"); }),
             Contains("split.tensors.count says 5 tensors but the 3 shards hold 3"));
  // A renamed shard.
  write_shards("r", 3, 3);
  std::filesystem::rename(dir / "r-00002-of-00003.gguf", dir / "r-00002-of-00004.gguf");
  CHECK_THAT(error_of_call([&] { GgufModel const m(dir / "r-00002-of-00004.gguf"); }),
             Contains("the name says shard 2 of 4 but the metadata says shard 2 of 3"));
  std::filesystem::rename(dir / "r-00002-of-00004.gguf", dir / "r.gguf");
  CHECK_THAT(error_of_call([&] { GgufModel const m(dir / "r.gguf"); }),
             Contains("is shard 2 of 3 (split.no = 1, split.count = 3) but its name does not end "
                      "in -NNNNN-of-NNNNN.gguf"));
  // A tensor in two shards.
  for (std::uint16_t i = 0; i < 2; ++i) {
    GgufWriter w;
    w.set_split(i, 2, 2);
    w.add_tensor("same", GgmlType::kF32, {1}, filled(4));
    w.save(dir / moe::io::gguf_split_path("t", i, 2));
  }
  CHECK_THAT(error_of_call([&] { GgufModel const m(dir / "t-00001-of-00002.gguf"); }),
             Contains("t-00002-of-00002.gguf: tensor 'same' is also in shard 1"));
}
