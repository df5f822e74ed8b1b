"""Train the V4.1 target model (train/model.py) and export it in the official format.

    /usr/bin/python3 train/train_target.py --device cuda --max-minutes 8 --steps 100000 \
        --cmap train/out/engram_cmap.safetensors --out train/out/target
    /usr/bin/python3 train/train_target.py --smoke          (CPU, < 1 minute, every code path)
    ... --init assets/dsx-small-v41 --token-classes C.bin --class-weights 1,1,3,12   (a fine-tune:
        the exported checkpoint's config and weights, its mtp.* stages carried into the export;
        the loss a per-token weighted mean by the class of each target token)

Inputs (agent D's data, train/out/):
  data/train.bin, data/val.bin   uint16 little-endian token ids, documents concatenated,
                                 each starting with BOS
  tokenizer.json                 the byte-level BPE with the V4.1 special tokens
  the Engram compressed token map of that tokenizer: --cmap FILE (safetensors "cmap" I32
  [len_tokenizer], "n_keys" I32 [1], as `dsx engram-cmap` writes it), or --dsx PATH to run
  `PATH engram-cmap --tokenizer tokenizer.json -o OUT/engram_cmap.safetensors`.

Configuration: --config (default train/configs/target.json; the dims and the layer schedule)
completed from the tokenizer: vocab_size = len(tokenizer) rounded up to a multiple of 32,
bos/eos/pad ids, engram_pad_token_id = the pad id, dspark_noise_token_id = <｜System｜>
(as in the release), image_token_id, engram_compressed_vocab_size = n_keys of the map,
engram_num_embeddings from the Engram prime walk.

Training: AdamW (betas 0.9/0.95, weight decay on matrices), linear warm-up then cosine
decay to --min-lr-frac; progress = max(step / --steps, elapsed / --max-minutes), so a time
limit also completes the schedule; loss = next-token cross entropy + --index-coef x the
indexer distillation loss + --aux-coef x the router balance loss; router selection biases
updated by the aux-free rule (--bias-rate). Deterministic data order: non-overlapping
windows of --seq + 1 tokens, shuffled per epoch with the seed. On CUDA the products run on
bf16 operands (model.set_matmul_bf16; see model.py), TF32 off.

Outputs (--out): run.json (every setting, data hashes, versions), log.jsonl (progress),
target.pt (torch checkpoint: state_dict, config, step; written every --save-minutes and at
the end), model/ (the exported checkpoint dir: config.json, model.safetensors,
tokenizer.json, engram_cmap.safetensors), and, with a dsx binary (--engine-dsx, default
build-cpu/dsx when present), engine_check.json (check_engine.py on held-out windows).
"""
import argparse
import hashlib
import json
import math
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import export as EX  # noqa: E402
import model as M  # noqa: E402
import st  # noqa: E402

REPO = os.path.dirname(HERE)
_GOLDEN_ROOT = os.environ.get("DSX_GOLDEN_DIR") or os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "shared", "golden"))  # DSX_GOLDEN_DIR or ../shared/golden beside the repo
GOLDEN_TOK = os.path.join(_GOLDEN_ROOT, "tokenizer/tokenizer-v41.json")
GOLDEN_CMAP = os.path.join(_GOLDEN_ROOT, "tokenizer/engram-cmap-v41.safetensors")


# ---------------------------------------------------------------------------------------
# tokenizer facts and the configuration


def tokenizer_facts(path):
    with open(path, encoding="utf-8") as f:
        t = json.load(f)
    ids = [int(v) for v in t["model"]["vocab"].values()] + [int(a["id"]) for a in t.get("added_tokens", [])]
    by = {a["content"]: int(a["id"]) for a in t.get("added_tokens", [])}
    return {"len": max(ids) + 1, "added": by}


