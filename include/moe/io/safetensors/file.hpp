// SPDX-License-Identifier: Apache-2.0
// This file is part of moe, a header-only library of sparse Mixture-of-Experts layers.
/// \file
/// SafetensorsFile: a validating, zero-copy reader of one .safetensors file (mmap or buffer).
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "moe/core/error.hpp"
#include "moe/io/detail/json.hpp"
#include "moe/io/detail/mapped_file.hpp"
#include "moe/io/safetensors/dtype.hpp"
#include "moe/io/safetensors/tensor_view.hpp"

namespace moe::io {

/// The "__metadata__" map of a safetensors header (string -> string only).
using Metadata = std::map<std::string, std::string, std::less<>>;

/// Largest header the format allows (the reference implementation's MAX_HEADER_SIZE).
inline constexpr std::uint64_t kMaxHeaderSize = 100'000'000;

/// A safetensors file, validated on construction; tensors are views into its bytes.
///
/// Layout: [u64 little-endian N][N bytes of UTF-8 JSON header][data]; each tensor's
/// "data_offsets" [begin, end) are relative to the start of the data. The constructor enforces
/// every rule of the reference Rust reader (SafeTensors::read_metadata + Metadata::validate),
/// and is stricter in three corner cases (duplicate keys are rejected instead of keeping the
/// last one; shape dimensions must fit int64_t; "-0" is not an integer):
///   1. the file holds at least the 8-byte length N;
///   2. N <= kMaxHeaderSize (100,000,000);
///   3. 8 + N <= file size;
///   4. the header is well-formed UTF-8;
///   5. the header is one JSON object (JSON whitespace around it is allowed; writers pad with
///      spaces), "__metadata__" is absent, null or an object of string values, every other key
///      is a tensor {"dtype": known name, "shape": [non-negative integers], "data_offsets":
///      [begin, end]} (unknown extra keys in a tensor entry are ignored, as by the reference);
///      no key appears twice;
///   6. sorted by data_offsets, the tensors tile the data: the first begins at 0, each begins
///      where the previous one ends, end >= begin; the element count and bit size do not
///      overflow 64 bits, the bit size is whole bytes, and end - begin equals it;
///   7. the last tensor ends exactly at the end of the file.
/// Values are not inspected: NaN and inf pass through as stored.
///
/// Every violation throws moe::Error naming the file (or "<memory>"), the tensor when there is
/// one, what is wrong and what to do. No input makes the reader read outside the file or
/// invoke undefined behaviour; this is fuzzed (tests/fuzz/fuzz_safetensors.cpp).
///
/// Complexity: O(N + T log T) for a header of N bytes and T tensors; the data is not read.
/// Thread-safety: const member functions may be called concurrently. The object is move-only;
/// views stay valid until it is destroyed (moves keep them valid).
class SafetensorsFile {
 public:
  /// Maps the file read-only and validates it.
  explicit SafetensorsFile(std::filesystem::path const& path)
      : file_(path, "safetensors"), bytes_(file_.bytes()), name_(path.string()) {
    parse();
  }

  /// Validates a file image held by the caller, who keeps `buffer` alive (and unchanged) for
  /// as long as this object and its views are used (zero-copy; the fuzzer uses this).
  /// `display_name` appears in error messages.
  explicit SafetensorsFile(std::span<std::byte const> buffer, std::string display_name = "<memory>")
      : bytes_(buffer), name_(std::move(display_name)) {
    parse();
  }

  /// Validates a file image and keeps it (moved in; so a temporary buffer is safe).
  explicit SafetensorsFile(std::vector<std::byte>&& buffer, std::string display_name = "<memory>")
      : owned_(std::move(buffer)), bytes_(owned_), name_(std::move(display_name)) {
    parse();
  }

