// CUDA variant of staging: device buffers -> host-registered (pinned) arena by DMA, then the
// shim's digest pass over the staged bytes. Built only where the CUDA toolkit is found, as
// its own library (cudart linked statically), so the main shim never needs a CUDA runtime.
#include <cuda_runtime.h>

#include <cstdint>
#include <vector>

#include "weightsync_native.h"

extern "C" {

int ws_cuda_device_count(void) {
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess ? n : 0;
}

// Spans' src are device pointers. The arena range [dst, dst + total) is pinned with
// cudaHostRegister for the copy (idempotent: an already registered range is fine).
int ws_cuda_stage(uint8_t* dst, uint64_t total, const uint64_t* chunk_lengths, uint64_t n_chunks, uint64_t piece_bytes,
                  const ws_span* spans, uint64_t n_spans, uint64_t* span_digests, double* span_sums,
                  uint64_t* chunk_digests, int n_threads) {
  if (dst == nullptr && total > 0) return WS_INVALID_ARGUMENT;
  cudaError_t reg = cudaHostRegister(dst, total, cudaHostRegisterDefault);
  const bool registered_here = reg == cudaSuccess;
  if (!registered_here && reg != cudaErrorHostMemoryAlreadyRegistered) return WS_INTERNAL;
  cudaGetLastError();  // clear a sticky "already registered"
  cudaStream_t stream;
  if (cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking) != cudaSuccess) return WS_INTERNAL;
  int rc = WS_OK;
  for (uint64_t i = 0; i < n_spans && rc == WS_OK; ++i) {
    if (spans[i].dst_offset + spans[i].nbytes > total) rc = WS_INVALID_ARGUMENT;
    else if (spans[i].nbytes && cudaMemcpyAsync(dst + spans[i].dst_offset, spans[i].src, spans[i].nbytes,
                                                 cudaMemcpyDeviceToHost, stream) != cudaSuccess)
      rc = WS_INTERNAL;
  }
  if (cudaStreamSynchronize(stream) != cudaSuccess && rc == WS_OK) rc = WS_INTERNAL;
  cudaStreamDestroy(stream);
  if (registered_here) cudaHostUnregister(dst);
  if (rc != WS_OK) return rc;
  return ws_digest_staged(dst, total, chunk_lengths, n_chunks, piece_bytes, spans, n_spans, span_digests, span_sums,
                          chunk_digests, n_threads);
}

// Self-test for machines with a GPU: host pattern -> device -> staged back; returns the
// digest of the pattern and of the staged span (equal when the path works).
int ws_cuda_selftest(uint64_t nbytes, uint64_t* pattern_digest, uint64_t* staged_digest) {
  std::vector<uint8_t> pattern(nbytes), arena(nbytes + 256);
  for (uint64_t i = 0; i < nbytes; ++i) pattern[i] = static_cast<uint8_t>((i * 2654435761u) >> 13);
  void* dev = nullptr;
  if (cudaMalloc(&dev, nbytes) != cudaSuccess) return WS_INTERNAL;
  int rc = cudaMemcpy(dev, pattern.data(), nbytes, cudaMemcpyHostToDevice) == cudaSuccess ? WS_OK : WS_INTERNAL;
  ws_span span{dev, nbytes, 0, WS_U8, 0};
  double sum = 0;
  uint64_t chunk = 0, length = nbytes;
  if (rc == WS_OK)
    rc = ws_cuda_stage(arena.data(), nbytes, &length, nbytes ? 1 : 0, nbytes ? nbytes : 1, &span, 1, staged_digest, &sum,
                       &chunk, 0);
  cudaFree(dev);
  if (rc != WS_OK) return rc;
  uint64_t off = 0, len = nbytes;
  return ws_digest_ranges(pattern.data(), &off, &len, 1, pattern_digest, 1);
}

}  // extern "C"
