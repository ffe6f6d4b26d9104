"""The demo model's data pipeline (scripts/train_demo.py): the corpus, the tokenizer and the token
streams. See train_demo.py's docstring, steps 1 and 2."""

import ast
import hashlib
import importlib.metadata
import json
import multiprocessing
import os
import random
import sys
import sysconfig
import time
import warnings

SEED = 1234
BOS, EOS, PAD = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜▁pad▁｜>"
TOKENIZER_TRAIN_CHARS = 40_000_000
CORPUS_MAX_CHARS = 120_000_000
# Only text of distributions under these licenses joins the corpus (matched in the SPDX expression,
# else in the License field and the license classifiers); anything naming a RESTRICTED term, or
# with no license information, stays out.
PERMISSIVE = ("MIT", "BSD", "APACHE", "PSF", "PYTHON SOFTWARE FOUNDATION", "ISC", "ZLIB", "CC0", "UNLICENSE", "HPND")
RESTRICTED = ("GPL", "MPL", "MOZILLA", "PROPRIETARY", "LICENSEREF-NVIDIA", "NVIDIA SOFTWARE LICENSE", "COMMERCIAL")


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
# Tokenizer and token streams


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
