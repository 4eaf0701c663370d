// SPDX-License-Identifier: Apache-2.0
// This file is part of moe, a header-only library of sparse Mixture-of-Experts layers.
/// \file
/// GgufFile: a validating, zero-copy reader of one GGUF file (llama.cpp's format), mmap'd or
/// from a buffer: metadata with typed getters, tensor infos and views of their bytes.
#pragma once

#include <algorithm>
#include <array>
#include <bit>
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <limits>
#include <map>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "moe/core/error.hpp"
#include "moe/io/detail/json.hpp"
#include "moe/io/detail/mapped_file.hpp"
#include "moe/io/gguf/value.hpp"
#include "moe/quant/ggml_type.hpp"

namespace moe::io {

/// "GGUF" as the first four bytes of the file.
inline constexpr char kGgufMagic[4] = {'G', 'G', 'U', 'F'};
/// The format version the writer writes; the reader reads 2 and 3 (same layout).
inline constexpr std::uint32_t kGgufVersion = 3;
/// The data alignment when "general.alignment" is absent.
inline constexpr std::uint32_t kGgufDefaultAlignment = 32;
/// ggml's GGML_MAX_DIMS: a tensor has 1 to 4 dimensions.
inline constexpr std::uint32_t kGgufMaxDims = 4;
/// The longest tensor name the format allows (gguf.md: "at most 64 bytes"). ggml itself keeps
/// names in a 64-byte buffer with the NUL, so llama.cpp reads names of at most 63 bytes, and
/// GgufWriter writes no longer ones.
inline constexpr std::size_t kGgufMaxTensorName = 64;
/// Arrays nest at most this deep (an array of arrays is depth 2); deeper files are refused so
/// that no input can exhaust the stack.
inline constexpr unsigned kGgufMaxArrayDepth = 16;

/// One tensor of a GGUF file: its info record and a view of its bytes in the file.
///
/// Dimensions are in ggml order: ne[0] is the innermost, contiguous one (the length of a
/// row), ne[1] the number of rows, and so on; dimensions past n_dims are 1. A PyTorch weight of
/// shape [out, in] is stored with ne = {in, out}. shape() gives the row-major order
/// [ne[n_dims-1], ..., ne[0]] that safetensors and moe's views use.
struct GgufTensorInfo {
  std::string name;
  std::uint32_t n_dims = 1;                       ///< 1 to 4
  std::array<std::int64_t, 4> ne = {1, 1, 1, 1};  ///< ggml order, each >= 0
  quant::GgmlType type = quant::GgmlType::kF32;
  std::uint64_t offset = 0;         ///< from the start of the data section; aligned
  std::span<std::byte const> data;  ///< the bytes, in the file (any alignment the file has)

