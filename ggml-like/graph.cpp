// Graph building (topological order) and the liveness-based arena plan for intermediates.
#include <algorithm>
#include <atomic>
#include <map>
#include <unordered_map>
#include <unordered_set>

#include "mgl.h"

namespace mgl {

tensor* alias_source(const tensor& t) {
    switch (t.op_kind) {
        case op::view:
        case op::kv_store:
        case op::expert_fetch:
            return t.src[0];
        case op::cpy:
            return t.src[1];
        default:
            return nullptr;
    }
}

namespace {

tensor* storage_root(tensor* t) {
    while (tensor* s = alias_source(*t)) t = s;
    return t;
}

void visit(tensor* t, std::unordered_set<tensor*>& seen, graph& g) {
    if (!seen.insert(t).second) return;
    for (tensor* s : t->src) {
        if (s) visit(s, seen, g);
    }
    if (t->op_kind == op::none) {
        g.leafs.push_back(t);
    } else {
        g.nodes.push_back(t);
    }
}

size_t align_up(size_t n, size_t a) { return (n + a - 1) / a * a; }

// First-fit allocator over free byte ranges of a growing arena.
class range_allocator {
public:
    explicit range_allocator(size_t alignment) : alignment_(alignment) {}

    size_t allocate(size_t bytes) {
        bytes = align_up(std::max<size_t>(bytes, 1), alignment_);
        for (auto it = free_.begin(); it != free_.end(); ++it) {
            if (it->second < bytes) continue;
            size_t offset = it->first, left = it->second - bytes;
            free_.erase(it);
            if (left) free_.emplace(offset + bytes, left);
            return offset;
        }
        // Grow the arena; a free range touching the end is extended rather than skipped.
        if (!free_.empty()) {
            auto last = std::prev(free_.end());
            if (last->first + last->second == end_) {
                size_t offset = last->first;
                free_.erase(last);
                end_ = offset + bytes;
                return offset;
            }
        }
        size_t offset = end_;
        end_ += bytes;
        return offset;
    }

    void release(size_t offset, size_t bytes) {
        bytes = align_up(std::max<size_t>(bytes, 1), alignment_);
        auto [it, inserted] = free_.emplace(offset, bytes);
        MGL_CHECK(inserted, "allocator: double release at offset " + std::to_string(offset));
        // Merge with the following and the preceding free range.
        auto next = std::next(it);
        if (next != free_.end() && it->first + it->second == next->first) {
            it->second += next->second;
            free_.erase(next);
        }
        if (it != free_.begin()) {
            auto prev = std::prev(it);
            if (prev->first + prev->second == it->first) {
                prev->second += it->second;
                free_.erase(it);
            }
        }
    }

