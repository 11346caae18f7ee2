// Delta codec for 16-bit elements (bf16, f16): which elements of a tensor changed from one
// version to the next, and how. Bit patterns are compared, never floats, so NaN payloads,
// -0.0 and subnormals round-trip.
//
// Encoding: for each changed element in index order, the LEB128 count of unchanged
// elements since the previous change (or the start), then one step byte: the signed
// difference new - old of the two bit patterns (int16 wrap-around) when it lies in
// [-127, 127], else 0x80 and the new pattern (2 bytes, little-endian). In RL on bf16
// weights nearly every change is +/-1 ulp, i.e. a step of +/-1 (docs: shared/notes/delta.md).
#include "weightsync_native.h"

#include <cstring>

#ifdef __AVX2__
#include <immintrin.h>
#endif

namespace {

constexpr uint8_t kEscape = 0x80;

inline uint8_t* put_varint(uint8_t* p, uint64_t v) {
  while (v >= 0x80) {
    *p++ = static_cast<uint8_t>(v) | 0x80;
    v >>= 7;
  }
  *p++ = static_cast<uint8_t>(v);
  return p;
}

// The encoding of one changed element needs at most 10 (varint) + 3 bytes.
constexpr uint64_t kMaxRecord = 13;

}  // namespace

extern "C" {

int64_t ws_delta16_encode(const uint16_t* base, const uint16_t* now, uint64_t n, uint8_t* out, uint64_t cap,
                          uint64_t* changed) {
  if ((n > 0 && (base == nullptr || now == nullptr)) || (cap > 0 && out == nullptr)) return -2;
  uint8_t* p = out;
  uint8_t* const end = out + cap;
  uint64_t last = 0;  // index just past the previous change
  uint64_t count = 0;
  auto emit = [&](uint64_t i) -> bool {
    if (static_cast<uint64_t>(end - p) < kMaxRecord) {
      // near the end: encode into scratch and copy only if it fits
      uint8_t tmp[kMaxRecord];
      uint8_t* q = put_varint(tmp, i - last);
      const int16_t step = static_cast<int16_t>(static_cast<uint16_t>(now[i] - base[i]));
      if (step >= -127 && step <= 127) {
        *q++ = static_cast<uint8_t>(static_cast<int8_t>(step));
      } else {
        *q++ = kEscape;
        *q++ = static_cast<uint8_t>(now[i]);
        *q++ = static_cast<uint8_t>(now[i] >> 8);
      }
      const uint64_t len = static_cast<uint64_t>(q - tmp);
      if (len > static_cast<uint64_t>(end - p)) return false;
      std::memcpy(p, tmp, len);
      p += len;
    } else {
      p = put_varint(p, i - last);
      const int16_t step = static_cast<int16_t>(static_cast<uint16_t>(now[i] - base[i]));
      if (step >= -127 && step <= 127) {
        *p++ = static_cast<uint8_t>(static_cast<int8_t>(step));
      } else {
        *p++ = kEscape;
        *p++ = static_cast<uint8_t>(now[i]);
        *p++ = static_cast<uint8_t>(now[i] >> 8);
      }
    }
    last = i + 1;
    ++count;
    return true;
  };
  uint64_t i = 0;
#ifdef __AVX2__
  // 16 elements per compare; most blocks of a small RL step are unchanged and skipped whole.
  for (; i + 16 <= n; i += 16) {
    const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(base + i));
    const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(now + i));
    uint32_t diff = ~static_cast<uint32_t>(_mm256_movemask_epi8(_mm256_cmpeq_epi16(a, b)));
    while (diff != 0) {  // two mask bits per element
      const uint64_t k = static_cast<uint64_t>(__builtin_ctz(diff)) / 2;
      if (!emit(i + k)) return -1;
      diff &= ~(3u << (2 * k));
    }
  }
#endif
  for (; i < n; ++i)
    if (base[i] != now[i] && !emit(i)) return -1;
  if (changed != nullptr) *changed = count;
  return p - out;
}

int ws_delta16_decode(uint16_t* buf, uint64_t n, const uint8_t* enc, uint64_t len) {
  if ((n > 0 && buf == nullptr) || (len > 0 && enc == nullptr)) return WS_INVALID_ARGUMENT;
  const uint8_t* p = enc;
  const uint8_t* const end = enc + len;
  uint64_t at = 0;  // the next element a gap counts from
  while (p < end) {
    uint64_t gap = 0;
    int shift = 0;
    for (;;) {
      if (p == end || shift > 63) return WS_DATA_LOSS;  // truncated or overlong varint
      const uint8_t b = *p++;
      gap |= static_cast<uint64_t>(b & 0x7f) << shift;
      if ((b & 0x80) == 0) break;
      shift += 7;
    }
    if (gap >= n - at || at >= n) return WS_DATA_LOSS;  // a change past the end
    const uint64_t i = at + gap;
    if (p == end) return WS_DATA_LOSS;
    const uint8_t step = *p++;
    if (step == kEscape) {
      if (end - p < 2) return WS_DATA_LOSS;
      buf[i] = static_cast<uint16_t>(p[0] | (p[1] << 8));
      p += 2;
    } else {
      if (step == 0) return WS_DATA_LOSS;  // a change of nothing: not an encoding this codec writes
      buf[i] = static_cast<uint16_t>(buf[i] + static_cast<int8_t>(step));
    }
    at = i + 1;
  }
  return WS_OK;
}

}  // extern "C"
