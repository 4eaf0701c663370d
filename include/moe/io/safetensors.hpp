// SPDX-License-Identifier: Apache-2.0
// This file is part of moe, a header-only library of sparse Mixture-of-Experts layers.
/// \file
/// The safetensors format: validating mmap reader, sharded checkpoints, writer, conversions.
///
/// Standard library and POSIX only (no Eigen, no xsimd), so it can be used on its own:
///   moe::io::SafetensorsFile      one file, validated like the reference Rust reader
///   moe::io::ShardedCheckpoint    model.safetensors.index.json + shards; open_checkpoint(dir)
///   moe::io::TensorView           name, dtype, shape, bytes; to_float() / from_float()
///   moe::io::SafetensorsWriter    save_safetensors() / serialize_safetensors()
/// See docs/io.md.
#pragma once

#include "moe/io/safetensors/convert.hpp"
#include "moe/io/safetensors/dtype.hpp"
#include "moe/io/safetensors/file.hpp"
#include "moe/io/safetensors/sharded.hpp"
#include "moe/io/safetensors/tensor_view.hpp"
#include "moe/io/safetensors/writer.hpp"
