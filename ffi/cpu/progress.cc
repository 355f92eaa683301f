#include "progress.h"

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <atomic>
#include <condition_variable>
#include <deque>
#include <map>
#include <mutex>
#include <optional>
#include <thread>
#include <utility>

#include "../protocol.h"
#include "host_memory.h"

namespace b12x {
namespace {

struct Pending {
  std::unique_ptr<HostCall> call;
  int phase = 0;
  bool started = false;  // phase `phase` pushed and announced
  Deadline deadline{};
  uint64_t ticket = 0;  // submission order, over every rank and group
};

class ProgressEngine {
 public:
  static ProgressEngine& get() {
    static ProgressEngine* engine = new ProgressEngine();  // lives until exit: calls may be in flight
    return *engine;
  }

  bool wait_idle(const ChannelGroup* group, double seconds) {
    return wait_for_none(seconds, [group](const auto& key, const Pending&) { return key.first == group; });
  }

  // Waits for the calls submitted before it was called, not for later ones.
  bool wait_submitted(double seconds) {
    const uint64_t now = [this] {
      std::lock_guard lock(mutex_);
      return next_ticket_;
    }();
    return wait_for_none(seconds, [now](const auto&, const Pending& p) { return p.ticket < now; });
  }

  // Waits until no queued call matches `counted`. `seconds` bounds the wait
  // for the next one to finish: the deadline moves on whenever one does, so
  // a long queue of calls that all complete is waited for, and a queue that
  // stops moving is not.
  template <typename Counted>
  bool wait_for_none(double seconds, Counted counted) {
    const uint64_t bound = static_cast<uint64_t>(seconds * 1e9);
    uint64_t deadline = HostMem::now_ns() + bound;
    size_t last = SIZE_MAX;
    std::unique_lock lock(mutex_);
    for (;;) {
      size_t queued = 0;
      for (const auto& [key, queue] : queues_) {
        for (const Pending& p : queue) queued += counted(key, p) ? 1 : 0;
      }
      if (queued == 0) return true;
      if (queued < last) deadline = HostMem::now_ns() + bound;
      last = queued;
      if (HostMem::now_ns() > deadline) return false;
      lock.unlock();
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
      lock.lock();
    }
  }

  // Waits, at most `seconds`, until no call is queued and no completion is
  // running XLA's continuation, then stops the progress thread and joins it:
  // at exit nothing of this engine may run while the process tears down
  // (a completion thread still inside XLA then aborts the process). True
  // when it was idle; later submissions fail at once.
  bool shutdown(double seconds) {
    const uint64_t deadline = HostMem::now_ns() + static_cast<uint64_t>(seconds * 1e9);
    std::unique_lock lock(mutex_);
    while ((pending_ > 0 || completing_.load() > 0) && HostMem::now_ns() < deadline) {
      lock.unlock();
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
      lock.lock();
    }
    const bool idle = pending_ == 0 && completing_.load() == 0;
    stopping_ = true;
    wake_.notify_one();
    lock.unlock();
    if (thread_.joinable()) thread_.join();
    return idle;
  }

  void submit(std::unique_ptr<HostCall> call) {
    std::lock_guard lock(mutex_);
    if (stopping_) {
      complete(std::move(call->promise), xla::ffi::Error::Internal("b12x_jax: the process is exiting"));
      return;
    }
    const auto key = std::make_pair(call->handle.group, call->handle.rank);
    Pending pending{std::move(call)};
    pending.ticket = next_ticket_++;
    queues_[key].push_back(std::move(pending));
    ++pending_;
    wake_.notify_one();
  }

 private:
  ProgressEngine() : thread_([this] { run(); }) {}