  /// The first n_dims entries of ne (ggml order).
  std::span<std::int64_t const> dims() const noexcept { return {ne.data(), n_dims}; }
  /// Row-major shape: [ne[n_dims-1], ..., ne[1], ne[0]].
  std::vector<std::int64_t> shape() const {
    return std::vector<std::int64_t>(ne.rbegin() + (kGgufMaxDims - n_dims), ne.rend());
  }
  /// ne[0] * ne[1] * ne[2] * ne[3] (< 2^63 in a validated file).
  std::int64_t num_elements() const noexcept { return ne[0] * ne[1] * ne[2] * ne[3]; }
  /// The number of rows: ne[1] * ne[2] * ne[3].
  std::int64_t num_rows() const noexcept { return ne[1] * ne[2] * ne[3]; }
  /// The bytes of one row of ne[0] elements (ne[0] / block elements * block bytes).
  std::uint64_t row_bytes() const noexcept {
    quant::GgmlTypeInfo const& t = quant::ggml_type_info(type);
    return static_cast<std::uint64_t>(ne[0]) / t.block_elements * t.block_bytes;
  }
};

/// One metadata entry: the key (a view into the file) and its value.
struct GgufKeyValue {
  std::string_view key;
  GgufValue value;
};

/// A GGUF file, validated on construction; metadata values and tensor data are views into its
/// bytes (nothing is copied but the tensor names).
///
/// Layout (little-endian): "GGUF", u32 version, u64 tensor count, u64 metadata count, the
/// metadata (string key, u32 value type, value), the tensor infos (string name, u32 n_dims,
/// n_dims x i64 ne, u32 ggml type, u64 offset), padding to the alignment, the data section.
/// A string is a u64 byte count and the bytes; an array a u32 element type, a u64 count and
/// the elements. The constructor enforces:
///   1. the magic "GGUF";
///   2. version 2 or 3 (version 1 is refused with a hint to reconvert; a big-endian file,
///      whose version reads as 0x0N000000, is refused with a hint to convert it);
///   3. the tensor and metadata counts fit the file (each entry takes at least 33 and 14 bytes)
///      before anything is allocated;
///   4. every key is non-empty, UTF-8 and unique; every value type is known, bools are 0 or
///      1, strings and arrays lie within the file, arrays nest at most kGgufMaxArrayDepth deep;
///   5. "general.alignment", when present, is a uint32 power of two (default 32);
///   6. every tensor name is 1 to 64 bytes of UTF-8 and unique; n_dims is 1..4; each ne >= 0;
///      the element count is below 2^63; the type is a known ggml type; ne[0] is a multiple of
///      the type's block; the byte size fits 64 bits; the offset is a multiple of the alignment;
///   7. the data section starts at the end of the tensor infos rounded up to the alignment, and
///      every tensor's bytes lie inside the file; sorted by offset, no two tensors overlap.
/// Padding between tensors and after the last one is not inspected. Values are not scanned:
/// NaN and inf in float metadata or tensor data pass through as stored; string values are not
/// checked for UTF-8.
///
/// Every violation throws moe::Error naming the file (or "<memory>"), the key or tensor when
/// there is one, what is wrong and what to do; no input makes the reader read outside the file
/// or invoke undefined behaviour (fuzzed: tests/fuzz/fuzz_gguf.cpp).
///
/// Complexity: O(H + T log T) for a header of H bytes and T tensors; tensor data is not read.
/// Thread-safety: const member functions may be called concurrently. Move-only; views stay
/// valid until the object is destroyed (moves keep them valid).
class GgufFile {
 public:
  /// Maps the file read-only and validates it.
  explicit GgufFile(std::filesystem::path const& path)
      : file_(path, "gguf", "the path of a .gguf file"),
        bytes_(file_.bytes()),
        name_(path.string()) {
    parse();
  }

  /// Validates a file image the caller keeps alive (and unchanged) while this object is used.
  explicit GgufFile(std::span<std::byte const> buffer, std::string display_name = "<memory>")
      : bytes_(buffer), name_(std::move(display_name)) {
    parse();
  }

  /// Validates a file image and keeps it.
  explicit GgufFile(std::vector<std::byte>&& buffer, std::string display_name = "<memory>")
      : owned_(std::move(buffer)), bytes_(owned_), name_(std::move(display_name)) {
    parse();
  }

  GgufFile(GgufFile&&) noexcept = default;
  GgufFile& operator=(GgufFile&&) noexcept = default;
  GgufFile(GgufFile const&) = delete;
  GgufFile& operator=(GgufFile const&) = delete;
  ~GgufFile() = default;

  /// The path given to the constructor, or the display name of a buffer.
  std::string const& display_name() const noexcept { return name_; }
  /// 2 or 3.
  std::uint32_t version() const noexcept { return version_; }
  /// "general.alignment", or 32.
  std::uint32_t alignment() const noexcept { return alignment_; }
  /// Where the data section starts in the file (tensor offsets count from here).
  std::uint64_t data_offset() const noexcept { return data_offset_; }
  /// The whole file image.
  std::span<std::byte const> bytes() const noexcept { return bytes_; }

  // --- metadata ---------------------------------------------------------------------------

  /// Every metadata entry, in file order.
  std::span<GgufKeyValue const> metadata() const noexcept { return kvs_; }
  /// The value of `key`, or nullptr.
  GgufValue const* find(std::string_view key) const {
    auto const it = key_index_.find(key);
    return it == key_index_.end() ? nullptr : &kvs_[it->second].value;
  }
  bool has(std::string_view key) const { return find(key) != nullptr; }
  /// The value of `key`; throws moe::Error when the file has no such key.
  GgufValue const& value(std::string_view key) const {
    if (GgufValue const* v = find(key)) return *v;
    moe::detail::fail("gguf: ", name_, ": no metadata key ", detail::printable_name(key), " (the ",
                      "file has ", kvs_.size(), " keys", some_keys(),
                      "); check the key, or use find() for an optional one");
  }

