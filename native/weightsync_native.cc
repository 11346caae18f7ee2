// Fused copy + digest staging for weightsync; see weightsync_native.h for the contract.
#include "weightsync_native.h"

#include <sched.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#define XXH_INLINE_ALL
#include <xxhash.h>

#include "delta_decoder.h"
#include "delta_encoder.h"

namespace {

// Blocks stay in L2 between the copy and the hash of the same source bytes.
constexpr uint64_t kBlock = 256 << 10;
// Below this a span is copied with ordinary stores: small tensors are re-read soon.
constexpr uint64_t kNonTemporalMin = 1 << 20;
alignas(64) const uint8_t kZeros[kBlock] = {};

#if defined(__AVX2__)
void copy_nt_avx2(uint8_t* dst, const uint8_t* src, uint64_t n) {
  uint64_t head = (32 - (reinterpret_cast<uintptr_t>(dst) & 31)) & 31;
  head = std::min(head, n);
  std::memcpy(dst, src, head);
  dst += head;
  src += head;
  n -= head;
  uint64_t i = 0;
  for (; i + 128 <= n; i += 128) {
    __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i));
    __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i + 32));
    __m256i c = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i + 64));
    __m256i d = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i + 96));
    _mm256_stream_si256(reinterpret_cast<__m256i*>(dst + i), a);
    _mm256_stream_si256(reinterpret_cast<__m256i*>(dst + i + 32), b);
    _mm256_stream_si256(reinterpret_cast<__m256i*>(dst + i + 64), c);
    _mm256_stream_si256(reinterpret_cast<__m256i*>(dst + i + 96), d);
  }
  std::memcpy(dst + i, src + i, n - i);
}
#endif

void copy_bytes(uint8_t* dst, const uint8_t* src, uint64_t n, bool non_temporal) {
#if defined(__AVX2__)
  if (non_temporal) {
    copy_nt_avx2(dst, src, n);
    return;
  }
#endif
  std::memcpy(dst, src, n);
}

void store_fence() {
#if defined(__x86_64__)
  _mm_sfence();
#endif
}

inline float bf16_to_float(uint16_t v) {
  uint32_t bits = static_cast<uint32_t>(v) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

inline float f16_to_float(uint16_t h) {
  uint32_t sign = (h & 0x8000u) << 16, exp = (h >> 10) & 0x1f, mant = h & 0x3ffu, bits;
  if (exp == 0) {
    if (mant == 0) {
      bits = sign;
    } else {  // subnormal: normalise
      exp = 127 - 15 + 1;
      while (!(mant & 0x400u)) {
        mant <<= 1;
        --exp;
      }
      bits = sign | (exp << 23) | ((mant & 0x3ffu) << 13);
    }
  } else if (exp == 0x1f) {
    bits = sign | 0x7f800000u | (mant << 13);
  } else {
    bits = sign | ((exp + 127 - 15) << 23) | (mant << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

template <typename T, typename Conv>
double sum_as(const uint8_t* p, uint64_t nbytes, Conv conv) {
  const uint64_t n = nbytes / sizeof(T);
  double acc[4] = {0, 0, 0, 0};
  uint64_t i = 0;
  for (; i + 4 <= n; i += 4) {
    T v[4];
    std::memcpy(v, p + i * sizeof(T), sizeof(v));
    acc[0] += conv(v[0]);
    acc[1] += conv(v[1]);
    acc[2] += conv(v[2]);
    acc[3] += conv(v[3]);
  }
  for (; i < n; ++i) {
    T v;
    std::memcpy(&v, p + i * sizeof(T), sizeof(T));
    acc[0] += conv(v);
  }
  return (acc[0] + acc[1]) + (acc[2] + acc[3]);
}

#if defined(__AVX2__)
// Float64 sums widen floats with vcvtps2pd straight from 128-bit halves: extracting the
// upper half of a 256-bit register would cost a shuffle-port uop per 4 elements. Four
// accumulators hide the add latency. The order of additions is fixed, so every party
// running this code gets the same bits for the same bytes.
inline void add4(__m128 v, __m256d& acc) { acc = _mm256_add_pd(acc, _mm256_cvtps_pd(v)); }

double hsum(__m256d a, __m256d b, __m256d c, __m256d d) {
  __m256d s = _mm256_add_pd(_mm256_add_pd(a, b), _mm256_add_pd(c, d));
  alignas(32) double t[4];
  _mm256_store_pd(t, s);
  return (t[0] + t[1]) + (t[2] + t[3]);
}

double sum_f32_avx2(const uint8_t* p, uint64_t nbytes) {
  const uint64_t n = nbytes / 4;
  const float* f = reinterpret_cast<const float*>(p);
  __m256d a = _mm256_setzero_pd(), b = a, c = a, d = a;
  uint64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    add4(_mm_loadu_ps(f + i), a);
    add4(_mm_loadu_ps(f + i + 4), b);
    add4(_mm_loadu_ps(f + i + 8), c);
    add4(_mm_loadu_ps(f + i + 12), d);
  }
  double rest = 0;
  for (; i < n; ++i) {
    float v;
    std::memcpy(&v, p + 4 * i, 4);
    rest += v;
  }
  return hsum(a, b, c, d) + rest;
}

// bf16 -> f32 without shuffles: within each 32-bit lane the even element becomes a float
// by shifting it up, the odd one by masking off its neighbour (a sum needs no order).
double sum_bf16_avx2(const uint8_t* p, uint64_t nbytes) {
  const uint64_t n = nbytes / 2;
  const __m128i high = _mm_set1_epi32(static_cast<int>(0xffff0000u));
  __m256d a = _mm256_setzero_pd(), b = a, c = a, d = a;
  uint64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    __m128i x = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 2 * i));
    __m128i y = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 2 * i + 16));
    add4(_mm_castsi128_ps(_mm_slli_epi32(x, 16)), a);
    add4(_mm_castsi128_ps(_mm_and_si128(x, high)), b);
    add4(_mm_castsi128_ps(_mm_slli_epi32(y, 16)), c);
    add4(_mm_castsi128_ps(_mm_and_si128(y, high)), d);
  }
  double rest = 0;
  for (; i < n; ++i) {
    uint16_t v;
    std::memcpy(&v, p + 2 * i, 2);
    rest += bf16_to_float(v);
  }
  return hsum(a, b, c, d) + rest;
}
#endif

