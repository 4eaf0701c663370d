// SPDX-License-Identifier: Apache-2.0
// This file is part of moe, a header-only library of sparse Mixture-of-Experts layers.
/// \file
/// gguf_decoder_config: the whole-model decoder's configuration of a GGUF model read by
/// io::gguf_as_hf() (without the decoder itself: moe/models/gguf_decoder.hpp loads one).
#pragma once

#include <string>

#include "moe/core/error.hpp"
#include "moe/io/gguf/hf_view.hpp"
#include "moe/layers/attention_options.hpp"
#include "moe/models/decoder_config.hpp"

namespace moe::models {

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

}  // namespace moe::models