  /// An integer value >= 0 of any integer type.
  std::uint64_t integer(std::string_view key) const {
    GgufValue const& v = value(key);
    if (std::optional<std::uint64_t> const x = v.to_uint64()) return *x;
    wrong_type(key, v, "a non-negative integer");
  }
  /// An integer value of any integer type within int64's range.
  std::int64_t signed_integer(std::string_view key) const {
    GgufValue const& v = value(key);
    if (std::optional<std::int64_t> const x = v.to_int64()) return *x;
    wrong_type(key, v, "an integer in int64's range");
  }
  /// A number: float32, float64 or any integer.
  double number(std::string_view key) const {
    GgufValue const& v = value(key);
    if (std::optional<double> const x = v.to_double()) return *x;
    wrong_type(key, v, "a number (float32, float64 or an integer)");
  }
  /// A string value (a view into the file).
  std::string_view string(std::string_view key) const {
    GgufValue const& v = value(key);
    if (std::optional<std::string_view> const x = v.to_string()) return *x;
    wrong_type(key, v, "a string");
  }
  /// A bool value.
  bool boolean(std::string_view key) const {
    GgufValue const& v = value(key);
    if (std::optional<bool> const x = v.to_bool()) return *x;
    wrong_type(key, v, "a bool");
  }
  /// integer(key), or `fallback` when the key is absent (a present key of another type throws).
  std::uint64_t integer_or(std::string_view key, std::uint64_t fallback) const {
    return has(key) ? integer(key) : fallback;
  }
  /// number(key), or `fallback` when the key is absent.
  double number_or(std::string_view key, double fallback) const {
    return has(key) ? number(key) : fallback;
  }
  /// string(key), or `fallback` when the key is absent.
  std::string_view string_or(std::string_view key, std::string_view fallback) const {
    return has(key) ? string(key) : fallback;
  }
  /// boolean(key), or `fallback` when the key is absent.
  bool boolean_or(std::string_view key, bool fallback) const {
    return has(key) ? boolean(key) : fallback;
  }

  /// An array of strings, as views into the file: O(1), no copies (tokenizer.ggml.tokens).
  std::span<std::string_view const> strings(std::string_view key) const {
    GgufValue const& v = value(key);
    if (!v.is_array() || v.element_type() != GgufValueType::kString) {
      wrong_type(key, v, "an array of strings");
    }
    return v.strings();
  }
  /// An array of integers of any integer type, as int64 (a uint64 above 2^63 - 1 throws).
  std::vector<std::int64_t> integers(std::string_view key) const {
    GgufValue const& v = value(key);
    if (!v.is_array() || !is_gguf_integer(v.element_type())) {
      wrong_type(key, v, "an array of integers");
    }
    std::vector<std::int64_t> out(v.size());
    for (std::size_t i = 0; i < out.size(); ++i) {
      std::optional<std::int64_t> const x = v[i].to_int64();
      if (!x) {
        moe::detail::fail("gguf: ", name_, ": metadata key ", detail::printable_name(key),
                          ": element ", i, " is ", *v[i].to_uint64(),
                          ", above int64's range; read it with value(key)[i].to_uint64()");
      }
      out[i] = *x;
    }
    return out;
  }
  /// An array of numbers (float32, float64 or integers), as float (float64 and large integers
  /// round to the nearest float; values are not scanned for NaN or inf).
  std::vector<float> floats(std::string_view key) const {
    GgufValue const& v = value(key);
    GgufValueType const e = v.element_type();
    if (!v.is_array() ||
        !(e == GgufValueType::kFloat32 || e == GgufValueType::kFloat64 || is_gguf_integer(e))) {
      wrong_type(key, v, "an array of numbers");
    }
    std::vector<float> out(v.size());
    if (e == GgufValueType::kFloat32) {
      std::span<std::byte const> const raw = v.raw();
      for (std::size_t i = 0; i < out.size(); ++i) {
        out[i] = std::bit_cast<float>(detail::gguf_load<std::uint32_t>(raw.data() + 4 * i));
      }
    } else {
      for (std::size_t i = 0; i < out.size(); ++i) out[i] = static_cast<float>(*v[i].to_double());
    }
    return out;
  }

  // --- tensors ----------------------------------------------------------------------------

