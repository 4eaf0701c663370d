// SPDX-License-Identifier: Apache-2.0
// This file is part of moe, a header-only library of sparse Mixture-of-Experts layers.
/// \file
/// load_gguf_moe_layer: one MoE layer of a llama.cpp GGUF model, through the Hugging Face
/// layer loader (moe/io/gguf/hf_view.hpp presents the file as a model directory).
#pragma once

#include <filesystem>
#include <string>
#include <type_traits>
#include <variant>

#include "moe/core/error.hpp"
#include "moe/core/types.hpp"
#include "moe/io/gguf/hf_view.hpp"
#include "moe/io/hf/config.hpp"
#include "moe/io/hf/layer.hpp"

namespace moe::io {

/// Loads MoE layer `layer` of the GGUF model at `path` into its family's preset type, as
/// load_hf_moe_layer() loads one of a directory (same checks, same HfLayer: tensors named as
/// in transformers). The file's metadata decides every setting, so no key counts as defaulted
/// or unknown; the reading's warnings (tensors decoded to fp32, tensors not read) lead
/// HfLayer::warnings. Throws moe::Error as gguf_as_hf() and load_hf_layer() do, and when
/// `layer` is not an MoE layer.
inline HfAnyLayer load_gguf_moe_layer(std::filesystem::path const& path, Index layer,
                                      HfLoadOptions const& options = {}) {
  GgufAsHf const g = gguf_as_hf(path);
  HfMoeConfig config = parse_hf_config(g.config_json, path.string());
  config.defaulted_keys.clear();  // llama.cpp's choices for the architecture, not omissions
  config.unknown_keys.clear();    // decoder keys the MoE parser does not read
  if (std::string const why = config.dense_reason(layer); !why.empty()) {
    moe::detail::fail("gguf: ", path.string(), ": cannot load layer ", layer, " of this ",
                      config.model_type(), " model as an MoE layer: ", why, "; pick an MoE layer");
  }
  HfAnyLayer any = visit_hf_layer_type(config.family, [&]<class L>(std::type_identity<L>) {
    return HfAnyLayer(load_hf_layer<L>(config, *g.checkpoint, layer, options));
  });
  std::visit(
      [&](auto& loaded) {
        loaded.warnings.insert(loaded.warnings.begin(), g.warnings.begin(), g.warnings.end());
      },
      any);
  return any;
}

}  // namespace moe::io
