#!/usr/bin/env python3
"""Full-size check (issue 8 item 6): minids against transformers on the exact DeepSeek-V2-Lite
shapes, random weights.

Steps (each timed; the whole run kept inside --time-budget):
  1. transformers' DeepseekV2ForCausalLM is built on the GPU in float32 (TF32 off) with the
     V2-Lite config (V2_LITE below), its weights re-drawn from normal(0, 0.02) with norms at 1 and
     rounded to BF16, and written in the hub's layout (per-expert tensors, sharded safetensors,
     index, config.json, the tiny tokenizer of tests/data/tiny-v2-lite, which `minids convert`
     accepts for a larger vocabulary);
  2. transformers' logits are recorded (float32 on the GPU) for three prompts of random token ids
     (--prompt-lens, default 7, 64, 700) extended by --greedy argmax tokens; then, for scale,
     the model cast to BF16 is run on the same ids and compared with those float32 logits
     (transformers' own "BF16 compute" error; reported as a baseline, decides nothing);
  3. `minids convert` writes FP8 experts, then BF16 experts; each .mds is run with `minids run
     --ids PROMPT+GREEDY -n 0 --temp 0 --dump-logits` (teacher-forced: every position's logits in
     one run) and deleted afterwards, as is the checkpoint once both conversions are done;
  4. per prompt: relative L2 of the logits over the prompt positions (limits: 2e-2 BF16 experts,
     5e-2 FP8 experts), and greedy agreement: the teacher-forced argmax of minids against
     transformers' greedy tokens; the first difference is the first difference of free-running
     greedy decoding too, and it is "explained" when transformers' top-1/top-2 gap there is below
     minids' error at that position.

Usage (repository root, build/ carried; see scripts/full_size_check.sh):
    python3 scripts/full_size_check.py --out OUT [--layers 4] [--cpu] [--work DIR]
--layers N keeps every shape but the layer count (quick run); --cpu forces minids onto the CPU
(passes --cpu when minids has that flag; a minids without it runs on the CPU anyway).
Writes three files: OUT/summary.txt, OUT/results.json, OUT/logs.tar.gz (each command's output).
Exit status 0 when every check passed.
"""

import argparse
import json
import math
import os
import re
import shutil
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import deepseek_reference as ds  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GB = 1e9

