// Fused copy + digest staging for weightsync; see weightsync_native.h for the contract.
#include "weightsync_native.h"

#include <algorithm>
#include <atomic>
#include <cstring>
#include <thread>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#define XXH_INLINE_ALL
#include <xxhash.h>

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
// Widen 8 floats to doubles and add them into two accumulators.
inline void add_ps_to_pd(__m256 v, __m256d& a, __m256d& b) {
  a = _mm256_add_pd(a, _mm256_cvtps_pd(_mm256_castps256_ps128(v)));
  b = _mm256_add_pd(b, _mm256_cvtps_pd(_mm256_extractf128_ps(v, 1)));
}

double hsum(__m256d a, __m256d b, __m256d c, __m256d d) {
  __m256d s = _mm256_add_pd(_mm256_add_pd(a, b), _mm256_add_pd(c, d));
  alignas(32) double t[4];
  _mm256_store_pd(t, s);
  return (t[0] + t[1]) + (t[2] + t[3]);
}

double sum_f32_avx2(const uint8_t* p, uint64_t nbytes) {
  const uint64_t n = nbytes / 4;
  __m256d a = _mm256_setzero_pd(), b = a, c = a, d = a;
  uint64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    add_ps_to_pd(_mm256_loadu_ps(reinterpret_cast<const float*>(p) + i), a, b);
    add_ps_to_pd(_mm256_loadu_ps(reinterpret_cast<const float*>(p) + i + 8), c, d);
  }
  double rest = 0;
  for (; i < n; ++i) {
    float v;
    std::memcpy(&v, p + 4 * i, 4);
    rest += v;
  }
  return hsum(a, b, c, d) + rest;
}

double sum_bf16_avx2(const uint8_t* p, uint64_t nbytes) {
  const uint64_t n = nbytes / 2;
  __m256d a = _mm256_setzero_pd(), b = a, c = a, d = a;
  uint64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 2 * i));
    __m256i lo = _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm256_castsi256_si128(w)), 16);
    __m256i hi = _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm256_extracti128_si256(w, 1)), 16);
    add_ps_to_pd(_mm256_castsi256_ps(lo), a, b);
    add_ps_to_pd(_mm256_castsi256_ps(hi), c, d);
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

// One thread's share: whole chunks [c_lo, c_hi), i.e. bytes [lo, hi) of dst.
struct Range {
  uint64_t c_lo, c_hi, lo, hi;
};

