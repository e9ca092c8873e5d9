// A collective library with NCCL's C API over host memory, for the emulated GPU (whose device
// pointers are host pointers): `tests/parallel.rs` builds it and names it in PAGODA_EMU_CCL, so
// that the engine's NCCL binding (src/parallel/ccl.rs) runs its real calls (counts, types,
// roots, peers, in-place buffers) end to end without a GPU. Only what that binding uses, and
// only float sums; every other value is refused, so a wrong argument fails the test.
//
// Each rank of a communicator is driven by its own thread (as the engine's workers do); a
// collective returns when it is complete (a real library only queues it on the stream, which
// orders the same way). All-reduce adds in rank order, as the engine's host communicator does.

#include <condition_variable>
#include <cstddef>
#include <cstring>
#include <deque>
#include <map>
#include <mutex>
#include <utility>
#include <vector>

namespace {

enum { kSuccess = 0, kInvalidArgument = 4, kInvalidUsage = 5, kRemoteError = 6 };
enum { kFloat32 = 7 };
enum { kSum = 0 };

struct Group {
    int size;
    std::mutex m;
    std::condition_variable cv;
    int arrived = 0;
    long generation = 0;
    bool aborted = false;
    std::vector<const void*> slots;
    std::map<std::pair<int, int>, std::deque<std::vector<float>>> mail;
    int live;
};

struct Comm {
    Group* g;
    int rank;
};

// Waits until every rank has arrived; false when the group was aborted.
bool meet(Group* g, std::unique_lock<std::mutex>& l) {
    long gen = g->generation;
    if (++g->arrived == g->size) {
        g->arrived = 0;
        g->generation++;
        g->cv.notify_all();
        return !g->aborted;
    }
    g->cv.wait(l, [&] { return g->generation != gen || g->aborted; });
    return !g->aborted;
}

int check(Comm* c, size_t count, int type) {
    if (!c || !c->g) return kInvalidArgument;
    if (type != kFloat32 || count == 0) return kInvalidArgument;
    return kSuccess;
}

}  // namespace

extern "C" {

int ncclGetVersion(int* v) {
    *v = 21900;
    return kSuccess;
}

const char* ncclGetErrorString(int r) {
    switch (r) {
        case kSuccess: return "no error";
        case kInvalidArgument: return "invalid argument";
        case kInvalidUsage: return "invalid usage";
        case kRemoteError: return "aborted";
        default: return "unknown error";
    }
}

int ncclCommInitAll(Comm** comms, int ndev, const int* devlist) {
    if (ndev < 1) return kInvalidArgument;
    for (int i = 0; i < ndev; i++)
        for (int j = 0; j < i; j++)
            if (devlist[i] == devlist[j]) return kInvalidUsage;  // NCCL: duplicate GPU
    Group* g = new Group();
    g->size = ndev;
    g->live = ndev;
    g->slots.assign(ndev, nullptr);
    for (int i = 0; i < ndev; i++) comms[i] = new Comm{g, i};
    return kSuccess;
}

static int release(Comm* c) {
    if (!c) return kInvalidArgument;
    Group* g = c->g;
    bool last;
    {
        std::lock_guard<std::mutex> l(g->m);
        last = --g->live == 0;
    }
    delete c;
    if (last) delete g;
    return kSuccess;
}

int ncclCommDestroy(Comm* c) { return release(c); }

// NOTE: the other ranks' threads may still be inside a collective of the group (here a
// collective blocks its caller; NCCL's only queue work), so an aborted group is never freed.
int ncclCommAbort(Comm* c) {
    if (!c) return kInvalidArgument;
    std::lock_guard<std::mutex> l(c->g->m);
    c->g->aborted = true;
    c->g->cv.notify_all();
    return kSuccess;
}

int ncclAllReduce(const void* send, void* recv, size_t count, int type, int op, Comm* c,
                  void*) {
    if (int r = check(c, count, type)) return r;
    if (op != kSum) return kInvalidArgument;
    Group* g = c->g;
    std::unique_lock<std::mutex> l(g->m);
    g->slots[c->rank] = send;
    if (!meet(g, l)) return kRemoteError;
    std::vector<float> sum(count, 0.0f);
    for (int r = 0; r < g->size; r++) {
        const float* x = static_cast<const float*>(g->slots[r]);
        for (size_t i = 0; i < count; i++) sum[i] = r == 0 ? x[i] : sum[i] + x[i];
    }
    if (!meet(g, l)) return kRemoteError;  // everyone has read every input
    std::memcpy(recv, sum.data(), count * sizeof(float));
    return kSuccess;
}

int ncclAllGather(const void* send, void* recv, size_t count, int type, Comm* c, void*) {
    if (int r = check(c, count, type)) return r;
    Group* g = c->g;
    std::unique_lock<std::mutex> l(g->m);
    g->slots[c->rank] = send;
    if (!meet(g, l)) return kRemoteError;
    std::vector<float> all(count * g->size);
    for (int r = 0; r < g->size; r++)
        std::memcpy(&all[r * count], g->slots[r], count * sizeof(float));
    if (!meet(g, l)) return kRemoteError;
    std::memcpy(recv, all.data(), all.size() * sizeof(float));
    return kSuccess;
}

int ncclBroadcast(const void* send, void* recv, size_t count, int type, int root, Comm* c,
                  void*) {
    if (int r = check(c, count, type)) return r;
    Group* g = c->g;
    if (root < 0 || root >= g->size) return kInvalidArgument;
    std::unique_lock<std::mutex> l(g->m);
    g->slots[c->rank] = send;
    if (!meet(g, l)) return kRemoteError;
    std::vector<float> v(count);
    std::memcpy(v.data(), g->slots[root], count * sizeof(float));
    if (!meet(g, l)) return kRemoteError;
    std::memcpy(recv, v.data(), count * sizeof(float));
    return kSuccess;
}

int ncclSend(const void* send, size_t count, int type, int peer, Comm* c, void*) {
    if (int r = check(c, count, type)) return r;
    Group* g = c->g;
    if (peer < 0 || peer >= g->size || peer == c->rank) return kInvalidArgument;
    const float* x = static_cast<const float*>(send);
    std::lock_guard<std::mutex> l(g->m);
    if (g->aborted) return kRemoteError;
    g->mail[{c->rank, peer}].emplace_back(x, x + count);
    g->cv.notify_all();
    return kSuccess;
}

int ncclRecv(void* recv, size_t count, int type, int peer, Comm* c, void*) {
    if (int r = check(c, count, type)) return r;
    Group* g = c->g;
    if (peer < 0 || peer >= g->size || peer == c->rank) return kInvalidArgument;
    std::unique_lock<std::mutex> l(g->m);
    auto& q = g->mail[{peer, c->rank}];
    g->cv.wait(l, [&] { return !q.empty() || g->aborted; });
    if (q.empty()) return kRemoteError;
    if (q.front().size() != count) return kInvalidUsage;  // NCCL: sizes must match
    std::memcpy(recv, q.front().data(), count * sizeof(float));
    q.pop_front();
    return kSuccess;
}

}  // extern "C"
