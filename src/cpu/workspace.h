// The CPU backend's scratch memory: one arena per call, leased from a process-wide cache.
//
// A kernel sizes everything it needs for the call up front (its plan), leases one arena of that
// many bytes, carves it with take<T>() and hands the arena back when the lease ends. Arenas are
// shared by all calling threads: a call takes the smallest idle arena large enough, or allocates
// a new one.
//
// Why a cache: a fresh multi-MiB allocation is faulted in page by page on first touch. Here
// (virtualized EPYC, 4 KiB pages) allocating and filling 50 MiB cost 60-70 ms against 4-11 ms
// to fill a buffer already resident, next to a 170 ms pre_backward at T = 8192, n = 4, D = 4096.
// Arenas are asked for transparent huge pages (madvise), which cut a fresh 50 MiB to 4-8 ms where
// the kernel allows it (THP "madvise" or "always").
//
// Bounds: idle arenas hold at most kMaxIdleBytes in all; an arena handed back past that is freed
// at once, and an arena idle for kIdleSeconds is freed by the next lease or hand-back (no thread
// watches the clock, so a process that stops calling keeps at most kMaxIdleBytes until its next
// call). Memory in use is one arena per call in flight. Before, each calling thread kept its own
// largest buffers for ever (thread_local), up to 12 of them, 48-84 MiB per thread.
// What stays thread_local is the projection's scratch (projection.cc: a folded weight block, a
// step's block sums, a packed column block), sized by one token tile and one feature block, not by
// T or D: tens to hundreds of KiB per thread.
//
// Arenas are not zeroed: a kernel that needs zeros writes them in the tiles that own the memory,
// on the workers (first touch there spreads the page faults over the threads too).
#pragma once

#include <cstddef>
#include <cstdint>

namespace mhc::cpu {

class Arena;

// Idle arenas kept for reuse, in bytes: the largest workspace of the models this library targets
// (pre_backward at n = 4, D = 7168, bf16: 16 chunk accumulators of 5.5 MiB and the f32 staging),
// with room to spare.
inline constexpr size_t kMaxIdleBytes = size_t{128} << 20;
inline constexpr double kIdleSeconds = 1.0;

// A lease of at least `bytes` bytes of scratch memory for one call; the arena returns to the cache
// when the lease is destroyed. take<T>(count) hands out consecutive 64-byte aligned pieces.
class Workspace {
 public:
  explicit Workspace(size_t bytes);
  ~Workspace();
  Workspace(const Workspace&) = delete;
  Workspace& operator=(const Workspace&) = delete;

  template <class T>
  T* take(size_t count) {
    return static_cast<T*>(take_bytes(count * sizeof(T)));
  }

  // Bytes of `count` values of T as take<T>() counts them (rounded up to the alignment): plans
  // add these up to size the lease.
  template <class T>
  static size_t bytes_for(size_t count) {
    return round_up(count * sizeof(T));
  }

 private:
  static size_t round_up(size_t bytes) {
    return (bytes + kAlignment - 1) / kAlignment * kAlignment;
  }
  void* take_bytes(size_t bytes);

  static constexpr size_t kAlignment = 64;
  Arena* arena_;
  size_t used_ = 0;
};

// The other side of Workspace::take: counts the bytes of the same sequence of take<T>() calls, so a
// plan describes its workspace once (a layout function templated on the taker) and both sizes
// the lease and carves it from that description.
class WorkspaceSize {
 public:
  template <class T>
  T* take(size_t count) {
    bytes_ += Workspace::bytes_for<T>(count);
    return nullptr;
  }
  size_t bytes() const { return bytes_; }

 private:
  size_t bytes_ = 0;
};

// Statistics of the cache, for tests: idle arenas and their bytes.
struct WorkspaceCacheStats {
  int idle_arenas;
  size_t idle_bytes;
};
WorkspaceCacheStats workspace_cache_stats();

// Frees every idle arena (tests; a host that wants the memory back at once).
void release_idle_workspaces();

// Asks the kernel to back the whole 2 MiB pages inside [data, data + bytes) with transparent huge
// pages (madvise MADV_HUGEPAGE; nothing where none fits). For outputs the caller allocated: XLA
// and torch allocate every output afresh and glibc maps each block over 32 MiB anew, so a kernel
// otherwise first-touches it 4 KiB page by page (65,536 faults for 256 MiB: 350 ms here, against
// 75 ms in 2 MiB pages). A hint: the contents stay, a failure or THP "never" changes nothing.
void advise_huge_pages(void* data, size_t bytes);

}  // namespace mhc::cpu