// Sums are additive, so every thread sums its piece of every span (partial_sums); digests
// are not, so a span cut by a thread boundary is marked in `crossing` and hashed whole later.
void stage_range(const Range& r, uint8_t* dst, uint64_t total, uint64_t chunk_bytes, const ws_span* spans,
                 uint64_t n_spans, uint64_t* span_digests, std::vector<double>& partial_sums, uint64_t* chunk_digests,
                 std::vector<uint8_t>& crossing) {
  XXH3_state_t chunk_state, span_state;
  XXH3_64bits_reset(&chunk_state);
  uint64_t chunk = r.c_lo;
  uint64_t chunk_end = std::min(total, (chunk + 1) * chunk_bytes);
  // First span that ends after lo.
  uint64_t s = std::lower_bound(spans, spans + n_spans, r.lo,
                                [](const ws_span& sp, uint64_t v) { return sp.dst_offset + sp.nbytes <= v; }) -
               spans;
  uint64_t pos = r.lo;
  bool span_open = false;
  auto feed = [&](const uint8_t* src, uint64_t len, bool non_temporal, uint8_t* out) {
    // Splits at chunk boundaries; copies (when src is data) and hashes the source bytes.
    while (len > 0) {
      uint64_t take = std::min(len, chunk_end - pos);
      if (out != nullptr && out != src) copy_bytes(out, src, take, non_temporal);
      XXH3_64bits_update(&chunk_state, src, take);
      pos += take;
      len -= take;
      src += (src == kZeros) ? 0 : take;
      if (out != nullptr) out += take;
      if (pos == chunk_end) {
        chunk_digests[chunk] = XXH3_64bits_digest(&chunk_state);
        XXH3_64bits_reset(&chunk_state);
        ++chunk;
        chunk_end = std::min(total, (chunk + 1) * chunk_bytes);
      }
    }
  };
  while (pos < r.hi) {
    const bool in_span = s < n_spans && spans[s].dst_offset <= pos;
    if (!in_span) {  // a gap: zero it, hash zeros
      uint64_t gap_end = std::min(r.hi, s < n_spans ? spans[s].dst_offset : r.hi);
      while (pos < gap_end) {
        uint64_t take = std::min<uint64_t>(gap_end - pos, kBlock);
        std::memset(dst + pos, 0, take);
        feed(kZeros, take, false, nullptr);
      }
      continue;
    }
    const ws_span& sp = spans[s];
    const uint64_t sp_end = sp.dst_offset + sp.nbytes;
    const bool whole = sp.dst_offset >= r.lo && sp_end <= r.hi;
    if (!whole) crossing[s] = 1;
    if (whole && !span_open) {
      XXH3_64bits_reset(&span_state);
      span_open = true;
    }
    const bool non_temporal = sp.nbytes >= kNonTemporalMin;
    const uint64_t isz = item_size(sp.dtype);
    const uint64_t block = kBlock - kBlock % isz;
    while (pos < std::min(sp_end, r.hi)) {
      uint64_t take = std::min(block, std::min(sp_end, r.hi) - pos);
      const uint8_t* src = static_cast<const uint8_t*>(sp.src) + (pos - sp.dst_offset);
      // Each element is summed by the block holding its first byte; the source is whole,
      // so an element split by a block or thread boundary is still read entirely.
      const uint64_t a = pos - sp.dst_offset, b = a + take;
      const uint64_t e0 = (a + isz - 1) / isz, e1 = (b + isz - 1) / isz;
      partial_sums[s] += sum_block(static_cast<const uint8_t*>(sp.src) + e0 * isz, (e1 - e0) * isz, sp.dtype);
      feed(src, take, non_temporal, dst + pos);
      if (whole) XXH3_64bits_update(&span_state, src, take);
    }
    if (whole) {
      span_digests[s] = XXH3_64bits_digest(&span_state);
      span_open = false;
    }
    if (pos >= sp_end) ++s;
  }
  store_fence();
}

}  // namespace

