"""The demo model itself (scripts/train_demo.py): its DeepSeek-V2 config, sizes, the transformers
glue (YaRN and attention-scale checks, dense experts for training, the router tap), rounding to
what minids stores, and the Hugging Face checkpoint. See train_demo.py's docstring, steps 3-5."""

import json
import math

SHARD_LIMIT_BYTES = 15 * 1024 * 1024

# ---------------------------------------------------------------------------------------------
# Model shape. Everything minids needs is spelled out, in the layout of DeepSeek-V2-Lite's config.


def model_config(vocab_size, smoke):
    if smoke:
        shape = dict(hidden_size=64, intermediate_size=160, moe_intermediate_size=32,
                     num_hidden_layers=3, num_attention_heads=4, kv_lora_rank=32,
                     qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=16)
    else:
        shape = dict(hidden_size=256, intermediate_size=768, moe_intermediate_size=80,
                     num_hidden_layers=6, num_attention_heads=8, kv_lora_rank=128,
                     qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32, n_routed_experts=32)
    cfg = {
        "architectures": ["DeepseekV2ForCausalLM"],
        "model_type": "deepseek_v2",
        "attention_bias": False,
        "hidden_act": "silu",
        # YaRN factor 40 over 4096 original positions, as DeepSeek-V2-Lite; transformers expects
        # max_position_embeddings = factor * original_max_position_embeddings.
        "max_position_embeddings": 163840,
        "rope_theta": 10000,
        "rms_norm_eps": 1e-06,
        "tie_word_embeddings": False,
        "scoring_func": "softmax",
        "moe_layer_freq": 1,
        "bos_token_id": 0,
        "eos_token_id": 1,
        "vocab_size": vocab_size,
        **shape,
        "num_key_value_heads": shape["num_attention_heads"],
        "q_lora_rank": None,
        "n_shared_experts": 2,
        "num_experts_per_tok": 4,
        "first_k_dense_replace": 1,
        "n_group": 1,
        "topk_group": 1,
        "topk_method": "greedy",
        # transformers' DeepseekV2 ignores norm_topk_prob; false keeps minids and it in agreement.
        "norm_topk_prob": False,
        "routed_scaling_factor": 1.0,
        "rope_scaling": {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096,
                         "beta_fast": 32, "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 0.707},
        "torch_dtype": "bfloat16",
    }
    return cfg


def moe_layer_ids(cfg):
    return [l for l in range(cfg["num_hidden_layers"])
            if l >= cfg["first_k_dense_replace"] and l % cfg["moe_layer_freq"] == 0]


def parameter_counts(cfg):
    """(total, active per token) parameter counts, from the config alone."""
    h, v = cfg["hidden_size"], cfg["vocab_size"]
    n_head = cfg["num_attention_heads"]
    qk = cfg["qk_nope_head_dim"] + cfg["qk_rope_head_dim"]
    attn = (h * n_head * qk + h * (cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"])
            + cfg["kv_lora_rank"] + cfg["kv_lora_rank"] * n_head * (cfg["qk_nope_head_dim"] + cfg["v_head_dim"])
            + n_head * cfg["v_head_dim"] * h + 2 * h)
    expert = 3 * h * cfg["moe_intermediate_size"]
    shared = expert * cfg["n_shared_experts"]
    n_moe = len(moe_layer_ids(cfg))
    n_dense = cfg["num_hidden_layers"] - n_moe
    dense_mlp = 3 * h * cfg["intermediate_size"]
    routed_total = n_moe * cfg["n_routed_experts"] * expert
    routed_active = n_moe * cfg["num_experts_per_tok"] * expert
    common = (2 * v * h + h + cfg["num_hidden_layers"] * attn + n_dense * dense_mlp
              + n_moe * (shared + cfg["n_routed_experts"] * h))
    return common + routed_total, common + routed_active


def mds_size_estimate(cfg, tokenizer_bytes):
    """Bytes of the converted .mds: BF16 dense tensors, FP8 experts with one F32 scale per output
    row, every tensor and every expert blob padded to 4096 bytes, plus the manifest."""
    def pad(n):
        return (n + 4095) // 4096 * 4096

    h, v = cfg["hidden_size"], cfg["vocab_size"]
    n_head = cfg["num_attention_heads"]
    nope, rope, vdim, r = cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"], cfg["v_head_dim"], cfg["kv_lora_rank"]
    bf16 = [v * h, v * h, h]  # embed_tokens, lm_head, final norm
    for layer in range(cfg["num_hidden_layers"]):
        bf16 += [h, h, n_head * (nope + rope) * h, (r + rope) * h, r, n_head * (nope + vdim) * r, h * n_head * vdim]
        if layer in moe_layer_ids(cfg):
            si = cfg["moe_intermediate_size"] * cfg["n_shared_experts"]
            bf16 += [cfg["n_routed_experts"] * h, si * h, si * h, h * si]
        else:
            bf16 += [cfg["intermediate_size"] * h] * 3
    dense_bytes = sum(pad(2 * n) for n in bf16)
    mi = cfg["moe_intermediate_size"]
    expert_blob = pad(3 * mi * h + 4 * (2 * mi + h))
    expert_bytes = len(moe_layer_ids(cfg)) * cfg["n_routed_experts"] * expert_blob
    manifest = pad(tokenizer_bytes + 256 * 1024)  # vocab, merges, regexes, template, tables: generous
    return dense_bytes + expert_bytes + manifest, dense_bytes, expert_bytes


# ---------------------------------------------------------------------------------------------
# transformers glue: scale and RoPE checks, dense experts for training, load-balancing loss


def yarn_mscale(scale, m):
    return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0


def deepseek_yarn_inv_freq(cfg):
    """DeepSeek's own YaRN inverse frequencies (docs/DESIGN.md), in float64."""
    rs = cfg["rope_scaling"]
    d, base = cfg["qk_rope_head_dim"], cfg["rope_theta"]

    def corr(n):
        return d * math.log(rs["original_max_position_embeddings"] / (2 * math.pi * n)) / (2 * math.log(base))

    low = max(math.floor(corr(rs["beta_fast"])), 0)
    high = min(math.ceil(corr(rs["beta_slow"])), d - 1)
    if low == high:
        high += 0.001
    out = []
    for i in range(d // 2):
        extra = base ** (-2 * i / d)
        ramp = min(max((i - low) / (high - low), 0.0), 1.0)
        out.append(extra / rs["factor"] * ramp + extra * (1 - ramp))
    return out


def check_and_fix_attention(model, cfg, log):
    """Asserts transformers' RoPE matches DeepSeek's YaRN formula, and makes every attention
    module's softmax scale (nope+rope)^-0.5 * mscale(factor, mscale_all_dim)^2 as DeepSeek's
    reference code has it. Returns True when a scale had to be patched."""
    rs = cfg["rope_scaling"]
    rotary = model.model.rotary_emb
    got = [float(x) for x in rotary.inv_freq.double().cpu()]
    want = deepseek_yarn_inv_freq(cfg)
    rel = max(abs(g - w) / w for g, w in zip(got, want))
    if len(got) != len(want) or rel > 1e-5:
        raise RuntimeError(f"transformers' YaRN inv_freq differs from DeepSeek's formula (max rel {rel:.2e})")
    cos_scale = yarn_mscale(rs["factor"], rs["mscale"]) / yarn_mscale(rs["factor"], rs["mscale_all_dim"])
    if abs(float(rotary.attention_scaling) - cos_scale) > 1e-6:
        raise RuntimeError(f"transformers' RoPE attention_scaling {rotary.attention_scaling} != {cos_scale}")
    expected = (cfg["qk_nope_head_dim"] + cfg["qk_rope_head_dim"]) ** -0.5 * yarn_mscale(rs["factor"], rs["mscale_all_dim"]) ** 2
    patched = False
    for layer in model.model.layers:
        if abs(layer.self_attn.scaling / expected - 1) > 1e-9:
            layer.self_attn.scaling = expected
            patched = True
    log(f"checks: YaRN inv_freq max rel diff {rel:.1e}; attention scale {expected:.6f}"
        f"{' (PATCHED: transformers lacked the mscale^2 factor)' if patched else ' (as transformers computes it)'}")
    return patched


def dense_experts_forward(self, hidden_states, top_k_index, top_k_weights):
    """Every expert on every token, weighted by the routing weights (zero where not routed):
    two large matmuls instead of a Python loop over experts. Same function as the expert loop."""
    import torch

    n_tok, hidden = hidden_states.shape
    n_exp, two_inter, _ = self.gate_up_proj.shape
    inter = two_inter // 2
    combine = torch.zeros(n_tok, n_exp, dtype=top_k_weights.dtype, device=hidden_states.device)
    combine = combine.scatter(1, top_k_index, top_k_weights)  # [tok, E]
    gate_up = (hidden_states @ self.gate_up_proj.reshape(n_exp * two_inter, hidden).t()).view(n_tok, n_exp, two_inter)
    gate, up = gate_up.split(inter, dim=-1)  # [tok, E, I] each
    act = self.act_fn(gate) * up * combine.unsqueeze(-1).to(gate.dtype)
    down = self.down_proj.transpose(1, 2).reshape(n_exp * inter, hidden)  # [E*I, H]
    return (act.reshape(n_tok, n_exp * inter) @ down).to(hidden_states.dtype)


def use_dense_experts(model):
    import types

    for layer in model.model.layers:
        if hasattr(layer.mlp, "experts"):
            layer.mlp.experts.forward = types.MethodType(dense_experts_forward, layer.mlp.experts)


class RouterTap:
    """Forward pre-hooks on every MoE block: recomputes the router (as transformers does: fp32
    logits, softmax, top-k) to get the load-balancing loss, the chosen experts, or their margin."""

    def __init__(self, model, cfg, mode):
        self.cfg, self.mode = cfg, mode
        self.aux, self.choices, self.margins = [], {}, []
        self.handles = []
        for idx, layer in enumerate(model.model.layers):
            if hasattr(layer.mlp, "experts"):
                self.handles.append(layer.mlp.register_forward_pre_hook(self._hook(idx)))

    def _hook(self, layer_idx):
        import torch

        def hook(module, args):
            x = args[0]
            k, n_exp = self.cfg["num_experts_per_tok"], self.cfg["n_routed_experts"]
            logits = torch.nn.functional.linear(x.reshape(-1, x.shape[-1]).float(), module.gate.weight.float())
            probs = logits.softmax(dim=-1, dtype=torch.float32)
            if self.mode == "aux":
                idx = probs.topk(k, dim=-1).indices
                with torch.no_grad():
                    f = torch.zeros(n_exp, device=x.device).index_add_(
                        0, idx.reshape(-1), torch.ones(idx.numel(), device=x.device)) / idx.numel()
                self.aux.append(n_exp * (f * probs.mean(dim=0)).sum())
            elif self.mode == "choices":
                self.choices.setdefault(layer_idx, []).append(probs.topk(k, dim=-1).indices.view(*x.shape[:-1], k))
            else:
                top = probs.topk(k + 1, dim=-1).values
                self.margins.append(float((top[:, k - 1] - top[:, k]).min()))
        return hook

    def remove(self):
        for h in self.handles:
            h.remove()


# ---------------------------------------------------------------------------------------------
# Rounding to what minids stores, and the checkpoint


def round_like_minids(model, log):
    """FP8 E4M3 with one F32 scale per output row for routed experts; BF16 for all else. In place."""
    import torch

    worst = 0.0
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".experts." in name:
                # gate_up_proj [E, 2I, H] and down_proj [E, H, I]: rows are output rows, the last
                # dim is the input dim, for gate, up and down alike.
                q = fp8_rows(p.data.float())
                p.data.copy_(q)
                worst = max(worst, float(((fp8_rows(q) - q).abs() / q.abs().clamp_min(1e-30)).max()))
            else:
                p.data.copy_(p.data.to(torch.bfloat16).float())
    log(f"rounding: experts to FP8 rows, rest to BF16; re-quantizing the FP8 values changes them by "
        f"at most {worst:.1e} (relative)")
    return worst


def fp8_rows(w):
    import torch

    absmax = w.abs().amax(dim=-1, keepdim=True)
    scale = torch.where(absmax > 0, absmax / 448.0, torch.ones_like(absmax))
    q = (w / scale).clamp(-448.0, 448.0).to(torch.float8_e4m3fn).float()
    if not torch.isfinite(q).all():
        raise RuntimeError("FP8 rounding produced a non-finite value")
    return q * scale


def hub_state_dict(model, cfg):
    """The trained weights under the hub's names, experts split per expert; BF16 except experts."""
    import torch

    inter = cfg["moe_intermediate_size"]
    out = {}
    for name, t in model.state_dict().items():
        t = t.detach().float().cpu()
        if name.endswith("mlp.experts.gate_up_proj"):
            base = name[: -len("gate_up_proj")]
            for e in range(t.shape[0]):
                out[f"{base}{e}.gate_proj.weight"] = t[e, :inter].clone()
                out[f"{base}{e}.up_proj.weight"] = t[e, inter:].clone()
        elif name.endswith("mlp.experts.down_proj"):
            base = name[: -len("down_proj")]
            for e in range(t.shape[0]):
                out[f"{base}{e}.down_proj.weight"] = t[e].clone()
        else:
            out[name] = t.to(torch.bfloat16).clone()
    order = sorted(out, key=lambda n: _name_key(n))
    return {n: out[n].contiguous() for n in order}


def _name_key(name):
    # Natural order: layers by number, experts by number, embeddings first and lm_head last.
    parts = name.split(".")
    key = [(0, int(p)) if p.isdigit() else (1, p) for p in parts]
    rank = 0 if name.startswith("model.embed") else 2 if name.startswith("lm_head") else 1
    return (rank, key)


def save_checkpoint(model, cfg, tokenizer_text, template_dir, out_dir, log):
    from safetensors.torch import save_file

    out_dir.mkdir(parents=True, exist_ok=True)
    tensors = hub_state_dict(model, cfg)
    shards, current, size = [], {}, 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if current and size + nbytes > SHARD_LIMIT_BYTES - 65536:
            shards.append(current)
            current, size = {}, 0
        current[name] = t
        size += nbytes
    shards.append(current)
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    if len(shards) == 1:
        save_file(shards[0], str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    else:
        weight_map = {}
        for i, shard in enumerate(shards):
            fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            save_file(shard, str(out_dir / fname), metadata={"format": "pt"})
            weight_map.update({n: fname for n in shard})
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    (out_dir / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    (out_dir / "tokenizer.json").write_text(tokenizer_text, encoding="utf-8")
    tok_cfg = (template_dir / "tokenizer_config.json").read_text(encoding="utf-8")
    (out_dir / "tokenizer_config.json").write_text(tok_cfg, encoding="utf-8")
    gen_cfg = {"bos_token_id": 0, "eos_token_id": 1, "do_sample": False}
    (out_dir / "generation_config.json").write_text(json.dumps(gen_cfg, indent=2) + "\n")
    log(f"checkpoint: {len(tensors)} tensors, {total / 2**20:.1f} MiB in {len(shards)} file(s)")


def load_float64(ckpt_dir, cfg, log):
    import torch
    from transformers import DeepseekV2ForCausalLM

    kwargs = dict(dtype=torch.float64, attn_implementation="eager", output_loading_info=True)
    try:
        model, info = DeepseekV2ForCausalLM.from_pretrained(ckpt_dir, experts_implementation="eager", **kwargs)
    except (TypeError, ValueError, AttributeError, KeyError) as err:
        log(f"reload: experts_implementation not accepted ({err}); using the default")
        model, info = DeepseekV2ForCausalLM.from_pretrained(ckpt_dir, **kwargs)
    for key in ("missing_keys", "unexpected_keys", "mismatched_keys"):
        if info.get(key):
            raise RuntimeError(f"reloading the checkpoint: {key} {sorted(info[key])[:8]}")
    if getattr(model.config, "_experts_implementation", "eager") not in (None, "eager"):
        try:
            model.config._experts_implementation = "eager"
        except (AttributeError, ValueError) as err:
            log(f"reload: could not select eager experts ({err})")
    if getattr(model.config, "_experts_implementation", "eager") not in (None, "eager"):
        log("reload: experts run through the dense path (same function) instead of transformers' loop")
        use_dense_experts(model)
    model.eval()
    if next(model.parameters()).dtype != torch.float64:
        raise RuntimeError("reloaded model is not float64")
    patched = check_and_fix_attention(model, cfg, log)
    log(f"reload: experts implementation {getattr(model.config, '_experts_implementation', '?')}, "
        f"attention {getattr(model.config, '_attn_implementation', '?')}")
    return model, patched