    size_t size() const { return end_; }

private:
    size_t alignment_;
    size_t end_ = 0;
    std::map<size_t, size_t> free_;  // offset -> length
};

}  // namespace

graph build_graph(context& c, std::initializer_list<tensor*> outputs) {
    return build_graph(c, std::span<tensor* const>(outputs.begin(), outputs.size()));
}

uint64_t new_graph_version() {
    // Only an identity for "what a backend recorded for this graph"; never reused in a process.
    static std::atomic<uint64_t> next{1};
    return next.fetch_add(1, std::memory_order_relaxed);
}

graph build_graph(context& c, std::span<tensor* const> outputs) {
    return build_graph(c, outputs, {});
}

graph build_graph(context&, std::span<tensor* const> outputs, std::span<tensor* const> first) {
    graph g;
    g.version = new_graph_version();
    std::unordered_set<tensor*> seen;
    for (tensor* t : first) {
        MGL_CHECK(t != nullptr, "build_graph: null node to place first");
        visit(t, seen, g);
    }
    for (tensor* out : outputs) {
        MGL_CHECK(out != nullptr, "build_graph: null output");
        g.outputs.push_back(out);
        visit(out, seen, g);
    }
    return g;
}

alloc_plan plan_allocation(const graph& g, size_t alignment,
                           std::span<const std::pair<tensor*, tensor*>> also_reads) {
    MGL_CHECK(alignment > 0 && (alignment & (alignment - 1)) == 0,
              "plan_allocation: alignment must be a power of two");
    std::unordered_map<const tensor*, size_t> step;  // node -> execution index
    for (size_t i = 0; i < g.nodes.size(); ++i) step[g.nodes[i]] = i;

    // A storage (the root of an alias chain) lives until the last node that reads it, directly or
    // through a view; an alias node itself also counts as a use, so views extend their source's
    // life.
    std::unordered_map<const tensor*, size_t> last_use;
    auto use = [&](tensor* t, size_t i) {
        tensor* root = storage_root(t);
        auto [it, inserted] = last_use.emplace(root, i);
        if (!inserted) it->second = std::max(it->second, i);
    };
    for (size_t i = 0; i < g.nodes.size(); ++i) {
        use(g.nodes[i], i);
        for (tensor* s : g.nodes[i]->src) {
            if (s) use(s, i);
        }
    }
    for (auto [node, t] : also_reads) {
        auto it = step.find(node);
        MGL_CHECK(it != step.end() && t != nullptr,
                  "plan_allocation: also_reads names a node outside the graph");
        use(t, it->second);
    }
    std::unordered_set<const tensor*> kept;
    for (tensor* out : g.outputs) kept.insert(storage_root(out));

    std::vector<std::vector<const tensor*>> dies_after(g.nodes.size());
    for (auto [root, i] : last_use) {
        if (!kept.count(root) && step.count(root)) dies_after[i].push_back(root);
    }
    for (auto& v : dies_after) {  // deterministic plans: release in execution order
        std::sort(v.begin(), v.end(),
                  [&](const tensor* a, const tensor* b) { return step[a] < step[b]; });
    }

    alloc_plan plan;
    range_allocator arena(alignment);
    std::unordered_map<const tensor*, size_t> placed;
    for (size_t i = 0; i < g.nodes.size(); ++i) {
        tensor* n = g.nodes[i];
        if (!alias_source(*n) && n->data == nullptr) {
            size_t offset = arena.allocate(nbytes(*n));
            placed[n] = offset;
            plan.offsets.emplace_back(n, offset);
        }
        for (const tensor* dead : dies_after[i]) {
            auto it = placed.find(dead);
            if (it != placed.end()) arena.release(it->second, nbytes(*dead));
        }
    }
    plan.arena_bytes = arena.size();
    return plan;
}

void clear_plan(graph& g, const buffer* arena) {
    for (tensor* n : g.nodes) {
        if (alias_source(*n) || (arena && n->buf == arena)) {
            n->data = nullptr;
            n->buf = nullptr;
        }
    }
}

const char* memory_kind_name(memory_kind k) {
    switch (k) {
        case memory_kind::host:
            return "host";
        case memory_kind::pinned_host:
            return "pinned host";
        case memory_kind::device:
            return "device";
    }
    return "unknown";
}

namespace {

class immediate_transfer_queue final : public transfer_queue {
public:
    explicit immediate_transfer_queue(backend& b) : b_(b) {}
    void copy(void* dst, const void* src, size_t n) override { b_.copy_to_backend(dst, src, n); }
    uint64_t fence() override { return ++fences_; }
    bool done(uint64_t) override { return true; }
    void drain() override {}
    void signal(int64_t* word, int64_t value) override {
        b_.copy_to_backend(word, &value, sizeof value);
    }

private:
    backend& b_;
    uint64_t fences_ = 0;
};

}  // namespace

std::unique_ptr<transfer_queue> backend::make_transfer_queue() {
    return std::make_unique<immediate_transfer_queue>(*this);
}

void backend::check_not_stale(const graph& g) {
    MGL_CHECK(g.placed_in != nullptr, "compute: the graph was not allocated");
    MGL_CHECK(g.placed_in->generation == g.arena_generation,
              "compute: the graph's arena grew after it was allocated; allocate it again");
}

void apply_plan(graph& g, const alloc_plan& plan, buffer& arena) {
    MGL_CHECK(plan.arena_bytes <= arena.size(),
              "apply_plan: arena of " + std::to_string(arena.size()) + " bytes for a plan of " +
                  std::to_string(plan.arena_bytes));
    for (auto [t, offset] : plan.offsets) {
        t->data = static_cast<char*>(arena.base()) + offset;
        t->buf = &arena;
    }
    for (tensor* n : g.nodes) {
        tensor* s = alias_source(*n);
        if (!s) continue;
        MGL_CHECK(s->data != nullptr, std::string(op_name(n->op_kind)) + " node '" + n->name +
                                          "' aliases '" + s->name + "', which has no memory");
        n->data = static_cast<char*>(s->data) + n->view_offset;
        n->buf = s->buf;
    }
    for (tensor* leaf : g.leafs) {
        MGL_CHECK(leaf->data != nullptr,
                  "leaf tensor '" + leaf->name + "' " + shape_str(*leaf) +
                      " has no data: bind or point it at memory before allocate()");
    }
}

}  // namespace mgl
