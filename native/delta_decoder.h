// The delta codec's decoder (format: delta.cc), run in pieces: ws_delta16_decode applies a
// whole encoding, the rebuild pass (ws_rebuild_digest) applies the changes under each block
// of a chunk just before it hashes that block, while the block is in cache.
#pragma once
#include <stdint.h>

#include <algorithm>

#include "delta_encoder.h"
#include "weightsync_native.h"

namespace ws_delta {

class Decoder {
 public:
  // Changes `n` 16-bit elements at buf by the encoding [enc, enc + len).
  Decoder(uint16_t* buf, uint64_t n, const uint8_t* enc, uint64_t len) : buf_(buf), n_(n), p_(enc), end_(enc + len) {}

  // Applies every change to an element below `limit` (<= n); WS_OK, or WS_DATA_LOSS for
  // an encoding that is truncated, names an element past the end or a step of 0 (from
  // then on every call fails). until(n) applies the rest: the whole encoding.
  int until(uint64_t limit) {
    // The changes land in index order: every line up to 8 KiB ahead is fetched for
    // writing while this one is changed. The loop otherwise waits on each line's load;
    // fetching only the lines near each change left the hardware's prefetcher a stream
    // with holes (measured: 17-25 -> 14-17 ns per change on a cold buffer).
    constexpr uint64_t kAhead = 4096;  // elements
    constexpr uint64_t kLine = 32;  // elements per 64-byte line
    while (rc_ == WS_OK && p_ < end_) {
      const uint8_t* p = p_;
      uint64_t gap = *p++;
      if (__builtin_expect(gap & 0x80, 0)) {  // a gap of 128 or more: the rest of its LEB128
        gap &= 0x7f;
        int shift = 7;
        for (;;) {
          if (p == end_ || shift > 63) return rc_ = WS_DATA_LOSS;  // truncated or overlong varint
          const uint8_t b = *p++;
          gap |= static_cast<uint64_t>(b & 0x7f) << shift;
          if ((b & 0x80) == 0) break;
          shift += 7;
        }
      }
      if (at_ >= n_ || gap >= n_ - at_) return rc_ = WS_DATA_LOSS;  // a change past the end
      const uint64_t i = at_ + gap;
      if (i >= limit) return WS_OK;  // the next change is past this piece: left for the next call
      if (p == end_) return rc_ = WS_DATA_LOSS;
      fetched_ = std::max(fetched_, i);  // nothing behind this change (after a long gap)
      for (const uint64_t ahead = std::min(n_, i + kAhead); fetched_ < ahead; fetched_ += kLine)
        __builtin_prefetch(buf_ + fetched_, 1, 0);
      const uint8_t step = *p++;
      if (__builtin_expect(step == kEscape, 0)) {
        if (end_ - p < 2) return rc_ = WS_DATA_LOSS;
        buf_[i] = static_cast<uint16_t>(p[0] | (p[1] << 8));
        p += 2;
      } else {
        if (step == 0) return rc_ = WS_DATA_LOSS;  // a change of nothing: not an encoding this codec writes
        buf_[i] = static_cast<uint16_t>(buf_[i] + static_cast<int8_t>(step));
      }
      at_ = i + 1;
      p_ = p;
    }
    return rc_;
  }

 private:
  uint16_t* buf_;
  uint64_t n_;
  const uint8_t* p_;
  const uint8_t* end_;
  uint64_t at_ = 0;  // the next element a gap counts from
  uint64_t fetched_ = 0;  // elements below this were prefetched
  int rc_ = WS_OK;
};

}  // namespace ws_delta