  /// A checkpoint that no safetensors file backs: `tensors` (unique names, each
  /// bytes.size() == num_elements * dtype size, or a U8 view of quantized rows) point into
  /// memory that `owner` keeps alive, such as a GGUF file's mapping (moe/io/gguf/checkpoint.hpp
  /// presents a GGUF model this way). Throws moe::Error for a duplicate name or a view whose
  /// size does not match its dtype and shape.
  static SafetensorsFile from_views(std::vector<TensorView> tensors, Metadata metadata,
                                    std::shared_ptr<void const> owner, std::string display_name) {
    SafetensorsFile f;
    f.name_ = std::move(display_name);
    f.keep_alive_ = std::move(owner);
    f.metadata_ = std::move(metadata);
    f.tensors_ = std::move(tensors);
    for (std::size_t i = 0; i < f.tensors_.size(); ++i) {
      TensorView const& t = f.tensors_[i];
      std::uint64_t const want =
          (static_cast<std::uint64_t>(t.num_elements()) * dtype_bits(t.dtype) + 7) / 8;
      moe::detail::check(t.bytes.size() == want, "safetensors: ", f.name_, ": tensor ",
                         detail::printable_name(t.name), " views ", t.bytes.size(),
                         " bytes but its dtype and shape need ", want);
      moe::detail::check(f.index_.emplace(t.name, i).second, "safetensors: ", f.name_, ": tensor ",
                         detail::printable_name(t.name), " appears twice");
    }
    return f;
  }

  SafetensorsFile(SafetensorsFile&&) noexcept = default;
  SafetensorsFile& operator=(SafetensorsFile&&) noexcept = default;
  SafetensorsFile(SafetensorsFile const&) = delete;
  SafetensorsFile& operator=(SafetensorsFile const&) = delete;
  ~SafetensorsFile() = default;

  /// The path given to the constructor, or the display name of a buffer.
  std::string const& display_name() const noexcept { return name_; }

  /// All tensors, in the order of their data in the file.
  std::span<TensorView const> tensors() const noexcept { return tensors_; }
  std::size_t size() const noexcept { return tensors_.size(); }

  /// The tensor named `name`, or nullptr.
  TensorView const* find(std::string_view name) const {
    auto const it = index_.find(name);
    return it == index_.end() ? nullptr : &tensors_[it->second];
  }
  bool contains(std::string_view name) const { return find(name) != nullptr; }

  /// The tensor named `name`; throws moe::Error listing some of the names that do exist.
  TensorView const& tensor(std::string_view name) const {
    if (TensorView const* t = find(name)) return *t;
    std::string some;
    std::size_t shown = 0;
    for (auto const& [key, position] : index_) {
      if (shown == 5) {
        some.append(", ...");
        break;
      }
      some.append(shown++ == 0 ? ": " : ", ").append(detail::printable_name(key));
    }
    moe::detail::fail("safetensors: ", name_, ": no tensor named ", detail::printable_name(name),
                      " (the file has ", tensors_.size(), " tensors", some,
                      "); check the name against tensors()");
  }

  /// The "__metadata__" map (empty when the header has none).
  Metadata const& metadata() const noexcept { return metadata_; }

  /// N: the length of the JSON header in bytes (including padding).
  std::uint64_t header_size() const noexcept { return header_size_; }

  /// The whole file image.
  std::span<std::byte const> bytes() const noexcept { return bytes_; }

 private:
  struct Entry {
    std::string name;
    Dtype dtype = Dtype::kF32;
    std::vector<std::int64_t> shape;
    std::uint64_t begin = 0;
    std::uint64_t end = 0;
  };

  static constexpr char kCorrupt[] =
      "the file is corrupt or was not written by a safetensors writer";

  template <class... What>
  [[noreturn]] void fail_header(What const&... what) const {
    moe::detail::fail("safetensors: ", name_, ": ", what..., "; ", kCorrupt);
  }

  template <class... What>
  [[noreturn]] void fail_tensor(std::string const& tensor, char const* hint,
                                What const&... what) const {
    moe::detail::fail("safetensors: ", name_, ": tensor ", detail::printable_name(tensor), ": ",
                      what..., "; ", hint);
  }

  static std::string offsets_string(Entry const& e) {
    return detail::concat("data_offsets [", e.begin, ", ", e.end, "]");
  }