# deepseek-ai/DeepSeek-V2-Lite config.json (the fields the model reads), checked against
# DeepSeek-V3's inference/configs/config_16B.json (the same model: dim 2048, inter_dim 10944,
# moe_inter_dim 1408, 27 layers, 1 dense, 16 heads, 64 routed / 2 shared / 6 active, route_scale
# 1.0, q_lora_rank 0, kv_lora_rank 512, nope 128, rope 64, v 128, mscale 0.707) and a transformers
# 5.7 dump of the hub config. bos/eos are 0/1 instead of 100000/100001: the tokenizer used here is
# the tiny one of tests/data/tiny-v2-lite (ids 0/1/2 special), and the prompts are random ids.
V2_LITE = {
    "architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2",
    "vocab_size": 102400, "hidden_size": 2048, "intermediate_size": 10944,
    "moe_intermediate_size": 1408, "num_hidden_layers": 27, "num_attention_heads": 16,
    "num_key_value_heads": 16, "q_lora_rank": None, "kv_lora_rank": 512,
    "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
    "n_routed_experts": 64, "n_shared_experts": 2, "num_experts_per_tok": 6,
    "first_k_dense_replace": 1, "moe_layer_freq": 1, "n_group": 1, "topk_group": 1,
    "topk_method": "greedy", "norm_topk_prob": False, "routed_scaling_factor": 1.0,
    "scoring_func": "softmax", "aux_loss_alpha": 0.001, "seq_aux": True, "rms_norm_eps": 1e-6,
    "rope_theta": 10000, "max_position_embeddings": 163840,
    "rope_scaling": {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096,
                     "beta_fast": 32, "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 0.707},
    "bos_token_id": 0, "eos_token_id": 1, "tie_word_embeddings": False, "hidden_act": "silu",
    "attention_bias": False, "attention_dropout": 0.0, "initializer_range": 0.02,
    "use_cache": True, "torch_dtype": "bfloat16",
}
LIMITS = {"fp8": 5e-2, "bf16": 2e-2}


class Run:
    """Log, timings and the time budget of the whole check."""

    def __init__(self, out, work, budget):
        self.out, self.t0, self.deadline = out, time.time(), time.time() + budget
        self.lines, self.results = [], {"stages": {}, "checks": [], "diagnostics": [],
                                          "skipped": []}
        self.logs = os.path.join(work, "logs")  # bundled into OUT/logs.tar.gz at the end
        os.makedirs(self.logs, exist_ok=True)
        os.makedirs(out, exist_ok=True)

    def log(self, s):
        s = "[%6.1f s] %s" % (time.time() - self.t0, s)
        print(s, flush=True)
        self.lines.append(s)

    def left(self):
        return self.deadline - time.time()

    def stage(self, name, t_start):
        self.results["stages"][name] = round(time.time() - t_start, 1)
        self.log("%s: %.1f s" % (name, time.time() - t_start))

    def skip(self, what, why):
        self.results["skipped"].append("%s: %s" % (what, why))
        self.log("SKIPPED %s: %s" % (what, why))


def free_bytes(path):
    try:
        return shutil.disk_usage(path).free
    except OSError:
        return 0


def checkpoint_bytes(c):
    return sum(2 * math.prod(shape) for shape, _ in ds.expected_shapes(c).values())


def expert_bytes(c):
    n_moe = sum(1 for i in range(c.num_hidden_layers) if c.is_moe_layer(i))
    return n_moe * c.n_routed_experts * 3 * c.hidden_size * c.moe_intermediate_size


def plan_dirs(args, c, run):
    """Where the checkpoint and the .mds files go. The checkpoint (BF16, ~31 GB for V2-Lite) and
    the BF16-expert .mds (as large) must coexist during the second conversion; a tmpfs
    (/dev/shm) with room takes the checkpoint so that the disk holds only the .mds."""
    hf = checkpoint_bytes(c)
    mds_bf16 = hf
    mds_fp8 = hf - expert_bytes(c) * 2 + expert_bytes(c) * 1.01
    margin = 2 * GB
    work = os.path.abspath(args.work)
    os.makedirs(work, exist_ok=True)
    shm = "/dev/shm"
    run.log("sizes: checkpoint %.1f GB, FP8 .mds ~%.1f GB, BF16 .mds ~%.1f GB; free: %s %.1f GB, "
            "%s %.1f GB" % (hf / GB, mds_fp8 / GB, mds_bf16 / GB, work, free_bytes(work) / GB,
                            shm, free_bytes(shm) / GB))
    if args.hf_dir:
        hf_root = os.path.abspath(args.hf_dir)
    elif os.path.isdir(shm) and free_bytes(shm) > hf + margin and free_bytes(work) > mds_bf16 + \
            margin:
        hf_root = os.path.join(shm, "minids_full_size_hf")
    else:
        hf_root = os.path.join(work, "hf")
    same_fs = os.stat(os.path.dirname(hf_root) if not os.path.exists(hf_root) else hf_root).st_dev \
        == os.stat(work).st_dev
    need = mds_bf16 + (hf if same_fs else 0) + margin
    run.log("checkpoint in %s; .mds files in %s (%.1f GB free needed there before the checkpoint "
            "is written, or the BF16 step is skipped)" % (hf_root, work, need / GB))
    return hf_root, {"hf": hf, "fp8": mds_fp8, "bf16": mds_bf16}


# ---------------------------------------------------------------------------------------------
# transformers side


def build_model(cfg_dir, seed, run):
    import transformers
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM
    run.results["transformers"] = transformers.__version__
    run.log("transformers %s, torch %s, %s" % (transformers.__version__, torch.__version__,
                                               torch.cuda.get_device_name(0)))
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")
    cfg = DeepseekV2Config.from_pretrained(cfg_dir)
    for attr in ("_attn_implementation", "_experts_implementation"):
        try:
            setattr(cfg, attr, "eager")
        except Exception:  # noqa: BLE001 - not in every version
            pass
    torch.set_default_dtype(torch.float32)
    with torch.device("cuda"):
        model = DeepseekV2ForCausalLM(cfg)
    if next(model.parameters()).device.type != "cuda":
        run.log("note: the model was built on %s; moving it to the GPU" %
                next(model.parameters()).device)
        model = model.cuda()
    model.eval()
    for fn in ("set_attn_implementation", "set_experts_implementation"):
        if hasattr(model, fn):
            try:
                getattr(model, fn)("eager")
            except Exception:  # noqa: BLE001
                pass
    # Our own weights: normal(0, 0.02) like transformers' init, norms at 1, rounded to BF16.
    g = torch.Generator(device="cuda").manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
                continue
            flat = p.view(-1)
            for a in range(0, flat.numel(), 1 << 28):  # chunks bound the BF16 temporary
                chunk = flat[a:a + (1 << 28)]
                chunk.normal_(0.0, 0.02, generator=g)
                chunk.copy_(chunk.to(torch.bfloat16).to(torch.float32))
    n = sum(p.numel() for p in model.parameters())
    run.log("model on the GPU: %.2f B parameters, float32, %.1f GB of GPU memory" %
            (n / 1e9, torch.cuda.memory_allocated() / GB))
    return model


def hub_tensors(model, c):
    """Yields (hub name, BF16 CPU tensor) in layer order from the model's parameters: the fused
    experts ([E, 2F, D] gate_up = cat(gate, up), [E, D, F] down) split per expert."""
    sd = model.state_dict()
    if hasattr(model, "named_parameters"):  # the weights only, not persistent buffers
        params = {n for n, _ in model.named_parameters()}
        sd = {k: v for k, v in sd.items() if k in params}
    F = c.moe_intermediate_size
    order = sorted(sd, key=lambda k: (int(m.group(1)) if (m := re.search(
        r"layers\.(\d+)\.", k)) else (-1 if "embed" in k else 10**6), k))
    for key in order:
        t = sd[key]
        m = re.match(r"^(model\.layers\.\d+\.mlp\.experts)\.(gate_up_proj|down_proj)(\.weight)?$",
                     key)
        if not m:
            yield key, t.to(torch.bfloat16).cpu()
            continue
        E = t.shape[0]
        full = t.to(torch.bfloat16).cpu()
        for e in range(E):
            if m.group(2) == "gate_up_proj":
                if tuple(full.shape[1:]) != (2 * F, c.hidden_size):
                    raise RuntimeError("%s: shape %s, expected [E, 2F, D]" % (key, tuple(t.shape)))
                yield "%s.%d.gate_proj.weight" % (m.group(1), e), full[e, :F]
                yield "%s.%d.up_proj.weight" % (m.group(1), e), full[e, F:]
            else:
                if tuple(full.shape[1:]) != (c.hidden_size, F):
                    raise RuntimeError("%s: shape %s, expected [E, D, F]" % (key, tuple(t.shape)))
                yield "%s.%d.down_proj.weight" % (m.group(1), e), full[e]


def write_checkpoint(model, c, hf_dir, run, shard_bytes=5 * GB):
    expected = ds.expected_shapes(c)
    weight_map, part, part_bytes, k, total, files = {}, {}, 0, 0, 0, []

    def flush():
        nonlocal part, part_bytes, k
        if not part:
            return
        k += 1
        fname = "model-%05d.safetensors" % k
        ds.write_safetensors(os.path.join(hf_dir, fname), part)
        files.append(fname)
        for n in part:
            weight_map[n] = fname
        part, part_bytes = {}, 0

    for name, t in hub_tensors(model, c):
        if name not in expected:
            raise RuntimeError("transformers parameter %s has no hub name" % name)
        if tuple(t.shape) != tuple(expected[name][0]):
            raise RuntimeError("%s: shape %s, hub layout %s" % (name, tuple(t.shape),
                                                                 expected[name][0]))
        part[name] = t
        part_bytes += t.numel() * 2
        total += t.numel() * 2
        if part_bytes >= shard_bytes:
            flush()
    flush()
    missing = set(expected) - set(weight_map)
    if missing:
        raise RuntimeError("hub tensors not produced: %s" % sorted(missing)[:5])
    # Hub names: model-0000k-of-0000n.safetensors.
    final = {}
    for i, f in enumerate(files):
        new = "model-%05d-of-%05d.safetensors" % (i + 1, len(files))
        os.replace(os.path.join(hf_dir, f), os.path.join(hf_dir, new))
        final[f] = new
    with open(os.path.join(hf_dir, "model.safetensors.index.json"), "w") as fh:
        json.dump({"metadata": {"total_size": total},
                   "weight_map": {n: final[f] for n, f in weight_map.items()}}, fh)
    run.log("checkpoint: %d shards, %.2f GB in %s" % (len(files), total / GB, hf_dir))


def probe_experts(model, c, hf_dir, run):
    """One expert through transformers' experts module against the exported tensors."""
    layer = next(i for i in range(c.num_hidden_layers) if c.is_moe_layer(i))
    e = 5
    with open(os.path.join(hf_dir, "model.safetensors.index.json")) as fh:
        wm = json.load(fh)["weight_map"]
    names = ["model.layers.%d.mlp.experts.%d.%s_proj.weight" % (layer, e, p)
             for p in ("gate", "up", "down")]
    w = {}
    for f in sorted({wm[n] for n in names}):
        w.update(ds.read_safetensors(os.path.join(hf_dir, f), names=set(names)))
    x = torch.randn(4, c.hidden_size, device="cuda", generator=torch.Generator(
        device="cuda").manual_seed(1))
    try:
        with torch.no_grad():
            got = model.model.layers[layer].mlp.experts(
                x, torch.full((4, 1), e, device="cuda"), torch.ones(4, 1, device="cuda"))
    except Exception as ex:  # noqa: BLE001 - another calling convention
        run.log("experts not probed alone (%s: %s); the end-to-end comparison covers the layout"
                % (type(ex).__name__, ex))
        return
    if isinstance(got, tuple):
        got = got[0]
    ref = ds.swiglu_mlp(x.double().cpu(), w, names[0][:-len("gate_proj.weight")])
    err = float(((got.double().cpu() - ref).norm() / ref.norm()))
    run.log("expert %d of layer %d through transformers vs the exported tensors: relative L2 %.1e"
            % (e, layer, err))
    if err > 1e-4:
        raise RuntimeError("exported experts do not match transformers' (%.2e)" % err)


def layer_outputs(model, ids):
    """transformers' per-layer attention output, FFN output and layer output for `ids` (float32
    CPU tensors [T, D] by name attn_out-i, ffn_out-i, l_out-i: minids' --dump-tensors names)."""
    got, hooks = {}, []

    def keep(name):
        def hook(_module, _inputs, output):
            t = output[0] if isinstance(output, tuple) else output
            got[name] = t[0].detach().float().cpu()
        return hook

    for i, layer in enumerate(model.model.layers):
        hooks.append(layer.self_attn.register_forward_hook(keep("attn_out-%d" % i)))
        hooks.append(layer.mlp.register_forward_hook(keep("ffn_out-%d" % i)))
        hooks.append(layer.register_forward_hook(keep("l_out-%d" % i)))
    try:
        model(input_ids=torch.tensor([ids], device="cuda"), use_cache=False)
    finally:
        for h in hooks:
            h.remove()
    return got


def reference(model, c, prompts, n_greedy, run, diagnose_prompt=-1):
    """transformers' greedy tokens after each prompt and its logits at every position of
    prompt + greedy[:-1] (float32 on the GPU), as CPU float32 tensors; for prompt number
    diagnose_prompt also its per-layer outputs (layer_outputs)."""
    refs = []
    with torch.no_grad():
        for pi, p in enumerate(prompts):
            seq = list(p)
            for _ in range(n_greedy):
                out = model(input_ids=torch.tensor([seq], device="cuda"), use_cache=False)
                seq.append(int(out.logits[0, -1].argmax()))
            greedy = seq[len(p):]
            ids = p + greedy[:-1]
            logits = model(input_ids=torch.tensor([ids], device="cuda"),
                           use_cache=False).logits[0].float().cpu()
            # Self-consistency: the one-pass logits give the same argmax as the step-wise runs.
            again = [int(logits[len(p) - 1 + k].argmax()) for k in range(n_greedy)]
            if again != greedy:
                run.log("note: one-pass argmax differs from step-wise greedy at steps %s" %
                        [k for k in range(n_greedy) if again[k] != greedy[k]])
            refs.append({"prompt": p, "greedy": greedy, "ids": ids, "logits": logits})
            if pi == diagnose_prompt:
                refs[-1]["layers"] = layer_outputs(model, ids)
            run.log("reference for the %d-token prompt: greedy %s" % (len(p), greedy))
    return refs


def bf16_baseline(model, refs, run):
    """transformers itself in BF16 (the model cast to bfloat16, as it is usually run) against its
    own float32 logits: what "BF16 compute" costs the reference implementation on these weights,
    for scale next to minids' BF16 figures. Reported apart; it decides nothing."""
    model.to(torch.bfloat16)
    with torch.no_grad():
        for ref in refs:
            got = model(input_ids=torch.tensor([ref["ids"]], device="cuda"),
                        use_cache=False).logits[0].float().cpu()
            m = compare(ref["logits"], got, len(ref["prompt"]), len(ref["greedy"]))
            m["what"] = "transformers BF16, %d-token prompt" % len(ref["prompt"])
            run.results.setdefault("baselines", []).append(m)
            run.log("baseline %s: rel L2 %.2e, continuation %.2e, greedy %d/%d teacher-forced" % (
                m["what"], m["rel_l2_prompt"], m["rel_l2_continuation"] or 0.0,
                m["greedy_agree"], m["greedy_steps"]))


class SelfTestModel:
    """--self-test stand-in for transformers (no GPU, no transformers): hub weights from
    deepseek_reference.random_weights, exposed in transformers 5's fused expert layout so the
    export path is exercised; the reference is deepseek_reference.forward in float64."""

    def __init__(self, c, seed):
        self.c, self.w = c, ds.random_weights(c, seed)

    def state_dict(self):
        sd, experts = {}, {}
        for name, t in self.w.items():
            m = re.match(r"^(.*\.mlp\.experts)\.(\d+)\.(gate|up|down)_proj\.weight$", name)
            if m:
                experts.setdefault(m.group(1), {}).setdefault(int(m.group(2)), {})[m.group(3)] = t
            else:
                sd[name] = t.float()
        for prefix, per in experts.items():
            E = len(per)
            sd[prefix + ".gate_up_proj"] = torch.stack(
                [torch.cat([per[e]["gate"], per[e]["up"]], 0) for e in range(E)]).float()
            sd[prefix + ".down_proj"] = torch.stack([per[e]["down"] for e in range(E)]).float()
        return sd

    def reference(self, prompts, n_greedy, run):
        refs = []
        for p in prompts:
            greedy, _ = ds.greedy(self.c, self.w, p, n_greedy)
            ids = p + greedy[:-1]
            refs.append({"prompt": p, "greedy": greedy, "ids": ids,
                         "logits": ds.forward(self.c, self.w, ids).float()})
            run.log("self-test reference for the %d-token prompt: greedy %s" % (len(p), greedy))
        return refs


# ---------------------------------------------------------------------------------------------
# minids side


def sh(cmd, run, log_name, timeout, env=None):
    t = time.time()
    with open(os.path.join(run.logs, log_name), "w") as log:
        log.write("$ %s%s\n" % ("".join("%s=%s " % kv for kv in (env or {}).items()), " ".join(
            cmd if len(" ".join(cmd)) < 2000 else cmd[:6] + ["..."])))
        log.flush()
        p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                           timeout=max(1, timeout), env=dict(os.environ, **(env or {})))
        log.write(p.stdout)
    return p.returncode, p.stdout, time.time() - t