def build_config(template, tok, n_keys, vocab_size=None):
    with open(template) as f:
        c = json.load(f)
    t = c["text_config"]
    n = tok["len"]
    V = vocab_size or ((n + 31) // 32) * 32
    if V < n and vocab_size is None:
        raise ValueError("vocab_size below the tokenizer size")
    t["vocab_size"] = V
    a = tok["added"]
    bos = a.get("<｜begin▁of▁sentence｜>", 0)
    eos = a.get("<｜end▁of▁sentence｜>", 1)
    pad = a.get("<｜▁pad▁｜>", 2)
    c["bos_token_id"], c["eos_token_id"], c["pad_token_id"] = bos, eos, pad
    t["engram_pad_token_id"] = pad
    noise = a.get("<｜System｜>", V - 1)
    t["dspark_noise_token_id"] = noise if noise < V else V - 1
    img = a.get("<｜deepseek_image｜>", V - 1)
    c["image_token_id"] = img if img < V else V - 1
    if t.get("engram_layer_ids"):
        t["engram_compressed_vocab_size"] = int(n_keys)
        t["engram_num_embeddings"] = M.engram_num_embeddings(t["engram_max_ngram_size"], t["engram_n_heads"],
                                                             t["engram_vocab_size"], len(t["engram_layer_ids"]))
    return c


def load_cmap(path):
    t, meta = st.read_safetensors(path)
    c = t["cmap"].long()
    n_keys = int(t["n_keys"][0]) if "n_keys" in t else int(c.max()) + 1
    return c, n_keys


# ---------------------------------------------------------------------------------------
# data


class Windows:
    """Non-overlapping windows of seq + 1 tokens of a uint16 token file, in a seeded order."""

    def __init__(self, path, seq, seed, weights=None):
        self.data = np.memmap(path, dtype=np.uint16, mode="r")
        self.weights = None
        if weights:
            self.weights = np.memmap(weights, dtype=np.uint8, mode="r")
            if len(self.weights) != len(self.data):
                raise ValueError("%s: %d token classes for the %d tokens of %s" % (weights, len(self.weights),
                                                                                len(self.data), path))
        self.seq = seq
        self.n = (len(self.data) - 1) // seq
        if self.n < 1:
            raise ValueError("%s: %d tokens, fewer than one window of %d" % (path, len(self.data), seq + 1))
        self.seed = seed
        self.epoch = -1
        self.pos = 0
        self.order = None

    def _shuffle(self):
        self.epoch += 1
        rng = np.random.default_rng(self.seed * 1000003 + self.epoch)
        self.order = rng.permutation(self.n)
        self.pos = 0

    def batch(self, B):
        return self.batch_with_classes(B)[0]

    def batch_with_classes(self, B):
        """(ids [B, seq + 1], token classes of the targets [B, seq] or None)."""
        rows, cls = [], []
        for _ in range(B):
            if self.order is None or self.pos >= self.n:
                self._shuffle()
            s = int(self.order[self.pos]) * self.seq
            self.pos += 1
            rows.append(np.asarray(self.data[s:s + self.seq + 1], dtype=np.int64))
            if self.weights is not None:
                cls.append(np.asarray(self.weights[s + 1:s + self.seq + 1], dtype=np.int64))
        c = torch.from_numpy(np.stack(cls)) if cls else None
        return torch.from_numpy(np.stack(rows)), c

    def first(self, k):
        k = min(k, self.n)
        return torch.from_numpy(np.stack([np.asarray(self.data[i * self.seq:i * self.seq + self.seq + 1],
                                                     dtype=np.int64) for i in range(k)]))


def sha256(path, limit=None):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while True:
            b = f.read(1 << 20)
            if not b:
                break
            h.update(b)
    return h.hexdigest()


def make_smoke_data(out_dir, vocab, n_train, n_val, seed):
    """Synthetic tokens for the smoke run: documents of repeated random phrases (learnable:
    copies within the window and n-grams), each starting with BOS = 0, ids in [3, vocab)."""
    rng = np.random.default_rng(seed)
    phrases = [rng.integers(3, vocab, size=rng.integers(3, 9)) for _ in range(64)]

    def doc_stream(n):
        out = []
        while len(out) < n:
            out.append(0)
            k = int(rng.integers(20, 200))
            while k > 0:
                p = phrases[int(rng.integers(0, len(phrases)))]
                out.extend(p.tolist())
                k -= len(p)
        return np.array(out[:n], dtype=np.uint16)

    os.makedirs(out_dir, exist_ok=True)
    doc_stream(n_train).tofile(os.path.join(out_dir, "train.bin"))
    doc_stream(n_val).tofile(os.path.join(out_dir, "val.bin"))
    return out_dir


# ---------------------------------------------------------------------------------------


def param_groups(model, wd):
    decay, no = [], []
    for n, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (decay if p.dim() >= 2 and "hc_" not in n.split(".")[-1] else no).append(p)
    return [{"params": decay, "weight_decay": wd}, {"params": no, "weight_decay": 0.0}]


@torch.no_grad()
def evaluate(model, windows, B, device, max_windows):
    model.eval()
    tot, cnt = 0.0, 0
    xs = windows.first(max_windows)
    for i in range(0, xs.shape[0], B):
        x = xs[i:i + B].to(device)
        lg = model(x[:, :-1])
        loss = F.cross_entropy(lg.reshape(-1, lg.shape[-1]).float(), x[:, 1:].reshape(-1), reduction="sum")
        tot += float(loss)
        cnt += x[:, 1:].numel()
    model.train()
    return tot / max(cnt, 1), cnt


def lr_at(progress, args):
    if progress < args.warmup_frac:
        return args.lr * max(progress / args.warmup_frac, 1e-3)
    p = (progress - args.warmup_frac) / max(1e-9, 1 - args.warmup_frac)
    p = min(max(p, 0.0), 1.0)
    return args.lr * (args.min_lr_frac + (1 - args.min_lr_frac) * 0.5 * (1 + math.cos(math.pi * p)))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default=os.path.join(HERE, "configs", "target.json"))
    ap.add_argument("--data-dir", default=os.path.join(HERE, "out", "data"))
    ap.add_argument("--tokenizer", default=os.path.join(HERE, "out", "tokenizer.json"))
    ap.add_argument("--cmap", default=None, help="Engram compressed token map (safetensors cmap, n_keys)")
    ap.add_argument("--dsx", default=None, help="dsx binary used to build the cmap (dsx engram-cmap)")
    ap.add_argument("--vocab-size", type=int, default=None, help="override (default: tokenizer size rounded to 32)")
    ap.add_argument("--out", default=os.path.join(HERE, "out", "target"))
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--max-minutes", type=float, default=None, help="stop (and finish the LR schedule) by then")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--min-lr-frac", type=float, default=0.1)
    ap.add_argument("--warmup-frac", type=float, default=0.03)
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--grad-clip", type=float, default=1.0)
    ap.add_argument("--index-coef", type=float, default=1.0)
    ap.add_argument("--aux-coef", type=float, default=1e-4)
    ap.add_argument("--bias-rate", type=float, default=1e-3)
    ap.add_argument("--dense-warmup-frac", type=float, default=0.0,
                    help="attend all visible compressed rows (no top-k) for this fraction of the run")
    ap.add_argument("--bf16", type=int, default=None, help="bf16 operands for the products (default: 1 on cuda)")
    ap.add_argument("--log-every", type=int, default=10)
    ap.add_argument("--save-minutes", type=float, default=3.0)
    ap.add_argument("--val-windows", type=int, default=64)
    ap.add_argument("--engine-dsx", default=None, help="dsx for the export check (default build-cpu/dsx if present)")
    ap.add_argument("--engine-windows", type=int, default=2)
    ap.add_argument("--engine-seq", type=int, default=512)
    ap.add_argument("--no-export", action="store_true")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--smoke", action="store_true", help="tiny config, synthetic data, CPU, < 1 minute")
    ap.add_argument("--init", default=None, help="start from this exported checkpoint dir (its config, its weights "
                    "and router biases; its mtp.* DSpark stages and their config keys are carried into the export "
                    "unchanged)")
    ap.add_argument("--train-file", default=None, help="token file to train on (default DATA_DIR/train.bin)")
    ap.add_argument("--token-classes", default=None, help="uint8 per token of the train file: the class of each "
                    "token (e.g. synth_finetune.py's 0 context, 1 assistant turn, 2 tool / parameter name)")
    ap.add_argument("--class-weights", default="1,1,1", help="loss weight of each token class (comma list)")
    ap.add_argument("--window", type=int, default=None, help="sliding_window of the trained model (default: the "
                    "config's, or the --init checkpoint's); the weights do not depend on it, so a fine-tune can "
                    "widen the window of an --init checkpoint")
    args = ap.parse_args(argv)

    if args.smoke:
        args.config = os.path.join(HERE, "configs", "smoke.json")
        args.device = "cpu"
        dflt = ap.parse_args([])
        keep = lambda name, v: v if getattr(args, name) == getattr(dflt, name) else getattr(args, name)  # noqa: E731
        args.steps = keep("steps", 6)
        args.batch = keep("batch", 2)
        args.seq = keep("seq", 64)
        args.vocab_size = args.vocab_size or 512
        args.val_windows = keep("val_windows", 4)
        args.log_every = keep("log_every", 1)
        if args.engine_windows == 2 and args.engine_seq == 512:
            args.engine_windows, args.engine_seq = 2, 96
        args.warmup_frac = 0.2
        if args.out == os.path.join(HERE, "out", "target"):
            args.out = os.path.join(HERE, "out", "target-smoke")
        if not os.path.exists(os.path.join(args.data_dir, "train.bin")) or args.data_dir == os.path.join(
                HERE, "out", "data"):
            args.data_dir = make_smoke_data(os.path.join(args.out, "smoke-data"), args.vocab_size, 20000, 4000,
                                            args.seed)
        if not os.path.exists(args.tokenizer) or args.tokenizer == os.path.join(HERE, "out", "tokenizer.json"):
            args.tokenizer = GOLDEN_TOK
            args.cmap = args.cmap or GOLDEN_CMAP
    if args.threads:
        torch.set_num_threads(args.threads)
    os.makedirs(args.out, exist_ok=True)
    t_start = time.time()
    dev = torch.device(args.device)
    bf16 = args.bf16 if args.bf16 is not None else (1 if dev.type == "cuda" else 0)
    M.set_matmul_bf16(bool(bf16))
    if dev.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False

    # the Engram token map
    cmap_path = args.cmap
    if cmap_path is None:
        dsx = args.dsx or os.path.join(REPO, "build-cpu", "dsx")
        cmap_path = os.path.join(args.out, "engram_cmap.safetensors")
        subprocess.run([dsx, "engram-cmap", "--tokenizer", args.tokenizer, "-o", cmap_path], check=True)
    cmap, n_keys = load_cmap(cmap_path)
    tok = tokenizer_facts(args.tokenizer)
    if args.init:
        with open(os.path.join(args.init, "config.json")) as f:
            cfgd = json.load(f)
        if cfgd["text_config"]["vocab_size"] < tok["len"]:
            raise ValueError("--init %s: vocab_size below the tokenizer size" % args.init)
    else:
        cfgd = build_config(args.config, tok, n_keys, args.vocab_size)
    if args.window is not None:
        if args.window < 1:
            raise ValueError("--window %d: must be at least 1" % args.window)
        cfgd["text_config"]["sliding_window"] = args.window
    cfg = M.Config(cfgd)

    torch.manual_seed(args.seed)
    np.random.seed(args.seed)
    model = M.V41Model(cfg, cmap=cmap)
    keep_tensors = None
    if args.init:  # the export is exact: these f32 weights re-quantize to the same bytes
        tensors = M.load_checkpoint_tensors(args.init)
        M.load_official(model, tensors)
        keep_tensors = init_extra_tensors(args.init)
        del tensors
    model = model.to(dev)
    model.train()
    n_params = sum(p.numel() for p in model.parameters())
    train_path = args.train_file or os.path.join(args.data_dir, "train.bin")
    train_w = Windows(train_path, args.seq, args.seed, args.token_classes)
    class_w = torch.tensor([float(v) for v in args.class_weights.split(",")], device=dev)
    if train_w.weights is not None and int(train_w.weights.max()) >= len(class_w):
        raise ValueError("--token-classes has class %d, --class-weights only %d values" % (
            int(train_w.weights.max()), len(class_w)))
    val_path = os.path.join(args.data_dir, "val.bin")
    val_w = Windows(val_path, args.seq, args.seed + 1) if os.path.exists(val_path) else None
    bad = int(np.max(train_w.data[: min(len(train_w.data), 10_000_000)]))
    if bad >= cfg.vocab_size:
        raise ValueError("token id %d in train.bin is outside vocab_size %d" % (bad, cfg.vocab_size))

    run = {"args": vars(args), "config": cfgd, "n_params": n_params, "torch": torch.__version__,
           "numpy": np.__version__, "device": str(dev),
           "device_name": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
           "bf16_products": bool(bf16), "cmap": {"path": cmap_path, "n_keys": n_keys, "sha256": sha256(cmap_path)},
           "init": {"dir": args.init, "sha256": sha256(os.path.join(args.init, "model.safetensors"))} if args.init else None,
           "data": {"train": {"path": train_path, "tokens": int(len(train_w.data)), "sha256": sha256(train_path),
                              "classes_sha256": sha256(args.token_classes) if args.token_classes else None},
                    "val": {"path": val_path, "tokens": int(len(val_w.data)) if val_w else 0,
                            "sha256": sha256(val_path) if val_w else None}},
           "tokenizer": {"path": args.tokenizer, "sha256": sha256(args.tokenizer), "len": tok["len"]}}
    with open(os.path.join(args.out, "run.json"), "w") as f:
        json.dump(run, f, indent=1)
    print("model: %.2fM parameters, vocab %d, %d layers, device %s, bf16 products %s" %
          (n_params / 1e6, cfg.vocab_size, cfg.n_layers, dev, bool(bf16)), flush=True)
    print("data: %d train tokens (%d windows of %d), batch %d -> %d tokens/step" %
          (len(train_w.data), train_w.n, args.seq, args.batch, args.batch * args.seq), flush=True)

    opt = torch.optim.AdamW(param_groups(model, args.weight_decay), lr=args.lr, betas=(0.9, 0.95), eps=1e-8)
    log = open(os.path.join(args.out, "log.jsonl"), "w")
    limit = args.max_minutes * 60 if args.max_minutes else None
    t0 = time.time()
    last_save = t0
    tokens = 0
    step = 0
    win_tok, win_t = 0, time.time()
    progress = 0.0
    while True:
        elapsed = time.time() - t0
        progress = step / args.steps
        if limit:
            progress = max(progress, elapsed / limit)
        if progress >= 1.0:
            break
        lr = lr_at(progress, args)
        for g in opt.param_groups:
            g["lr"] = lr
        model.sparse = progress >= args.dense_warmup_frac
        x, xc = train_w.batch_with_classes(args.batch)
        x = x.to(dev, non_blocking=True)
        try:
            logits = model(x[:, :-1])
            if xc is None:
                ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1))
            else:  # per-class weighted mean of the token losses
                w = class_w[xc.to(dev).reshape(-1)]
                ce = (F.cross_entropy(logits.reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1),
                                      reduction="none") * w).sum() / w.sum().clamp(min=1e-9)
            loss = ce + args.index_coef * model.index_loss + args.aux_coef * model.aux_loss
            opt.zero_grad(set_to_none=True)
            loss.backward()
        except RuntimeError as err:  # out of memory in the first steps: halve the batch, go on
            if "out of memory" not in str(err) or step > 2 or args.batch <= 1:
                raise
            logits = ce = loss = None
            opt.zero_grad(set_to_none=True)
            if dev.type == "cuda":
                torch.cuda.empty_cache()
            args.batch //= 2
            print(json.dumps({"out_of_memory": True, "batch_now": args.batch}), flush=True)
            continue
        gn = torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip) if args.grad_clip > 0 else None
        opt.step()
        model.update_router_bias(args.bias_rate)
        step += 1
        tokens += x[:, 1:].numel()
        win_tok += x[:, 1:].numel()
        if step % args.log_every == 0 or step == 1:
            if dev.type == "cuda":
                torch.cuda.synchronize()
            now = time.time()
            loads = [l.ffn.last_load for l in model.layers if l.ffn.last_load is not None]
            imb = max(float(ld.max() / ld.mean().clamp(min=1e-9)) for ld in loads) if loads else 0.0
            rec = {"step": step, "loss": round(float(ce), 4), "index_kl": round(float(model.index_loss), 4),
                   "aux": round(float(model.aux_loss), 4), "lr": lr, "grad_norm": float(gn) if gn is not None else None,
                   "max_expert_load_over_mean": round(imb, 3), "tokens": tokens,
                   "tok_per_s": round(win_tok / max(now - win_t, 1e-9)), "elapsed_s": round(now - t0, 1),
                   "sparse": model.sparse}
            if dev.type == "cuda":
                rec["gpu_mem_gb"] = round(torch.cuda.max_memory_allocated(dev) / 2 ** 30, 1)
            print(json.dumps(rec), flush=True)
            log.write(json.dumps(rec) + "\n")
            log.flush()
            win_tok, win_t = 0, now
        if time.time() - last_save > args.save_minutes * 60:
            save(model, cfgd, step, tokens, args.out)
            last_save = time.time()
    train_s = time.time() - t0
    save(model, cfgd, step, tokens, args.out)
    summary = {"steps": step, "tokens": tokens, "batch": args.batch, "seq": args.seq, "train_seconds": round(train_s, 1),
               "tokens_per_second": round(tokens / max(train_s, 1e-9)), "final_train_loss": float(ce)}
    if val_w is not None:
        vl, vn = evaluate(model, val_w, max(1, args.batch // 2), dev, args.val_windows)
        summary.update({"val_loss": vl, "val_ppl": math.exp(vl), "val_tokens": vn})
    print(json.dumps({"summary": summary}), flush=True)
    if not args.no_export:
        mdir = os.path.join(args.out, "model")
        model_cpu = model.to("cpu")
        M.set_matmul_bf16(False)
        EX.export(model_cpu, mdir, args.tokenizer, cmap=cmap, extra_tensors=keep_tensors,
                  metadata={"step": step, "tokens": tokens, "seed": args.seed,
                            **({"init": os.path.basename(os.path.normpath(args.init))} if args.init else {})})
        summary["export"] = mdir
        dsx = args.engine_dsx or os.path.join(REPO, "build-cpu", "dsx")
        if val_w is not None and os.path.exists(dsx) and args.engine_windows > 0:
            import check_engine as CE
            rep = CE.check(mdir, val_path, dsx=dsx, n_windows=args.engine_windows, seq=args.engine_seq,
                           threads=args.threads)
            with open(os.path.join(args.out, "engine_check.json"), "w") as f:
                json.dump(rep, f, indent=1)
            summary["engine_check"] = {k: rep[k] for k in ("max_row_rel_l2", "median_row_rel_l2", "rows_within_1e-3",
                                                          "rows", "leading_rows_per_window", "ppl_torch",
                                                          "ppl_engine", "ppl_rel_diff", "ok", "ok_leading_rule")}
    summary["wall_seconds"] = round(time.time() - t_start, 1)
    with open(os.path.join(args.out, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
    print(json.dumps({"done": summary}), flush=True)
    return summary


def init_extra_tensors(model_dir):
    """The --init checkpoint's tensors outside the backbone (mtp.*: the DSpark stages) as raw
    (dtype, shape, bytes) entries, so that the export carries them bit for bit."""
    out = {}
    for fn in st.checkpoint_files(model_dir):
        p = os.path.join(model_dir, fn)
        h = st.read_header(p)
        t, _ = st.read_safetensors(p)
        for name, v in t.items():
            if name.startswith("mtp."):
                out[name] = (h[name]["dtype"], list(h[name]["shape"]), st._tensor_bytes(v))
    return out


def save(model, cfgd, step, tokens, out):
    sd = {k: v.detach().cpu() for k, v in model.state_dict().items()}
    tmp = os.path.join(out, "target.pt.tmp")
    torch.save({"state_dict": sd, "config": cfgd, "step": step, "tokens": tokens}, tmp)
    os.replace(tmp, os.path.join(out, "target.pt"))


if __name__ == "__main__":
    main()
