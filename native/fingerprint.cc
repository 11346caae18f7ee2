// Row and column sums of a matrix of unsigned integers, modulo 2^32, in one pass: an
// array's exact fingerprint (rollout_agent/engines/fingerprint.py) reads its bytes once
// instead of once per reduction. The float variant reads each element as a float's bits:
// zero and subnormals (exponent bits all 0) count as +0 and NaN/infinity (all 1) are
// counted, in the same pass (an audit's reference of what a GEMM carries back). Columns go in blocks whose uint32
// accumulators stay in L1, so a wide matrix (a vocabulary axis) does not stream its
// accumulators from L2 for every row.
#include <cstring>

#include "weightsync_native.h"

namespace {

constexpr uint64_t kBlock = 4096;  // columns per block: 16 KiB of accumulators

// exp_mask 0: plain integers; else the float's exponent bits (see the file's comment).
template <typename T>
uint64_t matrix_sums(const T* data, uint64_t rows, uint64_t cols, uint32_t* row_sums, uint32_t* col_sums,
                     T exp_mask) {
  std::memset(row_sums, 0, rows * sizeof(uint32_t));
  std::memset(col_sums, 0, cols * sizeof(uint32_t));
  uint64_t nonfinite = 0;
  for (uint64_t c0 = 0; c0 < cols; c0 += kBlock) {
    const uint64_t width = cols - c0 < kBlock ? cols - c0 : kBlock;
    uint32_t* __restrict acc = col_sums + c0;
    for (uint64_t r = 0; r < rows; ++r) {
      const T* __restrict row = data + r * cols + c0;
      uint32_t sum = 0;
      if (exp_mask == 0) {
        for (uint64_t c = 0; c < width; ++c) {
          const uint32_t v = row[c];
          acc[c] += v;
          sum += v;
        }
      } else {
        uint32_t bad = 0;
        for (uint64_t c = 0; c < width; ++c) {
          const T e = row[c] & exp_mask;
          const uint32_t v = e == 0 ? 0u : static_cast<uint32_t>(row[c]);
          bad += e == exp_mask;
          acc[c] += v;
          sum += v;
        }
        nonfinite += bad;
      }
      row_sums[r] += sum;
    }
  }
  return nonfinite;
}

}  // namespace

extern "C" {

int ws_matrix_sums(const void* data, uint64_t rows, uint64_t cols, int itemsize, uint32_t* row_sums,
                   uint32_t* col_sums) {
  return ws_float_matrix_sums(data, rows, cols, itemsize, 0, row_sums, col_sums, nullptr);
}

int ws_float_matrix_sums(const void* data, uint64_t rows, uint64_t cols, int itemsize, uint32_t exp_mask,
                         uint32_t* row_sums, uint32_t* col_sums, uint64_t* nonfinite) {
  if ((rows * cols > 0 && data == nullptr) || (rows > 0 && row_sums == nullptr) ||
      (cols > 0 && col_sums == nullptr) || (exp_mask != 0 && nonfinite == nullptr) ||
      (itemsize == 1 && exp_mask > 0xFF) || (itemsize == 2 && exp_mask > 0xFFFF)) {
    return WS_INVALID_ARGUMENT;
  }
  uint64_t bad = 0;
  switch (itemsize) {
    case 1:
      bad = matrix_sums(static_cast<const uint8_t*>(data), rows, cols, row_sums, col_sums,
                        static_cast<uint8_t>(exp_mask));
      break;
    case 2:
      bad = matrix_sums(static_cast<const uint16_t*>(data), rows, cols, row_sums, col_sums,
                        static_cast<uint16_t>(exp_mask));
      break;
    case 4:
      bad = matrix_sums(static_cast<const uint32_t*>(data), rows, cols, row_sums, col_sums, exp_mask);
      break;
    default:
      return WS_INVALID_ARGUMENT;
  }
  if (nonfinite != nullptr) *nonfinite = bad;
  return WS_OK;
}

}  // extern "C"