def compare(ref, got, n_prompt, n_greedy):
    """Metrics of minids' logits `got` [T, V] against transformers' `ref` [T, V]."""
    r, g = ref.double(), got.double()
    P = n_prompt
    l2 = float((g[:P] - r[:P]).norm() / r[:P].norm())
    l2_cont = float((g[P:] - r[P:]).norm() / r[P:].norm()) if g.shape[0] > P else None
    per_pos = ((g - r).abs().max(dim=-1).values / r.abs().max(dim=-1).values)
    agree, first = 0, None
    for k in range(n_greedy):
        pos = P - 1 + k
        want = int(r[pos].argmax())
        if int(g[pos].argmax()) == want:
            agree += 1
        elif first is None:
            top = torch.topk(r[pos], 2).values
            first = {"step": k, "ref_gap_rel": float((top[0] - top[1]) / r[pos].abs().max()),
                     "minids_err_rel": float(per_pos[pos])}
    return {"rel_l2_prompt": l2, "rel_l2_continuation": l2_cont,
            "worst_pos_max_err_rel": float(per_pos.max()), "greedy_agree": agree,
            "greedy_steps": n_greedy, "first_divergence": first}


def run_minids(args, mds, dtype, refs, run, has_cpu_flag, variant=None):
    """minids on every prompt (the checks), or with variant = (label, extra flags, prompt
    indices) a diagnostic run whose rows are reported apart and do not decide the result."""
    label, extra, which, env = variant or ("", [], range(len(refs)), {})
    for i, ref in enumerate(refs):
        if i not in which:
            continue
        what = "%s experts, %d-token prompt%s" % (dtype, len(ref["prompt"]),
                                                   ", " + label if label else "")
        if run.left() < 20:
            run.skip(what, "time budget spent")
            continue
        npy = os.path.join(args.work, "logits_%s_%d.npy" % (dtype, i))
        cmd = [args.minids, "run", "-m", mds, "--ids", ",".join(map(str, ref["ids"])), "-n", "0",
               "--temp", "0", "-c", str(len(ref["ids"]) + 8), "-t", str(args.threads),
               "--dump-logits", npy]
        if args.cpu and has_cpu_flag:
            cmd.append("--cpu")
        cmd += args.minids_flag  # e.g. --minids-flag=--cache-type-k --minids-flag=f32
        cmd += extra
        log_name = "run_%s_%d%s.txt" % (dtype, i, "_" + re.sub(r"\W+", "_", label) if label else "")
        try:
            rc, out, secs = sh(cmd, run, log_name, run.left() - 10, env)
        except subprocess.TimeoutExpired:
            run.skip(what, "minids run did not finish inside the time budget")
            continue
        rows = run.results["diagnostics" if label else "checks"]
        if rc != 0 or not os.path.exists(npy):
            rows.append({"what": what, "pass": False,
                         "error": "minids run exit %d: %s" % (rc, out[-400:])})
            run.log("FAIL %s: minids run exit %d (logs/%s)" % (what, rc, log_name))
            continue
        import numpy as np
        got = torch.from_numpy(np.load(npy))
        os.remove(npy)
        m = compare(ref["logits"], got, len(ref["prompt"]), len(ref["greedy"]))
        fd = m["first_divergence"]
        explained = fd is None or fd["ref_gap_rel"] <= fd["minids_err_rel"]
        ok = m["rel_l2_prompt"] <= LIMITS[dtype] and explained
        engine = [s.strip() for s in out.splitlines()
                  if re.search(r"(?i)gpu|cuda|cpu|backend|upload|resident|tok/s", s)][:4]
        m.update(what=what, dtype=dtype, limit=LIMITS[dtype], greedy_explained=explained,
                 pass_=ok, seconds=round(secs, 1), engine_lines=engine)
        rows.append(m)
        run.log("%s %s: rel L2 %.2e (limit %.0e), continuation %.2e, worst position %.2e, greedy "
                "%d/%d teacher-forced%s, %.1f s" % (
                    "PASS" if ok else "FAIL", what, m["rel_l2_prompt"], LIMITS[dtype],
                    m["rel_l2_continuation"] or 0.0, m["worst_pos_max_err_rel"], m["greedy_agree"],
                    m["greedy_steps"], "" if fd is None else
                    ", first difference at step %d (reference gap %.1e, minids error %.1e: %s)" %
                    (fd["step"], fd["ref_gap_rel"], fd["minids_err_rel"],
                     "explained" if explained else "NOT explained"), secs))