  void parse() {
    std::size_t const total = bytes_.size();
    // Rule 1 (HeaderTooSmall).
    if (total < 8) {
      moe::detail::fail("safetensors: ", name_, ": the file is ", total,
                        " bytes, too short for the 8-byte header length; it is truncated or "
                        "not a safetensors file");
    }
    std::uint64_t const n = detail::load_le<std::uint64_t>(bytes_.data());
    // Rule 2 (HeaderTooLarge).
    if (n > kMaxHeaderSize) {
      moe::detail::fail("safetensors: ", name_, ": the header length field says ", n,
                        " bytes, more than the format's limit of ", kMaxHeaderSize,
                        "; the file is corrupt or not a safetensors file");
    }
    // Rule 3 (InvalidHeaderLength).
    if (n > total - 8) {
      moe::detail::fail("safetensors: ", name_, ": the header length field says ", n,
                        " bytes but only ", total - 8,
                        " bytes follow it; the file is truncated or corrupt");
    }
    header_size_ = n;
    std::string_view const header(reinterpret_cast<char const*>(bytes_.data()) + 8,
                                  static_cast<std::size_t>(n));
    // Rule 4 (InvalidHeader).
    if (std::size_t const bad = detail::find_invalid_utf8(header); bad != std::string_view::npos) {
      static constexpr char kHex[] = "0123456789abcdef";
      auto const byte = static_cast<unsigned char>(header[bad]);
      fail_header("the header is not valid UTF-8 (byte 0x", kHex[byte >> 4], kHex[byte & 0xF],
                  " at byte ", bad, " of the header)");
    }
    // Rule 5 (InvalidHeaderDeserialization).
    std::vector<Entry> entries = parse_header(header);
    // Rule 6 (InvalidOffset, ValidationOverflow, MisalignedSlice, TensorInvalidInfo), in the
    // reference's order: sort by (begin, end), then walk.
    std::stable_sort(entries.begin(), entries.end(), [](Entry const& a, Entry const& b) {
      return a.begin != b.begin ? a.begin < b.begin : a.end < b.end;
    });
    static constexpr char kNoGaps[] =
        "the data section must be fully covered by tensors, without gaps; the file is corrupt";
    std::uint64_t start = 0;
    for (std::size_t i = 0; i < entries.size(); ++i) {
      Entry const& e = entries[i];
      if (e.begin != start) {
        if (i == 0) {
          fail_tensor(e.name, kNoGaps, offsets_string(e), " make the first tensor start at byte ",
                      e.begin, " of the data, not at 0");
        }
        if (e.begin > start) {
          fail_tensor(e.name, kNoGaps, offsets_string(e), " leave a gap after tensor ",
                      detail::printable_name(entries[i - 1].name), ": bytes [", start, ", ",
                      e.begin, ") of the data belong to no tensor");
        }
        fail_tensor(e.name, "tensors must not share bytes; the file is corrupt", offsets_string(e),
                    " overlap tensor ", detail::printable_name(entries[i - 1].name),
                    ", which ends at byte ", start);
      }
      if (e.end < e.begin) {
        fail_tensor(e.name, "data_offsets are [begin, end) with end >= begin; the file is corrupt",
                    offsets_string(e), " end before they begin");
      }
      start = e.end;
      detail::ByteSize const size = detail::byte_size<std::int64_t>(e.dtype, e.shape);
      if (size.status == detail::ByteSize::Status::kOverflow) {
        fail_tensor(e.name, "the shape is corrupt", dtype_name(e.dtype), " ",
                    detail::shape_string(e.shape), " has more elements or bytes than fit 64 bits");
      }
      if (size.status == detail::ByteSize::Status::kMisaligned) {
        fail_tensor(e.name, "sub-byte tensors must fill whole bytes; the shape is corrupt",
                    dtype_name(e.dtype), " ", detail::shape_string(e.shape), " is ", size.elements,
                    " x ", dtype_bits(e.dtype), " bits, not a whole number of bytes");
      }
      if (e.end - e.begin != size.bytes) {
        fail_tensor(e.name, "the file is truncated or corrupt", offsets_string(e), " hold ",
                    e.end - e.begin, " bytes but ", dtype_name(e.dtype), " ",
                    detail::shape_string(e.shape), " needs ", size.bytes);
      }
    }
    // Rule 7 (MetadataIncompleteBuffer).
    std::uint64_t const data_size = total - 8 - n;
    if (start < data_size) {
      moe::detail::fail("safetensors: ", name_, ": the tensors cover ", start,
                        " bytes of data but the file has ", data_size, " bytes after the header (",
                        data_size - start,
                        " trailing bytes belong to no tensor); the file is corrupt or has data "
                        "appended");
    }
    if (start > data_size) {
      moe::detail::fail("safetensors: ", name_, ": the tensors need ", start,
                        " bytes of data but the file has only ", data_size,
                        " bytes after the header; the file is truncated (an interrupted "
                        "download or copy?)");
    }
    // Valid: build the views.
    std::byte const* data = bytes_.data() + 8 + n;
    tensors_.reserve(entries.size());
    index_.clear();
    for (Entry& e : entries) {
      auto const begin = static_cast<std::size_t>(e.begin);
      auto const count = static_cast<std::size_t>(e.end - e.begin);
      index_.emplace(e.name, tensors_.size());
      tensors_.push_back(TensorView{std::move(e.name), e.dtype, std::move(e.shape),
                                    std::span<std::byte const>(data + begin, count)});
    }
  }

