// A small fork-join pool: the caller and the workers pull task indices from one counter.
// Results never depend on which worker ran a task; kernels make sure of that by giving every
// task its own output range and reducing partials in task order.
//
// Waking a sleeping worker through the condition variable took about 15 us here, as long as a
// whole decode-sized operation, so a worker that finished a job spins for a short while
// (kSpinMicroseconds) watching for the next one before it sleeps, and the caller spins likewise
// while the last workers finish. Back-to-back calls, and the phases of one call, then cost no
// wake-up; an idle pool sleeps.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace mhc::cpu {

class ThreadPool {
 public:
  using Body = std::function<void(int64_t task, int worker)>;

  static ThreadPool& instance();
  ~ThreadPool();

  // threads < 1 restores the default: MHC_NUM_THREADS, else the hardware thread count.
  void set_threads(int threads);
  int threads();

  // Runs body(task, worker) for every task in [0, count), with 0 <= worker < max_workers, and
  // returns when all are done. If another call holds the pool, runs everything on this thread.
  // body must not throw.
  void parallel_for(int64_t count, int max_workers, const Body& body);

 private:
  ThreadPool();
  void start(int threads);
  void stop();
  void worker_loop(int worker, uint64_t seen);
  void run_tasks(int worker);

  std::mutex call_mutex_;  // one parallel_for (or resize) at a time
  std::mutex state_mutex_;
  std::condition_variable wake_;
  std::condition_variable done_;
  std::vector<std::thread> workers_;
  int threads_ = 1;
  std::atomic<uint64_t> generation_{0};  // written under state_mutex_, read while spinning
  bool stopping_ = false;
  int participants_ = 0;        // workers (besides the caller) taking part in the current job
  std::atomic<int> active_{0};  // participants still running the current job
  const Body* body_ = nullptr;
  int64_t count_ = 0;
  std::atomic<int64_t> next_{0};
};

}  // namespace mhc::cpu
