#include "model/weight_store.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <stdexcept>
#include <string>
#include <system_error>

#include <sys/mman.h>

#include "model/staged_copy.h"

namespace minids {

namespace {

constexpr uint64_t kAlign = 256;  // every copied tensor and blob starts 256-byte aligned

uint64_t align_up(uint64_t n, uint64_t a) { return (n + a - 1) / a * a; }

}  // namespace

uint64_t available_host_memory() {
    FILE* f = std::fopen("/proc/meminfo", "r");
    if (!f) return 0;
    char line[256];
    unsigned long long kib = 0;
    while (std::fgets(line, sizeof line, f))
        if (std::sscanf(line, "MemAvailable: %llu kB", &kib) == 1) break;
    std::fclose(f);
    return uint64_t(kib) * 1024;
}

AnonymousMemory::AnonymousMemory(size_t bytes, bool huge_pages) : n_(bytes) {
    void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) return;
    // Huge pages where the system allows: fewer faults while filling, fewer pages to pin.
    if (huge_pages) (void)madvise(p, bytes, MADV_HUGEPAGE);
    p_ = static_cast<uint8_t*>(p);
}

AnonymousMemory::~AnonymousMemory() {
    if (p_) munmap(p_, n_);
}

namespace {

uint64_t total(const std::vector<std::span<const uint8_t>>& parts) {
    uint64_t n = 0;
    for (const auto& p : parts) n += p.size();
    return n;
}

}  // namespace

ExpertStoreRequest expert_store_request() {
    const char* env = std::getenv("MINIDS_EXPERT_STORE");
    const std::string v = env ? env : "";
    if (v.empty() || v == "copy") return ExpertStoreRequest::copy;
    if (v == "mapped") return ExpertStoreRequest::mapped;
    if (v == "staging") return ExpertStoreRequest::staging;
    throw std::invalid_argument("MINIDS_EXPERT_STORE=" + v +
                                ": expected copy (the default), mapped or staging");
}

WeightStore::WeightStore(const mds::MdsFile& file, mgl::backend& backend,
                         const WeightOptions& options)
    : file_(file),
      backend_(backend),
      experts_resident_(options.experts_resident),
      stage_experts_(options.stage_experts) {}

WeightStore::~WeightStore() = default;

bool WeightStore::copies() const { return backend_.compute_memory() != mgl::memory_kind::host; }

void WeightStore::add(mgl::tensor* t, const uint8_t* host, uint64_t nbytes) {
    MGL_CHECK(nbytes == mgl::nbytes(*t), "weight store: '" + t->name + "' has " +
                                             std::to_string(nbytes) + " bytes for " +
                                             std::to_string(mgl::nbytes(*t)));
    // Until place(), and for good on the CPU, the leaf reads the mapping (read-only: mgl never
    // writes through a leaf weight).
    t->data = const_cast<uint8_t*>(host);
    items_.push_back({t, {{host, nbytes}}, 0});
}

void WeightStore::add_concat(mgl::tensor* t, std::vector<std::span<const uint8_t>> parts) {
    MGL_CHECK(copies(), "weight store: merged weight '" + t->name + "' needs a copying store");
    MGL_CHECK(total(parts) == mgl::nbytes(*t), "weight store: parts of '" + t->name +
                                                   "' do not add up to its " +
                                                   std::to_string(mgl::nbytes(*t)) + " bytes");
    items_.push_back({t, std::move(parts), 0});
}

void WeightStore::add_owned(mgl::tensor* t, std::vector<uint8_t> bytes) {
    MGL_CHECK(copies(), "weight store: re-laid-out weight '" + t->name + "' needs a copying store");
    MGL_CHECK(bytes.size() == mgl::nbytes(*t), "weight store: '" + t->name + "' has " +
                                                   std::to_string(bytes.size()) + " bytes for " +
                                                   std::to_string(mgl::nbytes(*t)));
    owned_.push_back(std::move(bytes));
    items_.push_back({t, {{owned_.back().data(), owned_.back().size()}}, 0});
}

