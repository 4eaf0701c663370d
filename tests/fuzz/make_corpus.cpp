// SPDX-License-Identifier: Apache-2.0
// Writes the seed corpus of the safetensors fuzzer (tests/fuzz/corpus/): small valid files made
// with moe's writer (valid-*) and one hand-made file per reader error class (invalid-*).
// Run by hand after changing it:
//   cmake --build <build> --target moe_fuzz_make_corpus && <build>/tests/io/moe_fuzz_make_corpus
//   tests/fuzz/corpus
#include <cstdio>
#include <filesystem>
#include <limits>
#include <string>
#include <vector>

#include "io/io_test_support.hpp"
#include "moe/io/safetensors.hpp"

namespace {

using iotest::image;
using moe::io::Dtype;

std::string tensor_header(std::string const& dtype, std::string const& shape,
                          std::string const& offsets) {
  return R"({"t":{"dtype":")" + dtype + R"(","shape":)" + shape + R"(,"data_offsets":)" + offsets +
         "}}";
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
  float const inf = std::numeric_limits<float>::infinity();
  std::vector<float> const values = {0.0f, -1.5f, 3.25f, 65504.0f, 1e-6f, inf, -inf, 0.1f};

  {  // F32 with metadata
    moe::io::SafetensorsWriter w;
    w.add_f32("model.layers.0.mlp.gate.weight", {2, 4}, values).set_metadata("format", "pt");
    put("valid-f32-metadata.safetensors", w.serialize());
  }
  {  // BF16 + F16 + F64
    moe::io::SafetensorsWriter w;
    w.add_bf16("w1", {4, 2}, values).add_f16("w2", {8}, values);
    std::vector<std::byte> const f64 = moe::io::from_float(values, Dtype::kF64);
    w.add("w3", Dtype::kF64, {2, 2, 2}, f64);
    put("valid-bf16-f16-f64.safetensors", w.serialize());
  }
  {  // integers, bool, F8
    moe::io::SafetensorsWriter w;
    std::vector<std::byte> const r = iotest::ramp(24);
    w.add("i8", Dtype::kI8, {3}, std::span(r).first(3))
        .add("u8", Dtype::kU8, {2}, std::span(r).first(2))
        .add("b", Dtype::kBool, {2}, std::span(r).first(2))
        .add("i16", Dtype::kI16, {2}, std::span(r).first(4))
        .add("u16", Dtype::kU16, {1}, std::span(r).first(2))
        .add("i32", Dtype::kI32, {2}, std::span(r).first(8))
        .add("u32", Dtype::kU32, {1}, std::span(r).first(4))
        .add("i64", Dtype::kI64, {1}, std::span(r).first(8))
        .add("u64", Dtype::kU64, {2}, std::span(r).first(16))
        .add("e4m3", Dtype::kF8E4M3, {4}, std::span(r).first(4))
        .add("e5m2", Dtype::kF8E5M2, {4}, std::span(r).first(4))
        .add("e8m0", Dtype::kF8E8M0, {2}, std::span(r).first(2))
        .add("fnuz", Dtype::kF8E4M3Fnuz, {2}, std::span(r).first(2))
        .add("fnuz2", Dtype::kF8E5M2Fnuz, {2}, std::span(r).first(2))
        .add("f4", Dtype::kF4, {4}, std::span(r).first(2))
        .add("f6", Dtype::kF6E3M2, {4}, std::span(r).first(3))
        .add("c64", Dtype::kC64, {1}, std::span(r).first(8));
    put("valid-all-dtypes.safetensors", w.serialize());
  }
  put("valid-empty.safetensors", moe::io::serialize_safetensors({}));
  put("valid-scalar-and-empty.safetensors",
      image(R"({"s":{"dtype":"F32","shape":[],"data_offsets":[0,4]},)"
            R"("e":{"dtype":"F16","shape":[0,3],"data_offsets":[4,4]}})",
            iotest::ramp(4)));
  put("valid-whitespace.safetensors",
      image(" \t\n{ \"t\" : {\"dtype\":\"U8\", \"shape\":[2], \"data_offsets\":[0,2]}}\r\n ",
            iotest::ramp(2)));
  put("valid-escapes.safetensors",
      image(R"({"__metadata__":{"k\u00e9\n":"\ud83d\ude00"},"a\"b":{"dtype":"U8","shape":[1],)"
            R"("data_offsets":[0,1],"extra":[1,{"x":null},true,-2.5e-3]}})",
            iotest::ramp(1)));

  put("invalid-too-small.safetensors", iotest::bytes_of("\x01\x02\x03"));
  put("invalid-header-too-large.safetensors", image(100'000'001, "{}"));
  put("invalid-header-past-eof.safetensors", image(64, "{}"));
  put("invalid-utf8.safetensors", image("{\"\xc0\x80\":1}"));
  put("invalid-json.safetensors", image(R"({"t":{"dtype":"U8",}})"));
  put("invalid-not-object.safetensors", image("[]"));
  put("invalid-unknown-dtype.safetensors",
      image(tensor_header("F12", "[1]", "[0,1]"), iotest::ramp(1)));
  put("invalid-negative-shape.safetensors",
      image(tensor_header("U8", "[-1]", "[0,1]"), iotest::ramp(1)));
  put("invalid-metadata-value.safetensors", image(R"({"__metadata__":{"n":1}})"));
  put("invalid-duplicate-name.safetensors",
      image(R"({"t":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},)"
            R"("t":{"dtype":"U8","shape":[1],"data_offsets":[1,2]}})",
            iotest::ramp(2)));
  put("invalid-gap.safetensors", image(R"({"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},)"
                                       R"("b":{"dtype":"U8","shape":[1],"data_offsets":[2,3]}})",
                                       iotest::ramp(3)));
  put("invalid-overlap.safetensors",
      image(R"({"a":{"dtype":"U8","shape":[2],"data_offsets":[0,2]},)"
            R"("b":{"dtype":"U8","shape":[2],"data_offsets":[1,3]}})",
            iotest::ramp(3)));
  put("invalid-size-mismatch.safetensors",
      image(tensor_header("F32", "[2,2]", "[0,12]"), iotest::ramp(12)));
  put("invalid-overflow.safetensors",
      image(tensor_header("U64", "[4294967296,4294967296]", "[0,0]")));
  put("invalid-misaligned.safetensors",
      image(tensor_header("F4", "[3]", "[0,2]"), iotest::ramp(2)));
  put("invalid-trailing-bytes.safetensors",
      image(tensor_header("U8", "[1]", "[0,1]"), iotest::ramp(3)));
  put("invalid-truncated.safetensors",
      image(tensor_header("F32", "[4]", "[0,16]"), iotest::ramp(15)));
  put("invalid-deep.safetensors",
      image(R"({"t":{"x":)" + std::string(130, '[') + std::string(130, ']') + "}}"));
  put("invalid-lone-surrogate.safetensors", image(R"({"\udc00":1})"));
  std::printf("wrote the corpus to %s\n", dir.string().c_str());
  return 0;
}