  /// All tensors, in the order of their info records.
  std::span<GgufTensorInfo const> tensors() const noexcept { return tensors_; }
  std::size_t size() const noexcept { return tensors_.size(); }
  /// The tensor named `name`, or nullptr.
  GgufTensorInfo const* find_tensor(std::string_view name) const {
    auto const it = tensor_index_.find(name);
    return it == tensor_index_.end() ? nullptr : &tensors_[it->second];
  }
  bool has_tensor(std::string_view name) const { return find_tensor(name) != nullptr; }
  /// The tensor named `name`; throws moe::Error listing some of the names that do exist.
  GgufTensorInfo const& tensor(std::string_view name) const {
    if (GgufTensorInfo const* t = find_tensor(name)) return *t;
    std::string some;
    for (std::size_t i = 0; i < tensors_.size() && i < 5; ++i) {
      some.append(i == 0 ? ": " : ", ").append(detail::printable_name(tensors_[i].name));
    }
    if (tensors_.size() > 5) some.append(", ...");
    moe::detail::fail("gguf: ", name_, ": no tensor named ", detail::printable_name(name),
                      " (the file has ", tensors_.size(), " tensors", some,
                      "); check the name against tensors()");
  }

 private:
  static constexpr char kCorrupt[] = "the file is corrupt or was not written by a GGUF writer";
  static constexpr char kTruncated[] =
      "the file is truncated (an interrupted download or copy?) or corrupt";
  // The smallest metadata entry: key length 8 + 1 byte, type 4, a uint8 value 1.
  static constexpr std::uint64_t kMinEntryBytes = 14;
  // The smallest tensor info: name length 8 + 1 byte, n_dims 4, one ne 8, type 4, offset 8.
  static constexpr std::uint64_t kMinTensorInfoBytes = 33;

  template <class... What>
  [[noreturn]] void fail_file(What const&... what) const {
    moe::detail::fail("gguf: ", name_, ": ", what...);
  }

  template <class... What>
  [[noreturn]] void fail_key(std::string_view key, What const&... what) const {
    moe::detail::fail("gguf: ", name_, ": metadata key ", detail::printable_name(key), ": ",
                      what...);
  }

  template <class... What>
  [[noreturn]] void fail_tensor(std::string_view tensor, What const&... what) const {
    moe::detail::fail("gguf: ", name_, ": tensor ", detail::printable_name(tensor), ": ", what...);
  }

  [[noreturn]] void wrong_type(std::string_view key, GgufValue const& v,
                               char const* expected) const {
    std::string actual = v.describe();
    if (is_gguf_integer(v.type()) || v.type() == GgufValueType::kFloat32 ||
        v.type() == GgufValueType::kFloat64) {
      if (std::optional<std::int64_t> const s = v.to_int64()) {
        actual += detail::concat(" ", *s);
      } else if (std::optional<std::uint64_t> const u = v.to_uint64()) {
        actual += detail::concat(" ", *u);
      } else {
        actual += detail::concat(" ", *v.to_double());
      }
    }
    fail_key(key, "expected ", expected, ", but the value is ", actual,
             "; the file does not follow the convention for this key, or the key means "
             "something else here");
  }

  std::string some_keys() const {
    std::string some;
    for (std::size_t i = 0; i < kvs_.size() && i < 5; ++i) {
      some.append(i == 0 ? ": " : ", ").append(detail::printable_name(kvs_[i].key));
    }
    if (kvs_.size() > 5) some.append(", ...");
    return some;
  }

  // --- the byte cursor ---------------------------------------------------------------------

  std::uint64_t left() const noexcept { return bytes_.size() - pos_; }

  // Throws unless `n` more bytes exist; `what()` names what is being read (only built on
  // failure).
  template <class What>
  void need(std::uint64_t n, What const& what) const {
    if (n > left()) {
      fail_file("reading ", what(), " at byte ", pos_, " needs ", n, " bytes but the file has ",
                left(), " left; ", kTruncated);
    }
  }

  template <class U, class What>
  U read(What const& what) {
    need(sizeof(U), what);
    U const v = detail::gguf_load<U>(bytes_.data() + pos_);
    pos_ += sizeof(U);
    return v;
  }

