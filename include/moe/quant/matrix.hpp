// SPDX-License-Identifier: Apache-2.0
// This file is part of moe, a header-only library of sparse Mixture-of-Experts layers.
/// \file
/// QuantMatrix: a weight matrix in GGUF blocks, and the error its quantization makes.
#pragma once

#include <cmath>
#include <cstddef>
#include <span>
#include <vector>

#include "moe/core/error.hpp"
#include "moe/core/types.hpp"
#include "moe/core/views.hpp"
#include "moe/quant/blocks.hpp"

namespace moe::quant {

/// A [rows, cols] weight matrix (Hugging Face [out, in]) quantized row by row: row r is
/// row_bytes(format, cols) bytes of consecutive GGUF blocks, exactly the data of a GGUF tensor
/// with ne = {cols, rows}. Preconditions: cols a positive multiple of block_elems(format).
class QuantMatrix {
 public:
  QuantMatrix() = default;
  /// All-zero bytes (every weight 0).
  QuantMatrix(Format format, Index rows, Index cols) : format_(format), rows_(rows), cols_(cols) {
    moe::detail::check(rows >= 0, "QuantMatrix: rows = ", rows, " must be >= 0");
    check_row_length(format, cols, "QuantMatrix");
    bytes_.assign(static_cast<std::size_t>(rows * quant::row_bytes(format, cols)), std::byte{0});
  }
  /// Quantizes w with the reference quantizer of `format` (quantize_row per row). Throws
  /// moe::Error for a non-finite weight or a width that is not whole blocks.
  static QuantMatrix quantize(ConstMatrixView<float> w, Format format) {
    QuantMatrix q(format, w.rows, w.cols);
    for (Index r = 0; r < w.rows; ++r) quantize_row(format, w.row(r), w.cols, q.row(r));
    return q;
  }

  Format format() const { return format_; }
  Index rows() const { return rows_; }
  Index cols() const { return cols_; }
  /// Bytes of one row, and all of them.
  Index row_bytes() const { return quant::row_bytes(format_, cols_); }
  std::span<std::byte const> bytes() const { return bytes_; }
  std::span<std::byte> bytes() { return bytes_; }
  std::byte const* row(Index r) const { return bytes_.data() + r * row_bytes(); }
  std::byte* row(Index r) { return bytes_.data() + r * row_bytes(); }

  /// The weights the blocks encode (ggml's dequantizers), into out [rows, cols].
  void dequantize(MatrixView<float> out) const {
    moe::detail::check(out.rows == rows_ && out.cols == cols_, "QuantMatrix::dequantize: out is [",
                       out.rows, ", ", out.cols, "] but the matrix is [", rows_, ", ", cols_, "]");
    for (Index r = 0; r < rows_; ++r) dequantize_row(format_, row(r), cols_, out.row(r));
  }

 private:
  Format format_ = Format::kQ8_0;
  Index rows_ = 0, cols_ = 0;
  std::vector<std::byte> bytes_;
};

/// How far a quantized matrix is from the weights it came from.
struct QuantError {
  double rms = 0;       ///< sqrt(mean((w - deq)^2))
  double relative = 0;  ///< ||w - deq||_F / ||w||_F (0 for an all-zero w)
  double max_abs = 0;   ///< max |w - deq|
};

/// The error of q against w (same shape).
inline QuantError quantization_error(ConstMatrixView<float> w, QuantMatrix const& q) {
  moe::detail::check(w.rows == q.rows() && w.cols == q.cols(), "quantization_error: w is [", w.rows,
                     ", ", w.cols, "] but q is [", q.rows(), ", ", q.cols(), "]");
  std::vector<float> row(static_cast<std::size_t>(w.cols));
  double se = 0, ss = 0, mx = 0;
  for (Index r = 0; r < w.rows; ++r) {
    dequantize_row(q.format(), q.row(r), w.cols, row.data());
    for (Index c = 0; c < w.cols; ++c) {
      double const e = static_cast<double>(w(r, c)) - row[static_cast<std::size_t>(c)];
      se += e * e;
      ss += static_cast<double>(w(r, c)) * w(r, c);
      mx = std::fmax(mx, std::fabs(e));
    }
  }
  double const n = static_cast<double>(w.rows * w.cols);
  return {n > 0 ? std::sqrt(se / n) : 0.0, ss > 0 ? std::sqrt(se / ss) : 0.0, mx};
}

}  // namespace moe::quant
