// Bulk byte movement for the `tcp` transport: sends from memory and verified receives.
// The control protocol (request/response headers, tokens) stays in Python; these calls
// move the payload with the GIL released and report errors as -errno.
#include "weightsync_native.h"

#include <errno.h>
#include <sys/socket.h>
#include <sys/types.h>
#include <unistd.h>

#include <algorithm>

#define XXH_INLINE_ALL
#include <xxhash.h>

namespace {
constexpr uint64_t kPiece = 1 << 20;  // bytes per syscall: hashed while still in cache
}

extern "C" {

int64_t ws_send_mem_ranges(int sock, const uint8_t* const* ptrs, const uint64_t* lengths, uint64_t n) {
  int64_t sent_total = 0;
  for (uint64_t i = 0; i < n; ++i) {
    const uint8_t* p = ptrs[i];
    uint64_t left = lengths[i];
    while (left > 0) {
      ssize_t s = send(sock, p, static_cast<size_t>(std::min<uint64_t>(left, 1ull << 30)), MSG_NOSIGNAL);
      if (s < 0) {
        if (errno == EINTR) continue;
        return -errno;
      }
      p += s;
      left -= static_cast<uint64_t>(s);
      sent_total += s;
    }
  }
  return sent_total;
}

int64_t ws_recv_verify(int sock, uint8_t* base, const uint64_t* dst_offsets, const uint64_t* lengths,
                       const uint64_t* digests, uint64_t n, uint8_t* ok) {
  XXH3_state_t* state = digests == nullptr ? nullptr : XXH3_createState();
  if (digests != nullptr && state == nullptr) return -ENOMEM;
  int64_t received = 0;
  int64_t failed = 0;
  for (uint64_t i = 0; i < n && failed == 0; ++i) {
    uint8_t* p = base + dst_offsets[i];
    uint64_t left = lengths[i];
    if (state != nullptr) XXH3_64bits_reset(state);
    while (left > 0) {
      ssize_t r = recv(sock, p, static_cast<size_t>(std::min(left, kPiece)), 0);
      if (r < 0) {
        if (errno == EINTR) continue;
        failed = -errno;
        break;
      }
      if (r == 0) {
        failed = -ECONNRESET;  // the peer closed mid-payload
        break;
      }
      if (state != nullptr) XXH3_64bits_update(state, p, static_cast<size_t>(r));
      p += r;
      left -= static_cast<uint64_t>(r);
      received += r;
    }
    ok[i] = state == nullptr || XXH3_64bits_digest(state) == digests[i] ? 1 : 0;
  }
  if (state != nullptr) XXH3_freeState(state);
  return failed != 0 ? failed : received;
}

}  // extern "C"
