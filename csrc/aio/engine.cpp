#include "aio/engine.h"

#include <cerrno>
#include <chrono>
#include <cstring>
#include <stdexcept>
#include <unistd.h>

#include "aio/crc32c.h"

namespace offload_aio {

namespace {
const char* op_name(Op op) { return op == Op::Read ? "read" : "write"; }

IoError make_error(int err, Op op, size_t len, uint64_t offset, const std::string& path,
                   const std::string& reason) {
  std::string msg = std::string(op_name(op)) + " of " + std::to_string(len) + " bytes at offset " +
                    std::to_string(offset) + " in " + path + ": " + reason;
  return IoError{err, msg, path};
}
}  // namespace

Request::Request(Op op, int fd, char* buf, uint64_t offset, size_t nbytes, size_t crc_nbytes, bool want_crc,
                 size_t piece_size, std::string path)
    : op_(op),
      fd_(fd),
      buf_(buf),
      offset_(offset),
      nbytes_(nbytes),
      crc_nbytes_(crc_nbytes),
      want_crc_(want_crc),
      piece_size_(piece_size),
      npieces_(nbytes == 0 ? 0 : (nbytes + piece_size - 1) / piece_size),
      path_(std::move(path)),
      piece_crc_(want_crc ? npieces_ : 0, 0),
      remaining_(npieces_) {
  if (npieces_ == 0) finished_.store(true, std::memory_order_release);
}

bool Request::wait(double timeout_s) {
  std::unique_lock<std::mutex> lock(mu_);
  auto ready = [this] { return finished_.load(std::memory_order_acquire); };
  if (timeout_s < 0) {
    cv_.wait(lock, ready);
  } else if (!cv_.wait_for(lock, std::chrono::duration<double>(timeout_s), ready)) {
    return false;
  }
  if (has_error_) {
    IoError e = error_;
    if (nerrors_ > 1) e.msg += " (and " + std::to_string(nerrors_ - 1) + " more failed pieces)";
    throw e;
  }
  return true;
}

void Request::finish_piece(size_t index, uint32_t crc, const IoError* error) {
  if (want_crc_) piece_crc_[index] = crc;
  if (error) {
    std::lock_guard<std::mutex> lock(mu_);
    if (!has_error_) {
      has_error_ = true;
      error_ = *error;
    }
    ++nerrors_;
  }
  if (remaining_.fetch_sub(1, std::memory_order_acq_rel) != 1) return;
  // Last piece: join the checksums in file order. Piece i covers crc bytes
  // [i*piece, min((i+1)*piece, crc_nbytes)).
  uint32_t total = 0;
  if (want_crc_) {
    for (size_t i = 0; i < npieces_; ++i) {
      size_t start = i * piece_size_;
      if (start >= crc_nbytes_) break;
      size_t len = std::min(piece_size_, crc_nbytes_ - start);
      total = crc32c_combine(total, piece_crc_[i], len);
    }
  }
  std::lock_guard<std::mutex> lock(mu_);
  checksum_ = total;
  finished_.store(true, std::memory_order_release);
  cv_.notify_all();
}

Engine::Engine(size_t block_size, size_t queue_depth, size_t threads, size_t background_depth)
    : block_size_(block_size),
      queue_depth_(queue_depth),
      background_depth_(background_depth),
      owner_pid_(getpid()) {
  if (block_size == 0 || block_size % 4096 != 0)
    throw std::invalid_argument("block_size must be a positive multiple of 4096, got " +
                                std::to_string(block_size));
  if (queue_depth == 0) throw std::invalid_argument("queue_depth must be at least 1");
  if (threads == 0) throw std::invalid_argument("threads must be at least 1");
  if (background_depth >= std::min(threads, queue_depth))
    throw std::invalid_argument("background_depth must be less than min(threads, queue_depth) = " +
                                std::to_string(std::min(threads, queue_depth)) + ", got " +
                                std::to_string(background_depth));
  workers_.reserve(threads);
  for (size_t i = 0; i < threads; ++i) workers_.emplace_back(&Engine::worker, this);
}

Engine::~Engine() { close(); }

void Engine::close() {
  if (getpid() != owner_pid_) {
    // A forked child has this object's memory but none of its threads (and mu_ may have been
    // copied locked): never lock, never join. The thread handles are leaked on purpose, since
    // destroying a joinable std::thread terminates the process.
    new std::vector<std::thread>(std::move(workers_));
    workers_.clear();
    return;
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stop_ && workers_.empty()) return;
    stop_ = true;
  }
  cv_.notify_all();
  for (auto& t : workers_)
    if (t.joinable()) t.join();
  workers_.clear();
}

void Engine::set_fault(int op, int err, uint64_t after_offset, int64_t count) {
  fault_op_.store(-1);
  fault_err_.store(err);
  fault_after_.store(after_offset);
  fault_left_.store(count < 0 ? -1 : count);
  fault_op_.store(op);
}

bool Engine::take_fault(Op op, uint64_t end) {
  if (fault_op_.load() != static_cast<int>(op) || end <= fault_after_.load()) return false;
  int64_t left = fault_left_.load();
  while (left >= 0) {
    if (left == 0) return false;  // spent
    if (fault_left_.compare_exchange_weak(left, left - 1)) return true;
  }
  return true;  // unlimited
}

void Engine::clear_fault() { fault_op_.store(-1); }