  template <class What>
  std::string_view read_string(What const& what) {
    std::uint64_t const n = read<std::uint64_t>(what);
    if (n > left()) {
      fail_file(what(), " at byte ", pos_ - 8, " says it is ", n,
                " bytes long but the file has only ", left(), " bytes left; ", kTruncated);
    }
    std::string_view const s(reinterpret_cast<char const*>(bytes_.data() + pos_),
                             static_cast<std::size_t>(n));
    pos_ += n;
    return s;
  }

  // --- parsing -----------------------------------------------------------------------------

  void parse() {
    pos_ = 0;
    auto const magic = [] { return std::string("the magic \"GGUF\""); };
    need(4, magic);
    for (int i = 0; i < 4; ++i) {
      if (static_cast<char>(bytes_[static_cast<std::size_t>(i)]) != kGgufMagic[i]) {
        std::string shown;
        for (int k = 0; k < 4; ++k) {
          auto const c = std::to_integer<unsigned char>(bytes_[static_cast<std::size_t>(k)]);
          shown += (c >= 0x20 && c < 0x7F) ? static_cast<char>(c) : '?';
        }
        fail_file("the file starts with '", shown,
                  "', not \"GGUF\"; it is not a GGUF file (a safetensors checkpoint is read "
                  "with moe::io::SafetensorsFile)");
      }
    }
    pos_ = 4;
    version_ = read<std::uint32_t>([] { return std::string("the version"); });
    check_version();
    std::uint64_t const n_tensors =
        read<std::uint64_t>([] { return std::string("the tensor count"); });
    std::uint64_t const n_kv =
        read<std::uint64_t>([] { return std::string("the metadata count"); });
    // Rule 3: bound the counts by the bytes left before allocating anything.
    if (n_kv > left() / kMinEntryBytes) {
      fail_file("the header says ", n_kv, " metadata entries but the ", left(),
                " bytes after it hold at most ", left() / kMinEntryBytes, " (", kMinEntryBytes,
                " bytes each at least); ", kTruncated);
    }
    std::uint64_t const rest = left() - n_kv * kMinEntryBytes;
    if (n_tensors > rest / kMinTensorInfoBytes) {
      fail_file("the header says ", n_tensors, " tensors and ", n_kv, " metadata entries, but the ",
                left(), " bytes after it hold at most ", rest / kMinTensorInfoBytes,
                " tensor infos besides the metadata (", kMinTensorInfoBytes,
                " bytes each at least); ", kTruncated);
    }
    parse_metadata(static_cast<std::size_t>(n_kv));
    parse_alignment();
    parse_tensor_infos(static_cast<std::size_t>(n_tensors));
    place_tensors();
  }

  void check_version() const {
    std::uint32_t const v = version_;
    if (v == 2 || v == 3) return;
    if (v != 0 && (v & 0xFFFFu) == 0) {
      std::uint32_t const swapped = ((v >> 24) & 0xFFu) | ((v >> 8) & 0xFF00u);
      fail_file("the version field reads ", v, " (0x", to_hex(v), "): this is a big-endian GGUF ",
                "file (version ", swapped,
                " in big-endian byte order); moe reads little-endian GGUF only, convert it with "
                "gguf-py's gguf_convert_endian.py (llama.cpp) first");
    }
    if (v == 1) {
      fail_file(
          "GGUF version 1 (the 2023 pre-release layout with 32-bit counts) is not "
          "supported; reconvert the model with a current llama.cpp (convert_hf_to_gguf.py), "
          "which writes version 3");
    }
    if (v == 0) fail_file("the version field is 0, which no GGUF writer produces; ", kCorrupt);
    fail_file("GGUF version ", v, " is newer than this reader, which reads versions 2 and 3; ",
              "update moe, or re-save the file with a llama.cpp that writes version 3");
  }

  static std::string to_hex(std::uint32_t v) {
    static constexpr char kHex[] = "0123456789abcdef";
    std::string out(8, '0');
    for (int i = 7; i >= 0; --i, v >>= 4) out[static_cast<std::size_t>(i)] = kHex[v & 0xF];
    return out;
  }

