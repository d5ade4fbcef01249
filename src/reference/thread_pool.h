// A small fixed-size thread pool with a statically partitioned parallel_for, used by the CPU
// reference. Static partitioning only decides which thread computes which output; no result of
// the reference depends on it.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <exception>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace mok::reference {

// The thread count to use: `requested` when > 0, else the environment variable MOK_NUM_THREADS,
// else std::thread::hardware_concurrency() (at least 1). Throws mok::Error for a negative
// request or a malformed MOK_NUM_THREADS.
int resolve_num_threads(int requested);

class ThreadPool {
 public:
  explicit ThreadPool(int num_threads);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int num_threads() const { return num_threads_; }

  // Calls fn(index) for every index in [0, n). Thread t of N runs the contiguous range
  // [n*t/N, n*(t+1)/N); the calling thread is thread 0. Returns when all calls are done and
  // rethrows the first exception any of them threw. A call from inside fn runs serially.
  void parallel_for(int64_t n, const std::function<void(int64_t)>& fn);

 private:
  void worker_loop(int thread_index);
  void run_chunk(int thread_index);

  int num_threads_;
  std::vector<std::thread> workers_;
  std::mutex mutex_;
  std::condition_variable start_cv_;
  std::condition_variable done_cv_;
  uint64_t generation_ = 0;  // bumped once per parallel_for; workers wake on a change
  int workers_pending_ = 0;
  bool stopping_ = false;
  int64_t job_size_ = 0;
  const std::function<void(int64_t)>* job_fn_ = nullptr;
  std::exception_ptr job_error_;
};

}  // namespace mok::reference
