// Checkpoint files of the OffloadEngine (docs/checkpoints.md).
//
// A checkpoint is a directory:
// - state.bin: each parameter's fp32 master, then m, then v (the state's precision, as
//   OffloadEngine::ReadState gives them), parameter after parameter;
// - manifest.json: the format version, the step count, the fp16 loss scaler's state, the
//   groups' hyperparameters, the state precision, a fingerprint of the config, and per
//   parameter its name, elements, shape, dtype, group, offset in state.bin, bytes and CRC32C.
// Writing is atomic: everything goes into DIR.tmp-PID, fsynced file by file, then the
// directory; an old DIR is renamed to DIR.prev, DIR.tmp-PID to DIR, DIR.prev removed, and the
// parent fsynced. A kill at any moment leaves DIR (old or new), or DIR.prev alone (killed
// between the two renames), which reading takes in DIR's place.
//
// Thread-safety: functions of values; one writer per directory.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <string_view>
#include <vector>

#include "engine/loss_scaler.h"
#include "zoffload/config.h"
#include "zoffload/cpu_adam.h"
#include "zoffload/dtype.h"
#include "zoffload/engine.h"
#include "zoffload/status.h"

namespace zoffload::internal {

struct CheckpointEntry {
  std::string name;
  uint64_t elements = 0;
  std::vector<uint64_t> shape;  // multiplies to elements
  DType dtype = DType::kBf16;
  int group = 0;
  uint64_t moment_bytes = 0;  // each of m and v
  uint64_t offset = 0;        // in state.bin
  uint32_t crc = 0;           // of the entry's bytes (master, m, v)
  uint64_t bytes() const { return 4 * elements + 2 * moment_bytes; }
};

struct CheckpointMeta {
  int64_t steps = 0;
  float loss_scale = 1;
  int overflows = 0, good_steps = 0;
  std::string precision;    // the state's: fp32, bf16, int8
  std::string fingerprint;  // of the config that wrote it (a hash of its JSON), for messages
  std::vector<ParamGroup> groups;
  std::vector<CheckpointEntry> entries;
};

/// A manifest's header: the step count, the loss scaler, the state precision, the config's
/// fingerprint and the groups (entries to be added with EntryFor).
CheckpointMeta CheckpointHeader(int64_t steps, const LossScaler::State& scaler,
                                const Config& config, const std::vector<ParamGroup>& groups);
/// A parameter's entry (offset and CRC are WriteCheckpoint's).
CheckpointEntry EntryFor(const std::string& name, uint64_t elements,
                         const std::vector<uint64_t>& shape, DType dtype, int group,
                         StatePrecision precision);

/// Fills entry i's master (elements floats), m and v (moment_bytes each).
using ReadEntry = std::function<Status(size_t i, float* master, std::byte* m, std::byte* v)>;

/// Writes `meta` and every entry's arrays (from `read`, one entry in memory at a time) into
/// `dir`, atomically (see above). Offsets and CRCs are filled in here.
Status WriteCheckpoint(const std::string& dir, CheckpointMeta meta, const ReadEntry& read);

/// The manifest of the checkpoint in `dir` (or in DIR.prev, see above), read with the bounded
/// reader and ParseCheckpointManifest, its state.bin checked to be the size it lists; `*from`
/// is the directory read.
Result<CheckpointMeta> ReadCheckpointMeta(const std::string& dir, std::string* from);

/// A manifest's text (read from `path`, for messages) checked field by field: its checksum
/// (format version 2), every field's type and range, unique names, contiguous entries whose
/// moment bytes match the precision. DATA_LOSS naming the field otherwise.
Result<CheckpointMeta> ParseCheckpointManifest(std::string_view text, const std::string& path);

/// A parameter as registered where a checkpoint is loaded.
struct RegisteredParam {
  std::string name;
  uint64_t elements = 0;
  DType dtype = DType::kBf16;
};

/// Checks that `meta` (read from `from`) holds `precision` state, `groups` parameter groups and
/// exactly the registered parameters (names, elements, dtypes); returns each one's entry, in
/// the order of `params`, or FAILED_PRECONDITION naming what differs (the first five).
Result<std::vector<const CheckpointEntry*>> MatchCheckpoint(
    const CheckpointMeta& meta, const std::string& from, const std::vector<RegisteredParam>& params,
    StatePrecision precision, size_t groups);

/// Entry `e`'s arrays from the checkpoint directory `from`, checked against its CRC32C.
Status ReadCheckpointEntry(const std::string& from, const CheckpointEntry& e, float* master,
                           std::byte* m, std::byte* v);

}  // namespace zoffload::internal