  void parse_metadata(std::size_t n_kv) {
    kvs_.clear();
    key_index_.clear();
    nodes_.clear();
    strings_.clear();
    std::vector<std::pair<std::string_view, std::size_t>> entries;  // key, node
    entries.reserve(n_kv);
    for (std::size_t i = 0; i < n_kv; ++i) {
      std::string_view const key =
          read_string([&] { return detail::concat("the key of metadata entry ", i); });
      if (key.empty()) {
        fail_file("metadata entry ", i, " has an empty key; ", kCorrupt);
      }
      if (std::size_t const bad = detail::find_invalid_utf8(key); bad != std::string_view::npos) {
        fail_file("the key of metadata entry ", i, " (", detail::printable_name(key),
                  ") is not valid UTF-8 (at byte ", bad, " of the key); ", kCorrupt);
      }
      if (!key_index_.emplace(key, i).second) {
        fail_key(key, "the key appears twice (entries ", key_index_.find(key)->second, " and ", i,
                 "); keys must be unique, ", kCorrupt);
      }
      std::uint32_t const type_id = read<std::uint32_t>(
          [&] { return detail::concat("the type of metadata key ", detail::printable_name(key)); });
      if (!is_gguf_value_type(type_id)) {
        fail_key(key, "unknown value type ", type_id, " (GGUF types are 0..12); ", kCorrupt);
      }
      std::size_t const slot = nodes_.size();
      nodes_.emplace_back();
      parse_value(slot, static_cast<GgufValueType>(type_id), key, 1);
      entries.emplace_back(key, slot);
    }
    kvs_.reserve(entries.size());
    for (auto const& [key, slot] : entries) {
      kvs_.push_back({key, GgufValue(nodes_[slot], nodes_.data(), strings_.data())});
    }
  }

  // Reads a value of `type` into nodes_[slot]; `depth` counts the arrays it is inside plus 1.
  void parse_value(std::size_t slot, GgufValueType type, std::string_view key, unsigned depth) {
    auto const what = [&] {
      return detail::concat("the value of metadata key ", detail::printable_name(key));
    };
    detail::GgufNode node;
    node.type = node.element_type = type;
    node.count = 1;
    if (type == GgufValueType::kString) {
      std::string_view const s = read_string(what);
      node.data = reinterpret_cast<std::byte const*>(s.data());
      node.count = s.size();
    } else if (type == GgufValueType::kArray) {
      if (depth > kGgufMaxArrayDepth) {
        fail_key(key, "arrays are nested more than ", kGgufMaxArrayDepth, " deep; ", kCorrupt);
      }
      std::uint32_t const element_id = read<std::uint32_t>(what);
      if (!is_gguf_value_type(element_id)) {
        fail_key(key, "an array has the unknown element type ", element_id,
                 " (GGUF types are 0..12); ", kCorrupt);
      }
      auto const element = static_cast<GgufValueType>(element_id);
      std::uint64_t const n = read<std::uint64_t>(what);
      node.element_type = element;
      node.count = n;
      std::size_t const width = gguf_value_type_size(element);
      // The least each element takes: its bytes, a string's length, an array's type + count.
      std::uint64_t const least = width != 0 ? width : (element == GgufValueType::kString ? 8 : 12);
      if (n > left() / least) {
        fail_key(key, "an array of ", n, " ", gguf_value_type_name(element), " at byte ", pos_ - 12,
                 " needs at least ", least, " bytes an element, but the file has only ", left(),
                 " bytes left; ", kTruncated);
      }
      auto const count = static_cast<std::size_t>(n);
      if (width != 0) {
        node.data = bytes_.data() + pos_;
        if (element == GgufValueType::kBool) {
          for (std::size_t i = 0; i < count; ++i) check_bool(node.data[i], key, i);
        }
        pos_ += n * width;
      } else if (element == GgufValueType::kString) {
        node.first = strings_.size();
        strings_.reserve(strings_.size() + count);
        for (std::size_t i = 0; i < count; ++i) {
          strings_.push_back(read_string([&] {
            return detail::concat("string ", i, " of metadata key ", detail::printable_name(key));
          }));
        }
      } else {
        node.first = nodes_.size();
        nodes_.resize(nodes_.size() + count);
        for (std::size_t i = 0; i < count; ++i) {
          parse_value(node.first + i, GgufValueType::kArray, key, depth + 1);
        }
      }
    } else {
      std::size_t const width = gguf_value_type_size(type);
      need(width, what);
      node.data = bytes_.data() + pos_;
      if (type == GgufValueType::kBool) check_bool(node.data[0], key, std::nullopt);
      pos_ += width;
    }
    nodes_[slot] = node;
  }

