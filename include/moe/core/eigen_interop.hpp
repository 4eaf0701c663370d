// SPDX-License-Identifier: Apache-2.0
// This file is part of moe, a header-only library of sparse Mixture-of-Experts layers.
/// \file
/// Zero-copy conversions between moe views and Eigen row-major matrices.
#pragma once

#include <Eigen/Core>

#include "moe/core/views.hpp"

namespace moe {

/// Row-major dynamic Eigen matrix, the layout every moe view uses.
template <class T>
using RowMatrixX = Eigen::Matrix<T, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;

/// A mutable view of an Eigen row-major matrix (no copy; the matrix must outlive the view).
template <class T>
MatrixView<T> view(RowMatrixX<T>& m) {
  return MatrixView<T>(m.data(), m.rows(), m.cols());
}
/// A const view of an Eigen row-major matrix (no copy).
template <class T>
ConstMatrixView<T> view(RowMatrixX<T> const& m) {
  return ConstMatrixView<T>(m.data(), m.rows(), m.cols());
}

/// An Eigen map over a view (no copy), with the view's row stride as the outer stride.
template <class T>
auto as_eigen(MatrixView<T> v) {
  using Plain = RowMatrixX<std::remove_const_t<T>>;
  using MapType =
      std::conditional_t<std::is_const_v<T>,
                         Eigen::Map<Plain const, Eigen::Unaligned, Eigen::OuterStride<>>,
                         Eigen::Map<Plain, Eigen::Unaligned, Eigen::OuterStride<>>>;
  return MapType(v.data, v.rows, v.cols, Eigen::OuterStride<>(v.row_stride));
}

}  // namespace moe
