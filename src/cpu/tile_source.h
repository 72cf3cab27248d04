// The pre kernels' one policy for where a token tile's x comes from and where its dx goes.
//
// pre_forward and pre_backward (pre_kernels.h) work on tiles of consecutive tokens, [tokens, M]
// rows of the activation type X (float or bf16). They never touch x or dx directly: they ask a
// TileSource. Four kinds of call share the kernels this way:
//
//   - the operations and their tensor-parallel split forms (pre_forward, pre_forward_finish,
//     pre_backward, pre_backward_finish) and the head: MemoryTiles, x read from the caller's
//     tensor and dx written into the caller's output;
//   - the fused boundary (boundary.cc): x_{l+1} written by sublayer l's post forward into the
//     tile just before the pre reads it (forward), or recomputed into a staging tile, and dx_{l+1}
//     staged and handed to sublayer l's post backward as soon as it is final (backward).
//
// A source's calls, for tile slot `slot` (a slot is one tile in flight; the kernel says how many):
//   x_tile(t0, tokens, slot)   the tile's x, row stride M, valid until the slot's next x_tile;
//   dx_tile(t0, slot)          where the backward stores the tile's dx, rounded to X as the
//                              operation's output would be;
//   consume(t0, begin, end, slot)  tokens [t0 + begin, t0 + end) of that dx are final (the
//                              backward calls it for every token once; for the decode split by
//                              rows, from several threads, one token each).
//
// Buffers: the kernel leases one workspace per call (workspace.h) and sizes it by its plan; a
// source that stages tiles says how many bytes per slot it needs (staging_bytes) and gets them
// from that workspace (attach). Nothing a source stages outlives the call.
//
// Widening: a source hands out tiles in X. The forward reads a bf16 tile in place: its
// projection widens a few blocks of rows at a time into an L1-sized piece (projection.h), and the
// pre-apply widens in its loads. The backward widens the tile to f32 into its own per-slot
// staging (its second sweep reads x three ways), and dx is accumulated in f32 and rounded to bf16
// once, when stored into dx_tile. f32 tiles are used in place.
//
// The results never depend on the source: a staged tile holds exactly the bits the separate
// operation would have stored to memory and read back, so the boundary equals the separate calls
// bit for bit.
#pragma once

#include <cstddef>
#include <cstdint>

namespace mhc::cpu {

template <class X>
class TileSource {
 public:
  virtual ~TileSource() = default;
  // Bytes of staging per slot for tiles of `tile` tokens (0: the source stages nothing).
  virtual size_t staging_bytes(int64_t /*tile*/) const { return 0; }
  // Gives the source its staging: `slots` consecutive pieces of staging_bytes(tile) bytes.
  virtual void attach(int64_t /*tile*/, int /*slots*/, void* /*staging*/) {}
  virtual const X* x_tile(int64_t t0, int64_t tokens, int slot) = 0;
  virtual X* dx_tile(int64_t t0, int slot) = 0;
  virtual void consume(int64_t t0, int64_t begin, int64_t end, int slot) = 0;
  // Whether consume() does anything (the decode split skips a parallel pass over the tokens).
  virtual bool consumes() const { return false; }
};

// x and dx in memory, [T, M] each (dx null for the forward).
template <class X>
class MemoryTiles final : public TileSource<X> {
 public:
  MemoryTiles(const X* x, X* dx, int64_t M) : x_(x), dx_(dx), M_(M) {}
  const X* x_tile(int64_t t0, int64_t /*tokens*/, int /*slot*/) override { return x_ + t0 * M_; }
  X* dx_tile(int64_t t0, int /*slot*/) override { return dx_ + t0 * M_; }
  void consume(int64_t /*t0*/, int64_t /*begin*/, int64_t /*end*/, int /*slot*/) override {}

 private:
  const X* x_;
  X* dx_;
  int64_t M_;
};

}  // namespace mhc::cpu
