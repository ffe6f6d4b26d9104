"""DeepSeek-V2's forward as DeepSeek's own code defines it, in float64, plus the file helpers the
fixture scripts share (safetensors without the safetensors package, sharded checkpoints in the
hub's per-expert layout, a tokenizer cut down to a smaller vocabulary).

The forward follows DeepSeek's modeling_deepseek.py (DeepSeek-V2 / V2-Lite on the hub; classes
named below) line for line in meaning, but computes everything in float64 (DeepSeek's code runs the
router, RMSNorm and RoPE tables in float32). It is the independent check on transformers: a
fixture is trusted when transformers' DeepseekV2ForCausalLM and this forward agree.

Where DeepSeek's V2 code and transformers differ, this file follows DeepSeek's V2 code:
  * q_a_layernorm and kv_a_layernorm use eps 1e-6 whatever rms_norm_eps says
    (DeepseekV2Attention.__init__: DeepseekV2RMSNorm(config.q_lora_rank) /
    DeepseekV2RMSNorm(config.kv_lora_rank), whose default eps is 1e-6);
  * a layer is MoE iff n_routed_experts is set, layer >= first_k_dense_replace and
    layer % moe_layer_freq == 0 (DeepseekV2DecoderLayer.__init__);
  * routing weights: top_k > 1 and norm_topk_prob -> w / (sum w + 1e-20), else
    w * routed_scaling_factor (MoEGate.forward);
  * YaRN: cos/sin scaled by mscale(factor, mscale) / mscale(factor, mscale_all_dim), softmax
    scale multiplied by mscale(factor, mscale_all_dim)^2 when mscale_all_dim is non-zero
    (DeepseekV2YarnRotaryEmbedding, DeepseekV2Attention.__init__);
  * shared experts exist iff n_shared_experts is not None (DeepseekV2MoE.__init__).
"""

import json
import math
import os
import re
import struct

import torch

F64 = torch.float64

# ---------------------------------------------------------------------------------------------
# Config


class DsConfig:
    """The fields of a DeepSeek-V2 config.json the forward needs, with DeepSeek's defaults
    (configuration_deepseek.py)."""

    def __init__(self, j):
        self.raw = j
        self.vocab_size = j["vocab_size"]
        self.hidden_size = j["hidden_size"]
        self.intermediate_size = j["intermediate_size"]
        self.moe_intermediate_size = j.get("moe_intermediate_size", 1407)
        self.num_hidden_layers = j["num_hidden_layers"]
        self.num_attention_heads = j["num_attention_heads"]
        self.q_lora_rank = j.get("q_lora_rank", 1536)
        self.kv_lora_rank = j.get("kv_lora_rank", 512)
        self.qk_nope_head_dim = j.get("qk_nope_head_dim", 128)
        self.qk_rope_head_dim = j.get("qk_rope_head_dim", 64)
        self.v_head_dim = j.get("v_head_dim", 128)
        self.n_routed_experts = j.get("n_routed_experts")
        self.n_shared_experts = j.get("n_shared_experts")
        self.num_experts_per_tok = j.get("num_experts_per_tok")
        self.first_k_dense_replace = j.get("first_k_dense_replace", 0)
        self.moe_layer_freq = j.get("moe_layer_freq", 1)
        self.n_group = j.get("n_group") or 1
        self.topk_group = j.get("topk_group") or 1
        self.topk_method = j.get("topk_method", "greedy")
        if self.topk_method == "gready":  # DeepSeek's configuration_deepseek.py default spelling
            self.topk_method = "greedy"
        self.norm_topk_prob = bool(j.get("norm_topk_prob", False))
        self.routed_scaling_factor = float(j.get("routed_scaling_factor", 1.0))
        self.scoring_func = j.get("scoring_func", "softmax")
        self.rms_norm_eps = float(j.get("rms_norm_eps", 1e-6))
        self.tie_word_embeddings = bool(j.get("tie_word_embeddings", False))
        # rope: DeepSeek's files carry rope_theta + rope_scaling{type: yarn, ...}; transformers 5
        # re-saves them as rope_parameters{rope_type, type, rope_theta, ...}.
        self.rope_theta = float(j.get("rope_theta", 10000.0))
        rs = j.get("rope_parameters") or j.get("rope_scaling")
        self.yarn = None
        if rs:
            self.rope_theta = float(rs.get("rope_theta", self.rope_theta))
            kind = rs.get("type") or rs.get("rope_type")
            if kind == "yarn":
                self.yarn = {
                    "factor": float(rs["factor"]),
                    "original_max_position_embeddings": int(
                        rs.get("original_max_position_embeddings", 4096)),
                    "beta_fast": float(rs.get("beta_fast", 32)),
                    "beta_slow": float(rs.get("beta_slow", 1)),
                    "mscale": float(rs.get("mscale", 1)),
                    "mscale_all_dim": float(rs.get("mscale_all_dim", 0)),
                }
            elif kind not in (None, "default"):
                raise ValueError("rope type %r is not covered by this reference" % kind)
        if self.scoring_func != "softmax":
            raise ValueError("scoring_func %r is not covered by this reference" % self.scoring_func)

    def is_moe_layer(self, layer):
        # DeepseekV2DecoderLayer.__init__
        return (self.n_routed_experts is not None and layer >= self.first_k_dense_replace and
                layer % self.moe_layer_freq == 0)

    @property
    def qk_head_dim(self):
        return self.qk_nope_head_dim + self.qk_rope_head_dim


