// Channel memory in host memory, for the devices of one process.
#pragma once

#include <cstddef>
#include <memory>
#include <string>
#include <vector>

#include "../registry.h"

namespace b12x {

// Allocates and zero-fills one Signal, one staging region and one error
// record per rank; every rank sees every other rank's memory directly. The
// host backend runs the barrier protocol only (no Lamport buffers).
// The host backends' starting view (base_view): one "block" per call, all of
// a call in one cell, and no Lamport buffers whatever the options say.
ChannelView host_base_view(ChannelOptions options, int world);

// A local rank's completed calls and poison flag, read from host memory.
uint32_t read_host_calls(const ChannelView& v);
bool read_host_poisoned(const ChannelView& v);

std::unique_ptr<ChannelGroup> make_host_group(const std::string& channel, std::vector<int> ordinals,
                                              const ChannelOptions& options);

}  // namespace b12x
