// SPDX-License-Identifier: Apache-2.0
// libFuzzer target for a GGUF file read as a whole model (moe/io/gguf/hf_view.hpp and
// moe/models/gguf_config.hpp): arbitrary bytes must either be rejected with moe::Error or give
// the config.json, the Hugging Face view of every tensor and the decoder configuration that the
// loaders read, with every view's bytes its shape's and every value readable. This is the
// metadata -> config logic of the twelve architectures and the converter's changes the reader
// undoes (norms, ssm_a, ssm_ba's split, attn_k_b / attn_v_b joined into kv_b_proj, rope_freqs).
// Any other outcome (a crash, a sanitizer report, another exception, a broken invariant) is a
// bug. Built like fuzz_gguf.cpp (tests/fuzz/CMakeLists.txt); seeds: tiny models of the 2026
// architectures written by the decoder tests (corpus_gguf_model/).
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <span>
#include <string>

#include "moe/core/error.hpp"
#include "moe/io/gguf/hf_view.hpp"
#include "moe/models/gguf_config.hpp"

namespace {

// A broken invariant: abort, so that libFuzzer and the sanitizers record the input.
void require(bool ok) {
  if (!ok) std::abort();
}

}  // namespace

/// Reads `data` as a GGUF model; returns 1 if it was accepted, 0 if it was rejected.
extern "C" int moe_fuzz_one(std::uint8_t const* data, std::size_t size) {
  std::span<std::byte const> const bytes(reinterpret_cast<std::byte const*>(data), size);
  try {
    moe::io::GgufAsHf const g =
        moe::io::gguf_as_hf(moe::io::GgufModel(moe::io::GgufFile(bytes, "fuzz.gguf")));
    require(!g.config_json.empty() && g.checkpoint != nullptr);
    for (std::string const& name : g.checkpoint->names()) {
      moe::io::TensorView const& t = g.checkpoint->tensor(name);
      require((static_cast<std::uint64_t>(t.num_elements()) * moe::io::dtype_bits(t.dtype) + 7) /
                  8 ==
              t.bytes.size());
      if (moe::io::converts_to_float(t.dtype) && t.num_elements() <= (1 << 16)) {
        (void)moe::io::to_float(t);  // every value readable
      }
    }
    moe::models::DecoderConfig const c = moe::models::gguf_decoder_config(g, "fuzz.gguf");
    require(c.num_hidden_layers >= 1 && c.moe.hidden_size >= 1 && c.vocab_size >= 1);
    require(c.rope_freq_factors.empty() ||
            static_cast<moe::Index>(c.rope_freq_factors.size()) * 2 ==
                (c.rotary_dim > 0 ? c.rotary_dim : c.head_dim));
  } catch (moe::Error const&) {
    return 0;
  }
  return 1;
}

extern "C" int LLVMFuzzerTestOneInput(std::uint8_t const* data, std::size_t size) {
  (void)moe_fuzz_one(data, size);
  return 0;
}
