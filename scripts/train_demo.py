#!/usr/bin/env python3
"""Train minids' embedded demo model: a small DeepSeek-V2-architecture model (MLA + fine-grained MoE).

Runs with `python3` on a CUDA machine that has PyTorch, transformers (>= 5), tokenizers and
safetensors installed; it needs no network. One run does, in order:

1. corpus     English text that ships with that machine's Python: the language reference topics of
              `pydoc_data`, and the long descriptions and the docstrings (every .py file, test
              folders left out, one document per file) of the standard library and of every
              site-packages distribution under a permissive license (PERMISSIVE below; the others,
              e.g. NVIDIA's proprietary CUDA wheels, are left out). Files are read in sorted order, every
              docstring is kept once (exact duplicates dropped), documents that are not mostly ASCII
              are dropped, and the documents are shuffled with the fixed seed; the last
              VAL_FRACTION are held out. The SHA-256 of the corpus and the package versions are
              printed and stored, so a rebuild on the same image can be checked.
2. tokenizer  byte-level BPE trained with `tokenizers` on a fixed prefix of the training documents,
              with DeepSeek's pre-tokenizer and decoder and the DeepSeek-V2 special tokens and chat
              template, all copied from the repository's fixture tokenizer (tests/data/tiny-v2-lite).
3. training   `DeepseekV2ForCausalLM` from transformers, fixed seed, AdamW, bf16 autocast, plus a
              Switch-style load-balancing loss (E * sum_i f_i * P_i per MoE layer) computed from the
              router probabilities, since transformers' DeepseekV2 has none. For speed, training
              runs the routed experts densely (every expert on every token, weighted by the routing
              weights, which are zero for experts not chosen); that is the same function as
              transformers' expert loop.
4. rounding   every routed expert weight goes through FP8 E4M3 with one F32 scale per output row
              (scale = row absmax / 448, value = e4m3(w / scale) * scale, in float32), exactly as
              `minids convert` stores it; every other tensor is rounded to BF16.
5. checkpoint a Hugging Face folder (config.json, sharded model.safetensors with per-expert tensors
              in the hub's layout, tokenizer.json, tokenizer_config.json, generation_config.json).
              Experts are stored as F32 (their dequantized values), everything else as BF16. The
              folder is reloaded with `from_pretrained` and must reproduce the trained model.
6. reference  the reloaded checkpoint in float64 on the CPU, eager attention: 32 greedy tokens after
              a few English prompts (plain argmax, the whole sequence recomputed every step, EOS not
              treated specially), the top-1/top-2 logit gap of every step, the float64 logits at the
              last prompt position. Written to demo.reference.json.
7. routing    router statistics over held-out text (expert popularity, token-to-token overlap,
              distinct experts per 32-token window). Written to routing-stats.md.

Usage:  python3 scripts/train_demo.py --out OUT_DIR [--work CACHE_DIR] [--steps N]
        python3 scripts/train_demo.py --estimate-only     (size of the converted .mds, no torch)
"""

import argparse
import ast
import hashlib
import importlib.metadata
import io
import json
import math
import multiprocessing
import os
import random
import re
import sys
import sysconfig
import tarfile
import time
import warnings
from pathlib import Path

SEED = 1234
BOS, EOS, PAD = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜▁pad▁｜>"
VOCAB_SIZE = 6144
CONTEXT = 512
VAL_FRACTION = 0.01
TOKENIZER_TRAIN_CHARS = 40_000_000
CORPUS_MAX_CHARS = 120_000_000
MDS_LIMIT_BYTES = 25_000_000
SHARD_LIMIT_BYTES = 15 * 1024 * 1024
N_GREEDY = 32
MAX_EPOCHS = 8
# Only text of distributions under these licenses joins the corpus (matched in the SPDX expression,
# else in the License field and the license classifiers); anything naming a RESTRICTED term, or
# with no license information, stays out.
PERMISSIVE = ("MIT", "BSD", "APACHE", "PSF", "PYTHON SOFTWARE FOUNDATION", "ISC", "ZLIB", "CC0", "UNLICENSE", "HPND")
RESTRICTED = ("GPL", "MPL", "MOZILLA", "PROPRIETARY", "LICENSEREF-NVIDIA", "NVIDIA SOFTWARE LICENSE", "COMMERCIAL")
PROMPTS = (
    "The following example shows how to",
    "This function returns",
    "If the input is not a valid",
    "A dictionary is a collection of",
    "The main advantage of this method is that",
    "Return the number of",
    "When the file is opened in binary mode,",
    "Note that this function",
)

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
# Corpus


def _mostly_ascii(text):
    return len(text.encode("ascii", "ignore")) >= 0.97 * len(text)


def _skip_dir(name):
    return name in ("test", "tests", "testing", "__pycache__", "site-packages", "dist-packages")


def _python_files(root):
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if not _skip_dir(d))
        found += [os.path.join(dirpath, f) for f in sorted(filenames) if f.endswith(".py")]
    return found