#if defined(__AVX2__)
// Copy with non-temporal stores and float64 sum in one loop, for bf16 and f32 spans: the
// widening adds run while the loads wait on memory, so the sum costs (almost) nothing.
// Needs dst 16-byte aligned and whole elements; the caller falls back otherwise.
template <bool kBf16>
double copy_sum_nt(uint8_t* dst, const uint8_t* src, uint64_t n) {
  const __m128i high = _mm_set1_epi32(static_cast<int>(0xffff0000u));
  __m256d acc[4] = {_mm256_setzero_pd(), _mm256_setzero_pd(), _mm256_setzero_pd(), _mm256_setzero_pd()};
  uint64_t i = 0;
  for (; i + 64 <= n; i += 64) {
    for (int k = 0; k < 4; ++k) {
      __m128i x = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i + 16 * k));
      _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i + 16 * k), x);
      if (kBf16) {
        add4(_mm_castsi128_ps(_mm_slli_epi32(x, 16)), acc[k]);
        add4(_mm_castsi128_ps(_mm_and_si128(x, high)), acc[k ^ 2]);
      } else {
        add4(_mm_castsi128_ps(x), acc[k]);
      }
    }
  }
  std::memcpy(dst + i, src + i, n - i);
  const double rest = kBf16 ? sum_bf16_avx2(src + i, n - i) : sum_f32_avx2(src + i, n - i);
  return hsum(acc[0], acc[1], acc[2], acc[3]) + rest;
}
#endif

// Copies n bytes (whole elements of dtype) and adds their float64 sum to *sum; false when
// there is no fused loop for this case (the caller copies and sums separately).
bool copy_and_sum(uint8_t* dst, const uint8_t* src, uint64_t n, int dtype, double* sum) {
#if defined(__AVX2__)
  if ((reinterpret_cast<uintptr_t>(dst) & 15) != 0) return false;
  if (dtype == WS_BF16 && n % 2 == 0) {
    *sum += copy_sum_nt<true>(dst, src, n);
    return true;
  }
  if (dtype == WS_F32 && n % 4 == 0) {
    *sum += copy_sum_nt<false>(dst, src, n);
    return true;
  }
#else
  (void)dst, (void)src, (void)n, (void)dtype, (void)sum;
#endif
  return false;
}

