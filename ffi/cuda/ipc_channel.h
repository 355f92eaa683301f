// Channel memory on GPUs of different processes, reached through CUDA IPC
// (docs/DESIGN.md, "Transports": one process per GPU, handles exchanged by the Python layer).
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "../shared_group.h"

namespace b12x {

// Allocates the local rank's Signal and staging (zero-filled) and Lamport
// buffers (filled with the "empty" word), exports each with
// cudaIpcGetMemHandle, and keeps the error record in mapped host memory,
// local only. `ordinals[r]` is kRemoteRank for the ranks other processes
// hold; `open` maps theirs with lazy peer access. One local rank per process:
// CUDA lets a process open another process's handle in one context only.
std::unique_ptr<SharedGroup> make_ipc_group(const std::string& channel, std::vector<int> ordinals,
                                            ChannelOptions options);

}  // namespace b12x