def _file_docstrings(path):
    """The docstrings of one Python file (module, classes, functions), in ast.walk order."""
    warnings.simplefilter("ignore")
    try:
        with open(path, encoding="utf-8") as f:
            source = f.read()
        if len(source) > 3_000_000:
            return []
        tree = ast.parse(source)
    except (OSError, UnicodeDecodeError, SyntaxError, ValueError, RecursionError, MemoryError):
        return []
    out = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node, clean=True)
            if doc and 20 <= len(doc) <= 50_000:
                out.append(doc.strip())
    return out


def _license(dist):
    md = dist.metadata
    if md.get("License-Expression"):
        return md["License-Expression"]
    parts = [(md.get("License") or "")[:300]] + [c for c in (md.get_all("Classifier") or []) if c.startswith("License ::")]
    return " | ".join(p.strip() for p in parts if p.strip())


def _permissive(license_text):
    up = license_text.upper()
    return any(t in up for t in PERMISSIVE) and not any(t in up for t in RESTRICTED)


def build_corpus(log):
    """Returns (documents, description). Deterministic for a given Python installation."""
    dists = sorted(importlib.metadata.distributions(), key=lambda d: (d.metadata["Name"] or "").lower())
    license_of = {d.metadata["Name"] or "": _license(d) for d in dists}
    owners = importlib.metadata.packages_distributions()  # top-level import name -> distributions
    sources = [("python-stdlib", _python_files(sysconfig.get_paths()["stdlib"]))]  # (label, python files)
    excluded = {}
    for site_dir in sorted({sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}):
        for entry in sorted(os.listdir(site_dir)):
            path = os.path.join(site_dir, entry)
            if os.path.isdir(path) and not entry.endswith((".dist-info", ".egg-info", ".data")):
                name, files = entry, _python_files(path)
            elif entry.endswith(".py"):
                name, files = entry[:-3], [path]
            else:
                continue
            licenses_here = [license_of.get(d, "") for d in owners.get(name, [])]
            if not licenses_here or not all(_permissive(t) for t in licenses_here):
                if files:
                    excluded[name] = "; ".join(t[:60] for t in licenses_here) or "no distribution metadata"
                continue
            sources.append((name, files))
    versions = {}

    docs, seen, seen_dists, stats = [], set(), set(), {}
    total_chars = 0

    def add(label, text):
        nonlocal total_chars
        text = text.strip()
        if len(text) < 200 or not _mostly_ascii(text) or total_chars >= CORPUS_MAX_CHARS:
            return
        docs.append(text)
        total_chars += len(text)
        s = stats.setdefault(label, {"docs": 0, "chars": 0})
        s["docs"] += 1
        s["chars"] += len(text)

    # The language reference topics (what `help("if")` prints): plain English prose.
    try:
        from pydoc_data.topics import topics
        for key in sorted(topics):
            add("pydoc_data.topics", topics[key])
    except ImportError:
        log("corpus: pydoc_data.topics not available")

    # Long descriptions of the installed distributions (their README texts).
    licenses = {}
    for dist in dists:
        name = dist.metadata["Name"] or ""
        body = dist.metadata.get_payload() if hasattr(dist.metadata, "get_payload") else ""
        body = body or dist.metadata.get("Description") or ""
        if name.lower() in seen_dists:
            continue
        seen_dists.add(name.lower())
        versions[name] = dist.version
        licenses[name] = license_of[name][:80]
        if _permissive(license_of[name]):
            add("distribution-descriptions", body)
        else:
            excluded[f"{name} (description)"] = license_of[name][:60] or "no license metadata"

    # spawn, not fork: the parent may hold CUDA and threads; this module imports nothing heavy.
    with multiprocessing.get_context("spawn").Pool(min(16, os.cpu_count() or 1)) as pool:
        for label, files in sources:
            for file_docs in pool.imap(_file_docstrings, files, chunksize=8):
                kept = []
                for d in file_docs:
                    key = hashlib.sha1(d.encode()).digest()
                    if key not in seen:
                        seen.add(key)
                        kept.append(d)
                if kept:
                    add(label, "\n\n".join(kept))
    random.Random(SEED).shuffle(docs)
    sha = hashlib.sha256("\x1e".join(docs).encode()).hexdigest()
    description = {"documents": len(docs), "chars": total_chars, "sha256": sha, "sources": stats,
                   "python": sys.version.split()[0], "distribution_versions": versions,
                   "distribution_licenses": licenses, "excluded": excluded}
    log(f"corpus: {len(docs)} documents, {total_chars / 1e6:.1f} M chars, sha256 {sha[:16]}; "
        f"left out for their license: {', '.join(sorted(excluded))}")
    for label, s in sorted(stats.items(), key=lambda kv: -kv[1]["chars"])[:30]:
        log(f"  {label:28s} {s['docs']:7d} docs {s['chars'] / 1e6:8.2f} M chars")
    return docs, description


# ---------------------------------------------------------------------------------------------
# Tokenizer


