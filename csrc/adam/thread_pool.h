// A persistent pool of worker threads for the Adam kernel and the reductions.
#pragma once

#include <sys/types.h>

#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace offload_adam {

// `run(job)` calls job(index, count) once on each of `count` threads: index 0 on the calling
// thread, 1..count-1 on the pool's workers, and returns when every call has returned. One job
// runs at a time; a second caller (another Python thread, the GIL being released) waits.
// Jobs must not throw.
class ThreadPool {
 public:
  explicit ThreadPool(int num_threads);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int num_threads();
  void resize(int num_threads);
  void run(const std::function<void(int, int)>& job);

 private:
  void start_workers(int num_threads);  // call_mutex_ held
  void stop_workers();                  // call_mutex_ held
  void worker_loop(int index, uint64_t start_generation);
  void restart_after_fork();  // call_mutex_ held

  std::mutex call_mutex_;         // held for the whole of run() / resize(): one job at a time
  std::mutex state_mutex_;        // guards the fields below it
  std::condition_variable wake_;  // workers wait here for a new generation or stop
  std::condition_variable done_;  // the caller waits here for remaining_ == 0
  const std::function<void(int, int)>* job_ = nullptr;  // borrowed from run()'s caller
  uint64_t generation_ = 0;
  int remaining_ = 0;  // workers that have not finished the current job
  int job_count_ = 1;  // threads taking part in the current job
  bool stopping_ = false;
  int num_threads_ = 1;               // workers_.size() + 1 (the caller)
  std::vector<std::thread> workers_;  // owned; joined by stop_workers()
  pid_t owner_pid_;                   // process that started workers_; a forked child has none of them
};

}  // namespace offload_adam