// Float64 sum of whole elements in [p, p + nbytes); callers keep blocks element-aligned.
double sum_block(const uint8_t* p, uint64_t nbytes, int dtype) {
#if defined(__AVX2__)
  if (dtype == WS_F32) return sum_f32_avx2(p, nbytes);
  if (dtype == WS_BF16) return sum_bf16_avx2(p, nbytes);
#endif
  switch (dtype) {
    case WS_F32: return sum_as<float>(p, nbytes, [](float v) { return double(v); });
    case WS_F64: return sum_as<double>(p, nbytes, [](double v) { return v; });
    case WS_BF16: return sum_as<uint16_t>(p, nbytes, [](uint16_t v) { return double(bf16_to_float(v)); });
    case WS_F16: return sum_as<uint16_t>(p, nbytes, [](uint16_t v) { return double(f16_to_float(v)); });
    case WS_I8: return sum_as<int8_t>(p, nbytes, [](int8_t v) { return double(v); });
    case WS_I16: return sum_as<int16_t>(p, nbytes, [](int16_t v) { return double(v); });
    case WS_I32: return sum_as<int32_t>(p, nbytes, [](int32_t v) { return double(v); });
    case WS_I64: return sum_as<int64_t>(p, nbytes, [](int64_t v) { return double(v); });
    case WS_U8: return sum_as<uint8_t>(p, nbytes, [](uint8_t v) { return double(v); });
    case WS_BOOL: return sum_as<uint8_t>(p, nbytes, [](uint8_t v) { return v ? 1.0 : 0.0; });
    default: return 0.0;
  }
}

int item_size(int dtype) {
  switch (dtype) {
    case WS_F64: case WS_I64: return 8;
    case WS_F32: case WS_I32: return 4;
    case WS_F16: case WS_BF16: case WS_I16: return 2;
    default: return 1;
  }
}

int resolve_threads(int n_threads, uint64_t work_items) {
  int n = n_threads > 0 ? n_threads : ws_default_threads();
  return static_cast<int>(std::max<uint64_t>(1, std::min<uint64_t>(n, work_items)));
}

template <typename Fn>
int run_parallel(int n, Fn fn) {
  if (n == 1) {
    fn(0);
    return WS_OK;
  }
  std::vector<std::thread> threads;
  try {
    threads.reserve(n - 1);
    for (int t = 1; t < n; ++t) threads.emplace_back(fn, t);
  } catch (...) {
    for (auto& th : threads) th.join();
    return WS_INTERNAL;
  }
  fn(0);
  for (auto& th : threads) th.join();
  return WS_OK;
}

// Float64 sum of the elements of a span whose first byte lies in [a, b) of it: a range
// cut anywhere still sums each element exactly once, reading it whole from the span.
double sum_elements(const uint8_t* span, uint64_t a, uint64_t b, int dtype) {
  const uint64_t isz = item_size(dtype);
  const uint64_t e0 = (a + isz - 1) / isz, e1 = (b + isz - 1) / isz;
  return sum_block(span + e0 * isz, (e1 - e0) * isz, dtype);
}

// Lengths laid end to end: item i is [offsets[i], offsets[i + 1]) (a chunk plan, or the
// pairs of a copy as one stream).
std::vector<uint64_t> prefix_offsets(const uint64_t* lengths, uint64_t n) {
  std::vector<uint64_t> off(n + 1, 0);
  for (uint64_t i = 0; i < n; ++i) off[i + 1] = off[i] + lengths[i];
  return off;
}

// Where staging writes each chunk's delta against the previous version (same layout):
// chunk c's encoding goes to out + out_off[c], at most caps[c] bytes; lengths[c] = its
// size, or -1 when it did not fit (the chunk travels raw).
struct DeltaSink {
  const uint8_t* base;
  uint8_t* out;
  const uint64_t* out_off;
  const uint64_t* caps;
  int64_t* lengths;
};

// Where the rebuild pass (ws_rebuild_digest) reads each chunk's delta: chunk c's encoding
// is enc[offsets[c], offsets[c] + lengths[c]), none where lengths[c] < 0; broken[c] = 1
// when it did not decode.
struct DecodePlan {
  const uint8_t* enc;
  const uint64_t* offsets;
  const int64_t* lengths;
  uint8_t* broken;
};

