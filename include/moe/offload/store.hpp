// SPDX-License-Identifier: Apache-2.0
// This file is part of moe, a header-only library of sparse Mixture-of-Experts layers.
/// \file
/// The expert store file: every routed expert of a model as one 4 KiB-aligned record, already
/// packed in the kernels' layout (experts::ExpertBank::packed_record), so that a miss of the
/// expert cache is one read straight into the slot the kernels then multiply from. Written layer
/// by layer by ExpertStoreWriter, read by ExpertStore (pread; O_DIRECT where the file system
/// allows it; optionally throttled to emulate a drive of a given bandwidth and latency).
/// POSIX only.
///
/// File layout (version 1, little-endian):
///
/// | offset | size | field |
/// | --- | --- | --- |
/// | 0 | 8 | magic `MOEXPERT` |
/// | 8 | 4 | u32 version = 1 |
/// | 12 | 4 | u32 panel width NP the fp32/bf16 parts were packed for (kernels::panel_width()) |
/// | 16 | 4 | u32 quantized panel columns (kernels::kQuantPanelCols) |
/// | 20 | 4 | u32 gated (1: GLU experts, gate and up; 0: MLP experts) |
/// | 24 | 4 | u32 num_layers L (MoE layers, 1..65536) |
/// | 28 | 4 | u32 num_experts E (1..65536; L E <= 2^22) |
/// | 32 | 8 | u64 d_model D |
/// | 40 | 8 | u64 d_ffn F |
/// | 48 | 8 | u64 data_offset: the first record (a multiple of 4096, after the index) |
/// | 56 | 8 | u64 reserved = 0 |
/// | 64 | 32 L E | the index, layer-major: u32 in format, u32 down format (ggml type ids), u64 |
/// |  |  | record offset (a multiple of 4096, >= data_offset), u64 record bytes (a multiple |
/// |  |  | of 64), u64 reserved = 0 |
/// | data_offset | | the records, each padded with zeros to a multiple of 4096 |
#pragma once

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <new>
#include <optional>
#include <span>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "moe/core/error.hpp"
#include "moe/core/types.hpp"
#include "moe/experts/weight_format.hpp"
#include "moe/kernels/gemm_packed.hpp"
#include "moe/kernels/quant_gemm.hpp"

