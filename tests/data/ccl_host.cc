// A collective library with NCCL's C API over host memory, for the emulated GPU (whose device
// pointers are host pointers): `tests/parallel.rs` builds it and names it in PAGODA_EMU_CCL, so
// that the engine's NCCL binding (src/parallel/ccl.rs) runs its real calls (counts, types,
// roots, peers, in-place buffers, unique ids) end to end without a GPU. Only what that binding
// uses, and only float sums; every other value is refused, so a wrong argument fails the test.
//
// A group lives in a POSIX shared-memory object, so that its ranks may be threads of one
// process (ncclCommInitAll) or of several (ncclGetUniqueId names the object; every rank's
// ncclCommInitRank opens it and waits for the others), as the engine's workers on several
// nodes are. Each rank is driven by its own thread; a collective returns when it is complete (a
// real library only queues it on the stream, which orders the same way). All-reduce adds in
// rank order, as the engine's host communicator does.
//
// As in NCCL, ncclCommAbort cancels what waits on that handle only: ranks in other processes
// go on waiting until their own handles are aborted (the engine tells their nodes to).

#include <fcntl.h>
#include <pthread.h>
#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <new>
#include <cstddef>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <vector>

namespace {

enum { kSuccess = 0, kSystemError = 2, kInvalidArgument = 4, kInvalidUsage = 5, kRemoteError = 6 };
enum { kFloat32 = 7 };
enum { kSum = 0 };

constexpr int kMaxRanks = 8;
// The most bytes one rank contributes to one collective, or sends in one message.
constexpr size_t kSlot = size_t(8) << 20;
constexpr size_t kHeader = 4096;
// One slot per rank, then one mailbox per (from, to) pair.
constexpr size_t kBytes = kHeader + kSlot * (kMaxRanks + kMaxRanks * kMaxRanks);

struct Shared {
    pthread_mutex_t m;
    pthread_cond_t cv;
    int size;  // 0 until the first rank joins
    int joined;
    int arrived;
    long generation;
    size_t counts[kMaxRanks];
    size_t mail_len[kMaxRanks][kMaxRanks];
    int mail_full[kMaxRanks][kMaxRanks];
};
static_assert(sizeof(Shared) <= kHeader, "the header fits");

struct Comm {
    Shared* sh;
    char* base;
    int rank;
    std::atomic<bool> aborted{false};