// Copies, zero-fills and hashes chunks [c_lo, c_hi) in blocks that stay in L2 between the
// sum, the copy and the hash. Sums are additive, so each thread adds its part of every span
// into partial_sums; span digests are derived from chunk digests afterwards. With a delta
// sink, each block is also compared with the previous version's while it is in cache.
// With a decode plan (bytes in place: every span's src is its place in dst), each block
// first gets the changes its chunk's delta makes under it, then is hashed while in cache.
void stage_chunks(uint64_t c_lo, uint64_t c_hi, const std::vector<uint64_t>& chunk_off, uint8_t* dst,
                  const ws_span* spans, uint64_t n_spans, std::vector<double>& partial_sums, uint64_t* chunk_digests,
                  const DeltaSink* delta, const DecodePlan* decode) {
  XXH3_state_t state;
  uint64_t s = std::lower_bound(spans, spans + n_spans, chunk_off[c_lo],
                                [](const ws_span& sp, uint64_t v) { return sp.dst_offset + sp.nbytes <= v; }) -
               spans;
  for (uint64_t c = c_lo; c < c_hi; ++c) {
    XXH3_64bits_reset(&state);
    uint64_t pos = chunk_off[c];
    const uint64_t end = chunk_off[c + 1];
    ws_delta::Encoder enc(delta ? delta->out + delta->out_off[c] : nullptr, delta ? delta->caps[c] : 0);
    std::optional<ws_delta::Decoder> dec;
    if (decode != nullptr && decode->lengths[c] >= 0)
      dec.emplace(reinterpret_cast<uint16_t*>(dst + pos), (end - pos) / 2, decode->enc + decode->offsets[c],
                  static_cast<uint64_t>(decode->lengths[c]));
    const uint64_t first = pos;
    auto rebuild_until = [&](uint64_t stop_byte) {  // every word with a byte below stop_byte
      if (dec) dec->until((stop_byte - first + 1) / 2);
    };
    while (pos < end) {
      while (s < n_spans && spans[s].dst_offset + spans[s].nbytes <= pos) ++s;
      if (s == n_spans || spans[s].dst_offset > pos) {  // a gap: zero it, hash the zeros
        const uint64_t gap_end = std::min(end, s < n_spans ? spans[s].dst_offset : end);
        for (; pos < gap_end;) {
          const uint64_t take = std::min<uint64_t>(gap_end - pos, kBlock);
          rebuild_until(pos + take);
          std::memset(dst + pos, 0, take);
          XXH3_64bits_update(&state, kZeros, take);
          if (delta) enc.feed(delta->base + pos, kZeros, take);
          pos += take;
        }
        continue;
      }
      const ws_span& sp = spans[s];
      const uint8_t* src = static_cast<const uint8_t*>(sp.src);
      const uint64_t stop = std::min(end, sp.dst_offset + sp.nbytes);
      const bool non_temporal = sp.nbytes >= kNonTemporalMin;
      while (pos < stop) {
        const uint64_t take = std::min(kBlock, stop - pos);
        rebuild_until(pos + take);
        const uint64_t a = pos - sp.dst_offset;
        const bool whole_elements = a % item_size(sp.dtype) == 0;
        if (dst + pos == src + a || !non_temporal || !whole_elements ||
            !copy_and_sum(dst + pos, src + a, take, sp.dtype, &partial_sums[s])) {
          if (dst + pos != src + a) copy_bytes(dst + pos, src + a, take, non_temporal);
          partial_sums[s] += sum_elements(src, a, a + take, sp.dtype);
        }
        XXH3_64bits_update(&state, src + a, take);
        if (delta) enc.feed(delta->base + pos, src + a, take);
        pos += take;
      }
    }
    chunk_digests[c] = XXH3_64bits_digest(&state);
    if (delta) delta->lengths[c] = enc.overflow() ? -1 : static_cast<int64_t>(enc.size());
    if (dec) decode->broken[c] = dec->until((end - first) / 2) != WS_OK;
  }
  store_fence();
}

uint64_t n_pieces(uint64_t nbytes, uint64_t piece_bytes) {
  return nbytes <= piece_bytes ? 1 : (nbytes + piece_bytes - 1) / piece_bytes;
}

// The piecewise rule (weightsync.digests.piecewise_xxh3): one piece -> its digest; several
// -> xxh3-64 of their little-endian u64 digests.
uint64_t combine_pieces(const uint64_t* digests, uint64_t n) {
  static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "the piecewise rule hashes little-endian u64s");
  return n == 1 ? digests[0] : XXH3_64bits(digests, n * sizeof(uint64_t));
}

// Hashes (and, when sums is not null, sums) work items (span, piece) on every thread,
// largest spans first; results land in piece_digests / piece_sums at the item's slot.
struct Piece {
  uint64_t span, index, slot;
};