namespace moe::offload {

/// The alignment of records in the file and of the buffers they are read into (O_DIRECT's).
inline constexpr std::uint64_t kStoreAlign = 4096;
inline constexpr char kStoreMagic[8] = {'M', 'O', 'E', 'X', 'P', 'E', 'R', 'T'};
inline constexpr std::uint32_t kStoreVersion = 1;
inline constexpr std::uint64_t kStoreHeaderBytes = 64, kStoreIndexEntryBytes = 32;

/// The shapes an expert store holds: L MoE layers of E experts, each expert's projections
/// [P, D] (in) and [D, F] (down), P = 2F for GLU experts.
struct StoreShape {
  Index num_layers = 0;
  Index num_experts = 0;
  Index d_model = 0;
  Index d_ffn = 0;
  bool gated = true;
  bool operator==(StoreShape const&) const = default;
};

/// One record's place in the file: expert (layer, e)'s formats, offset and size in bytes.
struct StoreRecord {
  experts::ExpertFormat format;
  std::uint64_t offset = 0;
  std::uint64_t bytes = 0;
  /// The bytes a read transfers (and a buffer holds): bytes rounded up to kStoreAlign.
  std::uint64_t read_bytes() const { return (bytes + kStoreAlign - 1) / kStoreAlign * kStoreAlign; }
};

namespace detail {

inline std::uint64_t round_up(std::uint64_t n, std::uint64_t a) { return (n + a - 1) / a * a; }

template <class T>
void put(std::byte* p, T v) {
  std::memcpy(p, &v, sizeof v);
}
template <class T>
T get(std::byte const* p) {
  T v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

/// Writes all n bytes at `offset` of fd (moe::Error naming `path` on failure).
inline void pwrite_all(int fd, void const* data, std::uint64_t n, std::uint64_t offset,
                       std::string const& path) {
  auto const* p = static_cast<char const*>(data);
  while (n > 0) {
    ssize_t const w = ::pwrite(fd, p, n, static_cast<off_t>(offset));
    if (w < 0 && errno == EINTR) continue;
    moe::detail::check(w > 0, "moe::offload: writing '", path, "' failed at byte ", offset, ": ",
                       std::strerror(errno), " (is the disk full?)");
    p += w;
    n -= static_cast<std::uint64_t>(w);
    offset += static_cast<std::uint64_t>(w);
  }
}

/// A file descriptor closed on destruction.
class Fd {
 public:
  Fd() = default;
  explicit Fd(int fd) : fd_(fd) {}
  Fd(Fd&& o) noexcept : fd_(std::exchange(o.fd_, -1)) {}
  Fd& operator=(Fd&& o) noexcept {
    if (this != &o) {
      reset();
      fd_ = std::exchange(o.fd_, -1);
    }
    return *this;
  }
  ~Fd() { reset(); }
  int get() const { return fd_; }
  void reset() {
    if (fd_ >= 0) ::close(fd_);
    fd_ = -1;
  }

 private:
  int fd_ = -1;
};

inline experts::WeightFormat store_format(std::uint32_t id, std::string const& where) {
  auto const t = static_cast<quant::GgmlType>(id);
  std::optional<experts::WeightFormat> const f = experts::native_format(t);
  moe::detail::check(f.has_value(), where, ": format id ", id,
                     " is not a weight format moe packs (ggml type ids of f32, bf16 and the "
                     "block formats)");
  return *f;
}

}  // namespace detail

/// Memory for one record read: `bytes` rounded up to kStoreAlign, kStoreAlign-aligned (as
/// O_DIRECT needs, and more than the kernels' 64).
class RecordBuffer {
 public:
  RecordBuffer() = default;
  explicit RecordBuffer(std::uint64_t bytes)
      : size_(detail::round_up(std::max<std::uint64_t>(bytes, 1), kStoreAlign)) {
    void* p = std::aligned_alloc(kStoreAlign, size_);
    if (p == nullptr) throw std::bad_alloc();
    data_.reset(static_cast<std::byte*>(p));
  }
  std::byte* data() const { return data_.get(); }
  std::uint64_t size() const { return size_; }
  explicit operator bool() const { return data_ != nullptr; }

 private:
  struct Free {
    void operator()(std::byte* p) const { std::free(p); }
  };
  std::unique_ptr<std::byte, Free> data_;
  std::uint64_t size_ = 0;
};

/// Writes an expert store: the constructor fixes the shape, add_layer appends the next MoE
/// layer's records (any ExpertBank, packed, of that shape), finish writes the index. A store
/// left unfinished (an exception, or no finish) is removed by the destructor, so a file at
/// `path` is always complete. Holds no weights: a model can be written one layer at a time.
class ExpertStoreWriter {
 public:
  ExpertStoreWriter(std::string path, StoreShape const& shape)
      : path_(std::move(path)), shape_(shape) {
    char const* w = "moe::offload::ExpertStoreWriter";
    moe::detail::check(shape.num_layers >= 1 && shape.num_layers <= 65536 &&
                           shape.num_experts >= 1 && shape.num_experts <= 65536 &&
                           shape.num_layers * shape.num_experts <= (Index{1} << 22),
                       w, ": ", shape.num_layers, " layers of ", shape.num_experts,
                       " experts; a store holds 1..65536 of each and at most 2^22 experts");
    moe::detail::check(shape.d_model >= 1 && shape.d_ffn >= 1, w, ": d_model ", shape.d_model,
                       " and d_ffn ", shape.d_ffn, " must be >= 1");
    index_.resize(static_cast<std::size_t>(shape.num_layers * shape.num_experts));
    data_offset_ = detail::round_up(
        kStoreHeaderBytes + kStoreIndexEntryBytes * static_cast<std::uint64_t>(index_.size()),
        kStoreAlign);
    end_ = data_offset_;
    fd_ = detail::Fd(::open(path_.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644));
    moe::detail::check(fd_.get() >= 0, w, ": cannot create '", path_, "': ", std::strerror(errno));
  }
  ExpertStoreWriter(ExpertStoreWriter const&) = delete;
  ExpertStoreWriter& operator=(ExpertStoreWriter const&) = delete;
  ~ExpertStoreWriter() {
    if (!finished_) {
      fd_.reset();
      ::unlink(path_.c_str());
    }
  }

