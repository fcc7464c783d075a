// A small persistent pool of worker threads for the memory-bound kernels (Adam, sums of squares).
//
// Why not OpenMP: torch ships its own libgomp, and two OpenMP runtimes in one process fight over cores.
// Why persistent: creating threads on every optimizer step costs tens of microseconds per thread, which
// dominates the step of a small tensor. One pool is owned by one object (e.g. a CPUAdam instance); there
// is no process-wide pool.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace offload {

class ThreadPool {
 public:
  // `num_threads` >= 1 counts the calling thread: a pool of 1 starts no thread at all.
  explicit ThreadPool(int num_threads);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int size() const { return static_cast<int>(workers_.size()) + 1; }

  // Runs task(i) once for every i in [0, num_tasks), spread over the workers and the calling thread, and
  // returns when all have finished. Tasks are handed out in increasing order (a shared counter), so a slow
  // core just takes fewer of them. `task` must not throw. Calls from several threads are serialised.
  void parallel_for(int64_t num_tasks, const std::function<void(int64_t)>& task);

 private:
  void worker_loop();
  void run_tasks();

  std::vector<std::thread> workers_;
  std::mutex call_mutex_;  // one parallel_for at a time
  std::mutex mutex_;       // guards everything below
  std::condition_variable wake_;
  std::condition_variable done_;
  const std::function<void(int64_t)>* task_ = nullptr;
  int64_t num_tasks_ = 0;
  int64_t next_task_ = 0;
  uint64_t generation_ = 0;
  int busy_workers_ = 0;
  bool stopping_ = false;
};

}  // namespace offload
