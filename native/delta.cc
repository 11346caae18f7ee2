// Delta codec for 16-bit elements (bf16, f16): which elements of a tensor changed from one
// version to the next, and how. Bit patterns are compared, never floats, so NaN payloads,
// -0.0 and subnormals round-trip.
//
// Encoding: for each changed element in index order, the LEB128 count of unchanged
// elements since the previous change (or the start), then one step byte: the signed
// difference new - old of the two bit patterns (int16 wrap-around) when it lies in
// [-127, 127], else 0x80 and the new pattern (2 bytes, little-endian). In RL on bf16
// weights nearly every change is +/-1 ulp, i.e. a step of +/-1 (docs: shared/notes/delta.md).
#include "delta_encoder.h"
#include "weightsync_native.h"

extern "C" {

int64_t ws_delta16_encode(const uint16_t* base, const uint16_t* now, uint64_t n, uint8_t* out, uint64_t cap,
                          uint64_t* changed) {
  if ((n > 0 && (base == nullptr || now == nullptr)) || (cap > 0 && out == nullptr)) return -2;
  ws_delta::Encoder enc(out, cap);
  enc.feed(reinterpret_cast<const uint8_t*>(base), reinterpret_cast<const uint8_t*>(now), 2 * n);
  if (enc.overflow()) return -1;
  if (changed != nullptr) *changed = enc.changed();
  return static_cast<int64_t>(enc.size());
}

int ws_delta16_decode(uint16_t* buf, uint64_t n, const uint8_t* enc, uint64_t len) {
  if ((n > 0 && buf == nullptr) || (len > 0 && enc == nullptr)) return WS_INVALID_ARGUMENT;
  const uint8_t* p = enc;
  const uint8_t* const end = enc + len;
  uint64_t at = 0;  // the next element a gap counts from
  // The changes land in index order: the lines a few KiB ahead are fetched for writing
  // while this one is changed (measured: the loop otherwise waits on each line's load).
  constexpr uint64_t kAhead = 2048;  // elements
  while (p < end) {
    uint64_t gap = *p++;
    if (__builtin_expect(gap & 0x80, 0)) {  // a gap of 128 or more: the rest of its LEB128
      gap &= 0x7f;
      int shift = 7;
      for (;;) {
        if (p == end || shift > 63) return WS_DATA_LOSS;  // truncated or overlong varint
        const uint8_t b = *p++;
        gap |= static_cast<uint64_t>(b & 0x7f) << shift;
        if ((b & 0x80) == 0) break;
        shift += 7;
      }
    }
    if (gap >= n - at || at >= n) return WS_DATA_LOSS;  // a change past the end
    const uint64_t i = at + gap;
    if (p == end) return WS_DATA_LOSS;
    if (i + kAhead < n) __builtin_prefetch(buf + i + kAhead, 1, 0);
    const uint8_t step = *p++;
    if (__builtin_expect(step == ws_delta::kEscape, 0)) {
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