  /// Appends the records of MoE layer layers_written() from `bank` (packed, of the store's shape,
  /// its records resident). Throws moe::Error otherwise, and on a failed write.
  template <class Bank>
  void add_layer(Bank const& bank) {
    char const* w = "moe::offload::ExpertStoreWriter::add_layer";
    moe::detail::check(layers_ < shape_.num_layers, w, ": all ", shape_.num_layers,
                       " layers are written already");
    moe::detail::check(bank.packed(), w, ": layer ", layers_,
                       "'s experts are not packed; pack() them in the formats to store");
    StoreShape const got{shape_.num_layers, bank.num_experts(), bank.d_model(), bank.d_ffn(),
                         Bank::Expert::gated};
    moe::detail::check(got == shape_, w, ": layer ", layers_, " has ", got.num_experts,
                       " experts of d_model ", got.d_model, ", d_ffn ", got.d_ffn,
                       got.gated ? " (GLU)" : " (MLP)", "; the store holds ", shape_.num_experts,
                       " of d_model ", shape_.d_model, ", d_ffn ", shape_.d_ffn,
                       shape_.gated ? " (GLU)" : " (MLP)");
    moe::detail::check(bank.pack_serves_inference(), w, ": layer ", layers_,
                       "'s GLU experts read gate and up from their fp32 weights (d_ffn not a "
                       "multiple of the panel width in an fp32 or bf16 pack); store them in a "
                       "quantized format");
    std::vector<std::byte> zeros;
    for (Index e = 0; e < shape_.num_experts; ++e) {
      std::span<std::byte const> const r = bank.packed_record(e);
      StoreRecord& rec = index_[static_cast<std::size_t>(layers_ * shape_.num_experts + e)];
      rec.format = bank.packed_formats()[static_cast<std::size_t>(e)];
      rec.offset = end_;
      rec.bytes = r.size();
      detail::pwrite_all(fd_.get(), r.data(), r.size(), end_, path_);
      std::uint64_t const pad = rec.read_bytes() - rec.bytes;
      if (pad > 0) {
        zeros.assign(pad, std::byte{0});
        detail::pwrite_all(fd_.get(), zeros.data(), pad, end_ + rec.bytes, path_);
      }
      end_ += rec.read_bytes();
    }
    ++layers_;
  }
  Index layers_written() const { return layers_; }