int hash_pieces(const ws_span* spans, const std::vector<Piece>& work, uint64_t piece_bytes, uint64_t* piece_digests,
                double* piece_sums, int n_threads) {
  std::atomic<uint64_t> next{0};
  return run_parallel(resolve_threads(n_threads, work.size()), [&](int) {
    for (uint64_t k = next++; k < work.size(); k = next++) {
      const Piece& w = work[k];
      const ws_span& sp = spans[w.span];
      const uint8_t* src = static_cast<const uint8_t*>(sp.src);
      const uint64_t lo = w.index * piece_bytes, hi = std::min(sp.nbytes, lo + piece_bytes);
      if (piece_sums == nullptr) {
        piece_digests[w.slot] = XXH3_64bits(src + lo, hi - lo);
        continue;
      }
      XXH3_state_t state;
      XXH3_64bits_reset(&state);
      double sum = 0.0;
      for (uint64_t pos = lo; pos < hi; pos += kBlock) {  // hash and sum each block while it is in cache
        const uint64_t take = std::min(kBlock, hi - pos);
        XXH3_64bits_update(&state, src + pos, take);
        sum += sum_elements(src, pos, pos + take, sp.dtype);
      }
      piece_digests[w.slot] = XXH3_64bits_digest(&state);
      piece_sums[w.slot] = sum;
    }
  });
}

// Every span's pieces as work items, spans largest first; first_piece[i] is span i's slot.
std::vector<Piece> all_pieces(const ws_span* spans, uint64_t n_spans, uint64_t piece_bytes,
                              std::vector<uint64_t>& first_piece) {
  first_piece.assign(n_spans + 1, 0);
  for (uint64_t i = 0; i < n_spans; ++i) first_piece[i + 1] = first_piece[i] + n_pieces(spans[i].nbytes, piece_bytes);
  std::vector<uint64_t> order(n_spans);
  for (uint64_t i = 0; i < n_spans; ++i) order[i] = i;
  std::stable_sort(order.begin(), order.end(), [&](uint64_t a, uint64_t b) { return spans[a].nbytes > spans[b].nbytes; });
  std::vector<Piece> work;
  work.reserve(first_piece[n_spans]);
  for (uint64_t i : order)
    for (uint64_t j = 0; j < first_piece[i + 1] - first_piece[i]; ++j) work.push_back({i, j, first_piece[i] + j});
  return work;
}

int check_spans(const ws_span* spans, uint64_t n_spans, uint64_t total) {
  uint64_t cursor = 0;
  for (uint64_t i = 0; i < n_spans; ++i) {
    if (spans[i].dst_offset < cursor || spans[i].dst_offset + spans[i].nbytes > total) return WS_INVALID_ARGUMENT;
    if (spans[i].src == nullptr && spans[i].nbytes > 0) return WS_INVALID_ARGUMENT;
    cursor = spans[i].dst_offset + spans[i].nbytes;
  }
  return WS_OK;
}

// The spans with each one's source its own place in dst: a pass over bytes already in place.
std::vector<ws_span> in_place(const ws_span* spans, uint64_t n_spans, uint8_t* dst) {
  std::vector<ws_span> out(spans, spans + n_spans);
  for (auto& sp : out) sp.src = dst + sp.dst_offset;
  return out;
}

// The chunk plan's offsets, or empty when the arguments every staging pass takes are bad.
std::vector<uint64_t> checked_plan(const uint8_t* dst, uint64_t total, const uint64_t* chunk_lengths,
                                   uint64_t n_chunks, uint64_t piece_bytes, const ws_span* spans, uint64_t n_spans) {
  if ((dst == nullptr && total > 0) || piece_bytes == 0 || (n_chunks > 0 && chunk_lengths == nullptr)) return {};
  if (check_spans(spans, n_spans, total) != WS_OK) return {};
  for (uint64_t i = 0; i < n_chunks; ++i)
    if (chunk_lengths[i] == 0) return {};
  std::vector<uint64_t> off = prefix_offsets(chunk_lengths, n_chunks);
  if (off[n_chunks] != total) return {};
  return off;
}

bool whole_words(const uint64_t* chunk_lengths, uint64_t n_chunks) {
  for (uint64_t i = 0; i < n_chunks; ++i)
    if (chunk_lengths[i] % 2 != 0) return false;
  return true;
}