def train_tokenizer(train_docs, template_dir, vocab_size, log):
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    template = json.loads((template_dir / "tokenizer.json").read_text(encoding="utf-8"))
    parts = []
    for p in template["pre_tokenizer"]["pretokenizers"]:
        if p["type"] == "Split":
            parts.append(pre_tokenizers.Split(Regex(p["pattern"]["Regex"]), behavior=p["behavior"].lower(),
                                              invert=p["invert"]))
        elif p["type"] == "ByteLevel":
            parts.append(pre_tokenizers.ByteLevel(add_prefix_space=p["add_prefix_space"], use_regex=p["use_regex"]))
        else:
            raise RuntimeError(f"unexpected pre-tokenizer step {p['type']} in the template")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(parts)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, show_progress=False,
                                  special_tokens=[BOS, EOS, PAD], max_token_length=24,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    sample, n = [], 0
    for d in train_docs:
        if n >= TOKENIZER_TRAIN_CHARS:
            break
        sample.append(d)
        n += len(d)
    t0 = time.time()
    tok.train_from_iterator(sample, trainer=trainer)
    log(f"tokenizer: trained on {len(sample)} docs ({n / 1e6:.1f} M chars) in {time.time() - t0:.0f} s, "
        f"vocab {tok.get_vocab_size()}")

    # The file is the template with the trained vocabulary and merges: the pre-tokenizer, decoder,
    # normalizer, post-processor and special tokens are the fixture's, byte for byte.
    trained = json.loads(tok.to_str())
    for key in ("added_tokens", "normalizer", "pre_tokenizer", "post_processor", "decoder"):
        trained[key] = template[key]
    trained["truncation"] = None
    trained["padding"] = None
    text = json.dumps(trained, ensure_ascii=False, indent=2)
    final = Tokenizer.from_str(text)
    for i, special in enumerate((BOS, EOS, PAD)):
        if final.token_to_id(special) != i:
            raise RuntimeError(f"special token {special} has id {final.token_to_id(special)}, expected {i}")
    for d in sample[:200]:
        a = final.encode(d, add_special_tokens=False).ids
        if a != tok.encode(d, add_special_tokens=False).ids:
            raise RuntimeError("the template's pre-tokenizer splits differently from the training one")
        if final.decode(a, skip_special_tokens=False) != d:
            raise RuntimeError("tokenizer round trip failed on a corpus document")
    return final, text


def windows(tokens, offsets, ctx):
    """BOS followed by ctx - 1 stream tokens from each offset: every sequence starts like a prompt."""
    import torch

    body = tokens[offsets[:, None] + torch.arange(ctx - 1, device=tokens.device)[None, :]].long()
    return torch.cat([torch.zeros_like(body[:, :1]), body], dim=1)


def evenly_spaced(n_tokens, ctx, count):
    import numpy as np

    return np.linspace(0, n_tokens - ctx, count).astype(np.int64)


def encode_stream(tok, docs):
    """One token stream: BOS doc EOS BOS doc EOS ...; returns (int32 array, doc start offsets)."""
    import numpy as np

    encode = getattr(tok, "encode_batch_fast", tok.encode_batch)
    pieces, starts, pos = [], [], 0
    for i in range(0, len(docs), 20000):
        for enc in encode(docs[i:i + 20000], add_special_tokens=False):
            ids = [0] + enc.ids + [1]
            starts.append(pos)
            pos += len(ids)
            pieces.append(np.asarray(ids, dtype=np.int32))
    return np.concatenate(pieces), np.asarray(starts, dtype=np.int64)


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
# Training


