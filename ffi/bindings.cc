// The nanobind module `b12x_jax._b12x`: FFI handler capsules and the
// preparation, release and inspection calls the Python layer makes before
// and after executions (never during one).
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <stdexcept>
#include <string>
#include <vector>

#include "cpu/host_channel.h"
#include "registry.h"
#include "xla/ffi/api/c_api.h"

#if defined(B12X_WITH_CUDA)
#include "cuda/cuda_channel.h"
#endif

namespace nb = nanobind;

extern "C" XLA_FFI_Error* b12x_all_reduce_host(XLA_FFI_CallFrame*);
#if defined(B12X_WITH_CUDA)
extern "C" XLA_FFI_Error* b12x_all_reduce_cuda(XLA_FFI_CallFrame*);
#endif

namespace b12x {
namespace {

template <typename Fn>
nb::capsule capsule(Fn* fn) {
  return nb::capsule(reinterpret_cast<void*>(fn));
}

Platform parse_platform(const std::string& platform) {
  if (platform == "cpu") return Platform::kHost;
  if (platform == "cuda") return Platform::kCuda;
  throw std::invalid_argument("b12x_jax: unknown platform '" + platform + "'");
}

void add_group(std::unique_ptr<ChannelGroup> group) {
  const std::string problem = Registry::get().add(std::move(group));
  if (!problem.empty()) throw std::invalid_argument("b12x_jax: " + problem);
}

RankHandle find_or_throw(const std::string& platform, const std::string& channel, int ordinal) {
  RankHandle handle = Registry::get().find(parse_platform(platform), channel, ordinal);
  if (!handle) throw std::invalid_argument(unprepared_message("stats", channel, ordinal));
  return handle;
}

}  // namespace
}  // namespace b12x

NB_MODULE(_b12x, m) {
  using namespace b12x;
  m.doc() = "b12x_jax native layer: channel memory, transports, kernels and FFI handlers.";

  m.def("handlers", [] {
    nb::dict out;
    nb::dict cpu;
    cpu["b12x_all_reduce"] = capsule(b12x_all_reduce_host);
    out["cpu"] = cpu;
#if defined(B12X_WITH_CUDA)
    nb::dict cuda;
    cuda["b12x_all_reduce"] = capsule(b12x_all_reduce_cuda);
    out["CUDA"] = cuda;
#endif
    return out;
  }, "FFI handler capsules by XLA platform name, then target name.");

  m.def("has_cuda", [] {
#if defined(B12X_WITH_CUDA)
    return true;
#else
    return false;
#endif
  });

  m.def("prepare_host", [](const std::string& channel, std::vector<int> ordinals, size_t capacity_bytes,
                           double timeout_s) {
    add_group(make_host_group(channel, std::move(ordinals), capacity_bytes, timeout_s));
  }, nb::arg("channel"), nb::arg("ordinals"), nb::arg("capacity_bytes"), nb::arg("timeout_s"),
     "Allocates the channel in host memory for the given CPU devices, ranks in list order.");

#if defined(B12X_WITH_CUDA)
  m.def("prepare_cuda", [](const std::string& channel, std::vector<int> ordinals, size_t capacity_bytes,
                           double timeout_s, int max_blocks) {
    add_group(make_cuda_group(channel, std::move(ordinals), capacity_bytes, timeout_s, max_blocks));
  }, nb::arg("channel"), nb::arg("ordinals"), nb::arg("capacity_bytes"), nb::arg("timeout_s"),
     nb::arg("max_blocks"),
     "Allocates the channel on the given GPUs of this process, enables and probes peer access.");
  m.def("probe_peer_access", &probe_peer_access, nb::arg("ordinals"),
        "Empty when every pair of the GPUs can read and write each other's memory, else why not.");
#endif

  m.def("release", [](const std::string& platform, const std::string& channel) {
    // Dropping the groups frees their memory; CUDA groups synchronise their
    // devices first (see cuda_channel.cc).
    return Registry::get().take(parse_platform(platform), channel).size();
  }, nb::arg("platform"), nb::arg("channel"),
     "Frees every group of the channel on the platform; returns how many there were.");

  m.def("stats", [](const std::string& platform, const std::string& channel, int ordinal) {
    const RankHandle h = find_or_throw(platform, channel, ordinal);
    nb::dict out;
    out["rank"] = h.rank;
    out["world"] = h.group->world();
    out["epoch"] = h.group->read_epoch(h.rank);
    out["poisoned"] = h.group->read_poisoned(h.rank);
    out["capacity_bytes"] = h.view().layout.capacity();
    return out;
  }, nb::arg("platform"), nb::arg("channel"), nb::arg("ordinal"),
     "Read-only state of one rank of a channel, for tests and debugging.");

  m.def("pending_errors", [] {
    std::vector<std::string> out;
    for (const ChannelGroup* group : Registry::get().groups()) {
      for (int r = 0; r < group->world(); ++r) {
        std::string message = pending_error(*group, r);
        if (!message.empty()) out.push_back(std::move(message));
      }
    }
    return out;
  }, "Messages of every recorded timeout, on any channel and rank of this process.");
}
