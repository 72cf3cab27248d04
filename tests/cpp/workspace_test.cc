// The CPU backend's workspace cache (src/cpu/workspace.h): arenas reused across calls and threads,
// idle memory bounded by kMaxIdleBytes, arenas idle for kIdleSeconds freed; huge-page advice on
// callers' buffers. Built with
// workspace.cc directly (its functions are internal to libmhc).
#include "../../src/cpu/workspace.h"

#include <gtest/gtest.h>
#include <sys/mman.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

namespace mhc::cpu {
namespace {

constexpr size_t kMiB = size_t{1} << 20;

class WorkspaceCache : public ::testing::Test {
 protected:
  void SetUp() override { release_idle_workspaces(); }
  void TearDown() override { release_idle_workspaces(); }
};

TEST_F(WorkspaceCache, AnArenaHandedBackIsReusedByTheNextLease) {
  char* first = nullptr;
  {
    Workspace workspace(3 * kMiB);
    first = workspace.take<char>(3 * kMiB);
    ASSERT_NE(first, nullptr);
    EXPECT_EQ(workspace_cache_stats().idle_arenas, 0);
  }
  EXPECT_EQ(workspace_cache_stats().idle_arenas, 1);
  EXPECT_GE(workspace_cache_stats().idle_bytes, 3 * kMiB);
  Workspace again(2 * kMiB);
  EXPECT_EQ(again.take<char>(2 * kMiB), first);
  EXPECT_EQ(workspace_cache_stats().idle_arenas, 0);
}

TEST_F(WorkspaceCache, PiecesAreAlignedAndDisjoint) {
  Workspace workspace(Workspace::bytes_for<double>(3) + Workspace::bytes_for<float>(5));
  auto* a = workspace.take<double>(3);
  auto* b = workspace.take<float>(5);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(a) % 64, 0u);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(b) % 64, 0u);
  EXPECT_GE(reinterpret_cast<char*>(b), reinterpret_cast<char*>(a + 3));
  EXPECT_EQ(workspace.take<float>(0), nullptr);
}

TEST_F(WorkspaceCache, WorkspaceSizeCountsWhatTakeCarves) {
  WorkspaceSize size;
  size.take<double>(7);
  size.take<float>(100);
  size.take<char>(1);
  EXPECT_EQ(size.bytes(), 64u + 448u + 64u);
}

TEST_F(WorkspaceCache, ALeaseTakesTheSmallestIdleArenaThatFits) {
  char* small = nullptr;
  char* large = nullptr;
  {
    Workspace a(4 * kMiB), b(16 * kMiB);
    small = a.take<char>(1);
    large = b.take<char>(1);
  }
  ASSERT_EQ(workspace_cache_stats().idle_arenas, 2);
  Workspace fits_small(3 * kMiB);
  EXPECT_EQ(fits_small.take<char>(1), small);
  Workspace needs_large(5 * kMiB);
  EXPECT_EQ(needs_large.take<char>(1), large);
}

TEST_F(WorkspaceCache, ConcurrentLeasesGetTheirOwnArenas) {
  Workspace a(kMiB), b(kMiB);
  EXPECT_NE(a.take<char>(kMiB), b.take<char>(kMiB));
}

TEST_F(WorkspaceCache, IdleMemoryStaysWithinTheBound) {
  // More arenas in flight at once than the bound keeps, from several threads (as XLA's would).
  constexpr int kThreads = 4;
  const size_t each = kMaxIdleBytes / 3;
  std::vector<std::thread> threads;
  threads.reserve(kThreads);
  std::atomic<int> leased{0};
  for (int k = 0; k < kThreads; ++k) {
    threads.emplace_back([&] {
      Workspace workspace(each);
      workspace.take<char>(each)[0] = 1;
      ++leased;
      while (leased.load() < kThreads) std::this_thread::yield();
    });
  }
  for (std::thread& thread : threads) thread.join();
  const WorkspaceCacheStats stats = workspace_cache_stats();
  EXPECT_LE(stats.idle_bytes, kMaxIdleBytes);
  EXPECT_EQ(stats.idle_arenas, 2);
}

TEST_F(WorkspaceCache, AnArenaLargerThanTheBoundIsFreedAtOnce) {
  { Workspace workspace(kMaxIdleBytes + kMiB); }
  EXPECT_EQ(workspace_cache_stats().idle_arenas, 0);
  EXPECT_EQ(workspace_cache_stats().idle_bytes, 0u);
}

TEST_F(WorkspaceCache, ArenasIdleForTheIdleTimeAreFreedByTheNextLease) {
  { Workspace workspace(8 * kMiB); }
  ASSERT_EQ(workspace_cache_stats().idle_arenas, 1);
  std::this_thread::sleep_for(std::chrono::duration<double>(kIdleSeconds + 0.1));
  Workspace larger(16 * kMiB);  // does not fit in the idle arena, so cannot take it
  EXPECT_EQ(workspace_cache_stats().idle_arenas, 0);
}

// Whether Linux's smaps lists the mapping that holds `address` with VM_HUGEPAGE set (flag "hg",
// which madvise(MADV_HUGEPAGE) sets whether or not huge pages are available at the time).
bool advised_onto_huge_pages(const char* address) {
  std::ifstream smaps("/proc/self/smaps");
  const auto target = reinterpret_cast<uintptr_t>(address);
  std::string line;
  bool inside = false;
  while (std::getline(smaps, line)) {
    uintptr_t begin = 0;
    uintptr_t end = 0;
    char dash = 0;
    std::istringstream range(line);
    if (range >> std::hex >> begin >> dash >> end && dash == '-') {
      inside = begin <= target && target < end;
    } else if (inside && line.rfind("VmFlags:", 0) == 0) {
      return line.find(" hg") != std::string::npos;
    }
  }
  return false;
}

TEST(AdviseHugePages, AdvisesTheWholeHugePagesInsideTheBufferAndNothingAround) {
  if (!std::ifstream("/sys/kernel/mm/transparent_hugepage/enabled")) {
    GTEST_SKIP() << "this kernel has no transparent huge pages";
  }
  constexpr size_t kHuge = 2 * kMiB;
  // A private mapping of 7 huge pages, aligned by hand: the buffer starts half a huge page in
  // and ends half a page early, so exactly pages 1 to 3 lie wholly inside it.
  const size_t span = 7 * kHuge;
  void* mapping = mmap(nullptr, span, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  ASSERT_NE(mapping, MAP_FAILED);
  const uintptr_t start = reinterpret_cast<uintptr_t>(mapping);
  char* aligned = static_cast<char*>(mapping) + ((start + kHuge - 1) / kHuge * kHuge - start);
  char* buffer = aligned + kHuge / 2;
  advise_huge_pages(buffer, 4 * kHuge);
  EXPECT_FALSE(advised_onto_huge_pages(aligned + kHuge - 1));
  EXPECT_TRUE(advised_onto_huge_pages(aligned + kHuge));
  EXPECT_TRUE(advised_onto_huge_pages(aligned + 4 * kHuge - 1));
  EXPECT_FALSE(advised_onto_huge_pages(aligned + 4 * kHuge));
  // Too small to hold a whole huge page: nothing is advised (no syscall for small outputs).
  char* small = aligned + 4 * kHuge + 100;
  advise_huge_pages(small, kHuge);
  EXPECT_FALSE(advised_onto_huge_pages(small));
  munmap(mapping, span);
}

}  // namespace
}  // namespace mhc::cpu