def train_model(cfg, cfg_dir, stream, val_stream, args, smoke, deadline, log):
    import torch
    from transformers import AutoConfig, DeepseekV2ForCausalLM

    device = "cuda"
    torch.manual_seed(SEED)
    torch.backends.cuda.matmul.allow_tf32 = True
    hf_cfg = AutoConfig.from_pretrained(cfg_dir)
    model = DeepseekV2ForCausalLM(hf_cfg).float().to(device)  # FP32 master weights
    if getattr(model.config, "_attn_implementation", None) != "sdpa" and hasattr(model, "set_attn_implementation"):
        try:
            model.set_attn_implementation("sdpa")
        except (ValueError, ImportError, AttributeError, TypeError, NotImplementedError) as err:
            log(f"model: sdpa attention not available ({err})")
    n_params = sum(p.numel() for p in model.parameters())
    log(f"model: attention implementation {getattr(model.config, '_attn_implementation', '?')}, "
        f"{n_params / 1e6:.2f} M parameters")
    if n_params != parameter_counts(cfg)[0]:
        raise RuntimeError(f"the model has {n_params} parameters, the config-derived count is {parameter_counts(cfg)[0]}")
    scale_patched = check_and_fix_attention(model, cfg, log)
    use_dense_experts(model)
    tap = RouterTap(model, cfg, "aux")

    batch, ctx = (8, 128) if smoke else (64, CONTEXT)
    tokens = torch.from_numpy(stream).to(device)
    val_tokens = torch.from_numpy(val_stream).to(device)
    val_pick = torch.from_numpy(evenly_spaced(len(val_stream), ctx, 8 if smoke else 128)).to(device)
    gen = torch.Generator(device=device).manual_seed(SEED)

    decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95), eps=1e-8, fused=True)
    warmup = 10 if smoke else 200
    aux_coef = 0.01

    def lr_at(step, total):
        if step < warmup:
            return args.lr * (step + 1) / warmup
        t = min((step - warmup) / max(total - warmup, 1), 1.0)
        return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t)))

    @torch.no_grad()
    def val_loss():
        model.eval()
        losses = []
        for i in range(0, len(val_pick), 16):
            x = windows(val_tokens, val_pick[i:i + 16], ctx)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                losses.append(float(model(input_ids=x, labels=x, use_cache=False).loss))
            tap.aux.clear()
        model.train()
        return sum(losses) / len(losses)

    total = args.steps if args.steps else (20 if smoke else 100_000)
    fixed_steps = bool(args.steps) or smoke
    budget = min(args.train_seconds, deadline - time.time() - (60 if smoke else 150))
    log(f"training: batch {batch} x {ctx} tokens, lr {args.lr}, warmup {warmup}, aux coef {aux_coef}, "
        f"time budget {budget:.0f} s{', fixed steps ' + str(total) if fixed_steps else ''}")
    model.train()
    curve, running, t_start, t_probe = [], torch.zeros((), device=device), time.time(), None
    best = (float("inf"), 0, None)  # (val loss, step, weights): guards against overfitting
    step = 0
    while step < total:
        for g in opt.param_groups:
            g["lr"] = lr_at(step, total)
        offs = torch.randint(0, len(stream) - ctx + 1, (batch,), device=device, generator=gen)
        x = windows(tokens, offs, ctx)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = model(input_ids=x, labels=x, use_cache=False)
        aux = torch.stack(tap.aux).sum()
        tap.aux.clear()
        loss = out.loss + aux_coef * aux
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        running += out.loss.detach()
        step += 1
        if step == 10:
            torch.cuda.synchronize()
            t_probe = time.time()
        if step == 40 and not fixed_steps:
            torch.cuda.synchronize()
            per_step = (time.time() - t_probe) / 30
            by_time = 40 + (budget - (time.time() - t_start)) / per_step
            by_epochs = MAX_EPOCHS * len(stream) / (batch * ctx)
            total = int(min(args.max_steps, by_time, by_epochs))
            log(f"training: {per_step * 1000:.1f} ms/step; steps allowed by time {by_time:.0f}, by "
                f"{MAX_EPOCHS} epochs {by_epochs:.0f} -> {total} steps")
        every = 5 if smoke else 250
        if step % every == 0 or step == total:
            n = every if step % every == 0 else step % every
            tl = float(running) / n
            running.zero_()
            entry = {"step": step, "train_loss": round(tl, 4), "aux": round(float(aux.detach()) / len(tap.handles), 4),
                     "lr": lr_at(step - 1, total), "seconds": round(time.time() - t_start, 1)}
            if step % (every * 2) == 0 or step == total:
                entry["val_loss"] = round(val_loss(), 4)
                if entry["val_loss"] < best[0]:
                    best = (entry["val_loss"], step, {k: v.detach().clone() for k, v in model.state_dict().items()})
            curve.append(entry)
            log("  " + json.dumps(entry))
        if time.time() - t_start > budget * 1.15 + 5:
            log(f"training: stopped at step {step} of {total}: over the time budget")
            break
    torch.cuda.synchronize()
    seconds = time.time() - t_start
    final_val = val_loss()
    log(f"training: {step} steps in {seconds:.0f} s, final val loss {final_val:.4f}")
    restored = None
    if best[2] is not None and best[0] < final_val - 0.02:
        model.load_state_dict(best[2])
        restored = best[1]
        final_val = val_loss()
        log(f"training: restored the weights of step {restored} (val loss {final_val:.4f})")
    tap.remove()
    info = {"steps": step, "batch": batch, "context": ctx, "tokens_seen": step * batch * ctx,
            "seconds": round(seconds, 1), "lr": args.lr, "warmup": warmup, "aux_coef": aux_coef,
            "final_val_loss": round(final_val, 4), "restored_step": restored, "curve": curve,
            "attention_scale_patched": scale_patched, "max_epochs": MAX_EPOCHS,
            "window": "BOS + (context - 1) tokens from a uniformly random offset of the token stream"}
    return model, info, val_loss


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


# ---------------------------------------------------------------------------------------------
# Checkpoint


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


# ---------------------------------------------------------------------------------------------
# Reference outputs and routing statistics


