// SPDX-License-Identifier: Apache-2.0
// Writes the seed corpus of the GGUF fuzzer (tests/fuzz/corpus_gguf/): small valid files made
// with moe's writer or byte by byte (valid-*) and one hand-made file per reader error class
// (invalid-*). Run by hand after changing it:
//   cmake --build <build> --target moe_fuzz_make_corpus_gguf &&
//   <build>/tests/fuzz/moe_fuzz_make_corpus_gguf tests/fuzz/corpus_gguf
#include <cstdio>
#include <filesystem>
#include <limits>
#include <string>
#include <vector>

#include "io/gguf_bytes.hpp"
#include "io/io_test_support.hpp"
#include "moe/io/gguf.hpp"

namespace {

using iotest::GgufBytes;
using moe::io::GgufMetadataValue;
using moe::io::GgufValueType;
using moe::io::GgufWriter;
using moe::quant::GgmlType;

std::vector<std::byte> zeros(std::size_t n) { return std::vector<std::byte>(n, std::byte{0x3c}); }

// One tensor info "t" with the given fields, then data_bytes bytes of data after the padding.
std::vector<std::byte> one_tensor(std::vector<std::int64_t> const& ne, std::uint32_t type,
                                  std::uint64_t offset, std::size_t data_bytes) {
  GgufBytes b;
  b.header(3, 1, 0).tensor("t", ne, type, offset).pad(32);
  for (std::size_t i = 0; i < data_bytes; ++i) b.u8(static_cast<std::uint8_t>(i));
  return b.bytes;
}

// One metadata entry written by `add` after a header of 0 tensors and 1 entry.
template <class Add>
std::vector<std::byte> one_kv(Add add) {
  GgufBytes b;
  b.header(3, 0, 1);
  add(b);
  return b.bytes;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s <corpus directory>\n", argv[0]);
    return 2;
  }
  std::filesystem::path const dir = argv[1];
  std::filesystem::create_directories(dir);
  auto put = [&](std::string const& name, std::vector<std::byte> const& bytes) {
    iotest::write_file(dir / name, bytes);
  };

  {  // every metadata type, and tensors of several types
    GgufWriter w;
    w.set("general.architecture", "qwen3moe")
        .set("u8", std::uint8_t{7})
        .set("i8", std::int8_t{-7})
        .set("u16", std::uint16_t{700})
        .set("i16", std::int16_t{-700})
        .set("u32", std::uint32_t{70000})
        .set("i32", std::int32_t{-70000})
        .set("f32", std::numeric_limits<float>::infinity())
        .set("b", true)
        .set("u64", std::uint64_t{1} << 40)
        .set("i64", std::int64_t{-1} << 40)
        .set("f64", 0.1)
        .set("arr.bool", GgufMetadataValue::bools({true, false}))
        .set("arr.f64", GgufMetadataValue::array<double>({1.0, -1.0}))
        .set("nested", GgufMetadataValue::array(std::vector<GgufMetadataValue>{
                           GgufMetadataValue::array<std::int16_t>({1, 2}),
                           GgufMetadataValue::array(std::vector<std::string>{"x"})}));
    w.add_tensor("a", GgmlType::kF32, {4}, zeros(16))
        .add_tensor("b", GgmlType::kQ8_0, {32, 2}, zeros(68))
        .add_tensor("c", GgmlType::kBF16, {2, 1, 1, 2}, zeros(8));
    put("valid-all-types.gguf", w.serialize());
  }
  {  // a tokenizer's arrays
    GgufWriter w;
    w.set("tokenizer.ggml.model", "gpt2")
        .set("tokenizer.ggml.tokens",
             GgufMetadataValue::array(std::vector<std::string>{"<s>", "</s>", "\xC4\xA0the", ""}))
        .set("tokenizer.ggml.scores", GgufMetadataValue::array<float>({0.0f, -1.0f, -2.0f, -3.0f}))
        .set("tokenizer.ggml.token_type", GgufMetadataValue::array<std::int32_t>({3, 3, 1, 1}));
    put("valid-tokenizer.gguf", w.serialize());
  }
  {  // v2, alignment 64, and alignment 1
    GgufWriter w;
    w.set_version(2).add_tensor("t", GgmlType::kQ4_K, {256}, zeros(144));
    put("valid-v2.gguf", w.serialize());
    GgufWriter a;
    a.set_alignment(64)
        .add_tensor("x", GgmlType::kF16, {3}, zeros(6))
        .add_tensor("y", GgmlType::kI8, {5}, zeros(5));
    put("valid-alignment-64.gguf", a.serialize());
    GgufWriter one;
    one.set_alignment(1)
        .add_tensor("x", GgmlType::kI16, {3}, zeros(6))
        .add_tensor("y", GgmlType::kMXFP4, {32}, zeros(17));
    put("valid-alignment-1.gguf", one.serialize());
  }
  {  // a shard of a split model, an empty tensor
    GgufWriter w;
    w.set_split(1, 3, 10).add_tensor("blk.1.ffn_down_exps.weight", GgmlType::kQ6_K, {256, 1, 2},
                                     zeros(420));
    w.add_tensor("empty", GgmlType::kQ4_0, {32, 0}, {});
    put("valid-split-shard.gguf", w.serialize());
  }
  put("valid-empty.gguf", GgufBytes().header(3, 0, 0).bytes);
  {
    GgufBytes b;
    b.header(3, 1, 1).str("general.architecture").u32(8).str("test");
    b.tensor("w", {2}, 0, 0).pad(32).f32(1.0f).f32(-2.0f);
    put("valid-hand-built.gguf", b.bytes);
  }
  put("valid-nested-16.gguf", one_kv([](GgufBytes& b) {
        b.str("k").u32(9);
        for (int i = 0; i < 15; ++i) b.u32(9).u64(1);
        b.u32(0).u64(1).u8(5);
      }));

