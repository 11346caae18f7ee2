// Row and column sums of a matrix of unsigned integers, modulo 2^32, in one pass: an
// array's exact fingerprint (rollout_agent/engines/fingerprint.py) reads its bytes once
// instead of once per reduction. Columns go in blocks whose uint32
// accumulators stay in L1, so a wide matrix (a vocabulary axis) does not stream its
// accumulators from L2 for every row.
#include <cstring>

#include "weightsync_native.h"

namespace {

constexpr uint64_t kBlock = 4096;  // columns per block: 16 KiB of accumulators

template <typename T>
void matrix_sums(const T* data, uint64_t rows, uint64_t cols, uint32_t* row_sums, uint32_t* col_sums) {
  std::memset(row_sums, 0, rows * sizeof(uint32_t));
  std::memset(col_sums, 0, cols * sizeof(uint32_t));
  for (uint64_t c0 = 0; c0 < cols; c0 += kBlock) {
    const uint64_t width = cols - c0 < kBlock ? cols - c0 : kBlock;
    uint32_t* __restrict acc = col_sums + c0;
    for (uint64_t r = 0; r < rows; ++r) {
      const T* __restrict row = data + r * cols + c0;
      uint32_t sum = 0;
      for (uint64_t c = 0; c < width; ++c) {
        const uint32_t v = row[c];
        acc[c] += v;
        sum += v;
      }
      row_sums[r] += sum;
    }
  }
}

}  // namespace

extern "C" {

int ws_matrix_sums(const void* data, uint64_t rows, uint64_t cols, int itemsize, uint32_t* row_sums,
                   uint32_t* col_sums) {
  if ((rows * cols > 0 && data == nullptr) || (rows > 0 && row_sums == nullptr) ||
      (cols > 0 && col_sums == nullptr)) {
    return WS_INVALID_ARGUMENT;
  }
  switch (itemsize) {
    case 1:
      matrix_sums(static_cast<const uint8_t*>(data), rows, cols, row_sums, col_sums);
      return WS_OK;
    case 2:
      matrix_sums(static_cast<const uint16_t*>(data), rows, cols, row_sums, col_sums);
      return WS_OK;
    case 4:
      matrix_sums(static_cast<const uint32_t*>(data), rows, cols, row_sums, col_sums);
      return WS_OK;
    default:
      return WS_INVALID_ARGUMENT;
  }
}

}  // extern "C"
