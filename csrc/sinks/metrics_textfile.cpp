#include "metrics_textfile.hpp"

#include <fcntl.h>
#include <fmt/format.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <random>

namespace steptrace::detail {

std::string write_textfile_atomically(const std::string& path, std::string_view text) {
  // node_exporter reads *.prom files: write a temporary name it ignores, then rename it
  // over the old one, so a scrape never sees half a file. The temporary is created anew
  // under a random name (O_EXCL, no link followed): a name planted in a shared textfile
  // folder (a symlink to a victim file) is never opened, only skipped.
  std::string error;
  std::string tmp;
  int fd = -1;
  std::random_device random;
  for (int attempt = 0; attempt < 8 && fd < 0; ++attempt) {
    tmp = fmt::format("{}.{:08x}{:08x}.tmp", path, random(), random());
    fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0666);
    if (fd < 0 && errno != EEXIST) break;
  }
  if (fd < 0) return fmt::format("creating {}: {}", tmp, std::strerror(errno));
  const char* p = text.data();
  std::size_t left = text.size();
  while (left > 0 && error.empty()) {
    const ssize_t n = ::write(fd, p, left);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      error = fmt::format("writing {}: {}", tmp, std::strerror(errno));
    } else {
      p += n;
      left -= static_cast<std::size_t>(n);
    }
  }
  if (::close(fd) != 0 && error.empty()) {
    error = fmt::format("writing {}: {}", tmp, std::strerror(errno));
  }
  if (error.empty() && std::rename(tmp.c_str(), path.c_str()) != 0) {
    error = fmt::format("renaming {} to {}: {}", tmp, path, std::strerror(errno));
  }
  if (!error.empty()) ::unlink(tmp.c_str());
  return error;
}

}  // namespace steptrace::detail
