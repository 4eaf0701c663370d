// SPDX-License-Identifier: Apache-2.0
// This file is part of moe, a header-only library of sparse Mixture-of-Experts layers.
/// \file
/// Writing safetensors files byte-compatible with the reference writer (safetensors.torch).
#pragma once

#include <algorithm>
#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <functional>
#include <map>
#include <set>
#include <span>
#include <string>
#include <string_view>
#include <system_error>
#include <utility>
#include <vector>

#include "moe/core/error.hpp"
#include "moe/io/detail/json.hpp"
#include "moe/io/detail/output_file.hpp"
#include "moe/io/safetensors/dtype.hpp"
#include "moe/io/safetensors/file.hpp"
#include "moe/io/safetensors/tensor_view.hpp"

namespace moe::io {

namespace detail {

/// The header of a file holding `tensors`, and the order their data is written in.
struct PreparedHeader {
  std::string header;              // JSON, space-padded to a multiple of 8 bytes
  std::vector<std::size_t> order;  // indices into `tensors`, in data order
  std::uint64_t data_size = 0;
};

inline void check_utf8(std::string_view text, std::string const& where, char const* what) {
  moe::detail::check(find_invalid_utf8(text) == std::string_view::npos, where, ": ", what, " ",
                     printable_name(text),
                     " is not valid UTF-8; safetensors headers are UTF-8 JSON, re-encode it");
}

/// Lays out the file as the reference writer (safetensors `prepare()`) does: tensors sorted by
/// dtype in descending enum order (so larger alignments come first), then by name (bytewise);
/// data_offsets contiguous from 0 in that order; the header is the compact JSON serde_json
/// writes ("__metadata__" first when not empty, then each tensor as
/// {"dtype":..,"shape":[..],"data_offsets":[b,e]}), padded with spaces to a multiple of 8 so
/// that the data starts 8-byte aligned.
inline PreparedHeader prepare_header(std::span<TensorView const> tensors, Metadata const& metadata,
                                     std::string const& where) {
  PreparedHeader out;
  std::set<std::string_view> names;
  for (TensorView const& t : tensors) {
    check_utf8(t.name, where, "tensor name");
    moe::detail::check(t.name != "__metadata__", where,
                       ": a tensor cannot be named \"__metadata__\" (the key is reserved for "
                       "the metadata map); rename it");
    moe::detail::check(names.insert(t.name).second, where, ": tensor ", printable_name(t.name),
                       " is given twice; tensor names must be unique");
    (void)checked_elements(t, where);
  }
  for (auto const& [key, value] : metadata) {
    check_utf8(key, where, "metadata key");
    check_utf8(value, where, "metadata value");
  }

  out.order.resize(tensors.size());
  for (std::size_t i = 0; i < tensors.size(); ++i) out.order[i] = i;
  std::sort(out.order.begin(), out.order.end(), [&](std::size_t a, std::size_t b) {
    TensorView const& ta = tensors[a];
    TensorView const& tb = tensors[b];
    if (ta.dtype != tb.dtype) return ta.dtype > tb.dtype;
    return ta.name < tb.name;  // std::string compares bytewise, like Rust's String
  });

  std::string& h = out.header;
  h += '{';
  bool first = true;
  if (!metadata.empty()) {
    h += "\"__metadata__\":{";
    for (auto const& [key, value] : metadata) {
      if (!first) h += ',';
      first = false;
      append_json_string(h, key);
      h += ':';
      append_json_string(h, value);
    }
    h += '}';
    first = false;
  }
  std::uint64_t offset = 0;
  for (std::size_t const i : out.order) {
    TensorView const& t = tensors[i];
    if (!first) h += ',';
    first = false;
    append_json_string(h, t.name);
    h += ":{\"dtype\":\"";
    h += dtype_name(t.dtype);
    h += "\",\"shape\":[";
    for (std::size_t d = 0; d < t.shape.size(); ++d) {
      if (d > 0) h += ',';
      h += std::to_string(t.shape[d]);
    }
    std::uint64_t const end = offset + t.bytes.size();
    moe::detail::check(end >= offset, where, ": the tensors hold more than 2^64 bytes");
    h.append("],\"data_offsets\":[").append(std::to_string(offset)).append(",");
    h.append(std::to_string(end)).append("]}");
    offset = end;
  }
  h += '}';
  h.resize((h.size() + 7) / 8 * 8, ' ');
  moe::detail::check(h.size() <= kMaxHeaderSize, where, ": the header would be ", h.size(),
                     " bytes, more than the format's limit of ", kMaxHeaderSize,
                     "; split the tensors into several files (shards)");
  out.data_size = offset;
  return out;
}

}  // namespace detail

/// The bytes of a safetensors file holding `tensors` and `metadata` (see
/// detail::prepare_header() for the layout; identical to what safetensors.torch.save_file
/// writes for the same tensors, except that the reference orders metadata keys arbitrarily
/// and we sort them). Throws moe::Error for duplicate or reserved names, invalid UTF-8, or a
/// view whose byte count does not match dtype x shape.
inline std::vector<std::byte> serialize_safetensors(std::span<TensorView const> tensors,
                                                    Metadata const& metadata = {}) {
  detail::PreparedHeader const prepared =
      detail::prepare_header(tensors, metadata, "safetensors: <memory>");
  std::vector<std::byte> out(8 + prepared.header.size() + prepared.data_size);
  detail::store_le<std::uint64_t>(out.data(), prepared.header.size());
  std::memcpy(out.data() + 8, prepared.header.data(), prepared.header.size());
  std::size_t pos = 8 + prepared.header.size();
  for (std::size_t const i : prepared.order) {
    std::span<std::byte const> const bytes = tensors[i].bytes;
    if (!bytes.empty()) std::memcpy(out.data() + pos, bytes.data(), bytes.size());
    pos += bytes.size();
  }
  return out;
}

/// Writes serialize_safetensors(tensors, metadata) to `path`, streaming the tensor data. The
/// file is written under a temporary name next to `path` and renamed over it at the end, so a
/// failed write never leaves a truncated checkpoint behind. An existing `path` must be a regular
/// file (check_output_path: a directory, symbolic link, FIFO or device is refused); errors carry
/// the errno text.
inline void save_safetensors(std::filesystem::path const& path, std::span<TensorView const> tensors,
                             Metadata const& metadata = {}) {
  std::string const where = detail::concat("safetensors: ", path.string());
  detail::PreparedHeader const prepared = detail::prepare_header(tensors, metadata, where);
  detail::write_file_atomically(path, where, [&](std::FILE* f) {
    std::byte length[8];
    detail::store_le<std::uint64_t>(length, prepared.header.size());
    bool ok =
        std::fwrite(length, 1, 8, f) == 8 &&
        std::fwrite(prepared.header.data(), 1, prepared.header.size(), f) == prepared.header.size();
    for (std::size_t const i : prepared.order) {
      std::span<std::byte const> const bytes = tensors[i].bytes;
      if (!ok) break;
      ok = bytes.empty() || std::fwrite(bytes.data(), 1, bytes.size(), f) == bytes.size();
    }
    return ok;
  });
}

/// Collects named tensors (copying their data) and writes them as one safetensors file.
///
///   SafetensorsWriter w;
///   w.add_f32("router.weight", {E, D}, router);        // [E, D] row-major floats
///   w.add_bf16("experts.0.w1", {F, D}, w1);            // rounded to bfloat16 (nearest even)
///   w.set_metadata("format", "pt");
///   w.save("model.safetensors");
class SafetensorsWriter {
 public:
  /// Adds a tensor from its encoded little-endian bytes (copied).
  SafetensorsWriter& add(std::string name, Dtype dtype, std::vector<std::int64_t> shape,
                         std::span<std::byte const> bytes) {
    return add_owned(std::move(name), dtype, std::move(shape),
                     std::vector<std::byte>(bytes.begin(), bytes.end()));
  }
  /// Adds an F32 tensor.
  SafetensorsWriter& add_f32(std::string name, std::vector<std::int64_t> shape,
                             std::span<float const> values) {
    return add_owned(std::move(name), Dtype::kF32, std::move(shape),
                     from_float(values, Dtype::kF32));
  }
  /// Adds a BF16 tensor, rounding the floats to nearest even.
  SafetensorsWriter& add_bf16(std::string name, std::vector<std::int64_t> shape,
                              std::span<float const> values) {
    return add_owned(std::move(name), Dtype::kBf16, std::move(shape),
                     from_float(values, Dtype::kBf16));
  }
  /// Adds an F16 tensor, rounding the floats to nearest even (overflow becomes inf).
  SafetensorsWriter& add_f16(std::string name, std::vector<std::int64_t> shape,
                             std::span<float const> values) {
    return add_owned(std::move(name), Dtype::kF16, std::move(shape),
                     from_float(values, Dtype::kF16));
  }
  /// Sets a "__metadata__" entry.
  SafetensorsWriter& set_metadata(std::string key, std::string value) {
    metadata_[std::move(key)] = std::move(value);
    return *this;
  }

  std::size_t size() const noexcept { return views_.size(); }

  std::vector<std::byte> serialize() const { return serialize_safetensors(views(), metadata_); }
  void save(std::filesystem::path const& path) const { save_safetensors(path, views(), metadata_); }

 private:
  SafetensorsWriter& add_owned(std::string name, Dtype dtype, std::vector<std::int64_t> shape,
                               std::vector<std::byte> bytes) {
    TensorView view{std::move(name), dtype, std::move(shape), bytes};
    (void)detail::checked_elements(view, "safetensors: SafetensorsWriter");  // fail early
    view.bytes = {};
    views_.push_back(std::move(view));
    data_.push_back(std::move(bytes));
    return *this;
  }

  // Views over data_, rebuilt on use (data_ may have reallocated).
  std::vector<TensorView> views() const {
    std::vector<TensorView> out = views_;
    for (std::size_t i = 0; i < out.size(); ++i) out[i].bytes = data_[i];
    return out;
  }

  std::vector<std::vector<std::byte>> data_;
  std::vector<TensorView> views_;
  Metadata metadata_;
};

}  // namespace moe::io
