#include "thread_pool.h"

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <memory>

namespace mhc::cpu {

namespace {
int default_threads() {
  if (const char* text = std::getenv("MHC_NUM_THREADS")) {
    char* end = nullptr;
    const long value = std::strtol(text, &end, 10);
    if (end != text && *end == '\0' && value >= 1 && value <= 1024) return static_cast<int>(value);
  }
  const unsigned hardware = std::thread::hardware_concurrency();
  return hardware == 0 ? 1 : static_cast<int>(hardware);
}
// How long a worker watches for the next job, and the caller for the end of its job, before
// sleeping: long enough to bridge the phases of one operation and back-to-back operations, short
// enough that an idle pool costs nothing noticeable. MHC_SPIN_US (0 to 10000) overrides it.
std::chrono::microseconds spin_time() {
  static const std::chrono::microseconds spin = [] {
    constexpr long kDefault = 50, kMost = 10000;
    const char* text = std::getenv("MHC_SPIN_US");
    if (text == nullptr) return std::chrono::microseconds(kDefault);
    char* end = nullptr;
    const long value = std::strtol(text, &end, 10);
    const bool valid = end != text && *end == '\0' && value >= 0 && value <= kMost;
    return std::chrono::microseconds(valid ? value : kDefault);
  }();
  return spin;
}

// Spins until done() or the spin time has passed; returns done().
template <class Done>
bool spin_until(Done done) {
  const auto deadline = std::chrono::steady_clock::now() + spin_time();
  for (int round = 0;; ++round) {
    if (done()) return true;
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
    if ((round & 63) == 63 && std::chrono::steady_clock::now() > deadline) return done();
  }
}

// The executor of this thread's parallel_for calls (ScopedExecutor), and whether this thread is
// running a task of an executor's job (a nested parallel_for then runs inline, as it does inside
// the pool's own jobs, where call_mutex_ is held).
thread_local const Executor* current_executor = nullptr;
thread_local bool inside_executor_task = false;

// One parallel_for on an executor. Shared with the scheduled helpers, which may start after the
// call returned: they then find no task left and touch nothing but this.
struct ExecutorJob {
  const ThreadPool::Body* body = nullptr;  // valid while done < count
  int64_t count = 0;
  int participants = 0;  // helpers that may take tasks, worker indices 1..participants
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};
  std::atomic<int> joined{0};
  std::mutex mutex;
  std::condition_variable finished;

  void run_tasks(int worker) {
    const bool outer = inside_executor_task;
    inside_executor_task = true;
    for (int64_t task = next.fetch_add(1); task < count; task = next.fetch_add(1)) {
      (*body)(task, worker);
      if (done.fetch_add(1, std::memory_order_acq_rel) + 1 == count) {
        { std::lock_guard<std::mutex> lock(mutex); }
        finished.notify_all();
      }
    }
    inside_executor_task = outer;
  }
};
}  // namespace

ScopedExecutor::ScopedExecutor(const Executor* executor) : previous_(current_executor) {
  current_executor = executor;
}

ScopedExecutor::~ScopedExecutor() { current_executor = previous_; }

ThreadPool& ThreadPool::instance() {
  static ThreadPool pool;
  return pool;
}

ThreadPool::ThreadPool() : threads_(default_threads()) {}

ThreadPool::~ThreadPool() { stop(); }

void ThreadPool::start() {
  uint64_t current = 0;
  int threads = 0;
  {
    std::lock_guard<std::mutex> lock(state_mutex_);
    threads = threads_;
    stopping_ = false;
    participants_ = 0;
    current = generation_.load();
  }
  // A new worker must wait for the next job: starting from generation 0 would make it join the
  // last (finished) job's generation and steal tasks of the next one under a stale worker index.
  for (int worker = 1; worker < threads; ++worker) {
    workers_.emplace_back([this, worker, current] { worker_loop(worker, current); });
  }
}