def greedy_reference(model, tok, cfg, log):
    import torch

    torch.set_num_threads(min(16, os.cpu_count() or 1))
    results = []
    with torch.no_grad():
        for text in PROMPTS:
            ids = [0] + tok.encode(text, add_special_tokens=False).ids
            seq, gaps, last_logits = list(ids), [], None
            for step in range(N_GREEDY):
                logits = model(input_ids=torch.tensor([seq]), use_cache=False).logits[0, -1]
                if step == 0:
                    last_logits = [float(v) for v in logits]
                top = torch.topk(logits, 2).values
                gaps.append(float((top[0] - top[1]) / logits.abs().max()))
                seq.append(int(torch.argmax(logits)))
            tap = RouterTap(model, cfg, "margins")
            model(input_ids=torch.tensor([seq]), use_cache=False)
            tap.remove()
            greedy = seq[len(ids):]
            entry = {"text": text, "ids": ids, "greedy": greedy,
                     "continuation": tok.decode(greedy, skip_special_tokens=False),
                     "min_gap": min(gaps), "gaps": gaps, "routing_min_margin": min(tap.margins),
                     "last_logits": last_logits}
            results.append(entry)
            log(f"  min gap {entry['min_gap']:.2e} routing margin {entry['routing_min_margin']:.2e} | "
                f"{text!r} -> {entry['continuation']!r}")
    good = [r for r in results if r["min_gap"] >= 1e-4]
    rest = sorted((r for r in results if r["min_gap"] < 1e-4), key=lambda r: -r["min_gap"])
    chosen = (good + rest)[: 6 if len(good) >= 6 else 5]
    return chosen, [{"text": r["text"], "min_gap": r["min_gap"]} for r in results]


