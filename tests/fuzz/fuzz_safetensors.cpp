// SPDX-License-Identifier: Apache-2.0
// libFuzzer target for the safetensors reader: arbitrary bytes must either be rejected with
// moe::Error or give tensors that convert to float and survive a write/read round trip. Any
// other outcome (a crash, a sanitizer report, another exception, a broken invariant) is a bug.
// Built with clang -fsanitize=fuzzer,address,undefined by the "fuzz: libFuzzer" test, and with
// the normal compiler into moe_fuzz_replay (tests/fuzz/replay_main.cpp).
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <span>
#include <vector>

#include "moe/core/error.hpp"
#include "moe/io/safetensors.hpp"

namespace {

// A broken invariant: abort, so that libFuzzer and the sanitizers record the input.
void require(bool ok) {
  if (!ok) std::abort();
}

}  // namespace

/// Parses `data` as a safetensors file; returns 1 if it was accepted, 0 if it was rejected.
extern "C" int moe_fuzz_one(std::uint8_t const* data, std::size_t size) {
  std::span<std::byte const> const bytes(reinterpret_cast<std::byte const*>(data), size);
  std::vector<std::byte> rewritten;
  try {
    moe::io::SafetensorsFile const file(bytes);
    std::vector<float> values;
    std::uint64_t covered = 0;
    for (moe::io::TensorView const& t : file.tensors()) {
      require(file.find(t.name) == &t);
      require(t.bytes.data() >= bytes.data() &&
              t.bytes.data() + t.bytes.size() <= bytes.data() + bytes.size());
      covered += t.bytes.size();
      if (!moe::io::converts_to_float(t.dtype)) continue;
      values.resize(static_cast<std::size_t>(t.num_elements()));
      moe::io::to_float(t, values);
    }
    require(8 + file.header_size() + covered == size);
    // Whatever the reader accepts, the writer must write and the reader accept again.
    rewritten = moe::io::serialize_safetensors(file.tensors(), file.metadata());
  } catch (moe::Error const&) {
    return 0;
  }
  moe::io::SafetensorsFile const again(rewritten);  // must not throw
  moe::io::SafetensorsFile const original(bytes);
  require(again.size() == original.size());
  require(again.metadata() == original.metadata());
  for (moe::io::TensorView const& t : original.tensors()) {
    moe::io::TensorView const* u = again.find(t.name);
    require(u != nullptr && u->dtype == t.dtype && u->shape == t.shape &&
            u->bytes.size() == t.bytes.size());
    require(t.bytes.empty() || std::memcmp(u->bytes.data(), t.bytes.data(), t.bytes.size()) == 0);
  }
  return 1;
}

extern "C" int LLVMFuzzerTestOneInput(std::uint8_t const* data, std::size_t size) {
  (void)moe_fuzz_one(data, size);
  return 0;
}