  /// Writes the header and the index; the store is complete. Throws unless every layer was added.
  void finish() {
    moe::detail::check(layers_ == shape_.num_layers,
                       "moe::offload::ExpertStoreWriter::finish: ", layers_, " of ",
                       shape_.num_layers, " layers written; add the others first");
    std::vector<std::byte> head(static_cast<std::size_t>(data_offset_), std::byte{0});
    std::memcpy(head.data(), kStoreMagic, 8);
    detail::put<std::uint32_t>(head.data() + 8, kStoreVersion);
    detail::put<std::uint32_t>(head.data() + 12,
                               static_cast<std::uint32_t>(kernels::panel_width()));
    detail::put<std::uint32_t>(head.data() + 16,
                               static_cast<std::uint32_t>(kernels::kQuantPanelCols));
    detail::put<std::uint32_t>(head.data() + 20, shape_.gated ? 1u : 0u);
    detail::put<std::uint32_t>(head.data() + 24, static_cast<std::uint32_t>(shape_.num_layers));
    detail::put<std::uint32_t>(head.data() + 28, static_cast<std::uint32_t>(shape_.num_experts));
    detail::put<std::uint64_t>(head.data() + 32, static_cast<std::uint64_t>(shape_.d_model));
    detail::put<std::uint64_t>(head.data() + 40, static_cast<std::uint64_t>(shape_.d_ffn));
    detail::put<std::uint64_t>(head.data() + 48, data_offset_);
    for (std::size_t i = 0; i < index_.size(); ++i) {
      std::byte* const p = head.data() + kStoreHeaderBytes + kStoreIndexEntryBytes * i;
      StoreRecord const& r = index_[i];
      detail::put<std::uint32_t>(p, static_cast<std::uint32_t>(experts::ggml_type(r.format.in)));
      detail::put<std::uint32_t>(p + 4,
                                 static_cast<std::uint32_t>(experts::ggml_type(r.format.down)));
      detail::put<std::uint64_t>(p + 8, r.offset);
      detail::put<std::uint64_t>(p + 16, r.bytes);
    }
    detail::pwrite_all(fd_.get(), head.data(), head.size(), 0, path_);
    moe::detail::check(::fsync(fd_.get()) == 0 || errno == EINVAL || errno == EROFS,
                       "moe::offload: writing '", path_, "' failed: ", std::strerror(errno));
    fd_.reset();
    finished_ = true;
  }

 private:
  std::string path_;
  StoreShape shape_;
  std::vector<StoreRecord> index_;
  std::uint64_t data_offset_ = 0, end_ = 0;
  Index layers_ = 0;
  detail::Fd fd_;
  bool finished_ = false;
};

/// How an ExpertStore reads. `direct`: open with O_DIRECT (reads bypass the page cache, as a
/// model larger than RAM needs), falling back to buffered reads where the file system refuses
/// it (tmpfs; ExpertStore::direct() says which). A positive `bandwidth_bytes_per_s` throttles
/// reads to emulate a drive: each read waits until latency + bytes / bandwidth after the drive is
/// free (one transfer at a time, latencies overlapped: a queue as deep as the reader threads).
struct StoreReadOptions {
  bool direct = false;
  double bandwidth_bytes_per_s = 0.0;  ///< 0: unthrottled
  double latency_seconds = 0.0;        ///< per read, with a throttle
};

/// Where an ExpertStreamer reads routed experts' packed records from: an expert store file
/// (ExpertStore), or a model's own file, each record packed from it on a miss
/// (models::CheckpointExperts). Implementations are thread-safe.
class RecordSource {
 public:
  virtual ~RecordSource() = default;
  /// The layers and shapes of the experts.
  virtual StoreShape const& shape() const = 0;
  /// The formats of MoE layer `layer`'s experts, one per expert.
  virtual std::vector<experts::ExpertFormat> layer_formats(Index layer) const = 0;
  /// The bytes of expert (layer, expert)'s buffer (a multiple of kStoreAlign, at least its
  /// record's): what it takes in a cache, and what read() writes.
  virtual std::uint64_t buffer_bytes(Index layer, Index expert) const = 0;
  /// Writes expert (layer, expert)'s record into `dst` (kStoreAlign-aligned, buffer_bytes()
  /// bytes). Throws moe::Error when it cannot (an I/O error, a bad file).
  virtual void read(Index layer, Index expert, std::byte* dst) const = 0;
  /// The file it reads, for messages.
  virtual std::string const& path() const = 0;
};

/// An expert store opened for reading: the header and index validated (moe::Error naming the
/// file and what is wrong), records read with read(). Thread-safe reads.
class ExpertStore final : public RecordSource {
 public:
  explicit ExpertStore(std::string path, StoreReadOptions const& options = {})
      : path_(std::move(path)), options_(options) {
    char const* w = "moe::offload::ExpertStore";
    moe::detail::check(options.bandwidth_bytes_per_s >= 0.0 && options.latency_seconds >= 0.0 &&
                           options.latency_seconds <= 10.0,
                       w, ": bandwidth ", options.bandwidth_bytes_per_s, " B/s and latency ",
                       options.latency_seconds, " s; give a bandwidth >= 0 (0: unthrottled) and ",
                       "a latency in [0, 10] s");
    detail::Fd fd(::open(path_.c_str(), O_RDONLY | O_CLOEXEC));
    moe::detail::check(fd.get() >= 0, w, ": cannot open '", path_, "': ", std::strerror(errno));
    struct stat st {};
    moe::detail::check(::fstat(fd.get(), &st) == 0 && S_ISREG(st.st_mode), w, ": '", path_,
                       "' is not a regular file");
    file_bytes_ = static_cast<std::uint64_t>(st.st_size);
    parse(fd.get());
    if (options.direct) {
#if defined(O_DIRECT)
      direct_fd_ = detail::Fd(::open(path_.c_str(), O_RDONLY | O_CLOEXEC | O_DIRECT));
#endif
    }
    fd_ = std::move(fd);
  }

