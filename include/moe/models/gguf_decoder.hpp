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
#include "moe/models/gguf_config.hpp"

namespace moe::models {

/// Loads the GGUF model at `path` (a .gguf file, or any shard of a split one) as
/// load_hf_decoder() loads a directory: io::gguf_as_hf() gives the config.json its metadata
/// implies and its tensors under the Hugging Face names; `options` choose the formats as for
/// a directory (unset: as stored, a quantized matrix's blocks re-packed for the kernels, never
/// re-quantized; a block type moe has no kernel for is decoded and packed as q8_0:
/// DecoderOptions). What the reading noticed (types without a kernel, tensors not read)
/// is added to Decoder::warnings. Throws moe::Error naming the file for an architecture moe
/// does not read, and as load_hf_decoder.
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

/// write_hf_expert_store for a GGUF file: its routed experts as an expert store, one MoE layer at
/// a time (the stored blocks re-packed, unless `options` ask for other formats).
inline std::vector<Fallback> write_gguf_expert_store(std::filesystem::path const& gguf,
                                                     std::string const& path,
                                                     ThreadPool* pool = nullptr,
                                                     DecoderOptions const& options = {}) {
  io::GgufAsHf const g = io::gguf_as_hf(gguf);
  DecoderConfig const c = gguf_decoder_config(g, gguf.string());
  return detail::write_any_expert_store(c, *g.checkpoint, path, pool, options);
}

}  // namespace moe::models
