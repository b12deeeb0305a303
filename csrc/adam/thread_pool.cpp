#include "adam/thread_pool.h"

#include <unistd.h>

namespace offload_adam {

ThreadPool::ThreadPool(int num_threads) : owner_pid_(getpid()) {
  std::lock_guard<std::mutex> call(call_mutex_);
  start_workers(num_threads);
}

ThreadPool::~ThreadPool() {
  std::lock_guard<std::mutex> call(call_mutex_);
  if (owner_pid_ == getpid()) stop_workers();
}

int ThreadPool::num_threads() {
  std::lock_guard<std::mutex> call(call_mutex_);
  return num_threads_;
}

void ThreadPool::resize(int num_threads) {
  std::lock_guard<std::mutex> call(call_mutex_);
  if (owner_pid_ != getpid()) restart_after_fork();
  if (num_threads == num_threads_) return;
  stop_workers();
  start_workers(num_threads);
}

void ThreadPool::start_workers(int num_threads) {
  if (num_threads < 1) num_threads = 1;
  {
    std::lock_guard<std::mutex> state(state_mutex_);
    stopping_ = false;
    job_ = nullptr;
    remaining_ = 0;
  }
  num_threads_ = num_threads;
  uint64_t start_generation;
  {
    std::lock_guard<std::mutex> state(state_mutex_);
    start_generation = generation_;
  }
  workers_.reserve(size_t(num_threads - 1));
  for (int index = 1; index < num_threads; ++index)
    workers_.emplace_back(&ThreadPool::worker_loop, this, index, start_generation);
}

void ThreadPool::stop_workers() {
  {
    std::lock_guard<std::mutex> state(state_mutex_);
    stopping_ = true;
  }
  wake_.notify_all();
  for (std::thread& worker : workers_) worker.join();
  workers_.clear();
  num_threads_ = 1;
}

void ThreadPool::restart_after_fork() {
  // In a forked child the worker threads do not exist: their std::thread objects can be
  // neither joined nor destroyed (destroying a joinable one aborts), so they are
  // deliberately leaked and a fresh set is started.
  int wanted = num_threads_;
  new std::vector<std::thread>(std::move(workers_));
  workers_ = std::vector<std::thread>();
  new (&state_mutex_) std::mutex();  // may have been held by a worker at fork time
  new (&wake_) std::condition_variable();
  new (&done_) std::condition_variable();
  owner_pid_ = getpid();
  start_workers(wanted);
}

void ThreadPool::run(const std::function<void(int, int)>& job) {
  std::lock_guard<std::mutex> call(call_mutex_);
  if (owner_pid_ != getpid()) restart_after_fork();
  const int count = num_threads_;
  if (count == 1) {
    job(0, 1);
    return;
  }
  {
    std::lock_guard<std::mutex> state(state_mutex_);
    job_ = &job;
    remaining_ = count - 1;
    job_count_ = count;
    ++generation_;
  }
  wake_.notify_all();
  job(0, count);
  std::unique_lock<std::mutex> state(state_mutex_);
  done_.wait(state, [this] { return remaining_ == 0; });
  job_ = nullptr;
}

void ThreadPool::worker_loop(int index, uint64_t start_generation) {
  uint64_t seen = start_generation;
  for (;;) {
    const std::function<void(int, int)>* job;
    int count;
    {
      std::unique_lock<std::mutex> state(state_mutex_);
      wake_.wait(state, [&] { return stopping_ || generation_ != seen; });
      if (stopping_) return;
      seen = generation_;
      job = job_;
      count = job_count_;
    }
    (*job)(index, count);
    {
      std::lock_guard<std::mutex> state(state_mutex_);
      if (--remaining_ == 0) done_.notify_one();
    }
  }
}

}  // namespace offload_adam