  std::string const& path() const override { return path_; }
  StoreShape const& shape() const override { return shape_; }
  /// The fp32/bf16 panel width the records were packed for.
  Index panel_width() const { return panel_width_; }
  /// Are reads O_DIRECT (asked for, and the file system allows it)?
  bool direct() const { return direct_fd_.get() >= 0; }
  StoreRecord const& record(Index layer, Index expert) const {
    moe::detail::check(
        layer >= 0 && layer < shape_.num_layers && expert >= 0 && expert < shape_.num_experts,
        "moe::offload::ExpertStore: expert (", layer, ", ", expert, ") is outside the store's ",
        shape_.num_layers, " x ", shape_.num_experts);
    return index_[static_cast<std::size_t>(layer * shape_.num_experts + expert)];
  }
  /// Every record of MoE layer `layer`'s experts, in expert order.
  std::span<StoreRecord const> layer_records(Index layer) const {
    (void)record(layer, 0);
    return {index_.data() + layer * shape_.num_experts,
            static_cast<std::size_t>(shape_.num_experts)};
  }
  std::vector<experts::ExpertFormat> layer_formats(Index layer) const override {
    std::vector<experts::ExpertFormat> f;
    for (StoreRecord const& r : layer_records(layer)) f.push_back(r.format);
    return f;
  }

  std::uint64_t buffer_bytes(Index layer, Index expert) const override {
    return record(layer, expert).read_bytes();
  }
  /// Reads expert (layer, expert)'s record into `dst` (kStoreAlign-aligned, at least
  /// record().read_bytes() bytes). Throws moe::Error on an I/O error or a short read.
  void read(Index layer, Index expert, std::byte* dst) const override {
    StoreRecord const& r = record(layer, expert);
    std::uint64_t const n = r.read_bytes();
    int const fd = direct() ? direct_fd_.get() : fd_.get();
    std::uint64_t done = 0;
    while (done < n) {
      ssize_t const got = ::pread(fd, dst + done, n - done, static_cast<off_t>(r.offset + done));
      if (got < 0 && errno == EINTR) continue;
      moe::detail::check(
          got > 0, "moe::offload::ExpertStore: reading expert (", layer, ", ", expert, ") of '",
          path_, "' failed: ",
          got == 0 ? "the file ends early (truncated since it was opened?)" : std::strerror(errno));
      done += static_cast<std::uint64_t>(got);
    }
    throttle(n);
  }