def parse_variant(text, n_prompts):
    """--variant "LABEL|ENV=V ENV2=V|--flag value ..." -> (label, flags, prompts, env)."""
    parts = (text.split("|") + ["", ""])[:3]
    env = dict(kv.split("=", 1) for kv in parts[1].split() if "=" in kv)
    return parts[0].strip(), parts[2].split(), range(n_prompts), env


def diagnose_layers(args, mds, dtype, ref, run):
    """minids' per-layer outputs (--dump-tensors) against transformers' for one prompt: where
    the error enters and how it grows."""
    import numpy as np
    dump = os.path.join(args.work, "dump_%s" % dtype)
    shutil.rmtree(dump, ignore_errors=True)
    cmd = [args.minids, "run", "-m", mds, "--ids", ",".join(map(str, ref["ids"])), "-n", "0",
           "--temp", "0", "-c", str(len(ref["ids"]) + 8), "--dump-tensors", dump]
    try:
        rc, out, _ = sh(cmd, run, "dump_%s.txt" % dtype, min(120, run.left() - 10))
    except subprocess.TimeoutExpired:
        run.skip("per-layer dump %s" % dtype, "time budget spent")
        return
    rows = []
    for i in range(len(ref["layers"]) // 3):
        row = [i]
        for name in ("attn_out", "ffn_out", "l_out"):
            key = "%s-%d" % (name, i)
            f = os.path.join(dump, key + ".npy")
            if key not in ref["layers"] or not os.path.exists(f):
                row.append(None)
                continue
            r = ref["layers"][key].double()
            g = torch.from_numpy(np.load(f)).double().reshape(r.shape)
            row.append(float((g - r).norm() / r.norm()))
        rows.append(row)
    shutil.rmtree(dump, ignore_errors=True)
    run.results.setdefault("layers", {})[dtype] = rows
    fmt = lambda v: "%9.2e" % v if v is not None else "        -"
    run.log("per-layer relative L2, %s experts, %d-token prompt (minids rc %d): layer, attention "
            "output, FFN output, layer output" % (dtype, len(ref["prompt"]), rc))
    for row in rows:
        run.log("  layer %2d %s %s %s" % (row[0], fmt(row[1]), fmt(row[2]), fmt(row[3])))


def convert(args, hf_dir, mds, dtype, run):
    t = time.time()
    cmd = [args.minids, "convert", hf_dir, "-o", mds, "--expert-dtype", dtype, "--force", "-q",
           "--threads", str(args.convert_threads)]
    try:
        rc, out, _ = sh(cmd, run, "convert_%s.txt" % dtype, run.left() - 30)
    except subprocess.TimeoutExpired:
        run.skip("convert %s" % dtype, "time budget spent")
        return False
    if rc != 0:
        run.results["checks"].append({"what": "convert %s" % dtype, "pass": False,
                                      "error": out[-600:]})
        run.log("FAIL convert %s: exit %d: %s" % (dtype, rc, out[-600:]))
        return False
    run.stage("convert %s (%.1f GB)" % (dtype, os.path.getsize(mds) / GB), t)
    return True


# ---------------------------------------------------------------------------------------------


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, help="results directory")
    ap.add_argument("--work", default="full_size_work",
                    help="directory for the .mds files (and the checkpoint without a tmpfs)")
    ap.add_argument("--hf-dir", default="", help="where to write the checkpoint (default: "
                    "/dev/shm when it has room, else WORK/hf)")
    ap.add_argument("--minids", default=os.path.join(REPO, "build", "minids"))
    ap.add_argument("--layers", type=int, default=27, help="fewer layers, same shapes otherwise")
    ap.add_argument("--cpu", action="store_true", help="run minids on the CPU")
    ap.add_argument("--minids-flag", action="append", default=[],
                    help="one more argument for every minids run (repeat for several), "
                         "e.g. --minids-flag=--cache-type-k --minids-flag=f32")
    ap.add_argument("--prompt-lens", default="7,64,700")
    ap.add_argument("--greedy", type=int, default=16)
    ap.add_argument("--seed", type=int, default=20240)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 16)
    ap.add_argument("--convert-threads", type=int, default=0)
    ap.add_argument("--time-budget", type=float, default=530, help="seconds for everything")
    ap.add_argument("--keep", action="store_true", help="keep the checkpoint and .mds files")
    ap.add_argument("--only", choices=["fp8", "bf16", "both"], default="both")
    ap.add_argument("--variant", action="append", default=[],
                    help="with --diagnose: a diagnostic run instead of the default ones, "
                         "\"LABEL|ENV=VALUE ...|--flag value ...\" (repeat for several)")
    ap.add_argument("--diagnose", action="store_true",
                    help="also, on the BF16 experts: per-layer outputs of the second prompt "
                         "against transformers', and diagnostic runs (the prompt in one-token "
                         "steps, 16-token steps, and on the CPU) that do not decide the result")
    ap.add_argument("--no-bf16-baseline", action="store_true",
                    help="skip the baseline run of transformers itself in BF16 against its "
                         "float32 logits (reported for scale, decides nothing)")
    ap.add_argument("--self-test", action="store_true", help="no transformers or GPU: "
                    "deepseek_reference.py's float64 forward as the reference (tests this script)")
    args = ap.parse_args()
    args.work = os.path.abspath(args.work)
    run = Run(os.path.abspath(args.out), args.work, args.time_budget)
    cfg = dict(V2_LITE, num_hidden_layers=args.layers)
    c = ds.DsConfig(cfg)
    run.results["config"] = {"layers": args.layers, "cpu": args.cpu,
                             "prompt_lens": args.prompt_lens, "greedy": args.greedy}
    rc_total = 0
    try:
        if not os.access(args.minids, os.X_OK):
            raise RuntimeError("%s is not an executable (build it: cmake --build build --target "
                               "minids)" % args.minids)
        if not torch.cuda.is_available() and not args.self_test:
            raise RuntimeError("no CUDA device for transformers' reference")
        _, help_text, _ = sh([args.minids, "run", "--help"], run, "minids_run_help.txt", 30)
        has_cpu_flag = "--cpu" in help_text
        run.log("minids: %s; %s" % (args.minids, "has --cpu (GPU engine by default)" if
                                    has_cpu_flag else "no --cpu flag: this build runs on the CPU"))
        if (not has_cpu_flag or args.cpu) and args.layers > 8:
            run.log("note: minids on the CPU with %d layers: the long prompt may take minutes "
                    "per expert dtype; what does not fit the budget is reported SKIPPED "
                    "(--layers 4 fits)" % args.layers)
        hf_root, sizes = plan_dirs(args, c, run)
        if os.path.exists(hf_root):
            shutil.rmtree(hf_root)
        os.makedirs(hf_root)

        t = time.time()
        with open(os.path.join(hf_root, "config.json"), "w") as fh:
            json.dump(cfg, fh, indent=2)
        for f in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(os.path.join(REPO, "tests", "data", "tiny-v2-lite", f), hf_root)
        model = SelfTestModel(c, args.seed) if args.self_test else build_model(
            hf_root, args.seed, run)
        run.stage("build model", t)
        t = time.time()
        write_checkpoint(model, c, hf_root, run)
        if not args.self_test:
            probe_experts(model, c, hf_root, run)
        run.stage("write checkpoint", t)
        t = time.time()
        g = torch.Generator().manual_seed(args.seed + 1)
        prompts = [[0] + torch.randint(3, c.vocab_size, (n - 1,), generator=g).tolist()
                   for n in (int(x) for x in args.prompt_lens.split(","))]
        if args.self_test:
            refs = model.reference(prompts, args.greedy, run)
        else:
            refs = reference(model, c, prompts, args.greedy, run,
                             diagnose_prompt=1 if args.diagnose and len(prompts) > 1 else -1)
        run.stage("reference", t)
        if not args.self_test and not args.no_bf16_baseline:
            t = time.time()
            bf16_baseline(model, refs, run)
            run.stage("transformers bf16 baseline", t)
        del model
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

        for dtype in ("fp8", "bf16"):
            if args.only not in ("both", dtype):
                continue
            mds = os.path.join(args.work, "v2lite-%s.mds" % dtype)
            need = sizes[dtype] + 2 * GB  # the checkpoint is already written
            if free_bytes(args.work) < need:
                run.skip("%s experts" % dtype, "%.1f GB free in %s, %.1f GB needed" %
                         (free_bytes(args.work) / GB, args.work, need / GB))
                continue
            if run.left() < 60:
                run.skip("%s experts" % dtype, "time budget spent")
                continue
            if not convert(args, hf_root, mds, dtype, run):
                continue
            if dtype == "bf16" or args.only == "fp8":
                if not args.keep:  # both conversions done: the checkpoint can go
                    shutil.rmtree(hf_root, ignore_errors=True)
            t = time.time()
            run_minids(args, mds, dtype, refs, run, has_cpu_flag)
            run.stage("minids runs %s" % dtype, t)
            if args.diagnose and dtype == "bf16":
                t = time.time()
                if len(refs) > 1 and "layers" in refs[1]:
                    diagnose_layers(args, mds, dtype, refs[1], run)
                variants = [parse_variant(v, len(refs)) for v in args.variant] or [
                    ("prompt in 1-token steps", ["--ubatch-size", "1"], range(len(refs)), {}),
                    ("CPU", ["--cpu"], range(min(2, len(refs))), {}),
                    ("prompt in 16-token steps", ["--ubatch-size", "16"], range(2), {})]
                for v in variants:
                    run_minids(args, mds, dtype, refs, run, has_cpu_flag, variant=v)
                run.stage("diagnostics %s" % dtype, t)
            if not args.keep:
                os.remove(mds)
    except Exception as e:  # noqa: BLE001 - the summary must still be written
        import traceback
        run.log("ERROR: %s: %s" % (type(e).__name__, e))
        run.log(traceback.format_exc())
        run.results["error"] = "%s: %s" % (type(e).__name__, e)
        rc_total = 2
    finally:
        if not args.keep:
            for d in ("/dev/shm/minids_full_size_hf", os.path.join(args.work, "hf")):
                shutil.rmtree(d, ignore_errors=True)

    checks = run.results["checks"]
    all_pass = bool(checks) and all(ch.get("pass_", ch.get("pass")) for ch in checks) and \
        not run.results["skipped"] and rc_total == 0
    out = ["", "=" * 100,
           "SUMMARY full_size_check: DeepSeek-V2-Lite shapes, %d layers, random BF16 weights; "
           "reference transformers %s float32 on the GPU (TF32 off); minids on the %s" % (
               args.layers, run.results.get("transformers", "?"),
               "CPU" if args.cpu else "GPU if this minids has one (see engine lines)")]
    for ch in checks:
        if "rel_l2_prompt" not in ch:
            out.append("  FAIL %s: %s" % (ch["what"], ch.get("error", "")[:300]))
            continue
        fd = ch["first_divergence"]
        out.append("  %s %-34s rel L2 %.2e (limit %.0e)  greedy %2d/%d%s" % (
            "PASS" if ch["pass_"] else "FAIL", ch["what"], ch["rel_l2_prompt"], ch["limit"],
            ch["greedy_agree"], ch["greedy_steps"], "" if fd is None else
            "  first diff step %d: ref gap %.1e vs minids err %.1e (%s)" % (
                fd["step"], fd["ref_gap_rel"], fd["minids_err_rel"],
                "explained" if ch["greedy_explained"] else "NOT explained")))
        if ch["engine_lines"]:
            out.append("       minids: " + " | ".join(ch["engine_lines"])[:200])
    for ch in run.results.get("baselines", []):
        out.append("  baseline   %-58s rel L2 %.2e  greedy %2d/%d" % (
            ch["what"], ch["rel_l2_prompt"], ch["greedy_agree"], ch["greedy_steps"]))
    for ch in run.results["diagnostics"]:
        if "rel_l2_prompt" not in ch:
            out.append("  diagnostic %s: %s" % (ch["what"], ch.get("error", "")[:200]))
            continue
        out.append("  diagnostic %-58s rel L2 %.2e  greedy %2d/%d" % (
            ch["what"], ch["rel_l2_prompt"], ch["greedy_agree"], ch["greedy_steps"]))
    for s in run.results["skipped"]:
        out.append("  SKIPPED " + s)
    if "error" in run.results:
        out.append("  ERROR " + run.results["error"])
    out.append("  stages: " + ", ".join("%s %.0f s" % kv for kv in run.results["stages"].items()))
    out.append("RESULT: %s (%.0f s)" % ("PASS" if all_pass else "NOT PASSED", time.time() - run.t0))
    for s in out:
        print(s)
    run.lines += out
    with open(os.path.join(run.out, "summary.txt"), "w") as fh:
        fh.write("\n".join(run.lines) + "\n")
    with open(os.path.join(run.out, "results.json"), "w") as fh:
        json.dump(run.results, fh, indent=1)
    import tarfile
    with tarfile.open(os.path.join(run.out, "logs.tar.gz"), "w:gz") as tar:
        tar.add(run.logs, arcname="logs")
    return 0 if all_pass else (rc_total or 1)


if __name__ == "__main__":
    sys.exit(main())
