// SPDX-License-Identifier: Apache-2.0
// This file is part of moe, a header-only library of sparse Mixture-of-Experts layers.
/// \file
/// The GGUF format (llama.cpp's): validating mmap reader, split models, writer, ggml types.
///
/// Standard library and POSIX only (no Eigen, no xsimd):
///   moe::io::GgufFile           one file: metadata (typed getters), tensor infos, tensor bytes
///   moe::io::GgufModel          one file or the shards of a split model, one tensor lookup
///   moe::io::GgufWriter         writes GGUF v3 (or v2): metadata, tensors, split.* keys
///   moe::quant::GgmlType        ggml's tensor types, ids and block sizes (ggml_type_info)
/// See docs/gguf.md.
#pragma once

#include "moe/io/gguf/file.hpp"
#include "moe/io/gguf/model.hpp"
#include "moe/io/gguf/value.hpp"
#include "moe/io/gguf/writer.hpp"
#include "moe/quant/ggml_type.hpp"