void WeightStore::forget(const mgl::tensor* t) {
    std::erase_if(items_, [t](const Item& it) { return it.t == t; });
}

mgl::tensor* WeightStore::add_expert_table(mgl::context& ctx, int64_t layer,
                                           std::vector<const uint8_t*> blobs, uint64_t blob_bytes) {
    mgl::tensor* t = ctx.new_tensor(mgl::dtype::i64, {int64_t(blobs.size())},
                                    "expert_table-" + std::to_string(layer));
    tables_.push_back({t, std::move(blobs), blob_bytes, {}});
    return t;
}

std::pair<const uint8_t*, uint64_t> WeightStore::expert_span() const {
    if (tables_.empty()) return {nullptr, 0};
    const uint8_t* lo = tables_[0].blobs[0];
    const uint8_t* hi = lo;
    for (const ExpertTable& tb : tables_) {
        for (const uint8_t* b : tb.blobs) {
            lo = std::min(lo, b);
            hi = std::max(hi, b + tb.blob_bytes);
        }
    }
    return {lo, uint64_t(hi - lo)};
}

void WeightStore::place_experts_in_host_memory(std::vector<int64_t>& addresses,
                                               const std::function<void(uint64_t)>& copied,
                                               const std::function<void(const char*)>& stamp) {
    const auto [lo, span] = expert_span();
    // The default store is a copy of the experts' span in anonymous memory, filled by several
    // threads and then registered: on the H200 machine (a VM) registering 14 GiB of touched
    // anonymous memory took 0.58 s, the file mapping 10.5 s (MAP_SHARED) or minutes
    // (MAP_PRIVATE), and cudaHostAlloc plus the copy ~10.6 s (docs/perf.md, 2026-12-01).
    // MINIDS_EXPERT_STORE=mapped registers the mapping instead (no second copy in host memory).
    // A backend that computes in host memory (the CPU) reads the mapping as is.
    // MINIDS_EXPERT_STORE=staging (or WeightOptions::stage_experts) registers nothing: the
    // staging store, also what is left when the system refuses both registrations.
    const ExpertStoreRequest request = expert_store_request();
    const bool want_mapped = request == ExpertStoreRequest::mapped;
    const bool want_staged = stage_experts_ || request == ExpertStoreRequest::staging;
    if (want_staged) return place_experts_staged(addresses, copied);
    // The copy is made only where the host has room for it beside everything else (the page
    // cache holding the file can be reclaimed, the copy cannot): else the mapping is used.
    const uint64_t available = available_host_memory();
    const bool room = available == 0 || span + (uint64_t(2) << 30) <= available;
    if (!want_mapped && room && backend_.compute_memory() != mgl::memory_kind::host) {
        // MINIDS_EXPERT_COPY_HUGEPAGES=0 leaves the copy to the system's default pages, the A/B
        // for a slow first load after a conversion. Measured on the H200 machine (docs/perf.md,
        // seventh session): without the advice the 12 GiB load took 3.14 / 3.23 s to the first
        // token, with it 2.05 / 1.93 s; the slow first loads came from a file not yet in the
        // page cache (the converter writes with O_DIRECT), not from the huge pages.
        const char* huge = std::getenv("MINIDS_EXPERT_COPY_HUGEPAGES");
        expert_copy_ =
            std::make_unique<AnonymousMemory>(size_t(span), !(huge && std::string(huge) == "0"));
        if (!expert_copy_->data()) expert_copy_.reset();  // no room: register the mapping
    }
    const uint8_t* store = lo;  // where the span is in host memory: the copy or the mapping
    bool counted = false;       // progress reported for the span already
    if (expert_copy_) {
        auto* dst = expert_copy_->data();
        const unsigned threads = load_copy_threads();
        constexpr uint64_t chunk = 256ull << 20;  // progress granularity
        for (uint64_t o = 0; o < span; o += chunk) {
            const uint64_t m = std::min(chunk, span - o);
            parallel_memcpy(dst + o, lo + o, size_t(m), threads);
            copied(m);
        }
        counted = true;
        stamp("experts copied to anonymous memory");
        expert_registration_ = backend_.register_host(dst, size_t(span), true);
        if (expert_registration_) {
            store = dst;
        } else {
            expert_copy_.reset();  // refused: register the mapping
        }
    }
    if (!expert_registration_) {
        // The experts stay in the mapping: register their span (read-only) so the backend's
        // kernels and copies address it directly.
        expert_registration_ = backend_.register_host(lo, size_t(span), true);
        if (!expert_registration_) {  // the system refused both: the staging store
            stamp("registration refused: the staging store");
            return place_experts_staged(addresses,
                                        counted ? std::function<void(uint64_t)>{} : copied);
        }
        if (!counted) copied(span);
    }
    for (ExpertTable& tb : tables_) {
        for (const uint8_t*& b : tb.blobs) {
            b = store + (b - lo);  // the cache fills its slots from the host store
            addresses.push_back(int64_t(expert_registration_->device_address(b)));
        }
    }
    placement_.experts_in_place = true;
    placement_.experts_pinned = expert_copy_ != nullptr;
}