extern "C" {

int ws_abi_version(void) { return 3; }

int ws_default_threads(void) {
  unsigned n = std::thread::hardware_concurrency();
  return n == 0 ? 1 : static_cast<int>(n);
}

int ws_stage(uint8_t* dst, uint64_t total, uint64_t chunk_bytes, const ws_span* spans, uint64_t n_spans,
             uint64_t* span_digests, double* span_sums, uint64_t* chunk_digests, int n_threads) {
  if ((dst == nullptr && total > 0) || chunk_bytes == 0) return WS_INVALID_ARGUMENT;
  uint64_t cursor = 0;
  for (uint64_t i = 0; i < n_spans; ++i) {
    if (spans[i].dst_offset < cursor || spans[i].dst_offset + spans[i].nbytes > total) return WS_INVALID_ARGUMENT;
    if (spans[i].src == nullptr && spans[i].nbytes > 0) return WS_INVALID_ARGUMENT;
    cursor = spans[i].dst_offset + spans[i].nbytes;
  }
  const uint64_t n_chunks = (total + chunk_bytes - 1) / chunk_bytes;
  const int n = resolve_threads(n_threads, n_chunks);
  std::vector<Range> ranges;
  for (int t = 0; t < n; ++t) {
    uint64_t c_lo = n_chunks * t / n, c_hi = n_chunks * (t + 1) / n;
    ranges.push_back({c_lo, c_hi, c_lo * chunk_bytes, std::min(total, c_hi * chunk_bytes)});
  }
  std::vector<std::vector<uint8_t>> crossing(n, std::vector<uint8_t>(n_spans, 0));
  std::vector<std::vector<double>> partial(n, std::vector<double>(n_spans, 0.0));
  int rc = run_parallel(n, [&](int t) {
    if (ranges[t].lo < ranges[t].hi)
      stage_range(ranges[t], dst, total, chunk_bytes, spans, n_spans, span_digests, partial[t], chunk_digests, crossing[t]);
  });
  if (rc != WS_OK) return rc;
  for (uint64_t i = 0; i < n_spans; ++i) {
    double sum = 0.0;
    for (int t = 0; t < n; ++t) sum += partial[t][i];
    span_sums[i] = sum;
  }
  // Spans cut by a thread boundary were copied in pieces: digest them whole (hash only).
  std::vector<uint64_t> cut;
  for (uint64_t i = 0; i < n_spans; ++i) {
    bool any = false;
    for (int t = 0; t < n; ++t) any = any || crossing[t][i];
    if (any || spans[i].nbytes == 0) cut.push_back(i);
  }
  return run_parallel(resolve_threads(n_threads, cut.size()), [&](int t) {
    const int m = resolve_threads(n_threads, cut.size());
    for (uint64_t k = t; k < cut.size(); k += m) {
      const ws_span& sp = spans[cut[k]];
      span_digests[cut[k]] = XXH3_64bits(sp.src, sp.nbytes);
    }
  });
}

int ws_digest_staged(uint8_t* dst, uint64_t total, uint64_t chunk_bytes, const ws_span* spans, uint64_t n_spans,
                     uint64_t* span_digests, double* span_sums, uint64_t* chunk_digests, int n_threads) {
  // Same pass as ws_stage with every span's source being its own place in dst: no copy.
  std::vector<ws_span> inplace(spans, spans + n_spans);
  for (auto& sp : inplace) sp.src = dst + sp.dst_offset;
  return ws_stage(dst, total, chunk_bytes, inplace.data(), n_spans, span_digests, span_sums, chunk_digests, n_threads);
}

int ws_digest_ranges(const uint8_t* base, const uint64_t* offsets, const uint64_t* lengths, uint64_t n,
                     uint64_t* out, int n_threads) {
  if (base == nullptr && n > 0) return WS_INVALID_ARGUMENT;
  const int m = resolve_threads(n_threads, n);
  return run_parallel(m, [&](int t) {
    for (uint64_t i = t; i < n; i += m) out[i] = XXH3_64bits(base + offsets[i], lengths[i]);
  });
}

int ws_digest_spans(const ws_span* spans, uint64_t n_spans, uint64_t* span_digests, double* span_sums,
                    int n_threads) {
  if (n_spans > 0 && (spans == nullptr || span_digests == nullptr || span_sums == nullptr)) return WS_INVALID_ARGUMENT;
  for (uint64_t i = 0; i < n_spans; ++i)
    if (spans[i].src == nullptr && spans[i].nbytes > 0) return WS_INVALID_ARGUMENT;
  // Largest spans first, handed out one at a time: the embedding does not serialize the rest.
  std::vector<uint64_t> order(n_spans);
  for (uint64_t i = 0; i < n_spans; ++i) order[i] = i;
  std::sort(order.begin(), order.end(), [&](uint64_t a, uint64_t b) { return spans[a].nbytes > spans[b].nbytes; });
  std::atomic<uint64_t> next{0};
  return run_parallel(resolve_threads(n_threads, n_spans), [&](int) {
    XXH3_state_t state;
    for (uint64_t k = next++; k < n_spans; k = next++) {
      const ws_span& sp = spans[order[k]];
      const uint8_t* p = static_cast<const uint8_t*>(sp.src);
      const uint64_t isz = item_size(sp.dtype);
      const uint64_t block = kBlock - kBlock % isz;
      XXH3_64bits_reset(&state);
      double sum = 0.0;
      for (uint64_t pos = 0; pos < sp.nbytes; pos += block) {  // hash and sum each block while it is in cache
        const uint64_t take = std::min(block, sp.nbytes - pos);
        XXH3_64bits_update(&state, p + pos, take);
        sum += sum_block(p + pos, take - take % isz, sp.dtype);
      }
      span_digests[order[k]] = XXH3_64bits_digest(&state);
      span_sums[order[k]] = sum;
    }
  });
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

}  // extern "C"
