// Tensor structs, the context that owns them, and the view family (no copies).
#include <numeric>

#include "mgl.h"

namespace mgl {

namespace {

void set_contiguous_strides(tensor& t) {
    int64_t step = int64_t(dtype_size(t.type));
    for (int i = max_dims - 1; i >= 0; --i) {
        t.stride[size_t(i)] = step;
        if (i < t.n_dims) step *= t.shape[size_t(i)];
    }
}

void set_shape(tensor& t, std::span<const int64_t> shape) {
    MGL_CHECK(shape.size() <= size_t(max_dims), "tensor rank " + std::to_string(shape.size()) +
                                                    " exceeds " + std::to_string(max_dims));
    t.n_dims = int(shape.size());
    t.shape.fill(1);
    for (size_t i = 0; i < shape.size(); ++i) {
        MGL_CHECK(shape[i] >= 0, "negative dimension " + std::to_string(shape[i]));
        t.shape[i] = shape[i];
    }
}

// Bytes from a tensor's first element to one past its last, for non-negative strides.
size_t extent_bytes(const tensor& t) {
    if (t.nelements() == 0) return 0;
    size_t end = dtype_size(t.type);
    for (int i = 0; i < t.n_dims; ++i)
        end += size_t(t.shape[size_t(i)] - 1) * size_t(t.stride[size_t(i)]);
    return end;
}

}  // namespace

int64_t tensor::nelements() const {
    int64_t n = 1;
    for (int i = 0; i < n_dims; ++i) n *= shape[size_t(i)];
    return n;
}

bool tensor::is_contiguous() const {
    int64_t step = int64_t(dtype_size(type));
    for (int i = n_dims - 1; i >= 0; --i) {
        if (shape[size_t(i)] != 1 && stride[size_t(i)] != step) return false;
        step *= shape[size_t(i)];
    }
    return true;
}

size_t nbytes(const tensor& t) { return size_t(t.nelements()) * dtype_size(t.type); }

std::string shape_str(const tensor& t) {
    std::string s = "[";
    for (int i = 0; i < t.n_dims; ++i) {
        if (i) s += ", ";
        s += std::to_string(t.shape[size_t(i)]);
    }
    return s + "]";
}

const char* op_name(op o) {
    switch (o) {
        case op::none:
            return "none";
        case op::view:
            return "view";
        case op::get_rows:
            return "get_rows";
        case op::matmul:
            return "matmul";
        case op::add:
            return "add";
        case op::mul:
            return "mul";
        case op::scale:
            return "scale";
        case op::rms_norm:
            return "rms_norm";
        case op::rope:
            return "rope";
        case op::softmax:
            return "softmax";
        case op::swiglu:
            return "swiglu";
        case op::moe_topk:
            return "moe_topk";
        case op::moe_weights:
            return "moe_weights";
        case op::moe_experts:
            return "moe_experts";
        case op::kv_store:
            return "kv_store";
        case op::mla_attn:
            return "mla_attn";
        case op::cpy:
            return "cpy";
        case op::contiguous:
            return "contiguous";
        case op::concat:
            return "concat";
        case op::expert_fetch:
            return "expert_fetch";
        case op::expert_prompt_stage:
            return "expert_prompt_stage";
        case op::count:
            break;
    }
    return "unknown";
}

tensor* context::new_tensor(dtype type, std::initializer_list<int64_t> shape, std::string name) {
    return new_tensor(type, std::span<const int64_t>(shape.begin(), shape.size()), std::move(name));
}

tensor* context::new_tensor(dtype type, std::span<const int64_t> shape, std::string name) {
    tensor* t = new_node(op::none, type, shape);
    t->name = std::move(name);
    return t;
}

tensor* context::new_node(op o, dtype type, std::span<const int64_t> shape) {
    tensor& t = tensors_.emplace_back();
    t.type = type;
    t.op_kind = o;
    set_shape(t, shape);
    set_contiguous_strides(t);
    return &t;
}

void bind(tensor& t, buffer& buf, size_t offset) {
    MGL_CHECK(offset + nbytes(t) <= buf.size(), "bind: tensor '" + t.name + "' " + shape_str(t) +
                                                    " at offset " + std::to_string(offset) +
                                                    " does not fit a buffer of " +
                                                    std::to_string(buf.size()) + " bytes");
    t.data = static_cast<char*>(buf.base()) + offset;
    t.buf = &buf;
}

// ----- views -----

tensor* view(context& c, tensor* a, std::span<const int64_t> shape, std::span<const int64_t> stride,
             size_t byte_offset) {
    MGL_CHECK(a != nullptr, "view of a null tensor");
    MGL_CHECK(shape.size() == stride.size(), "view: shape and stride ranks differ");
    tensor* v = c.new_node(op::view, a->type, shape);
    for (size_t i = 0; i < stride.size(); ++i) {
        MGL_CHECK(stride[i] >= 0, "view: negative strides are not supported");
        v->stride[i] = stride[i];
    }
    v->src[0] = a;
    v->view_offset = byte_offset;
    MGL_CHECK(byte_offset + extent_bytes(*v) <= extent_bytes(*a),
              "view " + shape_str(*v) + " at offset " + std::to_string(byte_offset) +
                  " reaches past the end of '" + a->name + "' " + shape_str(*a));
    return v;
}

tensor* reshape(context& c, tensor* a, std::initializer_list<int64_t> shape) {
    MGL_CHECK(a->is_contiguous(),
              "reshape of the non-contiguous tensor '" + a->name + "' " + shape_str(*a));
    int64_t n = std::accumulate(shape.begin(), shape.end(), int64_t(1), std::multiplies<>());
    MGL_CHECK(n == a->nelements(),
              "reshape of " + shape_str(*a) + " to " + std::to_string(n) + " elements");
    tensor probe;
    probe.type = a->type;
    set_shape(probe, std::span<const int64_t>(shape.begin(), shape.size()));
    set_contiguous_strides(probe);
    return view(c, a, std::span<const int64_t>(shape.begin(), shape.size()),
                std::span<const int64_t>(probe.stride.data(), shape.size()), 0);
}

tensor* permute(context& c, tensor* a, std::initializer_list<int> axes) {
    MGL_CHECK(int(axes.size()) == a->n_dims, "permute: " + std::to_string(axes.size()) +
                                                 " axes for a tensor of rank " +
                                                 std::to_string(a->n_dims));
    std::array<int64_t, max_dims> shape{}, stride{};
    std::array<bool, max_dims> used{};
    size_t i = 0;
    for (int ax : axes) {
        MGL_CHECK(ax >= 0 && ax < a->n_dims && !used[size_t(ax)],
                  "permute: bad axis " + std::to_string(ax));
        used[size_t(ax)] = true;
        shape[i] = a->shape[size_t(ax)];
        stride[i] = a->stride[size_t(ax)];
        ++i;
    }
    return view(c, a, std::span<const int64_t>(shape.data(), axes.size()),
                std::span<const int64_t>(stride.data(), axes.size()), 0);
}

tensor* transpose(context& c, tensor* a, int dim0, int dim1) {
    MGL_CHECK(dim0 >= 0 && dim0 < a->n_dims && dim1 >= 0 && dim1 < a->n_dims,
              "transpose: dims " + std::to_string(dim0) + ", " + std::to_string(dim1) +
                  " of a rank " + std::to_string(a->n_dims) + " tensor");
    std::array<int64_t, max_dims> shape = a->shape, stride = a->stride;
    std::swap(shape[size_t(dim0)], shape[size_t(dim1)]);
    std::swap(stride[size_t(dim0)], stride[size_t(dim1)]);
    return view(c, a, std::span<const int64_t>(shape.data(), size_t(a->n_dims)),
                std::span<const int64_t>(stride.data(), size_t(a->n_dims)), 0);
}

tensor* slice(context& c, tensor* a, int dim, int64_t start, int64_t len) {
    MGL_CHECK(dim >= 0 && dim < a->n_dims,
              "slice: dim " + std::to_string(dim) + " of " + shape_str(*a));
    MGL_CHECK(start >= 0 && len >= 0 && start + len <= a->shape[size_t(dim)],
              "slice [" + std::to_string(start) + ", " + std::to_string(start + len) + ") of dim " +
                  std::to_string(dim) + " of " + shape_str(*a));
    std::array<int64_t, max_dims> shape = a->shape;
    shape[size_t(dim)] = len;
    return view(c, a, std::span<const int64_t>(shape.data(), size_t(a->n_dims)),
                std::span<const int64_t>(a->stride.data(), size_t(a->n_dims)),
                size_t(start * a->stride[size_t(dim)]));
}

}  // namespace mgl
