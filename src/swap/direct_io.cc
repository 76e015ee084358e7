#include "swap/direct_io.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <vector>

#include "common/aligned_buffer.h"
#include "common/errno_status.h"
#include "common/strings.h"
#include "common/topology.h"
#include "common/unique_fd.h"

namespace zoffload::internal {
namespace {

// Removes the scratch file on every path out.
struct ScratchFile {
  std::string path;
  UniqueFd fd;
  ~ScratchFile() {
    if (!path.empty()) ::unlink(path.c_str());
  }
};

uint32_t SysfsLogicalBlockSize(const std::string& dir) {
  auto block = Topology::BlockDeviceOfPath(dir);
  if (!block.ok()) return 0;
  std::ifstream in(StrCat("/sys/block/", *block, "/queue/logical_block_size"));
  uint32_t size = 0;
  in >> size;
  return in ? size : 0;
}

// Writes then reads one block of `size` bytes at offset `size` with O_DIRECT.
bool TryDirectBlock(int fd, uint32_t size, uint32_t mem_align) {
  auto buffer = AlignedBuffer::Allocate(size, std::max<uint32_t>(mem_align, 64));
  if (!buffer.ok()) return false;
  std::memset(buffer->data(), 0x5a, size);
  if (::pwrite(fd, buffer->data(), size, size) != static_cast<ssize_t>(size)) return false;
  std::memset(buffer->data(), 0, size);
  if (::pread(fd, buffer->data(), size, size) != static_cast<ssize_t>(size)) return false;
  return buffer->data()[size - 1] == std::byte{0x5a};
}

}  // namespace

Result<DirectIoInfo> ProbeDirectIo(const std::string& dir) {
  struct stat st {};
  if (::stat(dir.c_str(), &st) != 0) return StatusFromErrno(errno, StrCat("directory ", dir));
  if (!S_ISDIR(st.st_mode)) return InvalidArgumentError(StrCat(dir, " is not a directory"));

  ScratchFile scratch;
  std::string name = StrCat(dir, "/.zoffload-probe-XXXXXX");
  std::vector<char> tmpl(name.begin(), name.end());
  tmpl.push_back('\0');
  const int plain_fd = ::mkostemp(tmpl.data(), O_CLOEXEC);
  if (plain_fd < 0) return StatusFromErrno(errno, StrCat("create scratch file in ", dir));
  scratch.path = tmpl.data();
  ::close(plain_fd);

  DirectIoInfo info;
  auto fd = UniqueFd::Open(scratch.path, O_RDWR | O_DIRECT);
  if (!fd.ok()) {
    if (fd.status().sys_errno() != EINVAL) return fd.status();
    info.refusal = StrCat("the file system at ", dir, " refuses O_DIRECT (EINVAL on open)");
    return info;
  }
  scratch.fd = std::move(fd).value();

  struct statx stx {};
  if (::statx(scratch.fd.get(), "", AT_EMPTY_PATH, STATX_DIOALIGN, &stx) == 0 &&
      (stx.stx_mask & STATX_DIOALIGN) != 0 && stx.stx_dio_offset_align != 0) {
    info.offset_alignment = stx.stx_dio_offset_align;
    info.memory_alignment = stx.stx_dio_mem_align;
    info.source = "statx";
  } else if (const uint32_t lbs = SysfsLogicalBlockSize(dir); lbs != 0) {
    info.offset_alignment = lbs;
    info.memory_alignment = lbs;
    info.source = "sysfs";
  }
  if (info.offset_alignment != 0) {
    info.supported = TryDirectBlock(scratch.fd.get(), info.offset_alignment, info.memory_alignment);
  } else {
    // Nothing told us: find the smallest size the device accepts.
    for (uint32_t size = 512; size <= 65536 && !info.supported; size *= 2) {
      if (TryDirectBlock(scratch.fd.get(), size, size)) {
        info = {true, size, size, "probe", ""};
      }
    }
  }
  if (!info.supported) {
    const int err = errno;
    if (err == ENOSPC || err == EDQUOT)
      return StatusFromErrno(err, StrCat("O_DIRECT probe in ", dir));
    info.refusal =
        StrCat("O_DIRECT write/read of one block failed in ", dir, ": ", std::strerror(err));
  }
  return info;
}

}  // namespace zoffload::internal
