// XLA FFI handler (platform cpu): stages the call's input buffers into the arena with the
// same fused pass as ws_stage. The arena base and results addresses are attributes (both
// persistent); the slot's byte offset is the first operand (u32[2], lo/hi), so one
// compiled function serves every slot without a retrace.
#include <cstdint>
#include <vector>

#include "weightsync_native.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

int32_t ws_dtype_of(ffi::DataType t) {
  switch (t) {
    case ffi::DataType::F32: return WS_F32;
    case ffi::DataType::F16: return WS_F16;
    case ffi::DataType::BF16: return WS_BF16;
    case ffi::DataType::F64: return WS_F64;
    case ffi::DataType::S8: return WS_I8;
    case ffi::DataType::S16: return WS_I16;
    case ffi::DataType::S32: return WS_I32;
    case ffi::DataType::S64: return WS_I64;
    case ffi::DataType::U8: return WS_U8;
    case ffi::DataType::PRED: return WS_BOOL;
    default: return 0;
  }
}

// results: u64 span digests [n], f64 span sums [n], u64 chunk digests [len(chunk_lengths)].
ffi::Error StageImpl(ffi::RemainingArgs args, ffi::Result<ffi::BufferR1<ffi::U32>> status, uint64_t arena,
                     uint64_t results, ffi::Span<const int64_t> offsets, int64_t total,
                     ffi::Span<const int64_t> chunk_lengths, int64_t piece_bytes, int64_t threads) {
  if (args.size() < 1) return ffi::Error::InvalidArgument("the first operand must be the slot offset (u32[2])");
  auto slot = args.get<ffi::AnyBuffer>(0);
  if (!slot.has_value()) return slot.error();
  if (slot->element_type() != ffi::DataType::U32 || slot->element_count() != 2)
    return ffi::Error::InvalidArgument("the slot offset operand must be u32[2]");
  const uint32_t* lohi = static_cast<const uint32_t*>(slot->untyped_data());
  const uint64_t slot_offset = static_cast<uint64_t>(lohi[0]) | (static_cast<uint64_t>(lohi[1]) << 32);
  const size_t n = args.size() - 1;
  if (offsets.size() != n) return ffi::Error::InvalidArgument("offsets must have one entry per input buffer");
  std::vector<ws_span> spans(n);
  for (size_t i = 0; i < n; ++i) {
    auto buf = args.get<ffi::AnyBuffer>(i + 1);
    if (!buf.has_value()) return buf.error();
    const int32_t dt = ws_dtype_of(buf->element_type());
    if (dt == 0) return ffi::Error::InvalidArgument("unsupported element type in weightsync staging");
    spans[i] = ws_span{buf->untyped_data(), static_cast<uint64_t>(buf->size_bytes()),
                       static_cast<uint64_t>(offsets[i]), dt, 0};
  }
  const std::vector<uint64_t> lengths(chunk_lengths.begin(), chunk_lengths.end());
  auto* out = reinterpret_cast<uint8_t*>(results);
  auto* span_digests = reinterpret_cast<uint64_t*>(out);
  auto* span_sums = reinterpret_cast<double*>(out + 8 * n);
  auto* chunk_digests = reinterpret_cast<uint64_t*>(out + 16 * n);
  int rc = ws_stage(reinterpret_cast<uint8_t*>(arena) + slot_offset, total, lengths.data(), lengths.size(), piece_bytes,
                    spans.data(), n, span_digests, span_sums, chunk_digests, static_cast<int>(threads));
  status->typed_data()[0] = static_cast<uint32_t>(rc);
  if (rc != WS_OK) return ffi::Error::InvalidArgument("ws_stage refused the spans (overlap or out of range)");
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(WsStageFfi, StageImpl,
                              ffi::Ffi::Bind()
                                  .RemainingArgs()
                                  .Ret<ffi::BufferR1<ffi::U32>>()
                                  .Attr<uint64_t>("arena")
                                  .Attr<uint64_t>("results")
                                  .Attr<ffi::Span<const int64_t>>("offsets")
                                  .Attr<int64_t>("total")
                                  .Attr<ffi::Span<const int64_t>>("chunk_lengths")
                                  .Attr<int64_t>("piece_bytes")
                                  .Attr<int64_t>("threads"));