// The staging pass over a checked plan (ws_stage_delta, ws_rebuild_digest).
int stage_pass(uint8_t* dst, uint64_t total, const std::vector<uint64_t>& off, uint64_t n_chunks,
               uint64_t piece_bytes, const ws_span* spans, uint64_t n_spans, uint64_t* span_digests,
               double* span_sums, uint64_t* chunk_digests, const DeltaSink* sink, const DecodePlan* decode,
               int n_threads) {
  // Threads take runs of whole chunks holding about equal bytes.
  const int n = resolve_threads(n_threads, std::max<uint64_t>(1, n_chunks));
  std::vector<uint64_t> first(n + 1, n_chunks);
  for (int t = 0; t < n; ++t) first[t] = std::lower_bound(off.begin(), off.end() - 1, total * t / n) - off.begin();
  std::vector<std::vector<double>> partial(n, std::vector<double>(n_spans, 0.0));
  int rc = run_parallel(n, [&](int t) {
    if (first[t] < first[t + 1])
      stage_chunks(first[t], first[t + 1], off, dst, spans, n_spans, partial[t], chunk_digests, sink, decode);
  });
  if (rc != WS_OK) return rc;
  for (uint64_t i = 0; i < n_spans; ++i) {
    double sum = 0.0;
    for (int t = 0; t < n; ++t) sum += partial[t][i];
    span_sums[i] = sum;
  }

  // A piece that is exactly a chunk has the chunk's digest (hashed once, above); the rest
  // (small spans packed together in one chunk, chunk plans that cut spans elsewhere) are
  // hashed again from their sources, never from dst: another process may write into a
  // shared arena between the copy and this pass, and the manifest must describe what the
  // trainer meant to publish, not what the arena holds a moment later.
  std::vector<uint64_t> first_piece;
  std::vector<Piece> work = all_pieces(spans, n_spans, piece_bytes, first_piece);
  std::vector<uint64_t> pieces(first_piece[n_spans]);
  std::vector<Piece> rest;
  for (const Piece& w : work) {
    const uint64_t lo = spans[w.span].dst_offset + w.index * piece_bytes;
    const uint64_t len = std::min(piece_bytes, spans[w.span].nbytes - w.index * piece_bytes);
    const uint64_t c = std::lower_bound(off.begin(), off.end() - 1, lo) - off.begin();
    if (len > 0 && c < n_chunks && off[c] == lo && off[c + 1] - lo == len) pieces[w.slot] = chunk_digests[c];
    else rest.push_back(w);
  }
  rc = hash_pieces(spans, rest, piece_bytes, pieces.data(), nullptr, n_threads);
  if (rc != WS_OK) return rc;
  for (uint64_t i = 0; i < n_spans; ++i)
    span_digests[i] = combine_pieces(pieces.data() + first_piece[i], first_piece[i + 1] - first_piece[i]);
  return WS_OK;
}

}  // namespace