  /// Throws unless `bank` (MoE layer `layer`'s experts) has the store's shape and each record
  /// the size this machine's pack of that format gives (a store written for another panel
  /// width, or by another version of the layout, cannot be read as it is).
  template <class Bank>
  void check_layer(Index layer, Bank const& bank) const {
    char const* w = "moe::offload::ExpertStore";
    // fp32 / bf16 parts are packed in panels of the instruction set's width; quantized ones in
    // panels of 32 columns everywhere (a store of quantized experts moves between machines).
    bool dense_parts = false;
    for (StoreRecord const& r : layer_records(layer)) {
      dense_parts = dense_parts || !experts::is_quantized(r.format.in) ||
                    !experts::is_quantized(r.format.down);
    }
    moe::detail::check(!dense_parts || panel_width_ == kernels::panel_width(), w, ": '", path_,
                       "' was packed for fp32/bf16 panels of ", panel_width_,
                       " columns and this build packs ", kernels::panel_width(),
                       " (another instruction set); write the store again on this machine");
    StoreShape const got{shape_.num_layers, bank.num_experts(), bank.d_model(), bank.d_ffn(),
                         Bank::Expert::gated};
    moe::detail::check(got == shape_, w, ": '", path_, "' holds experts of d_model ",
                       shape_.d_model, ", d_ffn ", shape_.d_ffn, ", ", shape_.num_experts,
                       " a layer", shape_.gated ? " (GLU)" : " (MLP)", ", but MoE layer ", layer,
                       " of the model has ", got.num_experts, " of d_model ", got.d_model,
                       ", d_ffn ", got.d_ffn, got.gated ? " (GLU)" : " (MLP)",
                       "; the store belongs to another model");
    for (Index e = 0; e < shape_.num_experts; ++e) {
      StoreRecord const& r = record(layer, e);
      auto const want = static_cast<std::uint64_t>(bank.record_bytes_for(r.format));
      moe::detail::check(r.bytes == want, w, ": '", path_, "': expert (", layer, ", ", e,
                         ")'s record has ", r.bytes, " bytes, and ", experts::name(r.format.in),
                         "/", experts::name(r.format.down), " experts of this shape take ", want,
                         "; the store was written by another layout version");
    }
  }

