// The delta codec's encoder (format: delta.cc), fed in pieces: ws_delta16_encode feeds one
// array, staging feeds each block of a chunk while its source bytes are in cache.
#pragma once
#include <stdint.h>

#include <cstring>

#ifdef __AVX2__
#include <immintrin.h>
#endif

namespace ws_delta {

constexpr uint8_t kEscape = 0x80;
constexpr uint64_t kMaxRecord = 13;  // a 10-byte varint + escape + 2 bytes

// Encodes the 16-bit words that differ between `base` and `now`, words counted from the
// first byte fed. Bytes may be fed in pieces of any length (an odd piece leaves half a
// word until the next). `overflow` once the encoding would pass `cap` bytes.
class Encoder {
 public:
  Encoder(uint8_t* out, uint64_t cap) : begin_(out), p_(out), end_(out + cap) {}

  void feed(const uint8_t* base, const uint8_t* now, uint64_t n) {
    if (overflow_ || n == 0) return;
    if (half_) {  // complete the word the previous piece left half fed
      word(static_cast<uint16_t>(half_base_ | (base[0] << 8)), static_cast<uint16_t>(half_now_ | (now[0] << 8)));
      half_ = false;
      ++base, ++now, --n;
    }
    uint64_t w = 0;
    const uint64_t words = n / 2;
#ifdef __AVX2__
    // The cursor lives in locals through the loop: a record's byte stores may alias any
    // member, so members would be stored and loaded again around every vector.
    uint64_t index = index_, last = last_, changed = changed_;
    uint8_t* q = p_;
    for (; w + 16 <= words; w += 16) {  // 16 words per compare; equal blocks skipped whole
      const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(base + 2 * w));
      const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(now + 2 * w));
      uint32_t diff = ~static_cast<uint32_t>(_mm256_movemask_epi8(_mm256_cmpeq_epi16(a, b)));
      if (diff == 0) {
        index += 16;
        continue;
      }
      if (static_cast<uint64_t>(end_ - q) >= 16 * kMaxRecord) {  // room for any 16 records: no checks
        while (diff != 0) {  // two mask bits per word
          const uint64_t k = static_cast<uint64_t>(__builtin_ctz(diff)) / 2;
          q = record(q, index + k - last, load(base + 2 * (w + k)), load(now + 2 * (w + k)));
          last = index + k + 1;
          ++changed;
          diff &= ~(3u << (2 * k));
        }
      } else {  // near the cap: word by word, each record checked (members in step)
        index_ = index, last_ = last, changed_ = changed, p_ = q;
        while (diff != 0) {
          const uint64_t k = static_cast<uint64_t>(__builtin_ctz(diff)) / 2;
          index_ = index + k;
          word(load(base + 2 * (w + k)), load(now + 2 * (w + k)));
          diff &= ~(3u << (2 * k));
        }
        if (overflow_) return;
        last = last_, changed = changed_, q = p_;
      }
      index += 16;
    }
    index_ = index, last_ = last, changed_ = changed, p_ = q;
#endif
    for (; w < words && !overflow_; ++w) word(load(base + 2 * w), load(now + 2 * w));
    if (n % 2 == 1) {
      half_ = true;
      half_base_ = base[n - 1];
      half_now_ = now[n - 1];
    }
  }

  bool overflow() const { return overflow_; }
  uint64_t size() const { return static_cast<uint64_t>(p_ - begin_); }
  uint64_t changed() const { return changed_; }
  bool ends_mid_word() const { return half_; }

 private:
  static uint16_t load(const uint8_t* p) {
    uint16_t v;
    std::memcpy(&v, p, 2);
    return v;
  }

  // One record (gap since the previous change, then the step or an escaped pattern) at q,
  // which has room for kMaxRecord bytes; returns the byte after it.
  static uint8_t* record(uint8_t* q, uint64_t gap, uint16_t b, uint16_t n) {
    if (__builtin_expect(gap < 0x80, 1)) {
      *q++ = static_cast<uint8_t>(gap);
    } else {
      while (gap >= 0x80) {
        *q++ = static_cast<uint8_t>(gap) | 0x80;
        gap >>= 7;
      }
      *q++ = static_cast<uint8_t>(gap);
    }
    const int16_t step = static_cast<int16_t>(static_cast<uint16_t>(n - b));
    if (__builtin_expect(step >= -127 && step <= 127, 1)) {
      *q++ = static_cast<uint8_t>(static_cast<int8_t>(step));
    } else {
      *q++ = kEscape;
      *q++ = static_cast<uint8_t>(n);
      *q++ = static_cast<uint8_t>(n >> 8);
    }
    return q;
  }

  void word(uint16_t b, uint16_t n) {
    if (b != n) emit(b, n);
    ++index_;
  }

  void emit(uint16_t b, uint16_t n) {
    uint8_t tmp[kMaxRecord];
    const uint64_t len = static_cast<uint64_t>(record(tmp, index_ - last_, b, n) - tmp);
    if (len > static_cast<uint64_t>(end_ - p_)) {
      overflow_ = true;
      return;
    }
    std::memcpy(p_, tmp, len);
    p_ += len;
    last_ = index_ + 1;
    ++changed_;
  }

  uint8_t* begin_;
  uint8_t* p_;
  uint8_t* end_;
  uint64_t index_ = 0;  // the next word's index
  uint64_t last_ = 0;   // the index just past the previous change
  uint64_t changed_ = 0;
  bool overflow_ = false;
  bool half_ = false;
  uint8_t half_base_ = 0, half_now_ = 0;
};

}  // namespace ws_delta