extern "C" {

int ws_abi_version(void) { return 14; }

int ws_cpu_limit(const char* cgroup_root) {
  const std::string root = cgroup_root;
  double quota = -1, period = 0;
  char word[32] = {};
  if (FILE* f = std::fopen((root + "/cpu.max").c_str(), "r")) {  // v2: "max 100000" or "200000 100000"
    if (std::fscanf(f, "%31s %lf", word, &period) == 2 && std::strcmp(word, "max") != 0) quota = std::atof(word);
    std::fclose(f);
  } else {
    for (const char* dir : {"/cpu/", "/cpu,cpuacct/"}) {  // v1: -1 is no quota
      FILE* q = std::fopen((root + dir + "cpu.cfs_quota_us").c_str(), "r");
      FILE* p = std::fopen((root + dir + "cpu.cfs_period_us").c_str(), "r");
      const bool read = q && p && std::fscanf(q, "%lf", &quota) == 1 && std::fscanf(p, "%lf", &period) == 1;
      if (q) std::fclose(q);
      if (p) std::fclose(p);
      if (read) break;
      quota = -1;
    }
  }
  if (quota <= 0 || period <= 0) return 0;
  return static_cast<int>(std::clamp(quota / period + 0.999999, 1.0, 4096.0));
}

int ws_threads_setting(void) {
  const char* e = std::getenv("WEIGHTSYNC_NATIVE_THREADS");
  if (e == nullptr) return 0;
  const size_t len = std::strlen(e);
  const bool digits = len > 0 && len <= 4 && std::all_of(e, e + len, [](char c) { return c >= '0' && c <= '9'; });
  const int v = digits ? std::atoi(e) : 0;
  return v > 0 && v <= 4096 ? v : 0;
}

int ws_default_threads(void) {
  static const int n = [] {
    if (const int v = ws_threads_setting()) return v;
    int cores = static_cast<int>(std::thread::hardware_concurrency());
    cpu_set_t set;
    if (sched_getaffinity(0, sizeof(set), &set) == 0) cores = CPU_COUNT(&set);
    const int limit = ws_cpu_limit("/sys/fs/cgroup");
    if (limit > 0) cores = std::min(cores, limit);
    return std::max(1, cores);
  }();
  return n;
}

int ws_stage(uint8_t* dst, uint64_t total, const uint64_t* chunk_lengths, uint64_t n_chunks, uint64_t piece_bytes,
             const ws_span* spans, uint64_t n_spans, uint64_t* span_digests, double* span_sums, uint64_t* chunk_digests,
             int n_threads) {
  return ws_stage_delta(dst, total, chunk_lengths, n_chunks, piece_bytes, spans, n_spans, span_digests, span_sums,
                        chunk_digests, nullptr, nullptr, nullptr, nullptr, n_threads);
}

int ws_stage_delta(uint8_t* dst, uint64_t total, const uint64_t* chunk_lengths, uint64_t n_chunks,
                   uint64_t piece_bytes, const ws_span* spans, uint64_t n_spans, uint64_t* span_digests,
                   double* span_sums, uint64_t* chunk_digests, const uint8_t* base, uint8_t* delta_out,
                   const uint64_t* delta_caps, int64_t* delta_lengths, int n_threads) {
  const std::vector<uint64_t> off = checked_plan(dst, total, chunk_lengths, n_chunks, piece_bytes, spans, n_spans);
  if (off.empty()) return WS_INVALID_ARGUMENT;
  if (base == nullptr)
    return stage_pass(dst, total, off, n_chunks, piece_bytes, spans, n_spans, span_digests, span_sums, chunk_digests,
                      nullptr, nullptr, n_threads);
  // 16-bit words: every chunk starts and ends on a word
  if (delta_caps == nullptr || delta_lengths == nullptr || !whole_words(chunk_lengths, n_chunks))
    return WS_INVALID_ARGUMENT;
  const std::vector<uint64_t> out_off = prefix_offsets(delta_caps, n_chunks);
  if (delta_out == nullptr && out_off[n_chunks] > 0) return WS_INVALID_ARGUMENT;
  const DeltaSink sink{base, delta_out, out_off.data(), delta_caps, delta_lengths};
  return stage_pass(dst, total, off, n_chunks, piece_bytes, spans, n_spans, span_digests, span_sums, chunk_digests,
                    &sink, nullptr, n_threads);
}

int ws_rebuild_digest(uint8_t* buf, uint64_t total, const uint64_t* chunk_lengths, uint64_t n_chunks,
                      uint64_t piece_bytes, const ws_span* spans, uint64_t n_spans, uint64_t* span_digests,
                      double* span_sums, uint64_t* chunk_digests, const uint8_t* enc, uint64_t enc_total,
                      const uint64_t* enc_offsets, const int64_t* enc_lengths, uint8_t* broken, int n_threads) {
  const std::vector<ws_span> inplace = in_place(spans, n_spans, buf);
  const std::vector<uint64_t> off =
      checked_plan(buf, total, chunk_lengths, n_chunks, piece_bytes, inplace.data(), n_spans);
  if (off.empty() || !whole_words(chunk_lengths, n_chunks)) return WS_INVALID_ARGUMENT;
  if (n_chunks > 0 && (enc_offsets == nullptr || enc_lengths == nullptr || broken == nullptr))
    return WS_INVALID_ARGUMENT;
  for (uint64_t c = 0; c < n_chunks; ++c) {
    broken[c] = 0;
    if (enc_lengths[c] < 0) continue;
    const uint64_t len = static_cast<uint64_t>(enc_lengths[c]);
    if (enc_offsets[c] > enc_total || len > enc_total - enc_offsets[c] || (len > 0 && enc == nullptr))
      return WS_INVALID_ARGUMENT;
  }
  const DecodePlan plan{enc, enc_offsets, enc_lengths, broken};
  return stage_pass(buf, total, off, n_chunks, piece_bytes, inplace.data(), n_spans, span_digests, span_sums,
                    chunk_digests, nullptr, &plan, n_threads);
}

int ws_digest_staged(uint8_t* dst, uint64_t total, const uint64_t* chunk_lengths, uint64_t n_chunks,
                     uint64_t piece_bytes, const ws_span* spans, uint64_t n_spans, uint64_t* span_digests,
                     double* span_sums, uint64_t* chunk_digests, int n_threads) {
  // Same pass as ws_stage with every span's source being its own place in dst: no copy.
  const std::vector<ws_span> inplace = in_place(spans, n_spans, dst);
  return ws_stage(dst, total, chunk_lengths, n_chunks, piece_bytes, inplace.data(), n_spans, span_digests, span_sums,
                  chunk_digests, n_threads);
}

int ws_digest_ranges(const uint8_t* base, const uint64_t* offsets, const uint64_t* lengths, uint64_t n,
                     uint64_t* out, int n_threads) {
  if (base == nullptr && n > 0) return WS_INVALID_ARGUMENT;
  const int m = resolve_threads(n_threads, n);
  return run_parallel(m, [&](int t) {
    for (uint64_t i = t; i < n; i += m) out[i] = XXH3_64bits(base + offsets[i], lengths[i]);
  });
}

int ws_digest_spans(const ws_span* spans, uint64_t n_spans, uint64_t piece_bytes, uint64_t* span_digests,
                    double* span_sums, int n_threads) {
  if (n_spans > 0 && (spans == nullptr || span_digests == nullptr || span_sums == nullptr)) return WS_INVALID_ARGUMENT;
  if (piece_bytes == 0) return WS_INVALID_ARGUMENT;
  for (uint64_t i = 0; i < n_spans; ++i)
    if (spans[i].src == nullptr && spans[i].nbytes > 0) return WS_INVALID_ARGUMENT;
  // Pieces, not spans, are the unit of work: the embedding does not serialize the rest.
  std::vector<uint64_t> first_piece;
  std::vector<Piece> work = all_pieces(spans, n_spans, piece_bytes, first_piece);
  std::vector<uint64_t> digests(first_piece[n_spans]);
  std::vector<double> sums(first_piece[n_spans]);
  int rc = hash_pieces(spans, work, piece_bytes, digests.data(), sums.data(), n_threads);
  if (rc != WS_OK) return rc;
  for (uint64_t i = 0; i < n_spans; ++i) {
    span_digests[i] = combine_pieces(digests.data() + first_piece[i], first_piece[i + 1] - first_piece[i]);
    double sum = 0.0;
    for (uint64_t k = first_piece[i]; k < first_piece[i + 1]; ++k) sum += sums[k];
    span_sums[i] = sum;
  }
  return WS_OK;
}

int ws_copy(uint8_t* dst, const uint8_t* src, uint64_t nbytes, int n_threads) {
  if ((dst == nullptr || src == nullptr) && nbytes > 0) return WS_INVALID_ARGUMENT;
  const int m = resolve_threads(n_threads, std::max<uint64_t>(1, nbytes / kBlock));
  int rc = run_parallel(m, [&](int t) {
    uint64_t lo = nbytes * t / m, hi = nbytes * (t + 1) / m;
    copy_bytes(dst + lo, src + lo, hi - lo, true);
    store_fence();
  });
  return rc;
}

int ws_copy_digest(uint8_t* dst, const uint8_t* src, uint64_t nbytes, uint64_t* digest) {
  if (((dst == nullptr || src == nullptr) && nbytes > 0) || digest == nullptr) return WS_INVALID_ARGUMENT;
  // Each block is copied with ordinary stores and hashed from dst while it is in cache:
  // the digest is of the bytes this process holds, whatever happens to src meanwhile.
  XXH3_state_t state;
  XXH3_64bits_reset(&state);
  for (uint64_t pos = 0; pos < nbytes; pos += kBlock) {
    const uint64_t take = std::min(kBlock, nbytes - pos);
    std::memcpy(dst + pos, src + pos, take);
    XXH3_64bits_update(&state, dst + pos, take);
  }
  *digest = XXH3_64bits_digest(&state);
  return WS_OK;
}

int ws_copy_many(uint8_t* const* dsts, const uint8_t* const* srcs, const uint64_t* lengths, uint64_t n,
                 int n_threads) {
  if (n > 0 && (dsts == nullptr || srcs == nullptr || lengths == nullptr)) return WS_INVALID_ARGUMENT;
  for (uint64_t i = 0; i < n; ++i)
    if ((dsts[i] == nullptr || srcs[i] == nullptr) && lengths[i] > 0) return WS_INVALID_ARGUMENT;
  const std::vector<uint64_t> starts = prefix_offsets(lengths, n);  // each pair's first byte in the stream
  const uint64_t total = starts[n];
  // Threads split the bytes, not the pairs: one call over a layer's tensors costs one
  // thread start, and a large tensor does not leave the other threads idle.
  const int m = resolve_threads(n_threads, std::max<uint64_t>(1, total / kBlock));
  return run_parallel(m, [&](int t) {
    const uint64_t lo = total * t / m, hi = total * (t + 1) / m;
    uint64_t i = std::upper_bound(starts.begin(), starts.end(), lo) - starts.begin() - 1;
    for (uint64_t pos = lo; pos < hi && i < n; ++i) {
      const uint64_t a = pos - starts[i], b = std::min(hi, starts[i + 1]) - starts[i];
      if (b > a) copy_bytes(dsts[i] + a, srcs[i] + a, b - a, true);
      pos = starts[i + 1];
    }
    store_fence();
  });
}

}  // extern "C"
