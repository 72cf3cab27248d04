#include "thread_pool.h"

#include <algorithm>
#include <chrono>
#include <cstdlib>

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
// enough that an idle pool costs nothing noticeable.
constexpr auto kSpin = std::chrono::microseconds(50);

// Spins until done() or kSpin has passed; returns done().
template <class Done>
bool spin_until(Done done) {
  const auto deadline = std::chrono::steady_clock::now() + kSpin;
  for (int round = 0;; ++round) {
    if (done()) return true;
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
    if ((round & 63) == 63 && std::chrono::steady_clock::now() > deadline) return done();
  }
}
}  // namespace

ThreadPool& ThreadPool::instance() {
  static ThreadPool pool;
  return pool;
}

ThreadPool::ThreadPool() { start(default_threads()); }

ThreadPool::~ThreadPool() { stop(); }

void ThreadPool::start(int threads) {
  uint64_t current = 0;
  {
    std::lock_guard<std::mutex> lock(state_mutex_);
    threads_ = threads;
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
  if (wanted == threads_) return;
  stop();
  start(wanted);
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

void ThreadPool::parallel_for(int64_t count, int max_workers, const Body& body) {
  if (count <= 0) return;
  std::unique_lock<std::mutex> call(call_mutex_, std::try_to_lock);
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