  void run() {
    std::unique_lock lock(mutex_);
    int idle_rounds = 0;  // rounds in a row in which no call moved and none came
    auto seen_ticket = next_ticket_;
    for (;;) {
      wake_.wait(lock, [this] { return pending_ > 0 || stopping_; });
      if (stopping_) return;
      bool progressed = false;
      for (auto& [key, queue] : queues_) {
        while (!queue.empty() && advance(queue.front())) {
          queue.pop_front();
          --pending_;
          progressed = true;
        }
      }
      if (progressed || next_ticket_ != seen_ticket) {
        idle_rounds = 0;
        seen_ticket = next_ticket_;
      } else if (++idle_rounds < kSpinRounds) {
        // Peers are other ranks' submissions: let XLA's threads make them.
        lock.unlock();
        std::this_thread::yield();
        lock.lock();
      } else {
        // A peer that is far behind (another process compiling, a late
        // rank): naps of growing length, so a wait of seconds does not
        // hold a core; a submission wakes it at once.
        const int doublings = std::min(idle_rounds - kSpinRounds, 5);
        wake_.wait_for(lock, std::chrono::microseconds(32 << doublings));
      }
    }
  }

  // Fruitless rounds spent yielding before the progress thread naps: about
  // a millisecond of spinning, which a call whose peers are near never
  // leaves.
  static constexpr int kSpinRounds = 4096;

  // Moves the head call of one rank forward; true when it completed.
  static bool advance(Pending& p) {
    HostCall& call = *p.call;
    const ChannelView& v = call.handle.view();
    for (;;) {
      if (!p.started) {
        // A failed channel fails fast (C8): nothing is pushed.
        if (p.phase == 0 && channel_poisoned<HostMem>(v)) return fail(p);
        call.start(v, p.phase);
        p.deadline = wait_deadline<HostMem>(v, 0);
        p.started = true;
      }
      switch (call.poll(v, p.phase, p.deadline)) {
        case PeerState::kPending: return false;
        case PeerState::kFailed: return fail(p);
        case PeerState::kArrived:
          if (p.deadline.first_call) mark_served<HostMem>(v, 0);
          break;
      }
      p.started = false;
      if (++p.phase == call.phases()) break;
    }
    call.finish(v);
    complete(std::move(call.promise), std::nullopt);
    return true;
  }

  // XLA runs the rest of the rank's program inside SetAvailable, on the
  // completing thread, and that may block: complete on a thread of its own so
  // the progress thread never waits for XLA.
  // Counted, so that shutdown can wait for them.
  static void complete(xla::ffi::Promise promise, std::optional<xla::ffi::Error> error) {
    ++completing_;
    std::thread([promise = std::move(promise), error = std::move(error)]() mutable {
      if (error) {
        promise.SetError(*error);
      } else {
        promise.SetAvailable();
      }
      --completing_;
    }).detach();
  }

  static bool fail(Pending& p) {
    const std::string message = timeout_message(*p.call->handle.group, p.call->handle.rank);
    complete(std::move(p.call->promise), xla::ffi::Error::Internal(message));
    return true;
  }

  std::mutex mutex_;
  std::condition_variable wake_;
  std::map<std::pair<const ChannelGroup*, int>, std::deque<Pending>> queues_;
  size_t pending_ = 0;
  uint64_t next_ticket_ = 0;
  bool stopping_ = false;
  static inline std::atomic<int> completing_{0};  // completion threads still inside XLA
  std::thread thread_;  // last: started once the rest is constructed
};

}  // namespace

void submit_host_call(std::unique_ptr<HostCall> call, const Placement& placement) {
  call->tag = placed_tag(call->tag, placement, call->handle.rank);
  ProgressEngine::get().submit(std::move(call));
}

bool wait_host_calls(const ChannelGroup* group, double seconds) {
  return ProgressEngine::get().wait_idle(group, seconds);
}

bool wait_submitted_host_calls(double seconds) { return ProgressEngine::get().wait_submitted(seconds); }

bool shutdown_host_progress(double seconds) { return ProgressEngine::get().shutdown(seconds); }

}  // namespace b12x
