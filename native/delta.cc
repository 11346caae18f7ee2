// Delta codec for 16-bit elements (bf16, f16): which elements of a tensor changed from one
// version to the next, and how. Bit patterns are compared, never floats, so NaN payloads,
// -0.0 and subnormals round-trip.
//
// Encoding: for each changed element in index order, the LEB128 count of unchanged
// elements since the previous change (or the start), then one step byte: the signed
// difference new - old of the two bit patterns (int16 wrap-around) when it lies in
// [-127, 127], else 0x80 and the new pattern (2 bytes, little-endian). In RL on bf16
// weights nearly every change is +/-1 ulp, i.e. a step of +/-1 (docs/performance.md "Delta sync").
#include "delta_decoder.h"
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
  return ws_delta::Decoder(buf, n, enc, len).until(n);
}

}  // extern "C"