  void check_bool(std::byte b, std::string_view key, std::optional<std::size_t> element) const {
    unsigned const v = std::to_integer<unsigned>(b);
    if (v > 1) {
      if (element) {
        fail_key(key, "bool element ", *element, " is the byte ", v, ", not 0 or 1; ", kCorrupt);
      }
      fail_key(key, "the bool value is the byte ", v, ", not 0 or 1; ", kCorrupt);
    }
  }

  void parse_alignment() {
    alignment_ = kGgufDefaultAlignment;
    GgufValue const* v = find("general.alignment");
    if (v == nullptr) return;
    if (v->type() != GgufValueType::kUint32) {
      fail_key("general.alignment", "must be a uint32 (as ggml requires), but it is a ",
               v->describe(), "; ", kCorrupt);
    }
    auto const a = static_cast<std::uint32_t>(*v->to_uint64());
    if (a == 0 || (a & (a - 1)) != 0) {
      fail_key("general.alignment", "is ", a, ", not a power of two; ", kCorrupt);
    }
    alignment_ = a;
  }

  void parse_tensor_infos(std::size_t n_tensors) {
    tensors_.clear();
    tensor_index_.clear();
    tensors_.reserve(n_tensors);
    sizes_.clear();
    sizes_.reserve(n_tensors);
    for (std::size_t i = 0; i < n_tensors; ++i) {
      std::string_view const name =
          read_string([&] { return detail::concat("the name of tensor info ", i); });
      if (name.empty()) fail_file("tensor info ", i, " has an empty name; ", kCorrupt);
      if (name.size() > kGgufMaxTensorName) {
        fail_tensor(name, "the name is ", name.size(), " bytes, more than the format's ",
                    kGgufMaxTensorName, "; ", kCorrupt);
      }
      if (std::size_t const bad = detail::find_invalid_utf8(name); bad != std::string_view::npos) {
        fail_tensor(name, "the name is not valid UTF-8 (at byte ", bad, "); ", kCorrupt);
      }
      if (auto const it = tensor_index_.find(name); it != tensor_index_.end()) {
        fail_tensor(name, "the name appears twice (tensor infos ", it->second, " and ", i,
                    "); tensor names must be unique, ", kCorrupt);
      }
      auto const what = [&] {
        return detail::concat("the info of tensor ", detail::printable_name(name));
      };
      GgufTensorInfo t;
      t.name = std::string(name);
      t.n_dims = read<std::uint32_t>(what);
      if (t.n_dims < 1 || t.n_dims > kGgufMaxDims) {
        fail_tensor(name, "n_dims is ", t.n_dims, ", not 1 to ", kGgufMaxDims, "; ", kCorrupt);
      }
      // The product of the non-zero dimensions must stay below 2^63 (ggml's bound), even when
      // another dimension is 0: then every partial product num_elements() forms fits int64.
      std::uint64_t product = 1;
      bool overflow = false;
      for (std::uint32_t d = 0; d < t.n_dims; ++d) {
        auto const ne = static_cast<std::int64_t>(read<std::uint64_t>(what));
        if (ne < 0) fail_tensor(name, "ne[", d, "] is ", ne, ", negative; ", kCorrupt);
        t.ne[d] = ne;
        auto const u = static_cast<std::uint64_t>(ne);
        if (u == 0) continue;
        if (product > static_cast<std::uint64_t>(INT64_MAX) / u) overflow = true;
        product = overflow ? 1 : product * u;
      }
      if (overflow) {
        fail_tensor(name, "ne ", dims_string(t), " has 2^63 or more elements; ", kCorrupt);
      }
      bool const empty = std::find(t.ne.begin(), t.ne.end(), 0) != t.ne.end();
      std::uint64_t const elements = empty ? 0 : product;
      std::uint32_t const type_id = read<std::uint32_t>(what);
      quant::GgmlTypeInfo const* type = quant::ggml_type_info(type_id);
      if (type == nullptr) {
        fail_tensor(name, "unknown ggml type ", type_id,
                    " (known: 0..3, 6..30, 34, 35, 39..42; 4, 5, 31..33 and 36..38 were removed "
                    "from ggml); the file needs a newer reader, or is corrupt");
      }
      t.type = type->type;
      if (t.ne[0] % type->block_elements != 0) {
        fail_tensor(name, "ne[0] = ", t.ne[0], " is not a multiple of ", type->name, "'s block of ",
                    type->block_elements, " elements (rows are whole blocks); ", kCorrupt);
      }
      std::uint64_t const blocks = elements / type->block_elements;
      if (blocks > UINT64_MAX / type->block_bytes ||
          blocks * type->block_bytes > std::numeric_limits<std::size_t>::max()) {
        fail_tensor(name, type->name, " ", dims_string(t), " takes more bytes than fit 64 bits; ",
                    kCorrupt);
      }
      t.offset = read<std::uint64_t>(what);
      if (t.offset % alignment_ != 0) {
        fail_tensor(name, "its data offset ", t.offset, " is not a multiple of the alignment ",
                    alignment_, "; ", kCorrupt);
      }
      sizes_.push_back(blocks * type->block_bytes);  // place_tensors() makes the span
      tensor_index_.emplace(t.name, i);
      tensors_.push_back(std::move(t));
    }
  }