    float* slot(int r) { return reinterpret_cast<float*>(base + kHeader + kSlot * r); }
    float* mail(int from, int to) {
        return reinterpret_cast<float*>(base + kHeader + kSlot * (kMaxRanks + from * kMaxRanks + to));
    }
};

struct Id {
    char name[128];
};

std::atomic<long> next_id{0};

// Waits (the lock held) until `done()`; false when the handle was aborted or `limit_s` passed.
template <class F>
bool wait(Comm* c, F done, int limit_s = 0) {
    timespec start;
    clock_gettime(CLOCK_REALTIME, &start);
    while (!done()) {
        if (c->aborted.load()) return false;
        timespec t;
        clock_gettime(CLOCK_REALTIME, &t);
        if (limit_s && t.tv_sec - start.tv_sec > limit_s) return false;
        t.tv_nsec += 5 * 1000 * 1000;
        if (t.tv_nsec >= 1000000000L) {
            t.tv_sec++;
            t.tv_nsec -= 1000000000L;
        }
        pthread_cond_timedwait(&c->sh->cv, &c->sh->m, &t);
    }
    return !c->aborted.load();
}

// Waits until every rank has arrived; false when the handle was aborted.
bool meet(Comm* c) {
    Shared* s = c->sh;
    long gen = s->generation;
    if (++s->arrived == s->size) {
        s->arrived = 0;
        s->generation++;
        pthread_cond_broadcast(&s->cv);
        return !c->aborted.load();
    }
    return wait(c, [&] { return s->generation != gen; });
}

struct Lock {
    Shared* s;
    explicit Lock(Comm* c) : s(c->sh) { pthread_mutex_lock(&s->m); }
    ~Lock() { pthread_mutex_unlock(&s->m); }
};

int check(Comm* c, size_t count, int type) {
    if (!c || !c->sh) return kInvalidArgument;
    if (type != kFloat32 || count == 0) return kInvalidArgument;
    if (count * sizeof(float) > kSlot) return kInvalidUsage;
    return kSuccess;
}

// Creates the shared object of a new group and writes its name.
int create(Id* id) {
    std::snprintf(id->name, sizeof id->name, "/pagoda-ccl-%d-%ld-%ld", int(getpid()),
                  next_id.fetch_add(1), long(clock()));
    int fd = shm_open(id->name, O_CREAT | O_EXCL | O_RDWR, 0600);
    if (fd < 0) return kSystemError;
    if (ftruncate(fd, kBytes) != 0) {
        close(fd);
        shm_unlink(id->name);
        return kSystemError;
    }
    void* p = mmap(nullptr, sizeof(Shared), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    close(fd);
    if (p == MAP_FAILED) return kSystemError;
    Shared* s = new (p) Shared();
    pthread_mutexattr_t ma;
    pthread_mutexattr_init(&ma);
    pthread_mutexattr_setpshared(&ma, PTHREAD_PROCESS_SHARED);
    pthread_mutex_init(&s->m, &ma);
    pthread_condattr_t ca;
    pthread_condattr_init(&ca);
    pthread_condattr_setpshared(&ca, PTHREAD_PROCESS_SHARED);
    pthread_cond_init(&s->cv, &ca);
    munmap(p, sizeof(Shared));
    return kSuccess;
}

// Opens the group named `name` as rank `rank` of `nranks`.
int attach(const char* name, int nranks, int rank, Comm** out) {
    if (nranks < 1 || nranks > kMaxRanks || rank < 0 || rank >= nranks) return kInvalidArgument;
    int fd = shm_open(name, O_RDWR, 0600);
    if (fd < 0) return kInvalidUsage;  // no such id (or every rank has joined already)
    void* p = mmap(nullptr, kBytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    close(fd);
    if (p == MAP_FAILED) return kSystemError;
    Comm* c = new Comm();
    c->sh = static_cast<Shared*>(p);
    c->base = static_cast<char*>(p);
    c->rank = rank;
    Lock l(c);
    if (c->sh->size == 0) c->sh->size = nranks;
    if (c->sh->size != nranks) {
        munmap(p, kBytes);
        delete c;
        return kInvalidUsage;  // NCCL: every rank must give the same count
    }
    if (++c->sh->joined == nranks) shm_unlink(name);
    pthread_cond_broadcast(&c->sh->cv);
    *out = c;
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
        case kSystemError: return "system error";
        case kInvalidArgument: return "invalid argument";
        case kInvalidUsage: return "invalid usage";
        case kRemoteError: return "aborted";
        default: return "unknown error";
    }
}

int ncclGetUniqueId(Id* id) {
    if (!id) return kInvalidArgument;
    std::memset(id, 0, sizeof *id);
    return create(id);
}

int ncclCommInitRank(Comm** comm, int nranks, Id id, int rank) {
    id.name[sizeof id.name - 1] = 0;
    int r = attach(id.name, nranks, rank, comm);
    if (r) return r;
    Comm* c = *comm;
    Lock l(c);
    // NOTE: NCCL waits for every rank of the group; here at most a minute.
    if (!wait(c, [&] { return c->sh->joined == c->sh->size; }, 60)) return kRemoteError;
    return kSuccess;
}

int ncclCommInitAll(Comm** comms, int ndev, const int* devlist) {
    if (ndev < 1 || ndev > kMaxRanks) return kInvalidArgument;
    for (int i = 0; i < ndev; i++)
        for (int j = 0; j < i; j++)
            if (devlist[i] == devlist[j]) return kInvalidUsage;  // NCCL: duplicate GPU
    Id id;
    std::memset(&id, 0, sizeof id);
    if (int r = create(&id)) return r;
    for (int i = 0; i < ndev; i++)
        if (int r = attach(id.name, ndev, i, &comms[i])) return r;
    return kSuccess;
}

int ncclCommDestroy(Comm* c) {
    if (!c) return kInvalidArgument;
    munmap(c->base, kBytes);
    delete c;
    return kSuccess;
}

// NOTE: the handle's thread may still be inside a collective (here a collective blocks its
// caller; NCCL's only queue work), so an aborted handle is never freed.
int ncclCommAbort(Comm* c) {
    if (!c) return kInvalidArgument;
    c->aborted.store(true);
    Lock l(c);
    pthread_cond_broadcast(&c->sh->cv);
    return kSuccess;
}

}  // extern "C"

namespace {

// One exchange: this rank's `count` values (none where `send` is null) go to its slot; once
// every rank has written, `read(out)` reads the slots; once every rank has read, `out` goes to
// `recv`.
template <class F>
int exchange(Comm* c, const void* send, void* recv, size_t count, size_t out_count, F read) {
    Lock l(c);
    if (c->aborted.load()) return kRemoteError;
    if (send) std::memcpy(c->slot(c->rank), send, count * sizeof(float));
    c->sh->counts[c->rank] = count;
    if (!meet(c)) return kRemoteError;
    bool same = true;
    for (int r = 0; r < c->sh->size; r++) same = same && c->sh->counts[r] == count;
    std::vector<float> out(out_count);
    read(out.data());
    if (!meet(c)) return kRemoteError;  // everyone has read every input
    if (!same) return kInvalidUsage;    // NCCL: every rank gives the same count
    std::memcpy(recv, out.data(), out_count * sizeof(float));
    return kSuccess;
}

}  // namespace

extern "C" {

int ncclAllReduce(const void* send, void* recv, size_t count, int type, int op, Comm* c,
                  void*) {
    if (int r = check(c, count, type)) return r;
    if (op != kSum) return kInvalidArgument;
    return exchange(c, send, recv, count, count, [&](float* sum) {
        for (int r = 0; r < c->sh->size; r++) {
            const float* x = c->slot(r);
            for (size_t i = 0; i < count; i++) sum[i] = r == 0 ? x[i] : sum[i] + x[i];
        }
    });
}

int ncclAllGather(const void* send, void* recv, size_t count, int type, Comm* c, void*) {
    if (int r = check(c, count, type)) return r;
    return exchange(c, send, recv, count, count * c->sh->size, [&](float* all) {
        for (int r = 0; r < c->sh->size; r++)
            std::memcpy(all + r * count, c->slot(r), count * sizeof(float));
    });
}

int ncclBroadcast(const void* send, void* recv, size_t count, int type, int root, Comm* c,
                  void*) {
    if (int r = check(c, count, type)) return r;
    if (root < 0 || root >= c->sh->size) return kInvalidArgument;
    return exchange(c, c->rank == root ? send : nullptr, recv, count, count, [&](float* v) {
        std::memcpy(v, c->slot(root), count * sizeof(float));
    });
}

// NOTE: one message in flight per (from, to): a second send waits until the first is taken.
int ncclSend(const void* send, size_t count, int type, int peer, Comm* c, void*) {
    if (int r = check(c, count, type)) return r;
    Shared* s = c->sh;
    if (peer < 0 || peer >= s->size || peer == c->rank) return kInvalidArgument;
    Lock l(c);
    if (!wait(c, [&] { return !s->mail_full[c->rank][peer]; })) return kRemoteError;
    std::memcpy(c->mail(c->rank, peer), send, count * sizeof(float));
    s->mail_len[c->rank][peer] = count;
    s->mail_full[c->rank][peer] = 1;
    pthread_cond_broadcast(&s->cv);
    return kSuccess;
}

int ncclRecv(void* recv, size_t count, int type, int peer, Comm* c, void*) {
    if (int r = check(c, count, type)) return r;
    Shared* s = c->sh;
    if (peer < 0 || peer >= s->size || peer == c->rank) return kInvalidArgument;
    Lock l(c);
    if (!wait(c, [&] { return s->mail_full[peer][c->rank] != 0; })) return kRemoteError;
    if (s->mail_len[peer][c->rank] != count) return kInvalidUsage;  // NCCL: sizes must match
    std::memcpy(recv, c->mail(peer, c->rank), count * sizeof(float));
    s->mail_full[peer][c->rank] = 0;
    pthread_cond_broadcast(&s->cv);
    return kSuccess;
}

}  // extern "C"
