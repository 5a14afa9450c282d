// A /proc file held open and read again from its start with pread: the kernel writes its
// text afresh at each read, so one open serves every reading (no open or close per
// reading, no allocation). Every /proc read goes through it: the host readers
// (run_queue.hpp, host_steal.hpp, process_stat.cpp).
#pragma once

#include <fcntl.h>
#include <unistd.h>

#include <cstddef>
#include <utility>

namespace steptrace::detail {

class ProcFile {
 public:
  ProcFile() = default;
  /// Opens `path`; is_open() says whether it could.
  explicit ProcFile(const char* path) noexcept : fd_(::open(path, O_RDONLY | O_CLOEXEC)) {}
  ~ProcFile() { close(); }
  ProcFile(ProcFile&& other) noexcept : fd_(std::exchange(other.fd_, -1)) {}
  ProcFile& operator=(ProcFile&& other) noexcept {
    if (this != &other) {
      close();
      fd_ = std::exchange(other.fd_, -1);
    }
    return *this;
  }
  ProcFile(const ProcFile&) = delete;
  ProcFile& operator=(const ProcFile&) = delete;

  bool is_open() const noexcept { return fd_ >= 0; }

  /// Reads up to `size` bytes from the file's start into `buf`: the count read; 0 or less
  /// on failure or when the file is not open.
  long read(char* buf, std::size_t size) const noexcept {
    return fd_ < 0 ? -1 : static_cast<long>(::pread(fd_, buf, size, 0));
  }

 private:
  void close() noexcept {
    if (fd_ >= 0) ::close(fd_);
    fd_ = -1;
  }

  int fd_ = -1;
};

}  // namespace steptrace::detail
