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

The code is in three files: demo_data.py (steps 1-2: corpus, tokenizer, token streams),
demo_model.py (the config, transformers glue, rounding and the checkpoint: steps 3-5), and this one
(the training loop, the reference, the routing statistics and the driver).

Usage:  python3 scripts/train_demo.py --out OUT_DIR [--work CACHE_DIR] [--steps N]
        python3 scripts/train_demo.py --estimate-only     (size of the converted .mds, no torch)
"""

import argparse
import io
import json
import math
import os
import re
import tarfile
import time
from pathlib import Path

from demo_data import SEED, build_corpus, encode_stream, evenly_spaced, train_tokenizer, windows
from demo_model import (RouterTap, check_and_fix_attention, load_float64, mds_size_estimate, model_config,
                        parameter_counts, round_like_minids, save_checkpoint, use_dense_experts)

VOCAB_SIZE = 6144
CONTEXT = 512
VAL_FRACTION = 0.01
MDS_LIMIT_BYTES = 25_000_000
N_GREEDY = 32
MAX_EPOCHS = 8
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
    if args.with_smoke or args.smoke_only:
        run_pipeline(args, True, deadline, log)
    if not args.smoke_only:
        run_pipeline(args, False, deadline, log)


if __name__ == "__main__":
    main()
