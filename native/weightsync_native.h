// weightsync native staging shim: fused copy + xxh3-64 + float64 sums, C ABI.
#pragma once
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

// Status codes returned by every entry point (mapped to errors.py classes in Python).
enum ws_status {
  WS_OK = 0,
  WS_INVALID_ARGUMENT = 1,  // spans overlap, leave [0, total), or a pointer is null
  WS_INTERNAL = 2,          // a worker thread failed
  WS_DATA_LOSS = 3,         // a delta encoding that does not decode (truncated, past the end)
};

// Element types, equal to weightsync.v1.DType values (used for the float64 sums).
enum ws_dtype {
  WS_F32 = 1, WS_F16 = 2, WS_BF16 = 3, WS_F64 = 4, WS_I8 = 5, WS_I16 = 6,
  WS_I32 = 7, WS_I64 = 8, WS_U8 = 9, WS_BOOL = 10,
};

typedef struct {
  const void* src;      // host pointer to the span's bytes (C order)
  uint64_t nbytes;
  uint64_t dst_offset;  // where the span goes in the destination region
  int32_t dtype;        // ws_dtype, for the sum
  int32_t _pad;
} ws_span;

// Span digests follow the piecewise rule: a span of at most piece_bytes bytes digests to
// its xxh3-64; a longer one to the xxh3-64 of the little-endian u64 xxh3-64s of its
// consecutive piece_bytes pieces (the last one shorter). A chunk plan that makes each
// piece of a large span its own chunk lets every such byte be hashed exactly once.
//
// Copies spans (sorted by dst_offset, non-overlapping) into dst[0, total), zeroes every
// gap, and computes in the same pass: xxh3-64 of each chunk (chunks tile [0, total) in
// order with the given lengths), float64 sum per span, and each span's piecewise digest.
// n_threads <= 0 uses ws_default_threads().
int ws_stage(uint8_t* dst, uint64_t total, const uint64_t* chunk_lengths, uint64_t n_chunks,
             uint64_t piece_bytes, const ws_span* spans, uint64_t n_spans, uint64_t* span_digests,
             double* span_sums, uint64_t* chunk_digests, int n_threads);

// ws_stage for bytes already in place (e.g. copied by a DMA engine): spans' src is
// ignored, each span is read from dst + dst_offset; gaps are zeroed, nothing is copied.
int ws_digest_staged(uint8_t* dst, uint64_t total, const uint64_t* chunk_lengths, uint64_t n_chunks,
                     uint64_t piece_bytes, const ws_span* spans, uint64_t n_spans, uint64_t* span_digests,
                     double* span_sums, uint64_t* chunk_digests, int n_threads);

// xxh3-64 of each (offset, length) range of base, in parallel (the verify path).
int ws_digest_ranges(const uint8_t* base, const uint64_t* offsets, const uint64_t* lengths,
                     uint64_t n, uint64_t* out, int n_threads);

// Piecewise xxh3-64 and float64 sum of each span's bytes in place (src, nbytes, dtype;
// dst_offset ignored), pieces spread over threads: the rollout's digest of what it hands
// the engine.
int ws_digest_spans(const ws_span* spans, uint64_t n_spans, uint64_t piece_bytes, uint64_t* span_digests,
                    double* span_sums, int n_threads);

// Plain copy with the same non-temporal stores (the benchmark's bound uses memcpy).
int ws_copy(uint8_t* dst, const uint8_t* src, uint64_t nbytes, int n_threads);

// dst = src and *digest = xxh3-64 of the bytes written, hashed from dst (not re-read from
// src, which another process may be changing: a mapped arena); one thread.
int ws_copy_digest(uint8_t* dst, const uint8_t* src, uint64_t nbytes, uint64_t* digest);

// dsts[i][0, lengths[i]) = srcs[i][...] for every pair, the bytes of all pairs split evenly
// over threads (non-temporal stores); pairs must not overlap (an engine's weight update).
int ws_copy_many(uint8_t* const* dsts, const uint8_t* const* srcs, const uint64_t* lengths, uint64_t n,
                 int n_threads);

// tcp transport (net.cc). Return bytes moved, or -errno. Sockets must be blocking
// (timeouts via SO_RCVTIMEO / SO_SNDTIMEO surface as -EAGAIN).
// Sends memory ranges (a trainer's mapped arena, a relay's receive buffers).
int64_t ws_send_mem_ranges(int sock, const uint8_t* const* ptrs, const uint64_t* lengths, uint64_t n);
// Receives n payloads back to back into base + dst_offsets[i], hashing each piece as it
// lands; ok[i] = 1 when payload i's xxh3-64 equals digests[i]. digests null: no hashing
// (the caller verifies the tensors the bytes make up), ok[i] = 1.
int64_t ws_recv_verify(int sock, uint8_t* base, const uint64_t* dst_offsets, const uint64_t* lengths,
                       const uint64_t* digests, uint64_t n, uint8_t* ok);