std::shared_ptr<Request> Engine::submit(Op op, int fd, char* buf, uint64_t offset, size_t nbytes,
                                        size_t crc_nbytes, bool want_crc, size_t piece_size,
                                        const std::string& path, bool urgent) {
  if (piece_size == 0) piece_size = block_size_;
  if (crc_nbytes > nbytes) throw std::invalid_argument("crc_nbytes exceeds nbytes");
  auto req = std::make_shared<Request>(op, fd, buf, offset, nbytes, crc_nbytes, want_crc, piece_size, path);
  if (req->npieces_ == 0) return req;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stop_) throw std::runtime_error("the I/O engine is closed; create a new one");
    std::deque<Piece>& queue = (urgent ? urgent_queue_ : queue_).by_op[static_cast<int>(op)];
    for (size_t i = 0; i < req->npieces_; ++i) queue.push_back(Piece{req, i, next_order_++});
  }
  cv_.notify_all();
  return req;
}

int Engine::kept_place_direction() const {
  if (background_in_flight_ >= background_depth_) return -1;
  for (int op = 0; op < 2; ++op)
    if (!queue_.by_op[op].empty() && urgent_queue_.by_op[op].empty()) return op;
  return -1;
}

Engine::Piece Engine::take(Queue& queue, int only_op) {
  int op = queue.by_op[0].empty() ? 1 : 0;
  if (only_op >= 0) {
    op = only_op;
  } else if (!queue.by_op[0].empty() && !queue.by_op[1].empty()) {
    if (background_depth_ > 0 && op_in_flight_[0] != op_in_flight_[1])
      op = op_in_flight_[0] < op_in_flight_[1] ? 0 : 1;
    else
      op = queue.by_op[0].front().order < queue.by_op[1].front().order ? 0 : 1;
  }
  Piece piece = std::move(queue.by_op[op].front());
  queue.by_op[op].pop_front();
  return piece;
}

void Engine::worker() {
  for (;;) {
    Piece piece;
    bool background = false;
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [this] {
        const bool empty = urgent_queue_.empty() && queue_.empty();
        return (stop_ && empty) || (!empty && in_flight_ < queue_depth_);
      });
      // the other queue's piece goes first while the urgent queue is empty, or takes one of
      // the background_depth places kept for it, in a direction with no urgent piece queued
      const int kept = urgent_queue_.empty() ? -1 : kept_place_direction();
      background = urgent_queue_.empty() ? !queue_.empty() : kept >= 0;
      Queue& queue = background ? queue_ : urgent_queue_;
      if (queue.empty()) return;  // stop_ and drained
      piece = take(queue, background ? kept : -1);
      ++in_flight_;
      ++op_in_flight_[static_cast<int>(piece.req->op_)];
      if (background) ++background_in_flight_;
    }
    run_piece(piece);
    {
      std::lock_guard<std::mutex> lock(mu_);
      --in_flight_;
      --op_in_flight_[static_cast<int>(piece.req->op_)];
      if (background) --background_in_flight_;
    }
    cv_.notify_one();
  }
}

void Engine::run_piece(const Piece& p) {
  Request& r = *p.req;
  const size_t start = p.index * r.piece_size_;
  const size_t len = std::min(r.piece_size_, r.nbytes_ - start);
  const uint64_t off = r.offset_ + start;
  char* buf = r.buf_ + start;
  const size_t crc_len = start < r.crc_nbytes_ ? std::min(len, r.crc_nbytes_ - start) : 0;
  uint32_t crc = 0;

  if (r.want_crc_ && r.op_ == Op::Write) crc = crc32c_extend(0, buf, crc_len);

  if (uint64_t us = delay_us_.load()) {
    const int delayed = delay_op_.load();
    if (delayed < 0 || delayed == static_cast<int>(r.op_))
      std::this_thread::sleep_for(std::chrono::microseconds(us));
  }
  if (take_fault(r.op_, off + len)) {
    int err = fault_err_.load();
    IoError e =
        make_error(err, r.op_, len, off, r.path_, std::string(std::strerror(err)) + " (injected fault)");
    r.finish_piece(p.index, 0, &e);
    return;
  }

  size_t done = 0;
  while (done < len) {
    ssize_t n = r.op_ == Op::Read ? ::pread(r.fd_, buf + done, len - done, off + done)
                                  : ::pwrite(r.fd_, buf + done, len - done, off + done);
    if (n < 0) {
      if (errno == EINTR) continue;
      int err = errno;
      IoError e = make_error(err, r.op_, len - done, off + done, r.path_, std::strerror(err));
      r.finish_piece(p.index, 0, &e);
      return;
    }
    if (n == 0) {
      if (r.op_ == Op::Read) {
        IoError e = make_error(
            EIO, r.op_, len, off, r.path_,
            "short read: end of file after " + std::to_string(done) + " bytes (the file is truncated)");
        r.finish_piece(p.index, 0, &e);
        return;
      }
      // pwrite returning 0 for a non-empty write: retrying would spin.
      IoError e = make_error(EIO, r.op_, len - done, off + done, r.path_, "write made no progress");
      r.finish_piece(p.index, 0, &e);
      return;
    }
    done += static_cast<size_t>(n);
  }
  if (r.want_crc_ && r.op_ == Op::Read) crc = crc32c_extend(0, buf, crc_len);
  r.finish_piece(p.index, crc, nullptr);
}

}  // namespace offload_aio
