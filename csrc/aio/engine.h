// Asynchronous file I/O on host buffers: a pool of worker threads doing pread/pwrite.
//
// Concurrency contract
// - submit() (caller thread) splits a request into pieces of `piece_size` bytes and appends
//   them to one of two FIFO queues, the urgent one (I/O that compute waits on) or the other;
//   it never blocks on I/O.
// - `threads` workers pop pieces, the urgent queue's first (a piece of the other queue waits
//   while any urgent one is queued, unless fewer than `background_depth` of its pieces are in
//   flight and its direction has no urgent piece queued: those places are kept for it, so that
//   on a drive that reads and writes at once the state's write-back goes on beside the urgent
//   reads, while the next step's reads ahead never take the urgent reads' bandwidth, their own
//   direction's); at most `queue_depth` pieces execute
//   at once (so the number of pieces in flight is min(threads, queue_depth)). Within a queue,
//   pieces go in submission order; with background_depth > 0 (that drive), the direction with
//   fewer pieces in flight goes first while both have pieces queued, so that a long run of reads
//   queued ahead of the write-back (the next step's state read ahead) does not hold the write
//   side idle. A worker reads into / writes
//   from the caller's buffer directly (no copy), and, when asked, checksums its piece
//   (after the read, before the write) so the checksum costs no extra pass on the caller.
// - The buffer belongs to the request from submit() until wait() returns true: the caller
//   must neither free nor modify it before then. Pieces of different requests are not
//   ordered against each other; callers order overlapping requests by waiting.
// - The last piece to finish joins the piece checksums and wakes the waiters.
// - Errors: every failing piece is counted; the first is kept with errno, op, file and
//   offset and thrown (IoError) by wait(). Short reads (EOF before the requested length)
//   are errors, short writes are retried until an errno comes back (e.g. ENOSPC).
// - The engine never opens files: it is given fds (the caller opens them, relative to a
//   directory fd, and keeps them open until the request completes).
// - The buffer's lifetime is the caller's to guarantee (offload/aio.py keeps the buffer's
//   owner in a table of requests in flight until the request is done, even when the Python
//   handle is dropped): a worker never releases Python objects, so it never takes the GIL.
// - close()/the destructor lets workers finish every queued piece, then joins them, so no
//   worker touches a buffer after close() returns.
#pragma once
#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <memory>
#include <sys/types.h>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace offload_aio {

struct IoError {
  int err;          // errno (EIO for a short read)
  std::string msg;  // "<op> of N bytes at offset O in <path>: <reason>"
  std::string path;
};

enum class Op { Read = 0, Write = 1 };

class Request {
 public:
  Request(Op op, int fd, char* buf, uint64_t offset, size_t nbytes, size_t crc_nbytes, bool want_crc,
          size_t piece_size, std::string path);
  // Blocks (caller must have released the GIL) for up to `timeout_s` (< 0: forever).
  // Returns false on timeout; throws IoError if any piece failed.
  bool wait(double timeout_s);
  bool done() const { return finished_.load(std::memory_order_acquire); }
  uint32_t checksum() const { return checksum_; }
  size_t nbytes() const { return nbytes_; }

 private:
  friend class Engine;
  void finish_piece(size_t index, uint32_t crc, const IoError* error);

  const Op op_;
  const int fd_;
  char* const buf_;
  const uint64_t offset_;
  const size_t nbytes_;      // bytes transferred
  const size_t crc_nbytes_;  // leading bytes covered by the checksum (<= nbytes_)
  const bool want_crc_;
  const size_t piece_size_;
  const size_t npieces_;
  const std::string path_;

  std::vector<uint32_t> piece_crc_;  // written by the worker of each piece, read by the last
  std::atomic<size_t> remaining_;
  std::atomic<bool> finished_{false};
  uint32_t checksum_ = 0;
  std::mutex mu_;
  std::condition_variable cv_;
  bool has_error_ = false;
  IoError error_;
  size_t nerrors_ = 0;
};

class Engine {
 public:
  // background_depth: places among the pieces in flight kept for the non-urgent queue while it
  // has pieces (0: urgent pieces always first), and, above 0, both directions served at once
  // within each queue; less than min(threads, queue_depth).
  Engine(size_t block_size, size_t queue_depth, size_t threads, size_t background_depth = 0);
  ~Engine();
  // piece_size 0: the engine's block_size.
  std::shared_ptr<Request> submit(Op op, int fd, char* buf, uint64_t offset, size_t nbytes, size_t crc_nbytes,
                                  bool want_crc, size_t piece_size, const std::string& path, bool urgent);
  void close();
  // Fault injection for tests: pieces of `op` whose range ends past `after_offset` fail with `err`;
  // `count` >= 0: only the next `count` such pieces fail, then the fault is spent.
  void set_fault(int op, int err, uint64_t after_offset, int64_t count = -1);
  void clear_fault();
  // Test hook: every piece of `op` (-1: of either op) sleeps this long before its I/O (0: off).
  void set_delay_us(uint64_t us, int op = -1) {
    delay_op_.store(op);
    delay_us_.store(us);
  }
  size_t block_size() const { return block_size_; }
  size_t queue_depth() const { return queue_depth_; }
  size_t threads() const { return workers_.size(); }
  size_t background_depth() const { return background_depth_; }

 private:
  struct Piece {
    std::shared_ptr<Request> req;
    size_t index;
    uint64_t order;  // submission order across both directions of its queue
  };
  // One queue (urgent or not): its pieces by direction (Op), each FIFO; `order` says which
  // direction's front was submitted first.
  struct Queue {
    std::deque<Piece> by_op[2];
    bool empty() const { return by_op[0].empty() && by_op[1].empty(); }
  };
  void worker();
  // Under mu_: the next piece of `queue` (not empty); of direction `only_op` when it is >= 0.
  // Otherwise in submission order; with background_depth_ > 0 (a drive that reads and writes at
  // once), the front piece of the direction with fewer pieces in flight when both directions
  // have pieces queued.
  Piece take(Queue& queue, int only_op);
  // Under mu_, while urgent pieces are queued: the direction (Op) in which the non-urgent queue
  // may take a kept place now (fewer than background_depth_ of its pieces in flight, a piece of
  // that direction queued and none of the urgent queue's), or -1.
  int kept_place_direction() const;
  void run_piece(const Piece& p);
  bool take_fault(Op op, uint64_t end);

  const size_t block_size_;
  const size_t queue_depth_;
  const size_t background_depth_;
  std::vector<std::thread> workers_;
  const pid_t owner_pid_;  // workers exist only in this process; a fork child must not join them
  std::mutex mu_;
  std::condition_variable cv_;
  Queue urgent_queue_;  // filled by submit(urgent), emptied first by the workers
  Queue queue_;         // filled by submit(not urgent), emptied when urgent_queue_ is
                        // (or background_depth_ of its pieces at a time before)
  uint64_t next_order_ = 0;
  size_t in_flight_ = 0;
  size_t background_in_flight_ = 0;  // pieces of queue_ being run (guarded by mu_)
  size_t op_in_flight_[2] = {0, 0};  // pieces being run by direction (guarded by mu_)
  bool stop_ = false;
  std::atomic<int> fault_op_{-1};
  std::atomic<int> fault_err_{0};
  std::atomic<uint64_t> fault_after_{0};
  std::atomic<int64_t> fault_left_{-1};  // pieces still to fail; -1: every matching piece
  std::atomic<uint64_t> delay_us_{0};
  std::atomic<int> delay_op_{-1};  // the op the delay applies to; -1: both
};

}  // namespace offload_aio