def yarn_get_mscale(scale=1.0, mscale=1.0):
    # modeling_deepseek.py yarn_get_mscale
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


def rope_inv_freq(c, dtype=F64):
    """(inv_freq [d/2], cos/sin multiplier) as DeepseekV2YarnRotaryEmbedding computes them; in
    float32 (dtype=torch.float32) that is operation for operation DeepSeek's table."""
    d, base = c.qk_rope_head_dim, c.rope_theta
    i = torch.arange(0, d, 2, dtype=dtype)
    freq_extra = 1.0 / (base**(i / d))
    if c.yarn is None:
        return freq_extra, 1.0
    y = c.yarn

    def corr_dim(n_rot):  # yarn_find_correction_dim
        return (d * math.log(y["original_max_position_embeddings"] /
                             (n_rot * 2 * math.pi))) / (2 * math.log(base))

    low = max(math.floor(corr_dim(y["beta_fast"])), 0)  # yarn_find_correction_range
    high = min(math.ceil(corr_dim(y["beta_slow"])), d - 1)
    if low == high:
        high += 0.001  # yarn_linear_ramp_mask
    ramp = torch.clamp((torch.arange(d // 2, dtype=dtype) - low) / (high - low), 0, 1)
    mask = 1.0 - ramp
    freq_inter = 1.0 / (y["factor"] * base**(i / d))
    inv = freq_inter * (1 - mask) + freq_extra * mask
    msc = yarn_get_mscale(y["factor"], y["mscale"]) / yarn_get_mscale(
        y["factor"], y["mscale_all_dim"])
    return inv, msc


def rope_angles(c, T):
    """Rotation angles [T, d/2]. DeepSeek's code (and transformers', and the engine) forms them as
    a float32 product of the float32 position and the float32 inverse frequency; that rounding is
    up to ~1e-5 rad at a few hundred positions and shows in the logits at 1e-5, so it is part of
    the definition kept here. The cosines and sines are then taken in float64."""
    inv32, msc = rope_inv_freq(c, torch.float32)
    ang = torch.arange(T, dtype=torch.float32)[:, None] * inv32[None, :]
    return ang.to(F64), msc


def softmax_scale(c):
    # DeepseekV2Attention.__init__
    s = c.qk_head_dim**(-0.5)
    if c.yarn is not None and c.yarn["mscale_all_dim"]:
        m = yarn_get_mscale(c.yarn["factor"], c.yarn["mscale_all_dim"])
        s = s * m * m
    return s


# ---------------------------------------------------------------------------------------------
# Forward


def rms_norm(x, w, eps):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def linear(x, w):
    return x @ w.t()


def swiglu_mlp(x, w, prefix):
    g = linear(x, w[prefix + "gate_proj.weight"])
    u = linear(x, w[prefix + "up_proj.weight"])
    return linear(torch.nn.functional.silu(g) * u, w[prefix + "down_proj.weight"])


def apply_rope(x, cos, sin):
    """Rotates adjacent pairs (2i, 2i+1): DeepSeek's view(d/2, 2).transpose + rotate_half, whose
    output order (evens, then odds) differs but whose dot products are the same."""
    x0, x1 = x[..., 0::2], x[..., 1::2]
    return torch.cat((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1)


def select_experts(c, scores, logits=None):
    """MoEGate.forward after the softmax: expert ids [T, k] and weights [T, k]; with the router
    `logits` also, per token, the smallest router-logit gap that decided its selection (the k-th
    chosen minus the best rejected, and for group-limited routing also the topk_group-th group
    minus the next), over max|logit| of the token: an engine whose logits are that close to the
    reference may choose differently. Works in the dtype of `scores` (DeepSeek routes in
    float32)."""
    E, k = c.n_routed_experts, c.num_experts_per_tok
    T = scores.shape[0]
    inf = float("inf")
    margin = torch.full((T,), inf, dtype=scores.dtype)
    if c.topk_method == "greedy":
        cand, cand_logits = scores, logits
    elif c.topk_method == "group_limited_greedy":
        G, tg = c.n_group, c.topk_group
        group_scores = scores.view(T, G, -1).max(dim=-1).values
        group_idx = torch.topk(group_scores, k=tg, dim=-1).indices
        group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1)
        score_mask = group_mask.unsqueeze(-1).expand(T, G, E // G).reshape(T, -1)
        cand = scores.masked_fill(~score_mask.bool(), 0.0)
        if logits is not None:
            if G > tg:  # softmax is monotone: the group order is the order of the group max logit
                gl = torch.sort(logits.view(T, G, -1).max(dim=-1).values, dim=-1,
                                descending=True).values
                margin = torch.minimum(margin, gl[:, tg - 1] - gl[:, tg])
            cand_logits = logits.masked_fill(~score_mask.bool(), -inf)
    else:
        raise ValueError("topk_method %r" % c.topk_method)
    if logits is not None:
        if E > k:
            srt = torch.sort(cand_logits, dim=-1, descending=True).values
            margin = torch.minimum(margin, srt[:, k - 1] - srt[:, k])
        margin = margin / logits.abs().max(dim=-1).values
    w, idx = torch.topk(cand, k=k, dim=-1)
    if k > 1 and c.norm_topk_prob:
        w = w / (w.sum(dim=-1, keepdim=True) + 1e-20)
    else:
        w = w * c.routed_scaling_factor
    return idx, w, margin


def route(c, x, gate_w, margins=None):
    """Softmax scores of the router in float64, then select_experts; appends the smallest
    relative margin of these tokens to `margins`."""
    logits = linear(x, gate_w)
    idx, w, margin = select_experts(c, torch.softmax(logits, dim=-1), logits)
    if margins is not None:
        margins.append(float(margin.min()))
    return idx, w


def moe(c, x, w, prefix, margins=None):
    idx, wt = route(c, x, w[prefix + "gate.weight"], margins)
    y = torch.zeros_like(x)
    for e in torch.unique(idx).tolist():
        rows, slot = torch.where(idx == e)
        ye = swiglu_mlp(x[rows], w, "%sexperts.%d." % (prefix, e))
        y.index_add_(0, rows, ye * wt[rows, slot].unsqueeze(-1))
    if c.n_shared_experts is not None:
        y = y + swiglu_mlp(x, w, prefix + "shared_experts.")
    return y


def attention(c, x, w, prefix, cos, sin, kv_cache=None):
    """MLA for the new tokens x [T, D] at the positions cos/sin describe; with `kv_cache` (a dict
    kept across calls) the keys and values of earlier calls are attended to as well."""
    T = x.shape[0]
    H, nope, rope, dv = (c.num_attention_heads, c.qk_nope_head_dim, c.qk_rope_head_dim,
                         c.v_head_dim)
    if c.q_lora_rank is None:
        q = linear(x, w[prefix + "q_proj.weight"])
    else:
        qa = linear(x, w[prefix + "q_a_proj.weight"])
        # eps 1e-6 here, not rms_norm_eps: DeepseekV2RMSNorm(config.q_lora_rank)
        q = linear(rms_norm(qa, w[prefix + "q_a_layernorm.weight"], 1e-6),
                   w[prefix + "q_b_proj.weight"])
    q = q.view(T, H, nope + rope)
    q_nope, q_pe = q[..., :nope], q[..., nope:]
    kv = linear(x, w[prefix + "kv_a_proj_with_mqa.weight"])
    c_kv, k_pe = kv[:, :c.kv_lora_rank], kv[:, c.kv_lora_rank:]
    # eps 1e-6 here, not rms_norm_eps: DeepseekV2RMSNorm(config.kv_lora_rank)
    c_kv = rms_norm(c_kv, w[prefix + "kv_a_layernorm.weight"], 1e-6)
    kvb = linear(c_kv, w[prefix + "kv_b_proj.weight"]).view(T, H, nope + dv)
    k_nope, v = kvb[..., :nope], kvb[..., nope:]
    q_pe = apply_rope(q_pe, cos[:, None, :], sin[:, None, :])
    k_pe = apply_rope(k_pe, cos, sin)
    qh = torch.cat((q_nope, q_pe), dim=-1).transpose(0, 1)  # [H, T, dq]
    kh = torch.cat((k_nope, k_pe[:, None, :].expand(T, H, rope)), dim=-1).transpose(0, 1)
    vh = v.transpose(0, 1)
    if kv_cache is not None:
        if "k" in kv_cache:
            kh = torch.cat((kv_cache["k"], kh), dim=1)
            vh = torch.cat((kv_cache["v"], vh), dim=1)
        kv_cache["k"], kv_cache["v"] = kh, vh
    past = kh.shape[1] - T
    s = (qh @ kh.transpose(1, 2)) * softmax_scale(c)
    causal = torch.triu(torch.ones(T, past + T, dtype=torch.bool), diagonal=past + 1)
    s = s.masked_fill(causal, float("-inf"))
    o = torch.softmax(s, dim=-1) @ vh  # [H, T, dv]
    return linear(o.transpose(0, 1).reshape(T, H * dv), w[prefix + "o_proj.weight"])


def forward(c, w, ids, margins=None, hidden=None, cache=None):
    """Logits [T, vocab] (float64) for token ids `ids` at positions 0..T-1. `margins` collects
    routing margins (see route); `hidden` collects the residual stream after each layer. With
    `cache` (a dict, empty at first), `ids` continue the tokens of the earlier calls."""
    ids_t = torch.as_tensor(ids, dtype=torch.long)
    T = ids_t.shape[0]
    past = cache.get("n", 0) if cache is not None else 0
    ang, msc = rope_angles(c, past + T)
    ang = ang[past:]
    cos, sin = torch.cos(ang) * msc, torch.sin(ang) * msc
    x = w["model.embed_tokens.weight"][ids_t]
    for layer in range(c.num_hidden_layers):
        p = "model.layers.%d." % layer
        kv = cache.setdefault(layer, {}) if cache is not None else None
        h = x + attention(c, rms_norm(x, w[p + "input_layernorm.weight"], c.rms_norm_eps), w,
                          p + "self_attn.", cos, sin, kv)
        hn = rms_norm(h, w[p + "post_attention_layernorm.weight"], c.rms_norm_eps)
        f = moe(c, hn, w, p + "mlp.", margins) if c.is_moe_layer(layer) else swiglu_mlp(
            hn, w, p + "mlp.")
        x = h + f
        if hidden is not None:
            hidden.append(x)
    if cache is not None:
        cache["n"] = past + T
    head = w["model.embed_tokens.weight"] if c.tie_word_embeddings else w["lm_head.weight"]
    return linear(rms_norm(x, w["model.norm.weight"], c.rms_norm_eps), head)


def greedy(c, w, prompt, n):
    """n argmax tokens after `prompt` (EOS not special) and the top-1/top-2 gap of each step over
    max|logit|, decoding incrementally through a key/value cache."""
    cache, toks, gaps = {}, [], []
    row = forward(c, w, prompt, cache=cache)[-1]
    for _ in range(n):
        tok, gap = top2_gap(row)
        toks.append(tok)
        gaps.append(gap)
        row = forward(c, w, [tok], cache=cache)[-1]
    return toks, gaps


def worst_position_error(got, ref):
    """max over positions of max|got - ref| / max|ref| within the position's row."""
    got, ref = got.to(F64), ref.to(F64)
    return float(((got - ref).abs().max(dim=-1).values / ref.abs().max(dim=-1).values).max())


def top2_gap(row):
    """(argmax, (top1 - top2) / max|row|) of one logits row."""
    v, i = torch.topk(row.to(F64), 2)
    return int(i[0]), float((v[0] - v[1]) / row.abs().max())


# ---------------------------------------------------------------------------------------------
# Hub-layout checkpoint: names, shapes and random BF16 weights


def expected_shapes(c):
    """Every tensor of the checkpoint in the hub's per-expert layout: name -> (shape, fan_in)."""
    D, H, V = c.hidden_size, c.num_attention_heads, c.vocab_size
    dq = c.qk_head_dim
    out = {"model.embed_tokens.weight": ((V, D), None)}
    for layer in range(c.num_hidden_layers):
        p = "model.layers.%d." % layer
        out[p + "input_layernorm.weight"] = ((D,), None)
        if c.q_lora_rank is None:
            out[p + "self_attn.q_proj.weight"] = ((H * dq, D), D)
        else:
            out[p + "self_attn.q_a_proj.weight"] = ((c.q_lora_rank, D), D)
            out[p + "self_attn.q_a_layernorm.weight"] = ((c.q_lora_rank,), None)
            out[p + "self_attn.q_b_proj.weight"] = ((H * dq, c.q_lora_rank), c.q_lora_rank)
        out[p + "self_attn.kv_a_proj_with_mqa.weight"] = ((c.kv_lora_rank + c.qk_rope_head_dim,
                                                           D), D)
        out[p + "self_attn.kv_a_layernorm.weight"] = ((c.kv_lora_rank,), None)
        out[p + "self_attn.kv_b_proj.weight"] = ((H * (c.qk_nope_head_dim + c.v_head_dim),
                                                  c.kv_lora_rank), c.kv_lora_rank)
        out[p + "self_attn.o_proj.weight"] = ((D, H * c.v_head_dim), H * c.v_head_dim)
        out[p + "post_attention_layernorm.weight"] = ((D,), None)
        if c.is_moe_layer(layer):
            F = c.moe_intermediate_size
            out[p + "mlp.gate.weight"] = ((c.n_routed_experts, D), D)
            for e in range(c.n_routed_experts):
                q = p + "mlp.experts.%d." % e
                out[q + "gate_proj.weight"] = ((F, D), D)
                out[q + "up_proj.weight"] = ((F, D), D)
                out[q + "down_proj.weight"] = ((D, F), F)
            if c.n_shared_experts is not None:
                Fs = F * c.n_shared_experts
                q = p + "mlp.shared_experts."
                out[q + "gate_proj.weight"] = ((Fs, D), D)
                out[q + "up_proj.weight"] = ((Fs, D), D)
                out[q + "down_proj.weight"] = ((D, Fs), Fs)
        else:
            F = c.intermediate_size
            out[p + "mlp.gate_proj.weight"] = ((F, D), D)
            out[p + "mlp.up_proj.weight"] = ((F, D), D)
            out[p + "mlp.down_proj.weight"] = ((D, F), F)
    out["model.norm.weight"] = ((D,), None)
    if not c.tie_word_embeddings:
        out["lm_head.weight"] = ((V, D), D)
    return out


def bf16_round(t):
    """The float64 values a BF16 checkpoint holds for `t` (round to nearest even)."""
    return t.to(torch.float32).to(torch.bfloat16).to(F64)


def random_weights(c, seed):
    """Normal random weights that keep activations at unit scale (std 1/sqrt(fan_in), embedding
    std 1, norms 1 + N(0, 0.2^2), as tests/data/tiny-v2-lite has them), rounded to BF16; float64
    tensors keyed by hub name. (Sharper attention or routing, e.g. projections scaled up 2-3x,
    pushes an FP32 engine's error against a float64 reference to ~1e-5 on 300-token prompts:
    right at the fixtures' tolerance, so it is not done.)"""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, (shape, fan_in) in expected_shapes(c).items():
        z = torch.randn(shape, generator=g, dtype=F64)
        if fan_in is None:  # embedding (unit variance) or a norm (1 +- 0.2)
            t = z if name == "model.embed_tokens.weight" else 1 + 0.2 * z
        else:
            t = z / math.sqrt(fan_in)
        out[name] = bf16_round(t)
    return out


# ---------------------------------------------------------------------------------------------
# safetensors (written and read here, so the scripts need only torch)

_ST_DTYPES = {torch.bfloat16: ("BF16", 2), torch.float32: ("F32", 4), torch.float64: ("F64", 8)}


def _tensor_bytes(t):
    """A view of the tensor's bytes (no copy for a contiguous CPU tensor)."""
    t = t.contiguous().cpu()
    if t.dtype == torch.bfloat16:
        t = t.view(torch.int16)
    return memoryview(t.numpy()).cast("B")


def write_safetensors(path, tensors):
    """tensors: name -> torch tensor (bf16, f32 or f64), written in the given order."""
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for name, t in tensors.items():
        code, size = _ST_DTYPES[t.dtype]
        nb = t.numel() * size
        header[name] = {"dtype": code, "shape": list(t.shape), "data_offsets": [offset, offset + nb]}
        offset += nb
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * (-len(h) % 8)
    with open(path + ".tmp", "wb") as f:
        f.write(struct.pack("<Q", len(h)))
        f.write(h)
        for t in tensors.values():
            f.write(_tensor_bytes(t))
    os.replace(path + ".tmp", path)
    return 8 + len(h) + offset


def read_safetensors(path, names=None):
    """name -> float64 tensor, for every tensor or only those in `names`."""
    out = {}
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
        for name, info in header.items():
            if name == "__metadata__" or (names is not None and name not in names):
                continue
            b, e = info["data_offsets"]
            f.seek(8 + n + b)
            raw = bytearray(f.read(e - b))
            if info["dtype"] == "BF16":
                t = torch.frombuffer(raw, dtype=torch.int16).view(torch.bfloat16)
            elif info["dtype"] == "F32":
                t = torch.frombuffer(raw, dtype=torch.float32)
            elif info["dtype"] == "F64":
                t = torch.frombuffer(raw, dtype=torch.float64)
            else:
                raise ValueError("%s: dtype %s" % (path, info["dtype"]))
            out[name] = t.reshape(info["shape"]).to(F64)
    return out


def write_sharded_checkpoint(out_dir, tensors, n_shards, dtype=torch.bfloat16):
    """model-0000i-of-0000n.safetensors + model.safetensors.index.json, as the hub has them:
    tensors in layer order, split into n_shards files of about equal size."""
    names = list(tensors)
    sizes = [tensors[n].numel() for n in names]
    total, bounds, acc, cut = sum(sizes), [], 0, 1
    for i, s in enumerate(sizes):
        if acc >= total * cut / n_shards and len(bounds) < n_shards - 1:
            bounds.append(i)
            cut += 1
        acc += s
    starts, ends = [0] + bounds, bounds + [len(names)]
    weight_map, total_bytes = {}, 0
    for k, (a, b) in enumerate(zip(starts, ends)):
        fname = "model-%05d-of-%05d.safetensors" % (k + 1, len(starts))
        part = {n: tensors[n].to(dtype) for n in names[a:b]}
        write_safetensors(os.path.join(out_dir, fname), part)
        total_bytes += sum(t.numel() * t.element_size() for t in part.values())
        for n in part:
            weight_map[n] = fname
    with open(os.path.join(out_dir, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total_bytes}, "weight_map": weight_map}, f, indent=2)
    return [os.path.join(out_dir, "model-%05d-of-%05d.safetensors" % (k + 1, len(starts)))
            for k in range(len(starts))]


# ---------------------------------------------------------------------------------------------
# Tokenizer


def cut_tokenizer(src_dir, dst_dir, vocab_size):
    """Copies tokenizer.json / tokenizer_config.json, keeping only the token ids below vocab_size
    (a byte-level BPE: ids 0-2 special, then the 256 bytes, then one token per merge in order), so
    `minids convert` accepts it for a smaller vocabulary. Fails if the cut is not consistent."""
    with open(os.path.join(src_dir, "tokenizer.json"), encoding="utf-8") as f:
        tok = json.load(f)
    model = tok["model"]
    vocab = model["vocab"]
    if vocab_size < len(vocab):
        keep = {t: i for t, i in vocab.items() if i < vocab_size}
        merges = []
        for m in model["merges"]:
            a, b = m if isinstance(m, list) else m.split(" ", 1)
            if a + b in keep:
                if a not in keep or b not in keep:
                    raise ValueError("tokenizer cut: merge %r %r keeps its result but not its parts"
                                     % (a, b))
                merges.append(m)
        if len(keep) != vocab_size or len(merges) != vocab_size - 259:
            raise ValueError("tokenizer cut to %d: kept %d tokens and %d merges, expected %d and %d"
                             % (vocab_size, len(keep), len(merges), vocab_size, vocab_size - 259))
        model["vocab"], model["merges"] = keep, merges
        tok["added_tokens"] = [t for t in tok["added_tokens"] if t["id"] < vocab_size]
    with open(os.path.join(dst_dir, "tokenizer.json"), "w", encoding="utf-8") as f:
        json.dump(tok, f, ensure_ascii=False)
    with open(os.path.join(src_dir, "tokenizer_config.json"), encoding="utf-8") as f:
        cfg = f.read()
    with open(os.path.join(dst_dir, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        f.write(cfg)
    return len(model["vocab"])