  static std::string dims_string(GgufTensorInfo const& t) {
    std::string out = "[";
    for (std::uint32_t d = 0; d < t.n_dims; ++d) {
      out += (d == 0 ? "" : ", ") + std::to_string(t.ne[d]);
    }
    return out + "] (ggml order)";
  }

  void place_tensors() {
    std::uint64_t const header_end = pos_;
    data_offset_ = header_end;
    std::vector<std::uint64_t> const sizes = std::move(sizes_);
    sizes_ = {};
    if (tensors_.empty()) return;
    std::uint64_t const aligned = (header_end + alignment_ - 1) / alignment_ * alignment_;
    if (aligned > bytes_.size()) {
      fail_file("the tensor infos end at byte ", header_end,
                " and the data section would start at ", aligned, " (aligned to ", alignment_,
                "), past the end of the file (", bytes_.size(), " bytes); ", kTruncated);
    }
    data_offset_ = aligned;
    std::uint64_t const data_size = bytes_.size() - aligned;
    for (std::size_t i = 0; i < tensors_.size(); ++i) {
      GgufTensorInfo& t = tensors_[i];
      std::uint64_t const n = sizes[i];
      if (t.offset > data_size || n > data_size - t.offset) {
        fail_tensor(t.name, "its data [", t.offset, ", ", t.offset, " + ", n,
                    ") of the data section runs past the end of the file (the data section has ",
                    data_size, " bytes); ", kTruncated);
      }
      t.data =
          bytes_.subspan(static_cast<std::size_t>(aligned + t.offset), static_cast<std::size_t>(n));
    }
    // Rule 7: sorted by offset (then size), no tensor may reach into the next one.
    std::vector<std::size_t> order(tensors_.size());
    for (std::size_t i = 0; i < order.size(); ++i) order[i] = i;
    std::sort(order.begin(), order.end(), [&](std::size_t a, std::size_t b) {
      GgufTensorInfo const& ta = tensors_[a];
      GgufTensorInfo const& tb = tensors_[b];
      if (ta.offset != tb.offset) return ta.offset < tb.offset;
      if (ta.data.size() != tb.data.size()) return ta.data.size() < tb.data.size();
      return a < b;
    });
    for (std::size_t k = 1; k < order.size(); ++k) {
      GgufTensorInfo const& prev = tensors_[order[k - 1]];
      GgufTensorInfo const& next = tensors_[order[k]];
      if (prev.offset + prev.data.size() > next.offset) {
        fail_tensor(next.name, "its data at offset ", next.offset, " overlaps tensor ",
                    detail::printable_name(prev.name), " at [", prev.offset, ", ",
                    prev.offset + prev.data.size(), "); tensors must not share bytes, ", kCorrupt);
      }
    }
  }

  detail::MappedFile file_;
  std::vector<std::byte> owned_;
  std::span<std::byte const> bytes_;
  std::string name_;
  std::uint64_t pos_ = 0;
  std::uint32_t version_ = 0;
  std::uint32_t alignment_ = kGgufDefaultAlignment;
  std::uint64_t data_offset_ = 0;
  std::vector<detail::GgufNode> nodes_;
  std::vector<std::string_view> strings_;
  std::vector<GgufKeyValue> kvs_;
  std::map<std::string_view, std::size_t, std::less<>> key_index_;
  std::vector<GgufTensorInfo> tensors_;
  std::map<std::string, std::size_t, std::less<>> tensor_index_;
  std::vector<std::uint64_t> sizes_;  // tensor byte sizes, while parsing
};

}  // namespace moe::io
