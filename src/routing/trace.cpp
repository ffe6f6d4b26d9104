#include "routing/trace.h"

#include <cerrno>
#include <cmath>
#include <cstring>
#include <fstream>
#include <limits>

namespace minids::routing {

namespace {

constexpr const char* format_name = "minids-routing-trace";
constexpr int format_version = 1;

template <class T>
std::vector<std::byte> as_bytes(const std::vector<T>& v) {
    std::vector<std::byte> b(v.size() * sizeof(T));
    if (!b.empty()) std::memcpy(b.data(), v.data(), b.size());
    return b;
}

template <class T>
T load(const std::byte* p) {
    T v;
    std::memcpy(&v, p, sizeof(T));
    return v;
}

// Integer array members as int64, whatever little-endian integer dtype they were saved with.
std::vector<int64_t> integers(const NpyView& v, const std::string& what) {
    const int64_t n = v.n_elements();
    std::vector<int64_t> out(size_t(n), 0);
    const std::byte* p = v.data.data();
    const std::string& d = v.descr;
    for (int64_t i = 0; i < n; ++i) {
        int64_t x = 0;
        if (d == "|u1" || d == "|b1" || d == "<u1" || d == "<b1") {
            x = load<uint8_t>(p + i);
        } else if (d == "|i1" || d == "<i1") {
            x = load<int8_t>(p + i);
        } else if (d == "<u2") {
            x = load<uint16_t>(p + 2 * i);
        } else if (d == "<i2") {
            x = load<int16_t>(p + 2 * i);
        } else if (d == "<u4") {
            x = load<uint32_t>(p + 4 * i);
        } else if (d == "<i4") {
            x = load<int32_t>(p + 4 * i);
        } else if (d == "<i8") {
            x = load<int64_t>(p + 8 * i);
        } else if (d == "<u8") {
            const uint64_t u = load<uint64_t>(p + 8 * i);
            x = u > uint64_t(INT64_MAX) ? -1 : int64_t(u);
        } else {
            throw TraceError(what + ": expected an integer array, found dtype '" + d + "'");
        }
        out[size_t(i)] = x;
    }
    return out;
}

std::string shape_str(const std::vector<int64_t>& s) {
    std::string r = "[";
    for (size_t i = 0; i < s.size(); ++i) r += (i ? ", " : "") + std::to_string(s[i]);
    return r + "]";
}

template <class T>
T header_int(const nlohmann::json& h, const char* key, const std::string& where) {
    auto it = h.find(key);
    if (it == h.end() || !it->is_number_integer()) {
        throw TraceError(where + ": header field \"" + key + "\" missing or not an integer");
    }
    if (it->is_number_unsigned()) {
        const uint64_t v = it->get<uint64_t>();
        if (v > uint64_t(std::numeric_limits<T>::max()))
            throw TraceError(where + ": header field \"" + key + "\" out of range");
        return T(v);
    }
    const int64_t v = it->get<int64_t>();
    if (v < int64_t(std::numeric_limits<T>::min()) ||
        (v > 0 && uint64_t(v) > uint64_t(std::numeric_limits<T>::max())))
        throw TraceError(where + ": header field \"" + key + "\" out of range");
    return T(v);
}

}  // namespace

void validate_shape(const TraceShape& s, const std::string& where) {
    if (s.n_experts < 1 || s.n_experts > 65536) {
        throw TraceError(where + ": n_experts must be in [1, 65536], found " +
                         std::to_string(s.n_experts));
    }
    if (s.top_k < 1 || s.top_k > s.n_experts) {
        throw TraceError(where + ": top_k must be in [1, n_experts], found " +
                         std::to_string(s.top_k));
    }
    if (s.moe_layers.empty()) throw TraceError(where + ": moe_layers is empty");
    if (s.moe_layers.size() > 4096) throw TraceError(where + ": more than 4096 MoE layers");
    for (size_t i = 0; i < s.moe_layers.size(); ++i) {
        if (s.moe_layers[i] < 0 || (i > 0 && s.moe_layers[i] <= s.moe_layers[i - 1])) {
            throw TraceError(where + ": moe_layers must be non-negative and ascending");
        }
    }
}

void RoutingTrace::append_step(int64_t n, bool is_prefill, const int32_t* ids_lnk,
                               const float* w_lnk) {
    const int32_t L = shape.n_moe_layers(), k = shape.top_k;
    const int32_t next_step = step.empty() ? 0 : step.back() + 1;
    for (int64_t t = 0; t < n; ++t) {
        for (int32_t l = 0; l < L; ++l) {
            const int64_t at = (int64_t(l) * n + t) * k;
            for (int32_t j = 0; j < k; ++j) {
                const int32_t e = ids_lnk[at + j];
                if (e < 0 || e >= shape.n_experts) {
                    throw TraceError("routing record: expert id " + std::to_string(e) +
                                     " outside [0, " + std::to_string(shape.n_experts) + ")");
                }
                ids.push_back(uint16_t(e));
                weights.push_back(w_lnk[at + j]);
            }
        }
        prefill.push_back(is_prefill ? 1 : 0);
        step.push_back(next_step);
    }
    n_tokens += n;
}

RoutingTrace parse_trace(NpzArchive a) {
    const std::string where = "trace " + a.path();
    RoutingTrace tr;

    const NpyView hv = parse_npy(a.member("header.npy"), where + ": header.npy");
    if (hv.descr != "|u1" || hv.shape.size() != 1) {
        throw TraceError(where + ": header.npy must be a 1-D |u1 array of JSON text");
    }
    nlohmann::json h;
    try {
        h = nlohmann::json::parse(
            std::string(reinterpret_cast<const char*>(hv.data.data()), hv.data.size()));
    } catch (const nlohmann::json::exception&) {
        throw TraceError(where + ": header.npy is not valid JSON");
    }
    if (!h.is_object()) throw TraceError(where + ": the header must be a JSON object");
    if (h.value("format", std::string()) != format_name) {
        throw TraceError(where + ": not a minids routing trace (header \"format\" is not \"" +
                         format_name + "\")");
    }
    const int version = header_int<int>(h, "version", where);
    if (version != format_version) {
        throw TraceError(where + ": trace format version " + std::to_string(version) +
                         " is not supported (this minids reads version 1)");
    }
    tr.shape.n_experts = header_int<int32_t>(h, "n_experts", where);
    tr.shape.top_k = header_int<int32_t>(h, "top_k", where);
    tr.shape.expert_bytes = header_int<uint64_t>(h, "expert_bytes", where);
    auto layers = h.find("moe_layers");
    if (layers == h.end() || !layers->is_array()) {
        throw TraceError(where + ": header field \"moe_layers\" missing or not an array");
    }
    for (const auto& v : *layers) {
        if (!v.is_number_integer() || v.get<int64_t>() < 0 || v.get<int64_t>() > 1000000)
            throw TraceError(where + ": moe_layers must hold non-negative integers");
        if (tr.shape.moe_layers.size() > 4096) throw TraceError(where + ": too many MoE layers");
        tr.shape.moe_layers.push_back(v.get<int32_t>());
    }
    validate_shape(tr.shape, where);
    tr.n_tokens = header_int<int64_t>(h, "n_tokens", where);
    if (h.contains("source") && h["source"].is_string()) tr.source = h["source"];
    tr.extra = nlohmann::json::object();
    for (const auto& [key, value] : h.items()) {
        if (key != "format" && key != "version" && key != "n_experts" && key != "top_k" &&
            key != "expert_bytes" && key != "moe_layers" && key != "n_tokens" && key != "source")
            tr.extra[key] = value;
    }

    const int64_t T = tr.n_tokens, L = tr.shape.n_moe_layers(), k = tr.shape.top_k;
    if (T < 1) throw TraceError(where + ": the trace has no tokens");
    const std::vector<int64_t> row_shape = {T, L, k};
    const NpyView iv = parse_npy(a.member("ids.npy"), where + ": ids.npy");
    if (iv.shape != row_shape) {
        throw TraceError(where + ": ids.npy: expected shape " + shape_str(row_shape) +
                         " (n_tokens, MoE layers, top_k from the header), found " +
                         shape_str(iv.shape));
    }
    const NpyView wv = parse_npy(a.member("weights.npy"), where + ": weights.npy");
    if (wv.shape != row_shape) {
        throw TraceError(where + ": weights.npy: expected shape " + shape_str(row_shape) +
                         ", found " + shape_str(wv.shape));
    }
    if (wv.descr != "<f4") {
        throw TraceError(where + ": weights.npy: expected dtype <f4, found " + wv.descr);
    }

    const std::vector<int64_t> ids = integers(iv, where + ": ids.npy");
    tr.ids.resize(ids.size());
    tr.weights.resize(ids.size());
    std::memcpy(tr.weights.data(), wv.data.data(), wv.data.size());
    std::vector<int64_t> seen(size_t(tr.shape.n_experts), -1);
    for (int64_t r = 0; r < T * L; ++r) {
        for (int64_t j = 0; j < k; ++j) {
            const int64_t i = r * k + j;
            const int64_t e = ids[size_t(i)];
            if (e < 0 || e >= tr.shape.n_experts) {
                throw TraceError(where + ": ids.npy: token " + std::to_string(r / L) +
                                 ", MoE layer " + std::to_string(r % L) + ": expert id " +
                                 std::to_string(e) + " outside [0, " +
                                 std::to_string(tr.shape.n_experts) + ")");
            }
            if (seen[size_t(e)] == r) {
                throw TraceError(where + ": ids.npy: token " + std::to_string(r / L) +
                                 ", MoE layer " + std::to_string(r % L) + ": expert " +
                                 std::to_string(e) + " chosen twice");
            }
            seen[size_t(e)] = r;
            tr.ids[size_t(i)] = uint16_t(e);
            if (!std::isfinite(tr.weights[size_t(i)])) {
                throw TraceError(where + ": weights.npy: token " + std::to_string(r / L) +
                                 " has a weight that is not finite");
            }
        }
    }

    tr.prefill.assign(size_t(T), 0);
    if (a.has("prefill.npy")) {
        const NpyView pv = parse_npy(a.member("prefill.npy"), where + ": prefill.npy");
        if (pv.shape != std::vector<int64_t>{T}) {
            throw TraceError(where + ": prefill.npy: expected shape [" + std::to_string(T) +
                             "], found " + shape_str(pv.shape));
        }
        const std::vector<int64_t> p = integers(pv, where + ": prefill.npy");
        for (int64_t t = 0; t < T; ++t) {
            if (p[size_t(t)] != 0 && p[size_t(t)] != 1)
                throw TraceError(where + ": prefill.npy: expected booleans (0 or 1)");
            tr.prefill[size_t(t)] = uint8_t(p[size_t(t)]);
        }
    }
    tr.step.resize(size_t(T));
    if (a.has("step.npy")) {
        const NpyView sv = parse_npy(a.member("step.npy"), where + ": step.npy");
        if (sv.shape != std::vector<int64_t>{T}) {
            throw TraceError(where + ": step.npy: expected shape [" + std::to_string(T) +
                             "], found " + shape_str(sv.shape));
        }
        const std::vector<int64_t> s = integers(sv, where + ": step.npy");
        for (int64_t t = 0; t < T; ++t) {
            if (s[size_t(t)] < 0 || s[size_t(t)] > INT32_MAX ||
                (t > 0 && s[size_t(t)] < s[size_t(t - 1)]))
                throw TraceError(where + ": step.npy: expected non-negative, non-decreasing steps");
            tr.step[size_t(t)] = int32_t(s[size_t(t)]);
        }
    } else {
        for (int64_t t = 0; t < T; ++t) tr.step[size_t(t)] = int32_t(t);
    }
    return tr;
}

RoutingTrace read_trace(const std::string& path) { return parse_trace(NpzArchive::read(path)); }

std::vector<std::byte> trace_bytes(const RoutingTrace& tr) {
    validate_shape(tr.shape, "trace");
    const int64_t T = tr.n_tokens, L = tr.shape.n_moe_layers(), k = tr.shape.top_k;
    if (int64_t(tr.ids.size()) != T * L * k || tr.weights.size() != tr.ids.size() ||
        int64_t(tr.prefill.size()) != T || int64_t(tr.step.size()) != T) {
        throw std::runtime_error("write_trace: array sizes do not match the trace's shape");
    }
    nlohmann::json h = tr.extra.is_object() ? tr.extra : nlohmann::json::object();
    h["format"] = format_name;
    h["version"] = format_version;
    h["n_experts"] = tr.shape.n_experts;
    h["top_k"] = tr.shape.top_k;
    h["expert_bytes"] = tr.shape.expert_bytes;
    h["moe_layers"] = tr.shape.moe_layers;
    h["n_tokens"] = T;
    h["source"] = tr.source;
    const std::string text = h.dump();
    std::vector<std::byte> header(text.size());
    std::memcpy(header.data(), text.data(), text.size());

    NpzWriter w;
    w.add("header.npy", make_npy("|u1", {int64_t(header.size())}, header));
    const std::vector<int64_t> shape = {T, L, k};
    if (tr.shape.n_experts <= 256) {
        std::vector<uint8_t> narrow(tr.ids.begin(), tr.ids.end());
        w.add("ids.npy", make_npy("|u1", shape, as_bytes(narrow)));
    } else {
        w.add("ids.npy", make_npy("<u2", shape, as_bytes(tr.ids)));
    }
    w.add("weights.npy", make_npy("<f4", shape, as_bytes(tr.weights)));
    w.add("prefill.npy", make_npy("|b1", {T}, as_bytes(tr.prefill)));
    w.add("step.npy", make_npy("<i4", {T}, as_bytes(tr.step)));
    return w.to_bytes();
}

void write_trace(const RoutingTrace& tr, const std::string& path) {
    // The bytes are built first, so a bad trace never leaves a half-written file.
    const std::vector<std::byte> bytes = trace_bytes(tr);
    std::ofstream f(path, std::ios::binary | std::ios::trunc);
    if (!f) throw std::runtime_error("cannot write " + path + ": " + std::strerror(errno));
    f.write(reinterpret_cast<const char*>(bytes.data()), std::streamsize(bytes.size()));
    f.close();
    if (!f) throw std::runtime_error("cannot write " + path + ": " + std::strerror(errno));
}

RoutingTrace select_tokens(const RoutingTrace& tr, const std::string& which) {
    if (which == "all") return tr;
    if (which != "prefill" && which != "decode") {
        throw std::invalid_argument("--tokens: expected all, prefill or decode, found " + which);
    }
    const uint8_t want = which == "prefill" ? 1 : 0;
    RoutingTrace out;
    out.shape = tr.shape;
    out.source = tr.source;
    out.extra = tr.extra;
    const int64_t row = tr.row_size();
    for (int64_t t = 0; t < tr.n_tokens; ++t) {
        if (tr.prefill[size_t(t)] != want) continue;
        out.ids.insert(out.ids.end(), tr.ids.begin() + t * row, tr.ids.begin() + (t + 1) * row);
        out.weights.insert(out.weights.end(), tr.weights.begin() + t * row,
                           tr.weights.begin() + (t + 1) * row);
        out.prefill.push_back(want);
        out.step.push_back(tr.step[size_t(t)]);
        ++out.n_tokens;
    }
    return out;
}

}  // namespace minids::routing
