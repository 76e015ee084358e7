// zoffload-export: a checkpoint's fp32 master weights as one safetensors file, the file that
// transformers (from_pretrained), the safetensors package and other frameworks read.
//
//   zoffload-export CHECKPOINT_DIR OUT.safetensors [--overwrite]
#include <sys/stat.h>

#include <cstdio>
#include <string>
#include <vector>

#include "common/strings.h"
#include "zoffload/engine.h"

namespace {

constexpr const char* kUsage =
    "usage: zoffload-export CHECKPOINT_DIR OUT.safetensors [--overwrite]\n"
    "  Writes the fp32 master weights of a checkpoint (OffloadEngine::Save, opt.save) as\n"
    "  safetensors, each parameter verified against its checksum first.\n"
    "  --overwrite  replace OUT if it exists\n";

}  // namespace

int main(int argc, char** argv) {
  std::vector<std::string> files;
  bool overwrite = false;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "-h" || a == "--help") {
      std::fputs(kUsage, stdout);
      return 0;
    }
    if (a == "--overwrite") {
      overwrite = true;
    } else if (a.starts_with("-")) {
      std::fprintf(stderr, "zoffload-export: unknown option '%s'\n%s", a.c_str(), kUsage);
      return 2;
    } else {
      files.push_back(a);
    }
  }
  if (files.size() != 2) {
    std::fprintf(stderr, "zoffload-export: need a checkpoint directory and an output file\n%s",
                 kUsage);
    return 2;
  }
  const zoffload::Status s = zoffload::ExportSafetensors(files[0], files[1], overwrite);
  if (!s.ok()) {
    std::fprintf(stderr, "zoffload-export: %s%s\n", s.message().c_str(),
                 s.code() == zoffload::StatusCode::kAlreadyExists ? ": pass --overwrite" : "");
    return 1;
  }
  struct stat st {};
  ::stat(files[1].c_str(), &st);
  std::printf("zoffload-export: wrote %s (%s) from %s\n", files[1].c_str(),
              zoffload::internal::HumanBytes(static_cast<uint64_t>(st.st_size)).c_str(),
              files[0].c_str());
  return 0;
}
