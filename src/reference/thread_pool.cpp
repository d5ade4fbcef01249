// Thread pool of the CPU reference: persistent workers woken once per parallel_for.
#include "thread_pool.h"

#include <cerrno>
#include <cstdlib>
#include <string>

#include "mok/error.h"

namespace mok::reference {

namespace {

// Set on pool workers and on a caller while it runs a job, so that a nested parallel_for runs
// serially instead of waiting for workers that are busy with the outer job.
thread_local bool tls_inside_job = false;

}  // namespace

int resolve_num_threads(int requested) {
  if (requested < 0)
    throw Error(ErrorCode::kInvalidArgument,
                "reference: Options.num_threads is " + std::to_string(requested) +
                    "; expected 0 (automatic) or a positive thread count");
  if (requested > 0) return requested;
  if (const char* env = std::getenv("MOK_NUM_THREADS"); env != nullptr && *env != '\0') {
    errno = 0;
    char* end = nullptr;
    long value = std::strtol(env, &end, 10);
    if (errno != 0 || *end != '\0' || value < 1 || value > 4096)
      throw Error(ErrorCode::kInvalidArgument,
                  std::string("environment variable MOK_NUM_THREADS is '") + env +
                      "'; expected an integer in [1, 4096]");
    return static_cast<int>(value);
  }
  unsigned hardware = std::thread::hardware_concurrency();
  return hardware == 0 ? 1 : static_cast<int>(hardware);
}

ThreadPool::ThreadPool(int num_threads) : num_threads_(num_threads < 1 ? 1 : num_threads) {
  workers_.reserve(num_threads_ - 1);
  for (int t = 1; t < num_threads_; ++t) workers_.emplace_back([this, t] { worker_loop(t); });
}

ThreadPool::~ThreadPool() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stopping_ = true;
  }
  start_cv_.notify_all();
  for (auto& worker : workers_) worker.join();
}

void ThreadPool::run_chunk(int thread_index) {
  const int64_t begin = job_size_ * thread_index / num_threads_;
  const int64_t end = job_size_ * (thread_index + 1) / num_threads_;
  try {
    for (int64_t index = begin; index < end; ++index) (*job_fn_)(index);
  } catch (...) {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!job_error_) job_error_ = std::current_exception();
  }
}

void ThreadPool::worker_loop(int thread_index) {
  tls_inside_job = true;
  uint64_t seen_generation = 0;
  for (;;) {
    {
      std::unique_lock<std::mutex> lock(mutex_);
      start_cv_.wait(lock, [&] { return stopping_ || generation_ != seen_generation; });
      if (stopping_) return;
      seen_generation = generation_;
    }
    run_chunk(thread_index);
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (--workers_pending_ == 0) done_cv_.notify_one();
    }
  }
}

void ThreadPool::parallel_for(int64_t n, const std::function<void(int64_t)>& fn) {
  if (n <= 0) return;
  if (num_threads_ == 1 || n == 1 || tls_inside_job) {
    for (int64_t index = 0; index < n; ++index) fn(index);
    return;
  }
  {
    std::lock_guard<std::mutex> lock(mutex_);
    job_size_ = n;
    job_fn_ = &fn;
    job_error_ = nullptr;
    workers_pending_ = num_threads_ - 1;
    ++generation_;
  }
  start_cv_.notify_all();
  tls_inside_job = true;
  run_chunk(0);
  tls_inside_job = false;
  std::exception_ptr error;
  {
    std::unique_lock<std::mutex> lock(mutex_);
    done_cv_.wait(lock, [&] { return workers_pending_ == 0; });
    error = job_error_;
    job_fn_ = nullptr;
  }
  if (error) std::rethrow_exception(error);
}

}  // namespace mok::reference
