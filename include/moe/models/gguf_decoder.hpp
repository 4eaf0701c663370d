// SPDX-License-Identifier: Apache-2.0
// This file is part of moe, a header-only library of sparse Mixture-of-Experts layers.
/// \file
/// load_gguf_decoder: a whole model from a llama.cpp GGUF file, through the same loader as a
/// Hugging Face directory (moe/io/gguf/hf_view.hpp presents the file as one).
#pragma once

#include <filesystem>
#include <string>
#include <variant>

#include "moe/core/thread_pool.hpp"
#include "moe/io/gguf/hf_view.hpp"
#include "moe/models/decoder.hpp"

namespace moe::models {

/// Loads the GGUF model at `path` (a .gguf file, or any shard of a split one) as
/// load_hf_decoder() loads a directory: io::gguf_as_hf() gives the config.json its metadata
/// implies and its tensors under the Hugging Face names; `options` choose the formats as for
/// a directory (unset: as stored, a quantized matrix's blocks re-packed for the kernels, never
/// re-quantized; a block type moe has no kernel for is decoded and packed as q8_0:
/// DecoderOptions). What the reading noticed (types without a kernel, tensors not read)
/// is added to Decoder::warnings. Throws moe::Error naming the file for an architecture moe
/// does not read, and as load_hf_decoder.
/// The decoder configuration of a GGUF model read by io::gguf_as_hf(): its config.json, and what
/// the file says beyond it (the Gated DeltaNet's projection layout and value-head order, the
/// RoPE frequency factors of rope_freqs.weight). `source` names the file in errors.
inline DecoderConfig gguf_decoder_config(io::GgufAsHf const& g, std::string const& source) {
  DecoderConfig c = parse_decoder_config(g.config_json, source);
  if (g.deltanet_split_projections) c.deltanet.split_projections = true;
  if (g.deltanet_tiled_value_heads) c.deltanet.head_order = DeltaNetHeadOrder::kTiled;
  if (!g.rope_freq_factors.empty()) {
    Index const rotary = c.rotary_dim > 0 ? c.rotary_dim : c.head_dim;
    moe::detail::check(
        static_cast<Index>(g.rope_freq_factors.size()) * 2 == rotary && !c.mla.enabled,
        "gguf: ", source, ": rope_freqs.weight has ", g.rope_freq_factors.size(),
        " factors; the model's RoPE rotates ", rotary,
        " dimensions a head, which needs half as many");
    c.rope_freq_factors = g.rope_freq_factors;
    c.llama3 = {};  // the factors are the scaling
  }
  return c;
}

inline AnyDecoder load_gguf_decoder(std::filesystem::path const& path, ThreadPool* pool = nullptr,
                                    DecoderOptions const& options = {}) {
  io::GgufAsHf const g = io::gguf_as_hf(path);
  DecoderConfig const c = gguf_decoder_config(g, path.string());
  AnyDecoder any = detail::load_any_decoder(c, g.checkpoint, pool, options);
  std::visit(
      [&](auto& d) { d.warnings.insert(d.warnings.begin(), g.warnings.begin(), g.warnings.end()); },
      any);
  return any;
}

}  // namespace moe::models
