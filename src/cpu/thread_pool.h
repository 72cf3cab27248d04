// A small fork-join pool: the caller and the workers pull task indices from one counter.
// Results never depend on which worker ran a task; kernels make sure of that by giving every
// task its own output range and reducing partials in task order.
//
// Whose threads: inside XLA (the FFI handlers) the helpers are XLA's own intra-op threads, lent
// through a ScopedExecutor, so mhc adds no threads of its own to a JAX process; the C++ API runs
// on the pool's workers, started at the first call that needs them.
//
// Spinning, bounded: waking a sleeping worker through the condition variable took about 15 us
// here, as long as a whole decode-sized operation, so a worker that finished a job spins for 50
// us (MHC_SPIN_US sets 0 to 10000) watching for the next one before it sleeps, and a caller spins
// as long for its helpers to finish before it sleeps. Back-to-back calls, and the phases of one
// call, then cost no wake-up; an idle pool sleeps and costs no CPU.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace mhc::cpu {

// Somewhere else to run a parallel_for's helper tasks: the XLA FFI handlers lend XLA's intra-op
// thread pool for the length of one call (src/ffi/cpu_handlers.cc). A scheduled task may run
// late, inline in schedule() or not before the call is done: parallel_for never waits for a task
// to start, only for its tasks' work, which the caller also takes from the shared counter.
class Executor {
 public:
  virtual ~Executor() = default;
  // Threads that run scheduled tasks (the caller may be one of them).
  virtual int threads() const = 0;
  virtual void schedule(std::function<void()> task) const = 0;
};

// While one lives, parallel_for calls made on its thread run their helpers on `executor` instead
// of the pool's own workers (nullptr: the pool's). Restores the previous choice when it ends.
class ScopedExecutor {
 public:
  explicit ScopedExecutor(const Executor* executor);
  ~ScopedExecutor();
  ScopedExecutor(const ScopedExecutor&) = delete;
  ScopedExecutor& operator=(const ScopedExecutor&) = delete;

 private:
  const Executor* previous_;
};

class ThreadPool {
 public:
  using Body = std::function<void(int64_t task, int worker)>;

  static ThreadPool& instance();
  ~ThreadPool();

  // threads < 1 restores the default: MHC_NUM_THREADS, else the hardware thread count.
  void set_threads(int threads);
  int threads();

  // Runs body(task, worker) for every task in [0, count), with 0 <= worker < max_workers, and
  // returns when all are done. If another call holds the pool, or from inside a task, runs
  // everything on this thread. Under a ScopedExecutor the helpers run on its executor, at most
  // threads() workers in all either way. body must not throw.
  void parallel_for(int64_t count, int max_workers, const Body& body);

 private:
  void run_on(const Executor& executor, int64_t count, int helpers, const Body& body);
  ThreadPool();
  void start();  // threads_ - 1 workers; call_mutex_ held
  void stop();
  void worker_loop(int worker, uint64_t seen);
  void run_tasks(int worker);

  std::mutex call_mutex_;  // one parallel_for (or resize) at a time
  std::mutex state_mutex_;
  std::condition_variable wake_;
  std::condition_variable done_;
  std::vector<std::thread> workers_;
  int threads_ = 1;                      // workers_ holds threads_ - 1 once started, none before
  std::atomic<uint64_t> generation_{0};  // written under state_mutex_, read while spinning
  bool stopping_ = false;
  int participants_ = 0;        // workers (besides the caller) taking part in the current job
  std::atomic<int> active_{0};  // participants still running the current job
  const Body* body_ = nullptr;
  int64_t count_ = 0;
  std::atomic<int64_t> next_{0};
};

}  // namespace mhc::cpu
