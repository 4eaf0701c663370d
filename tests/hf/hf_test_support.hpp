// SPDX-License-Identifier: Apache-2.0
// Helpers for the Hugging Face checkpoint tests: random layers, layer comparisons, forwards,
// and rewriting a saved checkpoint to break it in one specific way.
#pragma once

#include <catch2/catch.hpp>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <span>
#include <string>
#include <vector>

#include "io/io_test_support.hpp"
#include "moe/core/random.hpp"
#include "moe/io/hf.hpp"
#include "moe/io/safetensors.hpp"

namespace hftest {

using moe::Index;
namespace fs = std::filesystem;

/// Random weights in every parameter (and a random selection bias for DeepSeek-V3).
template <class Layer>
void randomize(Layer& layer, std::uint64_t seed) {
  auto w = layer.router_weight();
  moe::fill_uniform(std::span<float>(w.data, static_cast<std::size_t>(w.rows * w.cols)), -0.5f,
                    0.5f, seed);
  moe::fill_uniform(layer.experts().edit().parameters(), -0.3f, 0.3f, seed + 1);
  if constexpr (Layer::Shared::has_experts) {
    moe::fill_uniform(layer.shared_experts().bank().edit().parameters(), -0.3f, 0.3f, seed + 2);
    auto g = layer.shared_experts().gate_weight();
    moe::fill_uniform(std::span<float>(g.data, static_cast<std::size_t>(g.rows * g.cols)), -0.5f,
                      0.5f, seed + 3);
  }
  if constexpr (requires { layer.router().bias; }) {
    moe::fill_uniform(layer.router().bias, -0.1f, 0.1f, seed + 4);
  }
  moe::fill_uniform(layer.router_bias(), -0.5f, 0.5f, seed + 5);  // gpt-oss only (else empty)
}

inline std::vector<float> random_input(Index rows, Index cols, std::uint64_t seed) {
  std::vector<float> x(static_cast<std::size_t>(rows * cols));
  moe::fill_uniform(x, -1.0f, 1.0f, seed);
  return x;
}

/// y = layer(x) for x [T, D].
template <class Layer>
std::vector<float> forward(Layer const& layer, std::vector<float> const& x) {
  Index const D = layer.d_model(), T = static_cast<Index>(x.size()) / D;
  std::vector<float> y(x.size());
  moe::MoeFfnWorkspace ws;
  layer.forward({x.data(), T, D}, {y.data(), T, D}, ws);
  return y;
}

/// Rounds every value through `dtype` (BF16 / F16) and back, as a checkpoint of that dtype does.
inline std::vector<float> rounded(std::vector<float> const& v, moe::io::Dtype dtype) {
  std::vector<std::byte> const bytes = moe::io::from_float(v, dtype);
  moe::io::TensorView const view{"v", dtype, {static_cast<std::int64_t>(v.size())}, bytes};
  return moe::io::to_float(view);
}

/// Every tensor of `loaded` equals the same tensor of `original` (rounded through `dtype`; the
/// selection bias is always F32).
template <class Layer>
void require_same_tensors(moe::io::HfLayer<Layer> const& loaded, Layer const& original,
                          moe::io::Dtype dtype = moe::io::Dtype::kF32) {
  REQUIRE_FALSE(loaded.tensors.empty());
  for (moe::io::HfTensor const& t : loaded.tensors) {
    INFO(t.name);
    std::vector<float> want = moe::io::hf_tensor_values(original, t);
    if (t.part != moe::io::HfPart::kSelectionBias) want = rounded(want, dtype);
    REQUIRE(moe::io::hf_tensor_values(loaded.layer, t) == want);
  }
}

/// Reads model.safetensors of `dir`, lets `edit` change the list of tensors (views into the
/// old file, whose bytes stay valid meanwhile; replacement bytes go to `storage`), and writes
/// the file back.
inline void rewrite_checkpoint(
    fs::path const& dir,
    std::function<void(std::vector<moe::io::TensorView>&, std::vector<std::vector<std::byte>>&)>
        edit) {
  std::vector<std::byte> const image = iotest::read_file(dir / "model.safetensors");
  moe::io::SafetensorsFile const file(std::span<std::byte const>(image), "model.safetensors");
  std::vector<moe::io::TensorView> tensors(file.tensors().begin(), file.tensors().end());
  std::vector<std::vector<std::byte>> storage;
  storage.reserve(16);  // views into it must stay valid
  edit(tensors, storage);
  moe::io::save_safetensors(dir / "model.safetensors", tensors);
}

/// Index of the tensor named `name` in `tensors` (fails the test when absent).
inline std::size_t index_of(std::vector<moe::io::TensorView> const& tensors,
                            std::string const& name) {
  for (std::size_t i = 0; i < tensors.size(); ++i) {
    if (tensors[i].name == name) return i;
  }
  FAIL("no tensor " << name);
  return 0;
}

}  // namespace hftest
