// SPDX-License-Identifier: Apache-2.0
// libFuzzer target for the GGUF reader (moe/io/gguf/file.hpp): arbitrary bytes must either be
// rejected with moe::Error or give a file whose every metadata value and tensor can be read,
// whose tensors lie inside the input, aligned and apart, and which GgufWriter writes again into
// a file GgufFile accepts with the same content. Any other outcome (a crash, a sanitizer
// report, another exception, a broken invariant) is a bug. Built with clang
// -fsanitize=fuzzer,address,undefined by the "fuzz: gguf libFuzzer" test, and with the normal
// compiler into moe_fuzz_replay_gguf (tests/fuzz/replay_main.cpp).
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "moe/core/error.hpp"
#include "moe/io/gguf.hpp"

namespace {

using moe::io::GgufFile;
using moe::io::GgufMetadataValue;
using moe::io::GgufTensorInfo;
using moe::io::GgufValue;
using moe::io::GgufValueType;

// A broken invariant: abort, so that libFuzzer and the sanitizers record the input.
void require(bool ok) {
  if (!ok) std::abort();
}

// Reads every part of a value through the public accessors; returns the elements visited.
std::size_t walk(GgufValue const& v, std::span<std::byte const> file) {
  (void)v.describe();
  (void)v.to_uint64();
  (void)v.to_int64();
  (void)v.to_double();
  (void)v.to_bool();
  if (std::optional<std::string_view> const s = v.to_string()) {
    require(s->empty() || (reinterpret_cast<std::byte const*>(s->data()) >= file.data() &&
                           reinterpret_cast<std::byte const*>(s->data() + s->size()) <=
                               file.data() + file.size()));
  }
  std::span<std::byte const> const raw = v.raw();
  require(raw.empty() ||
          (raw.data() >= file.data() && raw.data() + raw.size() <= file.data() + file.size()));
  if (!v.is_array()) return 1;
  std::size_t n = 1;
  require(v.element_type() != GgufValueType::kString || v.strings().size() == v.size());
  for (std::size_t i = 0; i < v.size(); ++i) n += walk(v[i], file);
  return n;
}

std::vector<std::byte> encoded(GgufValue const& v) {
  std::vector<std::byte> out;
  GgufMetadataValue::from(v).encode(out);
  return out;
}

}  // namespace

/// Parses `data` as a GGUF file; returns 1 if it was accepted, 0 if it was rejected.
extern "C" int moe_fuzz_one(std::uint8_t const* data, std::size_t size) {
  std::span<std::byte const> const bytes(reinterpret_cast<std::byte const*>(data), size);
  bool long_name = false;
  try {
    GgufFile const file(bytes);
    require(file.version() == 2 || file.version() == 3);
    require(file.alignment() != 0 && (file.alignment() & (file.alignment() - 1)) == 0);
    for (moe::io::GgufKeyValue const& kv : file.metadata()) {
      require(file.find(kv.key) == &kv.value);
      (void)walk(kv.value, bytes);
      // The throwing getters throw moe::Error only (caught below as a rejection would be: so
      // catch each here).
      try {
        (void)file.integer(kv.key);
      } catch (moe::Error const&) {
      }
      try {
        (void)file.number(kv.key);
      } catch (moe::Error const&) {
      }
      try {
        (void)file.floats(kv.key);
      } catch (moe::Error const&) {
      }
      try {
        (void)file.integers(kv.key);
      } catch (moe::Error const&) {
      }
    }
    std::uint64_t previous_end = 0;
    std::vector<GgufTensorInfo const*> by_offset;
    for (GgufTensorInfo const& t : file.tensors()) {
      require(file.find_tensor(t.name) == &t);
      require(t.n_dims >= 1 && t.n_dims <= 4);
      require(t.offset % file.alignment() == 0);
      require(t.data.data() == bytes.data() + file.data_offset() + t.offset || t.data.empty());
      require(file.data_offset() + t.offset + t.data.size() <= size);
      require(static_cast<std::uint64_t>(t.num_rows()) * t.row_bytes() == t.data.size());
      require(t.shape().size() == t.n_dims);
      long_name = long_name || t.name.size() >= moe::io::kGgufMaxTensorName;
      by_offset.push_back(&t);
    }
    std::sort(by_offset.begin(), by_offset.end(), [](auto* a, auto* b) {
      return a->offset != b->offset ? a->offset < b->offset : a->data.size() < b->data.size();
    });
    for (GgufTensorInfo const* t : by_offset) {
      require(t->offset >= previous_end);
      previous_end = t->offset + t->data.size();
    }
  } catch (moe::Error const&) {
    return 0;
  }
  if (long_name) return 1;  // 64-byte names: valid GGUF, but GgufWriter writes ggml's 63 at most

  // Whatever the reader accepts, the writer must write and the reader accept again, the same.
  GgufFile const original(bytes);
  moe::io::GgufWriter w;
  w.set_version(original.version());
  for (moe::io::GgufKeyValue const& kv : original.metadata()) {
    w.set(std::string(kv.key), GgufMetadataValue::from(kv.value));
  }
  for (GgufTensorInfo const& t : original.tensors()) {
    w.add_tensor_view(t.name, t.type, {t.ne.begin(), t.ne.begin() + t.n_dims}, t.data);
  }
  GgufFile const again(w.serialize());  // must not throw
  require(again.version() == original.version() && again.alignment() == original.alignment());
  require(again.metadata().size() == original.metadata().size());
  for (std::size_t i = 0; i < original.metadata().size(); ++i) {
    require(again.metadata()[i].key == original.metadata()[i].key);
    require(encoded(again.metadata()[i].value) == encoded(original.metadata()[i].value));
  }
  require(again.size() == original.size());
  for (std::size_t i = 0; i < original.size(); ++i) {
    GgufTensorInfo const& a = again.tensors()[i];
    GgufTensorInfo const& o = original.tensors()[i];
    require(a.name == o.name && a.type == o.type && a.n_dims == o.n_dims && a.ne == o.ne);
    require(a.data.size() == o.data.size());
    require(o.data.empty() || std::memcmp(a.data.data(), o.data.data(), o.data.size()) == 0);
  }
  return 1;
}

extern "C" int LLVMFuzzerTestOneInput(std::uint8_t const* data, std::size_t size) {
  (void)moe_fuzz_one(data, size);
  return 0;
}