void ThreadPool::stop() {
  {
    std::lock_guard<std::mutex> lock(state_mutex_);
    stopping_ = true;
  }
  wake_.notify_all();
  for (std::thread& thread : workers_) thread.join();
  workers_.clear();
}

void ThreadPool::set_threads(int threads) {
  std::lock_guard<std::mutex> call(call_mutex_);
  const int wanted = threads < 1 ? default_threads() : threads;
  if (wanted == this->threads()) return;
  stop();  // the next parallel_for on the pool's own workers starts the new count
  std::lock_guard<std::mutex> lock(state_mutex_);
  threads_ = wanted;
}

int ThreadPool::threads() {
  std::lock_guard<std::mutex> lock(state_mutex_);
  return threads_;
}

void ThreadPool::run_tasks(int worker) {
  for (int64_t task = next_.fetch_add(1); task < count_; task = next_.fetch_add(1)) {
    (*body_)(task, worker);
  }
}

void ThreadPool::worker_loop(int worker, uint64_t seen) {
  for (;;) {
    spin_until([&] { return generation_.load(std::memory_order_acquire) != seen; });
    {
      std::unique_lock<std::mutex> lock(state_mutex_);
      wake_.wait(lock, [&] { return stopping_ || generation_ != seen; });
      if (stopping_) return;
      seen = generation_.load();
      if (worker > participants_) continue;  // this job has fewer scratch slots than threads
    }
    run_tasks(worker);
    std::lock_guard<std::mutex> lock(state_mutex_);
    if (--active_ == 0) done_.notify_one();
  }
}

void ThreadPool::run_on(const Executor& executor, int64_t count, int helpers, const Body& body) {
  auto job = std::make_shared<ExecutorJob>();
  job->body = &body;
  job->count = count;
  job->participants = helpers;
  for (int helper = 0; helper < helpers; ++helper) {
    executor.schedule([job] {
      const int worker = job->joined.fetch_add(1) + 1;
      if (worker <= job->participants) job->run_tasks(worker);
    });
  }
  job->run_tasks(0);
  const auto finished = [&] { return job->done.load(std::memory_order_acquire) == count; };
  if (spin_until(finished)) return;
  std::unique_lock<std::mutex> lock(job->mutex);
  job->finished.wait(lock, finished);
}

void ThreadPool::parallel_for(int64_t count, int max_workers, const Body& body) {
  if (count <= 0) return;
  if (inside_executor_task) {
    for (int64_t task = 0; task < count; ++task) body(task, 0);
    return;
  }
  if (current_executor != nullptr) {
    const int helpers = static_cast<int>(std::min<int64_t>(
        {threads() - 1, current_executor->threads() - 1, max_workers - 1, count - 1}));
    if (helpers <= 0) {
      for (int64_t task = 0; task < count; ++task) body(task, 0);
    } else {
      run_on(*current_executor, count, helpers, body);
    }
    return;
  }
  std::unique_lock<std::mutex> call(call_mutex_, std::try_to_lock);
  if (call.owns_lock() && workers_.empty() && threads_ > 1) start();
  const int helpers =
      call.owns_lock()
          ? static_cast<int>(std::min<int64_t>({threads_ - 1, max_workers - 1, count - 1}))
          : 0;
  if (helpers <= 0) {
    for (int64_t task = 0; task < count; ++task) body(task, 0);
    return;
  }
  {
    std::lock_guard<std::mutex> lock(state_mutex_);
    body_ = &body;
    count_ = count;
    next_.store(0);
    participants_ = helpers;
    active_ = helpers;
    generation_.fetch_add(1, std::memory_order_release);
  }
  wake_.notify_all();
  run_tasks(0);
  spin_until([&] { return active_.load(std::memory_order_acquire) == 0; });
  std::unique_lock<std::mutex> lock(state_mutex_);
  done_.wait(lock, [&] { return active_ == 0; });
  body_ = nullptr;
}

}  // namespace mhc::cpu