  std::vector<Entry> parse_header(std::string_view header) {
    detail::JsonCursor cur(header, detail::concat("safetensors: ", name_), "the header", kCorrupt);
    if (detail::JsonKind const kind = cur.peek(); kind != detail::JsonKind::kObject) {
      fail_header("the header must be a JSON object, but it is ", detail::json_kind_name(kind));
    }
    std::vector<Entry> entries;
    bool seen_metadata = false;
    std::string key;
    bool first = true;
    cur.begin_object();
    while (cur.next_member(key, first)) {
      if (key == "__metadata__") {
        if (seen_metadata) fail_header("the header has two \"__metadata__\" keys");
        seen_metadata = true;
        parse_metadata(cur);
      } else {
        if (!index_.emplace(key, entries.size()).second) {
          fail_tensor(key, "tensor names must be unique; the file is corrupt",
                      "the name appears twice in the header");
        }
        entries.push_back(parse_tensor(cur, key));
      }
    }
    cur.finish();
    return entries;
  }

  void parse_metadata(detail::JsonCursor& cur) {
    detail::JsonKind const kind = cur.peek();
    if (kind == detail::JsonKind::kNull) {  // serde's Option: null means no metadata
      cur.read_null();
      return;
    }
    if (kind != detail::JsonKind::kObject) {
      fail_header("\"__metadata__\" must be an object of strings, but it is ",
                  detail::json_kind_name(kind));
    }
    std::string key;
    bool first = true;
    cur.begin_object();
    while (cur.next_member(key, first)) {
      if (detail::JsonKind const value_kind = cur.peek(); value_kind != detail::JsonKind::kString) {
        fail_header("\"__metadata__\" value of key ", detail::printable_name(key), " is ",
                    detail::json_kind_name(value_kind),
                    ", but the format allows only string values (encode others as JSON text)");
      }
      std::string value = cur.read_string();
      if (!metadata_.emplace(key, std::move(value)).second) {
        fail_header("\"__metadata__\" has the key ", detail::printable_name(key), " twice");
      }
    }
  }