def routing_statistics(model, cfg, val_stream, smoke, log):
    import numpy as np
    import torch

    ctx = 128 if smoke else CONTEXT
    n_windows = 8 if smoke else 192
    x_all = windows(torch.from_numpy(val_stream).cuda(), torch.from_numpy(evenly_spaced(len(val_stream), ctx, n_windows)).cuda(), ctx)
    tap = RouterTap(model, cfg, "choices")
    model.eval()
    with torch.no_grad():
        for i in range(0, n_windows, 32):
            model(input_ids=x_all[i:i + 32], use_cache=False)
    tap.remove()
    n_exp, k = cfg["n_routed_experts"], cfg["num_experts_per_tok"]
    layers = []
    for layer_idx in sorted(tap.choices):
        idx = torch.cat(tap.choices[layer_idx], dim=0)  # [windows, ctx, k]
        onehot = torch.zeros(*idx.shape[:2], n_exp, device=idx.device).scatter_(2, idx, 1.0)  # [W, T, E]
        counts = onehot.sum(dim=(0, 1))
        share = (counts / counts.sum()).cpu().numpy()
        shares_sorted = np.sort(share)[::-1]
        entropy = float(-(share[share > 0] * np.log(share[share > 0])).sum())
        cum = np.cumsum(shares_sorted)
        overlap = float((onehot[:, 1:] * onehot[:, :-1]).sum(dim=2).mean() / k)
        reuse = {}
        csum = torch.cat([torch.zeros_like(onehot[:, :1]), onehot.cumsum(dim=1)], dim=1)  # [W, T+1, E]
        for w in (1, 4, 16, 64):
            if w >= ctx:
                continue
            seen = (csum[:, w:-1] - csum[:, :-w - 1]) > 0  # experts used in tokens t-w..t-1, for t >= w
            hits = (seen & (onehot[:, w:] > 0)).sum(dim=2).float() / k
            reuse[w] = float(hits.mean())
        chunks = onehot[:, : ctx // 32 * 32].reshape(onehot.shape[0], ctx // 32, 32, n_exp)
        distinct = (chunks.sum(dim=2) > 0).sum(dim=2).flatten().float().cpu().numpy()
        layers.append({
            "layer": layer_idx, "shares_sorted": [round(float(s), 4) for s in shares_sorted],
            "max_share": float(shares_sorted[0]), "min_share": float(shares_sorted[-1]),
            "entropy_ratio": entropy / math.log(n_exp),
            "experts_for_50pct": int(np.searchsorted(cum, 0.5) + 1),
            "experts_for_90pct": int(np.searchsorted(cum, 0.9) + 1),
            "overlap_next_token": overlap, "reuse_within": reuse,
            "distinct_per_32": {"mean": float(distinct.mean()), "p10": float(np.percentile(distinct, 10)),
                                "p50": float(np.percentile(distinct, 50)), "p90": float(np.percentile(distinct, 90)),
                                "max": float(distinct.max())},
        })
        log(f"  layer {layer_idx}: max share {shares_sorted[0]:.3f} entropy ratio {entropy / math.log(n_exp):.3f} "
            f"overlap {overlap:.3f} distinct/32 {distinct.mean():.1f}")
    return {"tokens": int(n_windows * ctx), "windows": n_windows, "context": ctx, "layers": layers}


def routing_markdown(stats, cfg, command):
    n_exp, k = cfg["n_routed_experts"], cfg["num_experts_per_tok"]
    uniform_distinct = n_exp * (1 - (1 - k / n_exp) ** 32)
    lines = [
        "# Routing statistics of the demo model",
        "",
        f"Measured on held-out text (documents never trained on): {stats['windows']} windows of "
        f"{stats['context']} tokens = {stats['tokens']} tokens (BOS, then {stats['context'] - 1} tokens from evenly "
        "spaced offsets of the held-out token stream). "
        f"The model has {n_exp} routed experts per MoE layer, top-{k}, greedy softmax routing; "
        "routing was recomputed in FP32 from the FP8/BF16-rounded weights (what minids runs).",
        "",
        f"Produced by `{command}` (the routing phase, right after training).",
        "",
        f"For comparison, uniformly random routing would give every expert a share of {1 / n_exp:.4f}, "
        f"an entropy ratio of 1, a next-token overlap of k/E = {k / n_exp:.3f}, and "
        f"{uniform_distinct:.1f} distinct experts per 32-token window.",
        "",
        "## Summary per MoE layer",
        "",
        "| layer | max share | min share | entropy / ln E | experts for 50% / 90% of assignments "
        "| overlap t→t+1 | reuse within 4 / 16 / 64 previous tokens | distinct experts per 32 tokens: mean (p10, p50, p90, max) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for l in stats["layers"]:
        reuse = " / ".join(f"{l['reuse_within'][w]:.3f}" for w in (4, 16, 64) if w in l["reuse_within"])
        d = l["distinct_per_32"]
        lines.append(f"| {l['layer']} | {l['max_share']:.3f} | {l['min_share']:.4f} | {l['entropy_ratio']:.3f} "
                     f"| {l['experts_for_50pct']} / {l['experts_for_90pct']} | {l['overlap_next_token']:.3f} "
                     f"| {reuse} | {d['mean']:.1f} ({d['p10']:.0f}, {d['p50']:.0f}, {d['p90']:.0f}, {d['max']:.0f}) |")
    lines += ["", "## Expert popularity, sorted (share of token-assignments per expert)", ""]
    for l in stats["layers"]:
        lines.append(f"- layer {l['layer']}: " + " ".join(f"{s:.3f}" for s in l["shares_sorted"]))
    lines += ["", "Definitions: *share* = assignments to the expert / (tokens × k). *Overlap t→t+1* = mean "
              "fraction of token t+1's k experts that token t also chose. *Reuse within w* = mean fraction of "
              "token t's experts that some token among t−w … t−1 chose (the hit rate of an unbounded cache "
              "that remembers the last w tokens). *Distinct per 32 tokens* = experts touched by 32 "
              "consecutive tokens (non-overlapping windows).", ""]
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# Driver


def compact_json(obj):
    """Indented JSON with every list of plain numbers on one line (logits stay readable in a diff)."""
    text = json.dumps(obj, indent=1, ensure_ascii=False)
    return re.sub(r"\[([^\[\]{}\"]*)\]", lambda m: "[" + ", ".join(x.strip() for x in m.group(1).split(",")) + "]", text)


def export_results(out_dir, export_dir, log):
    """Tars out_dir into export_dir as 15 MiB parts (the transfer back allows few, small files)."""
    if export_dir is None:
        return
    export_dir.mkdir(parents=True, exist_ok=True)
    for old in export_dir.glob("results.tar.part-*"):
        old.unlink()
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        tar.add(str(out_dir), arcname=".")
    data = buf.getvalue()
    part = 15 * 1024 * 1024
    for i in range(0, len(data), part):
        (export_dir / f"results.tar.part-{i // part:02d}").write_bytes(data[i:i + part])
    log(f"export: {len(data) / 2**20:.1f} MiB in {(len(data) + part - 1) // part} part(s)")


def run_pipeline(args, smoke, deadline, log):
    import numpy as np
    import torch
    import tokenizers
    import transformers

    out_dir = Path(args.out) / ("smoke" if smoke else "")
    out_dir.mkdir(parents=True, exist_ok=True)
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    template_dir = Path(args.template_dir)
    log(f"=== {'smoke run' if smoke else 'full run'}: torch {torch.__version__}, transformers "
        f"{transformers.__version__}, tokenizers {tokenizers.__version__}, GPU {torch.cuda.get_device_name()}")

    # Corpus, tokenizer and token streams are cached in --work: the smoke run builds them, the
    # full run reuses them (they are the same either way).
    cache = work / "data.npz"
    if cache.exists():
        corpus_info = json.loads((work / "corpus.json").read_text())
        tokenizer_text = (work / "tokenizer.json").read_text(encoding="utf-8")
        tok = tokenizers.Tokenizer.from_str(tokenizer_text)
        data = np.load(cache)
        stream, starts, val_stream, val_starts = data["stream"], data["starts"], data["val_stream"], data["val_starts"]
    else:
        t0 = time.time()
        docs, corpus_info = build_corpus(log)
        n_val = max(8, int(len(docs) * VAL_FRACTION))
        train_docs, val_docs = docs[:-n_val], docs[-n_val:]
        corpus_info["seconds"] = round(time.time() - t0, 1)
        tok, tokenizer_text = train_tokenizer(train_docs, template_dir, VOCAB_SIZE, log)
        t0 = time.time()
        stream, starts = encode_stream(tok, train_docs)
        val_stream, val_starts = encode_stream(tok, val_docs)
        val_chars = sum(len(d) for d in val_docs)
        corpus_info.update({"train_documents": len(train_docs), "val_documents": len(val_docs),
                            "train_tokens": int(len(stream)), "val_tokens": int(len(val_stream)),
                            "val_chars_per_token": round(val_chars / len(val_stream), 3)})
        log(f"tokens: train {len(stream) / 1e6:.1f} M, val {len(val_stream) / 1e6:.2f} M, "
            f"{corpus_info['val_chars_per_token']} chars/token, encoded in {time.time() - t0:.0f} s")
        np.savez(cache, stream=stream, starts=starts, val_stream=val_stream, val_starts=val_starts)
        (work / "corpus.json").write_text(json.dumps(corpus_info, indent=1))
        (work / "tokenizer.json").write_text(tokenizer_text, encoding="utf-8")

    cfg = model_config(tok.get_vocab_size(), smoke)
    total_params, active_params = parameter_counts(cfg)
    mds_bytes, dense_bytes, expert_bytes = mds_size_estimate(cfg, len(tokenizer_text.encode()))
    log(f"model: {total_params / 1e6:.2f} M parameters ({active_params / 1e6:.2f} M active per token); "
        f".mds estimate {mds_bytes / 1e6:.2f} MB (dense {dense_bytes / 1e6:.2f}, experts {expert_bytes / 1e6:.2f})")
    if mds_bytes > MDS_LIMIT_BYTES:
        raise RuntimeError(f"the converted model would be {mds_bytes} bytes, over the {MDS_LIMIT_BYTES} limit")
    cfg_dir = work / ("cfg-smoke" if smoke else "cfg")
    cfg_dir.mkdir(exist_ok=True)
    (cfg_dir / "config.json").write_text(json.dumps(cfg, indent=2))

    model, train_info, val_loss = train_model(cfg, cfg_dir, stream, val_stream, args, smoke, deadline, log)
    requant = round_like_minids(model, log)
    train_info["val_loss_after_rounding"] = round(val_loss(), 4)
    log(f"rounding: val loss {train_info['final_val_loss']} -> {train_info['val_loss_after_rounding']}")

    ckpt = out_dir / "demo-hf"
    save_checkpoint(model, cfg, tokenizer_text, template_dir, ckpt, log)
    summary = {"config": cfg, "parameters": total_params, "active_parameters": active_params,
               "mds_estimate_bytes": mds_bytes, "corpus": corpus_info, "training": train_info,
               "fp8_requantization_max_rel_change": requant,
               "versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                            "tokenizers": tokenizers.__version__, "gpu": torch.cuda.get_device_name()}}
    (out_dir / "train_summary.json").write_text(json.dumps(summary, indent=1))
    if not smoke:
        export_results(Path(args.out), args.export, log)

    log("routing statistics:")
    stats = routing_statistics(model, cfg, val_stream, smoke, log)
    command = "python3 scripts/train_demo.py --out OUT_DIR" + (f" --steps {args.steps}" if args.steps else "")
    (out_dir / "routing-stats.md").write_text(routing_markdown(stats, cfg, command))
    (out_dir / "routing-stats.json").write_text(json.dumps(stats, indent=1))

    # The float64 reference comes from the saved checkpoint, reloaded: first make sure it is the
    # model that was trained (same logits as an in-memory float64 copy).
    import copy

    # The in-memory copy keeps the dense expert path: the same function, in float64.
    mem64 = copy.deepcopy(model).to("cpu", torch.float64).eval()
    del model
    torch.cuda.empty_cache()
    ref, patched = load_float64(str(ckpt), cfg, log)
    probe = torch.tensor([[0] + tok.encode(PROMPTS[0] + " and the rest of it", add_special_tokens=False).ids])
    with torch.no_grad():
        a = ref(input_ids=probe, use_cache=False).logits
        b = mem64(input_ids=probe, use_cache=False).logits
    diff = float((a - b).abs().max() / b.abs().max())
    log(f"reload: reloaded vs trained model, max logit difference {diff:.1e} (relative to max |logit|)")
    if diff > 1e-6:
        raise RuntimeError("the saved checkpoint does not reproduce the trained model")
    del mem64
    log("reference (float64, CPU):")
    chosen, candidates = greedy_reference(ref, tok, cfg, log)
    reference = reference_document(chosen, candidates, patched, transformers.__version__)
    (out_dir / "demo.reference.json").write_text(compact_json(reference) + "\n")
    summary["reference_min_gap"] = min(r["min_gap"] for r in chosen)
    (out_dir / "train_summary.json").write_text(json.dumps(summary, indent=1))
    if not smoke:
        export_results(Path(args.out), args.export, log)
    log(f"=== {'smoke run' if smoke else 'full run'} done")


def run_from_checkpoint(args, log):
    """Recomputes the routing statistics and the reference outputs of a saved checkpoint (the same
    corpus split, encoded with the checkpoint's own tokenizer)."""
    import torch
    import tokenizers
    import transformers
    from transformers import DeepseekV2ForCausalLM

    ckpt = Path(args.from_checkpoint)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    cfg = json.loads((ckpt / "config.json").read_text())
    tok = tokenizers.Tokenizer.from_file(str(ckpt / "tokenizer.json"))
    docs, _ = build_corpus(log)
    n_val = max(8, int(len(docs) * VAL_FRACTION))
    val_stream, _ = encode_stream(tok, docs[-n_val:])
    model = DeepseekV2ForCausalLM.from_pretrained(str(ckpt), dtype=torch.float32).cuda()
    check_and_fix_attention(model, cfg, log)
    use_dense_experts(model)
    log("routing statistics:")
    stats = routing_statistics(model, cfg, val_stream, False, log)
    command = f"python3 scripts/train_demo.py --from-checkpoint HF_DIR --out OUT_DIR"
    (out_dir / "routing-stats.md").write_text(routing_markdown(stats, cfg, command))
    (out_dir / "routing-stats.json").write_text(json.dumps(stats, indent=1))
    del model
    ref, patched = load_float64(str(ckpt), cfg, log)
    log("reference (float64, CPU):")
    chosen, candidates = greedy_reference(ref, tok, cfg, log)
    reference = reference_document(chosen, candidates, patched, transformers.__version__)
    (out_dir / "demo.reference.json").write_text(compact_json(reference) + "\n")
    export_results(out_dir, args.export, log)


def reference_document(chosen, candidates, patched, transformers_version):
    return {
        "model": "minids demo model (scripts/train_demo.py)",
        "computed_with": f"transformers {transformers_version} DeepseekV2ForCausalLM, float64, CPU, eager "
                         "attention, from the saved checkpoint",
        "method": f"{N_GREEDY} greedy tokens: plain argmax, the whole sequence recomputed each step (no cache); "
                  "EOS not treated specially; prompt ids = BOS (0) + tokenizer ids of the text",
        "attention_scale_patched": patched,
        "gap_definition": "(best - second best logit) / max |logit| at each greedy step",
        "routing_margin_definition": "smallest (k-th - (k+1)-th) router probability over all positions of "
                                     "prompt + greedy tokens (router in FP32, as transformers computes it)",
        "prompts": chosen,
        "candidates": candidates,
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", help="results folder (demo-hf/, demo.reference.json, routing-stats.md, ...)")
    parser.add_argument("--work", default="/tmp/minids-demo-work", help="cache for corpus, tokenizer, tokens")
    parser.add_argument("--template-dir", default=str(Path(__file__).resolve().parent.parent / "tests/data/tiny-v2-lite"),
                        help="folder with the fixture tokenizer.json and tokenizer_config.json to copy from")
    parser.add_argument("--steps", type=int, default=0, help="training steps (default: as many as --train-seconds allow)")
    parser.add_argument("--max-steps", type=int, default=8000)
    parser.add_argument("--train-seconds", type=float, default=240.0)
    parser.add_argument("--deadline-seconds", type=float, default=1e9, help="whole-run wall-clock limit")
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--with-smoke", action="store_true", help="run a tiny end-to-end smoke run first")
    parser.add_argument("--smoke-only", action="store_true")
    parser.add_argument("--from-checkpoint", help="only recompute routing statistics and reference outputs")
    parser.add_argument("--export", type=Path, default=None, help="also write results as tar parts here")
    parser.add_argument("--estimate-only", action="store_true", help="print the .mds size estimate and exit")
    args = parser.parse_args()

    t0 = time.time()

    def log(msg):
        print(f"[{time.time() - t0:6.1f}s] {msg}", flush=True)

    if args.estimate_only:
        for smoke in (False, True):
            cfg = model_config(VOCAB_SIZE, smoke)
            total, active = parameter_counts(cfg)
            mds, dense, experts = mds_size_estimate(cfg, 600_000)
            log(f"{'smoke' if smoke else 'full'}: {total / 1e6:.2f} M params ({active / 1e6:.2f} M active), "
                f".mds {mds / 1e6:.2f} MB (dense {dense / 1e6:.2f}, experts {experts / 1e6:.2f})")
        return
    if not args.out:
        parser.error("--out is required")
    deadline = t0 + args.deadline_seconds
    if args.from_checkpoint:
        run_from_checkpoint(args, log)
        return
    if args.with_smoke or args.smoke_only:
        run_pipeline(args, True, deadline, log)
    if not args.smoke_only:
        run_pipeline(args, False, deadline, log)


if __name__ == "__main__":
    main()
