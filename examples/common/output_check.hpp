// SPDX-License-Identifier: Apache-2.0
// This file is part of moe, a header-only library of sparse Mixture-of-Experts layers.
//
// The output checks the example tools share (not part of the library's API): model_inputs(),
// the files of a model directory that a run reads, and check_output(), the refusal, before any
// work, of an output file that is one of them, is not a regular file or sits in a directory that
// does not exist.
#pragma once

#include <sys/stat.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <string>
#include <system_error>
#include <vector>

#include "moe/core/error.hpp"
#include "moe/io/detail/output_file.hpp"
#include "moe/io/gguf/model.hpp"
#include "moe/io/safetensors/sharded.hpp"

namespace moe_cli {

/// The files of the model directory `model` that loading it reads: config.json, and
/// model.safetensors or the index and every shard it names (opens only the index); for a GGUF
/// file, every shard of the model. Only config.json when `model` is neither (loading it then
/// fails with its own message).
inline std::vector<std::filesystem::path> model_inputs(std::filesystem::path const& model) {
  if (moe::io::is_gguf_file(model)) {
    moe::io::GgufModel const gguf(model);
    std::vector<std::filesystem::path> inputs;
    for (std::size_t i = 0; i < gguf.num_shards(); ++i) {
      inputs.emplace_back(gguf.shard(i).display_name());
    }
    return inputs;
  }
  std::vector<std::filesystem::path> inputs = {model / "config.json"};
  std::error_code ec;
  if (std::filesystem::is_directory(model, ec)) {
    moe::io::ShardedCheckpoint const files = moe::io::open_checkpoint(model);
    inputs.emplace_back(files.source());
    for (std::size_t i = 0; i < files.num_shards(); ++i) inputs.push_back(files.shard_path(i));
  }
  return inputs;
}

/// Refuses the output file `output` before any work, so that a refused run reads and writes
/// nothing: its directory must exist, it must not exist or be a regular file, and it must not be
/// (by device and inode: hard and symbolic links included) one of `inputs`. `where` (the option)
/// starts the message.
inline void check_output(std::filesystem::path const& output,
                         std::vector<std::filesystem::path> const& inputs,
                         std::string const& where) {
  moe::io::check_output_file(output, inputs, where);  // a directory, FIFO, ... or an input
  std::filesystem::path dir = output.parent_path();
  if (dir.empty()) dir = ".";
  struct stat st {};
  if (::stat(dir.c_str(), &st) != 0) {
    moe::detail::fail(where, ": the directory of the output '", output.string(),
                      "' cannot be used (", std::strerror(errno),
                      "); pass a file path in an existing directory");
  }
  if (!S_ISDIR(st.st_mode)) {
    moe::detail::fail(where, ": the directory of the output '", output.string(),
                      "' is not a directory; pass a file path in an existing directory");
  }
}

}  // namespace moe_cli
