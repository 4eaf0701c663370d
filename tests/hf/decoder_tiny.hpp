// SPDX-License-Identifier: Apache-2.0
// The tiny whole-model checkpoints of the decoder tests (test_decoder*.cpp): every decoding
// family's config.json and tensors under the Hugging Face names, random values, the
// checkpoint written as safetensors; and the moe_generate runner.
#pragma once

#include <algorithm>
#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

#include "../../examples/common/tiny_model.hpp"
#include "io/io_test_support.hpp"

namespace dectest {

using namespace tiny_model;  // NOLINT(google-build-using-namespace)

/// The checkpoint of `m` (F32 tensors, or BF16 ones rounded to nearest even) in a scratch
/// directory of this name.
inline fs::path write_model(Tiny const& t, Tensors const& m, std::string const& name,
                            bool bf16 = false) {
  fs::path const dir = iotest::scratch_dir(name);
  write_checkpoint(dir, t, m, bf16);
  return dir;
}

inline std::int64_t argmax(float const* v, Index n) {
  return static_cast<std::int64_t>(std::max_element(v, v + n) - v);
}

}  // namespace dectest

#ifdef MOE_GENERATE
#include <sys/wait.h>

#include <cstdlib>

namespace dectest {

/// Runs moe_generate with `args`; stdout and stderr go to files in `dir`.
inline int run_generate(std::string const& args, fs::path const& dir) {
  std::string command = "'";
  command.append(MOE_GENERATE).append("' ").append(args);
  command.append(" >'").append((dir / "out.txt").string()).append("'");
  command.append(" 2>'").append((dir / "err.txt").string()).append("'");
  int const status = std::system(command.c_str());
  return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

inline std::string text_of(fs::path const& p) {
  std::vector<std::byte> const b = iotest::read_file(p);
  return std::string(reinterpret_cast<char const*>(b.data()), b.size());
}

}  // namespace dectest
#endif  // MOE_GENERATE