void WeightStore::place_experts_staged(std::vector<int64_t>& addresses,
                                       const std::function<void(uint64_t)>& copied) {
    // Nothing registered: the homes are the blobs' addresses in the mapping, which the device
    // cannot read; the expert cache copies each miss through its pinned stage
    // (runtime/expert_offload.h) and never lets a kernel read one in place.
    for (const ExpertTable& tb : tables_)
        for (const uint8_t* b : tb.blobs) addresses.push_back(int64_t(b));
    if (copied) copied(expert_span().second);
    placement_.experts_in_place = true;
    placement_.experts_pinned = false;
    placement_.experts_staged = true;
}

void WeightStore::place(const std::function<void(uint64_t, uint64_t)>& progress) {
    const auto t0 = std::chrono::steady_clock::now();
    const bool copy = copies();
    placement_.copied = copy;
    placement_.memory = mgl::memory_kind_name(backend_.compute_memory());

    // Expert tables: one buffer of backend memory, n_experts addresses per MoE layer.
    uint64_t n_entries = 0;
    for (const ExpertTable& tb : tables_) n_entries += tb.blobs.size();
    std::vector<int64_t> addresses;
    addresses.reserve(n_entries);
    placement_.table_bytes = n_entries * sizeof(int64_t);
    if (n_entries) tables_buf_ = backend_.alloc_buffer(placement_.table_bytes);

    if (!copy) {
        for (const Item& it : items_) placement_.dense_bytes += total(it.parts);
        for (const ExpertTable& tb : tables_) {
            for (const uint8_t* b : tb.blobs) addresses.push_back(int64_t(b));
            placement_.expert_bytes += tb.blobs.size() * tb.blob_bytes;
        }
        // The mapping is read in place here anyway; marked, the expert cache stages its fills
        // as it would on a device (the CPU tests of the staging store).
        placement_.experts_staged = stage_experts_ && !tables_.empty();
    } else {
        uint64_t dense = 0, experts = 0;
        for (Item& it : items_) {
            it.offset = dense;
            dense = align_up(dense + total(it.parts), kAlign);
        }
        const bool in_place = !experts_resident_ && !tables_.empty();
        if (!in_place)
            for (const ExpertTable& tb : tables_)
                experts += tb.blobs.size() * align_up(tb.blob_bytes, kAlign);
        placement_.dense_bytes = dense;
        placement_.expert_bytes = experts;
        dense_ = backend_.alloc_buffer(std::max<uint64_t>(dense, 1));
        if (experts) experts_ = backend_.alloc_buffer(experts);

        // Page-locking the whole mapping first (read-only) lets the copies run at PCIe speed, but
        // measured on the H200 machine with a 17 GB file not yet in the page cache, the
        // registration had not returned after 45 s while plain pageable copies loaded everything
        // in 10 s (docs/perf.md). So the one-time load copies from pageable memory unless
        // MINIDS_HOST_REGISTER=1 asks for the registration (the expert cache will register ranges
        // it streams repeatedly).
        const char* reg = std::getenv("MINIDS_HOST_REGISTER");
        const bool trace = std::getenv("MINIDS_LOAD_TRACE") != nullptr;
        auto stamp = [&](const char* what) {
            if (trace)
                std::fprintf(
                    stderr, "weight store: %s at %.3f s\n", what,
                    std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
        };
        stamp("allocated");
        std::unique_ptr<mgl::host_registration> registration;
        if (reg && *reg == '1')
            registration = backend_.register_host(file_.map_base(), file_.file_size(), true);
        placement_.registered = registration != nullptr;
        stamp(registration ? "registered the mapping" : "mapping not registered");

        // An expert cache's host store is a copy in pinned memory unless the mapping is registered
        // instead (place_experts_in_host_memory): count it in the progress either way.
        const uint64_t all = dense + experts + (in_place ? expert_span().second : 0);
        uint64_t done = 0;
        // Without a registration: parallel copies into pinned staging buffers, overlapped with
        // the transfers (MINIDS_STAGED_COPY=0: the driver's own pageable copies).
        const char* staged_env = std::getenv("MINIDS_STAGED_COPY");
        std::unique_ptr<StagedCopier> staged;
        if (!registration && !(staged_env && *staged_env == '0')) {
            staged =
                std::make_unique<StagedCopier>(backend_, size_t(64) << 20, load_copy_threads());
        }
        placement_.staged = staged != nullptr;
        auto copy_in = [&](uint8_t* dst, const uint8_t* src, uint64_t n) {
            constexpr uint64_t chunk = 256ull << 20;  // progress granularity
            for (uint64_t o = 0; o < n; o += chunk) {
                const uint64_t m = std::min(chunk, n - o);
                if (staged) {
                    staged->copy(dst + o, src + o, m);
                } else {
                    backend_.copy_to_backend(dst + o, src + o, m);
                }
                done += m;
                if (progress) progress(done, all);
            }
        };
        auto* dense_base = static_cast<uint8_t*>(dense_->base());
        for (Item& it : items_) {
            uint8_t* dst = dense_base + it.offset;
            for (const auto& part : it.parts) {
                copy_in(dst, part.data(), part.size());
                dst += part.size();
            }
            mgl::bind(*it.t, *dense_, it.offset);
        }
        stamp("dense weights copied");
        if (in_place) {
            place_experts_in_host_memory(
                addresses,
                [&](uint64_t n) {
                    done += n;
                    if (progress) progress(done, all);
                },
                stamp);
            stamp(placement_.experts_pinned   ? "experts' copy registered"
                  : placement_.experts_staged ? "experts left in the mapping, unregistered"
                                              : "experts registered in the mapping");
        } else {
            uint64_t slot = 0;
            for (const ExpertTable& tb : tables_) {
                for (const uint8_t* b : tb.blobs) {
                    auto* dst = static_cast<uint8_t*>(experts_->base()) + slot;
                    copy_in(dst, b, tb.blob_bytes);
                    addresses.push_back(int64_t(dst));
                    slot += align_up(tb.blob_bytes, kAlign);
                }
            }
        }
        if (staged) staged->finish();
        if (progress) progress(all, all);
        stamp("experts placed");
        owned_.clear();
    }

    uint64_t at = 0;
    for (ExpertTable& tb : tables_) {
        mgl::bind(*tb.t, *tables_buf_, at * sizeof(int64_t));
        tb.home.assign(addresses.begin() + std::ptrdiff_t(at),
                       addresses.begin() + std::ptrdiff_t(at + tb.blobs.size()));
        at += tb.blobs.size();
    }
    if (n_entries) {
        backend_.copy_to_backend(tables_buf_->base(), addresses.data(), placement_.table_bytes);
    }
    placement_.seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace minids
