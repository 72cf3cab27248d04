#include "workspace.h"

#include <sys/mman.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <mutex>
#include <new>
#include <vector>

namespace mhc::cpu {

using Clock = std::chrono::steady_clock;

class Arena {
 public:
  explicit Arena(size_t bytes);
  ~Arena() { std::free(data_); }
  Arena(const Arena&) = delete;
  Arena& operator=(const Arena&) = delete;

  char* data() const { return data_; }
  size_t bytes() const { return bytes_; }
  Clock::time_point idle_since;

 private:
  size_t bytes_;
  char* data_;
};

namespace {

// Arenas of at least a huge page are whole huge pages, aligned to one, so the kernel can back
// them with 2 MiB pages.
constexpr size_t kHugePage = size_t{2} << 20;

size_t arena_bytes(size_t bytes) {
  const size_t unit = bytes >= kHugePage ? kHugePage : size_t{64};
  return std::max(unit, (bytes + unit - 1) / unit * unit);
}

class Cache {
 public:
  Arena* lease(size_t bytes) {
    std::vector<Arena*> expired;
    Arena* found = nullptr;
    {
      const std::lock_guard<std::mutex> lock(mutex_);
      take_expired(Clock::now(), &expired);
      auto best = idle_.end();
      for (auto it = idle_.begin(); it != idle_.end(); ++it) {
        if ((*it)->bytes() >= bytes && (best == idle_.end() || (*it)->bytes() < (*best)->bytes())) {
          best = it;
        }
      }
      if (best != idle_.end()) {
        found = *best;
        idle_bytes_ -= found->bytes();
        idle_.erase(best);
      }
    }
    for (Arena* arena : expired) delete arena;
    return found != nullptr ? found : new Arena(arena_bytes(bytes));
  }

  void hand_back(Arena* arena) {
    std::vector<Arena*> freed;
    {
      const std::lock_guard<std::mutex> lock(mutex_);
      const Clock::time_point now = Clock::now();
      take_expired(now, &freed);
      arena->idle_since = now;
      idle_.push_back(arena);
      idle_bytes_ += arena->bytes();
      // Over the bound: free the longest idle first (the arena just handed back last).
      while (idle_bytes_ > kMaxIdleBytes) {
        freed.push_back(idle_.front());
        idle_bytes_ -= idle_.front()->bytes();
        idle_.erase(idle_.begin());
      }
    }
    for (Arena* stale : freed) delete stale;
  }

  void release_idle() {
    std::vector<Arena*> freed;
    {
      const std::lock_guard<std::mutex> lock(mutex_);
      freed.swap(idle_);
      idle_bytes_ = 0;
    }
    for (Arena* arena : freed) delete arena;
  }

  WorkspaceCacheStats stats() {
    const std::lock_guard<std::mutex> lock(mutex_);
    return {static_cast<int>(idle_.size()), idle_bytes_};
  }

 private:
  // Moves the arenas idle for kIdleSeconds to `expired` (freed after the lock is dropped).
  void take_expired(Clock::time_point now, std::vector<Arena*>* expired) {
    const auto limit = std::chrono::duration<double>(kIdleSeconds);
    // idle_ is in hand-back order, so the expired ones are a prefix.
    auto first_fresh = idle_.begin();
    while (first_fresh != idle_.end() && now - (*first_fresh)->idle_since >= limit) {
      idle_bytes_ -= (*first_fresh)->bytes();
      expired->push_back(*first_fresh);
      ++first_fresh;
    }
    idle_.erase(idle_.begin(), first_fresh);
  }

  std::mutex mutex_;
  std::vector<Arena*> idle_;  // in hand-back order
  size_t idle_bytes_ = 0;
};

// Never destroyed: calls may run during static destruction (another library's destructor), and
// the process's memory goes back to the system at exit anyway.
Cache& cache() {
  static Cache* instance = new Cache();
  return *instance;
}

}  // namespace

Arena::Arena(size_t bytes) : bytes_(bytes) {
  const size_t alignment = bytes >= kHugePage ? kHugePage : size_t{64};
  data_ = static_cast<char*>(std::aligned_alloc(alignment, bytes));
  if (data_ == nullptr) throw std::bad_alloc();
  advise_huge_pages(data_, bytes);
}

void advise_huge_pages(void* data, size_t bytes) {
  const auto begin = reinterpret_cast<uintptr_t>(data);
  const uintptr_t first = (begin + kHugePage - 1) / kHugePage * kHugePage;
  const uintptr_t last = (begin + bytes) / kHugePage * kHugePage;
  // NOLINTNEXTLINE(performance-no-int-to-ptr): madvise takes the page-aligned address back
  if (last > first) madvise(reinterpret_cast<void*>(first), last - first, MADV_HUGEPAGE);
}

Workspace::Workspace(size_t bytes) : arena_(bytes > 0 ? cache().lease(bytes) : nullptr) {}

Workspace::~Workspace() {
  if (arena_ != nullptr) cache().hand_back(arena_);
}

void* Workspace::take_bytes(size_t bytes) {
  bytes = round_up(bytes);
  if (bytes == 0) return nullptr;
  if (arena_ == nullptr || used_ + bytes > arena_->bytes()) {
    // A plan that under-counts its workspace is a bug in the library, not bad input.
    std::abort();
  }
  void* piece = arena_->data() + used_;
  used_ += bytes;
  return piece;
}

WorkspaceCacheStats workspace_cache_stats() { return cache().stats(); }

void release_idle_workspaces() { cache().release_idle(); }

}  // namespace mhc::cpu