  Entry parse_tensor(detail::JsonCursor& cur, std::string const& name) {
    Entry e;
    e.name = name;
    if (detail::JsonKind const kind = cur.peek(); kind != detail::JsonKind::kObject) {
      fail_tensor(name, kCorrupt,
                  "expected an object with \"dtype\", \"shape\" and \"data_offsets\", found ",
                  detail::json_kind_name(kind));
    }
    bool have_dtype = false, have_shape = false, have_offsets = false;
    std::string field;
    bool first = true;
    cur.begin_object();
    while (cur.next_member(field, first)) {
      if (field == "dtype") {
        if (have_dtype) fail_tensor(name, kCorrupt, "\"dtype\" is given twice");
        have_dtype = true;
        if (detail::JsonKind const kind = cur.peek(); kind != detail::JsonKind::kString) {
          fail_tensor(name, kCorrupt, "\"dtype\" must be a string, found ",
                      detail::json_kind_name(kind));
        }
        std::string const dtype = cur.read_string();
        std::optional<Dtype> const parsed = parse_dtype(dtype);
        if (!parsed) {
          std::string known;
          for (Dtype const d : kAllDtypes)
            known.append(known.empty() ? "" : " ").append(dtype_name(d));
          fail_tensor(name, "the file needs a newer reader, or is corrupt", "unknown dtype ",
                      detail::printable_name(dtype), " (known: ", known, ")");
        }
        e.dtype = *parsed;
      } else if (field == "shape") {
        if (have_shape) fail_tensor(name, kCorrupt, "\"shape\" is given twice");
        have_shape = true;
        e.shape = read_integers(cur, name, "shape");
        for (std::size_t i = 0; i < e.shape.size(); ++i) {
          if (e.shape[i] < 0) {
            fail_tensor(name, "the shape is corrupt", "shape dimension ", i,
                        " is larger than 2^63 - 1");
          }
        }
      } else if (field == "data_offsets") {
        if (have_offsets) fail_tensor(name, kCorrupt, "\"data_offsets\" is given twice");
        have_offsets = true;
        std::vector<std::uint64_t> offsets;
        read_u64_array(cur, name, "data_offsets", offsets);
        if (offsets.size() != 2) {
          fail_tensor(name, kCorrupt,
                      "\"data_offsets\" must hold exactly 2 integers [begin, end], found ",
                      offsets.size());
        }
        e.begin = offsets[0];
        e.end = offsets[1];
      } else {
        cur.skip_value();  // as the reference (serde ignores unknown fields)
      }
    }
    if (!have_dtype) fail_tensor(name, kCorrupt, "\"dtype\" is missing");
    if (!have_shape) fail_tensor(name, kCorrupt, "\"shape\" is missing");
    if (!have_offsets) fail_tensor(name, kCorrupt, "\"data_offsets\" is missing");
    return e;
  }

  // Reads an array of non-negative 64-bit integers; values above INT64_MAX come back as -1 for
  // the caller to reject.
  std::vector<std::int64_t> read_integers(detail::JsonCursor& cur, std::string const& name,
                                          char const* field) {
    std::vector<std::uint64_t> values;
    read_u64_array(cur, name, field, values);
    std::vector<std::int64_t> out(values.size());
    for (std::size_t i = 0; i < values.size(); ++i) {
      out[i] = values[i] > static_cast<std::uint64_t>(INT64_MAX)
                   ? -1
                   : static_cast<std::int64_t>(values[i]);
    }
    return out;
  }

  void read_u64_array(detail::JsonCursor& cur, std::string const& name, char const* field,
                      std::vector<std::uint64_t>& out) {
    if (detail::JsonKind const kind = cur.peek(); kind != detail::JsonKind::kArray) {
      fail_tensor(name, kCorrupt, "\"", field, "\" must be an array of integers, found ",
                  detail::json_kind_name(kind));
    }
    bool first = true;
    cur.begin_array();
    while (cur.next_element(first)) {
      if (detail::JsonKind const kind = cur.peek(); kind != detail::JsonKind::kNumber) {
        fail_tensor(name, kCorrupt, "\"", field, "\" must hold integers, found ",
                    detail::json_kind_name(kind));
      }
      detail::JsonNumber const number = cur.read_number();
      if (!number.is_u64) {
        fail_tensor(name, kCorrupt, "\"", field, "\" holds ", detail::printable_name(number.text),
                    ", which is not an integer in [0, 2^64)");
      }
      out.push_back(number.value);
    }
  }

  SafetensorsFile() = default;  // from_views()

  detail::MappedFile file_;
  std::shared_ptr<void const> keep_alive_;  // from_views(): what owns the viewed memory
  std::vector<std::byte> owned_;            // the image when constructed from a moved-in vector
  std::span<std::byte const> bytes_;
  std::string name_;
  std::vector<TensorView> tensors_;
  std::map<std::string, std::size_t, std::less<>> index_;
  Metadata metadata_;
  std::uint64_t header_size_ = 0;
};

}  // namespace moe::io