 private:
  void parse(int fd) {
    std::string const where = "moe::offload::ExpertStore: '" + path_ + "'";
    auto fail_if = [&](bool bad, auto const&... what) {
      if (bad) moe::detail::fail(where, ": ", what...);
    };
    fail_if(file_bytes_ < kStoreHeaderBytes, "the file has ", file_bytes_,
            " bytes, fewer than a header's 64; not an expert store");
    std::byte head[kStoreHeaderBytes];
    read_exact(fd, head, kStoreHeaderBytes, 0);
    fail_if(std::memcmp(head, kStoreMagic, 8) != 0,
            "no MOEXPERT magic; not an expert store (moe_generate --write-expert-store makes one)");
    std::uint32_t const version = detail::get<std::uint32_t>(head + 8);
    fail_if(version != kStoreVersion, "version ", version, "; this build reads version ",
            kStoreVersion);
    panel_width_ = detail::get<std::uint32_t>(head + 12);
    std::uint32_t const qcols = detail::get<std::uint32_t>(head + 16);
    std::uint32_t const gated = detail::get<std::uint32_t>(head + 20);
    std::uint32_t const L = detail::get<std::uint32_t>(head + 24);
    std::uint32_t const E = detail::get<std::uint32_t>(head + 28);
    std::uint64_t const D = detail::get<std::uint64_t>(head + 32);
    std::uint64_t const F = detail::get<std::uint64_t>(head + 40);
    std::uint64_t const data = detail::get<std::uint64_t>(head + 48);
    fail_if(panel_width_ < 1 || panel_width_ > 1024 || qcols != kernels::kQuantPanelCols,
            "panel width ", panel_width_, " and quantized panel columns ", qcols,
            " are not a layout this build packs");
    fail_if(gated > 1 || detail::get<std::uint64_t>(head + 56) != 0,
            "reserved header fields are not 0");
    fail_if(
        L < 1 || L > 65536 || E < 1 || E > 65536 || std::uint64_t{L} * E > (std::uint64_t{1} << 22),
        L, " layers of ", E, " experts; a store holds 1..65536 of each, 2^22 in all");
    fail_if(D < 1 || F < 1 || D > (std::uint64_t{1} << 24) || F > (std::uint64_t{1} << 24),
            "d_model ", D, " and d_ffn ", F, " must be in [1, 2^24]");
    std::uint64_t const n = std::uint64_t{L} * E;
    std::uint64_t const index_end = kStoreHeaderBytes + kStoreIndexEntryBytes * n;
    fail_if(data % kStoreAlign != 0 || data < index_end || data > file_bytes_, "data offset ", data,
            " is not a multiple of 4096 after the index (", index_end,
            " bytes) and within the file (", file_bytes_, " bytes)");
    shape_ = {static_cast<Index>(L), static_cast<Index>(E), static_cast<Index>(D),
              static_cast<Index>(F), gated == 1};
    std::vector<std::byte> index(static_cast<std::size_t>(kStoreIndexEntryBytes * n));
    read_exact(fd, index.data(), index.size(), kStoreHeaderBytes);
    index_.resize(static_cast<std::size_t>(n));
    std::uint64_t previous_end = data;
    for (std::uint64_t i = 0; i < n; ++i) {
      std::byte const* p = index.data() + kStoreIndexEntryBytes * i;
      std::string const who =
          where + ": expert (" + std::to_string(i / E) + ", " + std::to_string(i % E) + ")";
      StoreRecord& r = index_[static_cast<std::size_t>(i)];
      r.format.in = detail::store_format(detail::get<std::uint32_t>(p), who);
      r.format.down = detail::store_format(detail::get<std::uint32_t>(p + 4), who);
      r.offset = detail::get<std::uint64_t>(p + 8);
      r.bytes = detail::get<std::uint64_t>(p + 16);
      if (detail::get<std::uint64_t>(p + 24) != 0) moe::detail::fail(who, ": reserved field not 0");
      // Records in file order, each inside the file: no overlap, no overflow.
      if (r.offset % kStoreAlign != 0 || r.offset < previous_end || r.bytes == 0 ||
          r.bytes % 64 != 0 || r.offset > file_bytes_ || r.read_bytes() > file_bytes_ - r.offset) {
        moe::detail::fail(who, ": record at byte ", r.offset, " of ", r.bytes,
                          " bytes is not 4096-aligned, in order, a multiple of 64 bytes and "
                          "inside the file (",
                          file_bytes_, " bytes; truncated?)");
      }
      previous_end = r.offset + r.read_bytes();
    }
  }
  void read_exact(int fd, void* dst, std::uint64_t n, std::uint64_t offset) const {
    auto* p = static_cast<char*>(dst);
    while (n > 0) {
      ssize_t const got = ::pread(fd, p, n, static_cast<off_t>(offset));
      if (got < 0 && errno == EINTR) continue;
      moe::detail::check(got > 0, "moe::offload::ExpertStore: reading '", path_,
                         "' failed at byte ", offset, ": ",
                         got == 0 ? "unexpected end of file" : std::strerror(errno));
      p += got;
      n -= static_cast<std::uint64_t>(got);
      offset += static_cast<std::uint64_t>(got);
    }
  }
  /// The emulated drive: one transfer at a time at the given bandwidth, each read complete a
  /// latency after its transfer.
  void throttle(std::uint64_t bytes) const {
    if (options_.bandwidth_bytes_per_s <= 0.0) return;
    using Clock = std::chrono::steady_clock;
    auto const transfer = std::chrono::duration_cast<Clock::duration>(
        std::chrono::duration<double>(static_cast<double>(bytes) / options_.bandwidth_bytes_per_s));
    auto const latency = std::chrono::duration_cast<Clock::duration>(
        std::chrono::duration<double>(options_.latency_seconds));
    Clock::time_point done;
    {
      std::lock_guard<std::mutex> const lock(drive_->mutex);
      Clock::time_point const start = std::max(Clock::now(), drive_->free_at);
      drive_->free_at = start + transfer;
      done = drive_->free_at + latency;
    }
    std::this_thread::sleep_until(done);
  }

  struct Drive {
    std::mutex mutex;
    std::chrono::steady_clock::time_point free_at{};
  };

  std::string path_;
  StoreReadOptions options_;
  std::uint64_t file_bytes_ = 0;
  Index panel_width_ = 0;
  StoreShape shape_;
  std::vector<StoreRecord> index_;
  detail::Fd fd_, direct_fd_;
  std::unique_ptr<Drive> drive_ = std::make_unique<Drive>();
};

}  // namespace moe::offload