  put("invalid-magic.gguf", GgufBytes().raw("GGML").u32(3).u64(0).u64(0).bytes);
  put("invalid-version-1.gguf", GgufBytes().header(1, 0, 0).bytes);
  put("invalid-version-4.gguf", GgufBytes().header(4, 0, 0).bytes);
  put("invalid-big-endian.gguf", GgufBytes().raw("GGUF").u32(0x03000000).u64(0).u64(0).bytes);
  put("invalid-too-short.gguf", GgufBytes().raw("GGU").bytes);
  put("invalid-huge-kv-count.gguf", GgufBytes().header(3, 0, 1ull << 60).bytes);
  put("invalid-huge-tensor-count.gguf", GgufBytes().header(3, 1ull << 60, 0).u64(0).bytes);
  put("invalid-string-past-end.gguf",
      one_kv([](GgufBytes& b) { b.str("k").u32(8).u64(100).raw("abcdefgh"); }));
  put("invalid-array-past-end.gguf",
      one_kv([](GgufBytes& b) { b.str("k").u32(9).u32(4).u64(100).u32(1); }));
  put("invalid-value-type.gguf", one_kv([](GgufBytes& b) { b.str("k").u32(13).u32(0); }));
  put("invalid-element-type.gguf", one_kv([](GgufBytes& b) { b.str("k").u32(9).u32(42).u64(0); }));
  put("invalid-bool.gguf", one_kv([](GgufBytes& b) { b.str("k").u32(7).u8(2).u32(0); }));
  put("invalid-empty-key.gguf", one_kv([](GgufBytes& b) { b.str("").u32(4).u32(1); }));
  put("invalid-key-utf8.gguf", one_kv([](GgufBytes& b) { b.str("\xff").u32(4).u32(1); }));
  {
    GgufBytes b;
    b.header(3, 0, 2).str("k").u32(4).u32(1).str("k").u32(4).u32(2);
    put("invalid-duplicate-key.gguf", b.bytes);
  }
  put("invalid-nested-17.gguf", one_kv([](GgufBytes& b) {
        b.str("k").u32(9);
        for (int i = 0; i < 16; ++i) b.u32(9).u64(1);
        b.u32(0).u64(0);
      }));
  put("invalid-alignment-type.gguf",
      one_kv([](GgufBytes& b) { b.str("general.alignment").u32(10).u64(32); }));
  put("invalid-alignment-48.gguf",
      one_kv([](GgufBytes& b) { b.str("general.alignment").u32(4).u32(48); }));
  put("invalid-ggml-type.gguf", one_tensor({8}, 31, 0, 32));
  put("invalid-n-dims-0.gguf", one_tensor({}, 0, 0, 32));
  put("invalid-n-dims-5.gguf", one_tensor({1, 1, 1, 1, 1}, 0, 0, 32));
  put("invalid-negative-ne.gguf", one_tensor({8, -2}, 0, 0, 32));
  put("invalid-block-multiple.gguf", one_tensor({100}, 12, 0, 144));
  put("invalid-overflow.gguf", one_tensor({1ll << 32, 1ll << 32}, 0, 0, 0));
  put("invalid-byte-overflow.gguf", one_tensor({1ll << 61}, 28, 0, 0));
  put("invalid-misaligned.gguf", one_tensor({8}, 0, 8, 64));
  put("invalid-data-past-end.gguf", one_tensor({8}, 0, 0, 31));
  {
    GgufBytes b;
    b.header(3, 2, 0).tensor("a", {16}, 0, 0).tensor("b", {8}, 0, 32).pad(32);
    b.bytes.resize(b.bytes.size() + 64);
    put("invalid-overlap.gguf", b.bytes);
    GgufBytes d;
    d.header(3, 2, 0).tensor("t", {8}, 0, 0).tensor("t", {8}, 0, 32).pad(32);
    d.bytes.resize(d.bytes.size() + 64);
    put("invalid-duplicate-tensor.gguf", d.bytes);
    GgufBytes n;
    n.header(3, 1, 0).tensor(std::string(65, 'n'), {8}, 0, 0).pad(32);
    n.bytes.resize(n.bytes.size() + 32);
    put("invalid-long-name.gguf", n.bytes);
  }
  {
    GgufWriter w;
    w.set("general.architecture", "llama").add_tensor("t", GgmlType::kF32, {8}, zeros(32));
    std::vector<std::byte> bytes = w.serialize();
    bytes.resize(bytes.size() - 5);
    put("invalid-truncated.gguf", bytes);
  }
  std::printf("wrote the corpus to %s\n", dir.string().c_str());
  return 0;
}
