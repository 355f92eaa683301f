// A channel group spread over processes (docs/DESIGN.md, "Transports": one process per GPU).
//
// The Python layer prepares it in steps and ends each with a collective
// verdict (communicator.py): construct (allocate, zero-fill, export the local
// ranks' memory), `exported` per local rank, `open` per remote rank, then
// either install it in the Registry or roll back: close_imports, a barrier,
// destroy (free the exports). No step frees memory a peer may still map.
#pragma once

#include <string>

#include "registry.h"

namespace b12x {

class SharedGroup : public ChannelGroup {
 public:
  using ChannelGroup::ChannelGroup;

  // What another process needs to open local rank `rank`'s memory: opaque
  // bytes (CUDA IPC handles, shared-memory names) for the rendezvous frame.
  virtual std::string exported(int rank) const = 0;
  // Maps remote rank `rank`'s memory from its export into every local view;
  // throws std::runtime_error with what failed.
  virtual void open(int rank, const std::string& exported) = 0;
  // Called once the names of the exports can serve nobody: every rank
  // opened every import, or the preparation failed (a failed preparation
  // leaves no name on the host, also where a peer keeps its mapping). A
  // transport drops what only the exchange needed (shared-memory names).
  // Default: nothing.
  virtual void drop_names() {}
};

}  // namespace b12x