// Delta codec for 16-bit elements (delta.cc): the changed elements of `now` against
// `base` (n elements each), as LEB128 gaps + step bytes. Returns the bytes written to out,
// -1 when more than cap bytes would be needed (the caller sends the raw bytes instead),
// -2 for a null pointer; *changed (if not null) = elements that differ.
int64_t ws_delta16_encode(const uint16_t* base, const uint16_t* now, uint64_t n, uint8_t* out, uint64_t cap,
                          uint64_t* changed);
// Applies an encoding to buf (the base, n elements) in place: WS_OK, or WS_DATA_LOSS for an
// encoding that is truncated, names an element past the end or a step of 0 (buf may then
// hold part of the changes: rebuild from a clean base).
int ws_delta16_decode(uint16_t* buf, uint64_t n, const uint8_t* enc, uint64_t len);

// ws_stage, and in the same pass each chunk's delta against `base`, the previous version
// staged with the same layout (16-bit words; every chunk length must be even): chunk c's
// encoding (delta.cc) goes to delta_out + sum(delta_caps[0..c)), at most delta_caps[c]
// bytes; delta_lengths[c] = its size, or -1 when it would not fit (send that chunk raw).
int ws_stage_delta(uint8_t* dst, uint64_t total, const uint64_t* chunk_lengths, uint64_t n_chunks,
                   uint64_t piece_bytes, const ws_span* spans, uint64_t n_spans, uint64_t* span_digests,
                   double* span_sums, uint64_t* chunk_digests, const uint8_t* base, uint8_t* delta_out,
                   const uint64_t* delta_caps, int64_t* delta_lengths, int n_threads);

// A delta rebuilt and digested in one pass over a receive buffer that holds the base
// version (the rollout side of ws_stage_delta): per chunk, the changes its encoding
// enc[enc_offsets[c], + enc_lengths[c]) makes (none where enc_lengths[c] < 0) are applied
// block by block, each block then summed and hashed in place while in cache, as
// ws_digest_staged would (gaps zeroed). Every chunk length must be even. broken[c] = 1
// where an encoding did not decode (WS_DATA_LOSS's cases; its chunk's digest then differs).
int ws_rebuild_digest(uint8_t* buf, uint64_t total, const uint64_t* chunk_lengths, uint64_t n_chunks,
                      uint64_t piece_bytes, const ws_span* spans, uint64_t n_spans, uint64_t* span_digests,
                      double* span_sums, uint64_t* chunk_digests, const uint8_t* enc, uint64_t enc_total,
                      const uint64_t* enc_offsets, const int64_t* enc_lengths, uint8_t* broken, int n_threads);

// Sums of a row-major rows x cols matrix of unsigned integers of itemsize 1, 2 or 4
// bytes, each modulo 2^32: row_sums[r] over row r, col_sums[c] over column c, in one pass.
int ws_matrix_sums(const void* data, uint64_t rows, uint64_t cols, int itemsize, uint32_t* row_sums,
                   uint32_t* col_sums);
// The same sums over floats' bits, exp_mask their exponent bits (bf16 0x7F80, fp16 0x7C00,
// fp32 0x7F800000): an element whose exponent bits are all 0 (a zero of either sign, a
// subnormal) counts as 0; *nonfinite = the elements whose exponent bits are all 1 (NaN,
// infinity). exp_mask 0 is ws_matrix_sums (nonfinite may then be null).
int ws_float_matrix_sums(const void* data, uint64_t rows, uint64_t cols, int itemsize, uint32_t exp_mask,
                         uint32_t* row_sums, uint32_t* col_sums, uint64_t* nonfinite);

int ws_abi_version(void);
// Threads a pass given n_threads <= 0 runs on, decided once per process: the environment's
// WEIGHTSYNC_NATIVE_THREADS when a positive integer, else the cores of the process's CPU
// affinity capped by its cgroup's CPU quota, rounded up (a container's CPU limit: the
// node's core count would start a thread per node core in a pod limited to 2 CPUs, and
// the quota would throttle them).
int ws_default_threads(void);
// WEIGHTSYNC_NATIVE_THREADS as ws_default_threads reads it: 1..4096 written in at most four
// ASCII digits, else 0 (unset or ignored).
int ws_threads_setting(void);
// Whole cores of the CPU quota of the cgroup mounted at cgroup_root (v2 cpu.max, else v1
// cpu.cfs_quota_us / cpu.cfs_period_us), rounded up; 0 where there is no quota.
int ws_cpu_limit(const char* cgroup_root);

#ifdef __cplusplus
}
#endif
