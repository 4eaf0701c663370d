// SPDX-License-Identifier: Apache-2.0
// This file is part of moe, a header-only library of sparse Mixture-of-Experts layers.
/// \file
/// MatrixView / ConstMatrixView: non-owning row-major views over raw memory.
#pragma once

#include <concepts>
#include <type_traits>

#include "moe/core/types.hpp"

namespace moe {

/// A non-owning row-major matrix view: element (i, j) lives at data[i * row_stride + j].
///
/// `T` may be const-qualified; `ConstMatrixView<T>` is `MatrixView<T const>`, and a mutable view
/// converts to a const one implicitly. Preconditions (not checked here; layers check shapes):
/// rows >= 0, cols >= 0, row_stride >= cols, and `data` valid for rows * row_stride elements
/// (it may be null when rows or cols is 0). Copying a view never copies the elements.
template <class T>
struct MatrixView {
  using value_type = std::remove_const_t<T>;

  T* data = nullptr;
  Index rows = 0;
  Index cols = 0;
  Index row_stride = 0;

  constexpr MatrixView() = default;
  /// A dense view: row_stride == cols.
  constexpr MatrixView(T* data_, Index rows_, Index cols_)
      : data(data_), rows(rows_), cols(cols_), row_stride(cols_) {}
  constexpr MatrixView(T* data_, Index rows_, Index cols_, Index row_stride_)
      : data(data_), rows(rows_), cols(cols_), row_stride(row_stride_) {}
  /// MatrixView<float> -> MatrixView<float const>.
  template <class U>
  requires(std::is_const_v<T>&& std::same_as<U const, T> &&
           !std::is_const_v<
               U>) constexpr MatrixView(MatrixView<U> other)  // NOLINT(google-explicit-constructor)
      : data(other.data), rows(other.rows), cols(other.cols), row_stride(other.row_stride) {}

  constexpr T* row(Index i) const { return data + i * row_stride; }
  constexpr T& operator()(Index i, Index j) const { return data[i * row_stride + j]; }
  constexpr bool empty() const { return rows == 0 || cols == 0; }
  /// Rows [first, first + count) as a view.
  constexpr MatrixView middle_rows(Index first, Index count) const {
    return MatrixView(data + first * row_stride, count, cols, row_stride);
  }
};

template <class T>
using ConstMatrixView = MatrixView<T const>;

}  // namespace moe
