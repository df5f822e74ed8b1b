"""Train the 3 DSpark draft stages on the FROZEN trained target (issue 24), then export.

The recipe is DeepSpec's (../shared/spec/dspark.md Appendix C, paper §3.3):
  * blocks at random anchor positions n of training sequences: row 0 = the anchor token x_n,
    rows 1..B-1 = the noise token, positions n .. n+B-1; the context is the target's taps of
    the positions max(0, n - W) .. n - 1 (every committed position, §5.1) and the block rows
    see each other bidirectionally (§5.4) -- exactly the inference computation of dspark.py;
  * the target, its embedding and its head are frozen (no gradient into the backbone);
  * draft logits of row j already include the Markov bias of the ground-truth previous token
    x_{n+j} (teacher forcing); the target distribution of row j is the target's softmax at
    position n + j (it predicts n + j + 1);
  * loss per row j, weighted by exp(-j / 4) (0-based j):
        0.1 * CE(draft logits, label) + 0.9 * L1(draft probs, target probs)
        + 1.0 * BCE(confidence logit, 1 - TV(draft, target))      (TV at temperature 1)
    label = the target's greedy token at n + j (--ce-label argmax, the default: acceptance is
    measured against the target's greedy chain at T = 0) or the data token x_{n+j+1}
    (--ce-label data). The confidence head reads [z ; e] detached (a probe: its loss does not
    move the drafter), as its target 1 - TV is a function of the drafter's own output.
  * training-mode fake quantization like the target: QA8 / fq8 with STE on activations,
    weights through the STE fake-quantizers of their storage (FP8 32x32 blocks, MXFP4
    experts, BF16), so the exported checkpoint computes what was trained; the router's
    selection bias is balanced without an aux loss (dspark.update_router_bias).

Targets:
  --target DIR       a checkpoint dir of the trained target (the official format train/export.py
                     writes); loaded with train/model.py, run in eval mode under no_grad:
                     model.forward(ids, want_taps=True) -> (logits, taps [B, T, n_taps, D]);
                     sequences from --data DIR/train.bin (uint16 token ids).
  --golden-case DIR  the golden DSpark case's target as a stand-in: its one 192-token prompt
                     with the golden's target logits and taps (no model run); for --smoke.

Outputs (--out, default train/out/dspark): settings.json, dspark.pt (master weights, config),
model/ (the target's checkpoint dir plus the stages: what dsx loads), summary.json (progress,
the teacher-forced validation figures, the export check; with --check the engine check).

Examples
  GPU:   python3 train/train_dspark.py --target train/out/target/model --data train/out/data \\
             --out train/out/dspark --device cuda --max-minutes 3
         python3 train/eval_dspark.py --model train/out/dspark/model \\
             --text train/out/data/heldout_code.txt --device cuda --prompts 64 --prompt-len 256 --gen-len 128
  smoke: /usr/bin/python3 train/train_dspark.py --smoke     (CPU, ~30 s: train, export, engine check)

Cost: a drafter step is ~8,400 tensor ops (forward + backward, independent of the batch:
launch-bound on a GPU), plus one no-grad forward of the target per step; the defaults (16
sequences x 1024 tokens, 256 blocks each) keep the GPU busy. The progress line's "block rows/s"
gives the speed; --max-minutes ends the loop (the LR schedule follows the clock).
"""
import argparse
import json
import math
import os
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, _HERE)

import dspark as DS  # noqa: E402
import st as ST  # noqa: E402

GOLDEN_CASE = os.path.join(os.environ.get("DSX_GOLDEN_DIR") or os.path.normpath(os.path.join(_HERE, "..", "..", "shared", "golden")), "deepseek_v41_dspark_tiny")

GOLDEN_ROOT = os.path.dirname(GOLDEN_CASE)
GOLDEN_TARGET = os.path.join(GOLDEN_ROOT, "deepseek_v41_tiny")  # a random V4.1 target (T's model runs it)
GOLDEN_CMAP = os.path.join(GOLDEN_ROOT, "tokenizer", "engram-cmap-v41.safetensors")

DEFAULT_TARGET = os.path.join(_HERE, "out", "target", "model")  # train_target.py's export
DEFAULT_DATA = os.path.join(_HERE, "out", "data")

NOISE_TOKEN_CONTENT = "<\uff5cSystem\uff5c>"  # the release's dspark_noise_token_id 128799 (spec §5.2)


def log(msg):
    print(msg, flush=True)


# ---------------------------------------------------------------------------------------
# targets

class GoldenTarget:
    """The golden DSpark case's target: one prompt with its prefill logits and taps."""

    def __init__(self, case, device):
        g, _ = ST.read_safetensors(os.path.join(case, "dspark_golden.safetensors"))
        self.dir = case
        self.config = DS.load_config(case)
        self.ids = g["input_ids"].long()[None].to(device)
        self.logits = g["target.logits_prefill"][None].to(device)
        self.taps = g["taps"][None].to(device)
        t = DS._read_model_tensors(case, lambda k: k in ("embed.weight", "head.weight"))
        self.embed = DS.dequant(t, "embed.weight", "bf16")
        self.head = DS.dequant(t, "head.weight", "bf16")
        self.seq_len = self.ids.shape[1]

    def batch(self, gen, bs, seq_len):
        return self.ids, self.logits, self.taps


def load_target_model(model_dir, device, tap_layers=None, cmap_file=None):
    """T's PyTorch target (train/model.py: V41Model.from_pretrained) loaded from a checkpoint
    dir, frozen, eval mode; its Engram map from cmap_file or the dir's engram_cmap.safetensors
    (what train/export.py writes); its taps those of tap_layers when given (else the config's
    dspark_target_layer_ids)."""
    import model as TM  # train/model.py (agent T)
    cmap = None
    for f in (cmap_file, os.path.join(model_dir, "engram_cmap.safetensors")):
        if f and os.path.exists(f):
            cmap = ST.read_safetensors(f)[0]["cmap"]
            break
    m = TM.V41Model.from_pretrained(model_dir, cmap=cmap, device=device)
    if tap_layers:
        m.cfg.dspark_target_layers = sorted(int(x) for x in tap_layers)
        for l, layer in enumerate(m.layers):
            layer.plan.tap = m.cfg.dspark_target_layers.index(l) if l in m.cfg.dspark_target_layers else -1
    m.eval()
    for p in m.parameters():
        p.requires_grad_(False)
    return m


class ModelTarget:
    """The trained target run on random windows of a token file."""

    def __init__(self, model_dir, data_file, device, tap_layers=None, cmap_file=None):
        self.dir = model_dir
        self.config = DS.load_config(model_dir)
        self.model = load_target_model(model_dir, device, tap_layers, cmap_file)
        self.device = device
        self.data = np.memmap(data_file, dtype=np.uint16, mode="r")
        t = DS._read_model_tensors(model_dir, lambda k: k in ("embed.weight", "head.weight"))
        self.embed = DS.dequant(t, "embed.weight", "bf16")
        self.head = DS.dequant(t, "head.weight", "bf16")

    def with_data(self, data_file):
        o = ModelTarget.__new__(ModelTarget)
        o.__dict__.update(self.__dict__)
        o.data = np.memmap(data_file, dtype=np.uint16, mode="r")
        return o

    def forward(self, ids):
        with torch.no_grad():
            logits, taps = self.model(ids, want_taps=True)
        B, T = ids.shape
        return logits.float(), taps.float().reshape(B, T, -1)

    def batch(self, gen, bs, seq_len):
        n = len(self.data) - seq_len - 1
        starts = torch.randint(0, n, (bs,), generator=gen).tolist()
        ids = np.stack([np.asarray(self.data[s:s + seq_len], dtype=np.int64) for s in starts])
        ids = torch.from_numpy(ids).to(self.device)
        logits, taps = self.forward(ids)
        return ids, logits, taps


def _have_target_model():
    try:
        import model as TM  # noqa: F401
        return hasattr(TM, "V41Model")
    except ImportError:
        return False


def make_random_data(out, cfg, seed, n=20000):
    """train.bin / val.bin of uniform random ids (the smoke test's data)."""
    d = os.path.join(out, "random-data")
    os.makedirs(d, exist_ok=True)
    V = int(DS.text_config(cfg)["vocab_size"])
    rng = np.random.default_rng(seed)
    for name in ("train.bin", "val.bin"):
        rng.integers(3, V - 2, size=n).astype(np.uint16).tofile(os.path.join(d, name))
    return d


def noise_token_id(tokenizer_json, vocab):
    """The id of the release's noise token content in a tokenizer.json, else vocab - 1."""
    try:
        with open(tokenizer_json) as f:
            tok = json.load(f)
        for a in tok.get("added_tokens", []):
            if a.get("content") == NOISE_TOKEN_CONTENT and a["id"] < vocab:
                return int(a["id"])
    except (OSError, ValueError):
        pass
    return vocab - 1


def drafter_text_config(target_cfg, args):
    """The target's text_config plus the stage keys (§2.1) for the drafter to be trained."""
    t = dict(DS.text_config(target_cfg))
    L = int(t["num_hidden_layers"])
    S = args.stages
    if t.get("dspark_target_layer_ids") and not args.tap_layers:
        taps = sorted(int(x) for x in t["dspark_target_layer_ids"])
    else:
        taps = [int(x) for x in args.tap_layers.split(",")] if args.tap_layers else [L - 3, L - 2, L - 1]
    noise = args.noise_token
    if noise is None:
        noise = int(t["dspark_noise_token_id"]) if t.get("dspark_noise_token_id", -1) not in (None, -1) else None
    if noise is None:
        noise = noise_token_id(os.path.join(args.target_dir, "tokenizer.json"), int(t["vocab_size"]))
    E = args.experts or int(t.get("dspark_n_routed_experts", 0) or 0) or int(t["n_routed_experts"])
    K = args.top_k or int(t.get("dspark_num_experts_per_tok", 0) or 0) or int(t["num_experts_per_tok"])
    R = args.markov_rank or int(t.get("dspark_markov_rank", 0) or 0) or 64
    t.update(DS.dspark_config_keys(L, t.get("compress_ratios", [0] * L), S, args.block_size, noise, taps, R, E, K))
    return t


# ---------------------------------------------------------------------------------------
# the loss

def sample_anchors(gen, bs, T, per_seq, B, device):
    """[bs, per_seq] distinct anchor positions n in [2, T - B] per sequence (row j = n + j
    needs the target's row n + j)."""
    hi = T - B  # inclusive
    k = min(per_seq, hi - 1)
    cols = [torch.randperm(hi - 1, generator=gen)[:k] + 2 for _ in range(bs)]
    return torch.stack(cols).to(device)


def position_weights(B, device, gamma=4.0):
    return torch.exp(-torch.arange(B, dtype=torch.float32, device=device) / gamma)


def dspark_loss(d, ids, logits, taps, n, ce_label="argmax", with_stats=True):
    """The DeepSpec loss of the blocks at anchors n [bs, K] of sequences ids [bs, T] with the
    target's logits [bs, T, V] and taps [bs, T, n_taps * D]. Returns (loss, stats)."""
    c = d.cfg
    bs, T = ids.shape
    B, W = c.block_size, c.window
    dev = ids.device
    pos = torch.arange(T, device=dev)
    u = d.fuse(taps.reshape(bs * T, -1))
    rows = d.ring_rows(u, pos.repeat(bs))  # list of [bs * T, hd]
    K = n.shape[1]
    b_idx = torch.arange(bs, device=dev)[:, None].expand(bs, K).reshape(-1)
    nf = n.reshape(-1)
    widx, mask = DS.window_index(nf, W, slot_order=False)
    flat = (b_idx[:, None] * T + widx.clamp(min=0))
    ctx = [r[flat] * mask[..., None] for r in rows]
    anchors = ids[b_idx, nf]
    out = d.block(ctx, mask, anchors, nf)
    rp = nf[:, None] + torch.arange(B, device=dev)[None, :]  # [A, B] positions n + j
    prev = ids[b_idx[:, None], rp]  # teacher forcing: x_{n+j}
    tl = logits[b_idx[:, None], rp]  # target row n + j predicts n + j + 1
    e, bias = d.markov_bias(prev)
    ml = out["base_logits"] + bias
    logq = F.log_softmax(ml, dim=-1)
    q = logq.exp()
    p = F.softmax(tl, dim=-1)
    if ce_label == "argmax":
        label = tl.argmax(-1)
    else:
        label = ids[b_idx[:, None], (rp + 1).clamp(max=T - 1)]
    ce = -logq.gather(-1, label[..., None])[..., 0]
    l1 = (q - p).abs().sum(-1)
    tv = 0.5 * l1.detach()
    conf = d.confidence_logit(out["z"].detach(), e.detach())
    bce = F.binary_cross_entropy_with_logits(conf, 1.0 - tv, reduction="none")
    w = position_weights(B, dev)
    per = 0.1 * ce + 0.9 * l1 + 1.0 * bce  # [A, B]
    loss = (per * w).sum(-1).mean() / w.sum()
    stats = {}
    if with_stats:
        with torch.no_grad():
            hit = (ml.argmax(-1) == tl.argmax(-1)).float()  # greedy draft == target greedy, teacher-forced
            surv = torch.cumprod(hit, dim=1)
            stats = {"loss": float(loss), "ce": float(ce.mean()), "l1": float(l1.mean()), "bce": float(bce.mean()),
                     "acc": [float(x) for x in hit.mean(0)],
                     "tf_tokens_per_cycle": float(1.0 + surv.sum(1).mean()),
                     "conf_mean": [float(x) for x in torch.sigmoid(conf).mean(0)],
                     "rows": int(hit.shape[0] * B)}
    return loss, stats


# ---------------------------------------------------------------------------------------

def lr_at(step, progress, base, warmup):
    """Linear warm-up over `warmup` steps, then cosine decay to 0.1 x base as progress (the
    larger of step / steps and elapsed / max-minutes) goes from 0 to 1."""
    if step < warmup:
        return base * (step + 1) / warmup
    return base * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


def build_drafter(target, args, device):
    t = drafter_text_config(target.config, args)
    cfg = DS.DSparkConfig(t)
    d = DS.DSparkDrafter(cfg)
    d.init_random(seed=args.seed)
    copied = []
    if args.init == "target":
        copied = DS.init_from_target(d, target.dir, seed=args.seed)
    elif args.init == "checkpoint":
        t_ = DS._read_model_tensors(target.dir, lambda k: k.startswith("mtp."))
        DS.load_state_from_tensors(d, t_)
        copied = sorted(t_)
    d.set_target_tables(target.embed, target.head)
    return d.to(device), t, copied


def evaluate(d, target, gen, args, batches, device):
    tot = {}
    d.eval()
    with torch.no_grad():
        for _ in range(batches):
            ids, logits, taps = target.batch(gen, args.batch, args.seq_len)
            n = sample_anchors(gen, ids.shape[0], ids.shape[1], args.anchors, d.cfg.block_size, device)
            _, s = dspark_loss(d, ids, logits, taps, n, args.ce_label)
            for k, v in s.items():
                if isinstance(v, list):
                    tot.setdefault(k, [0.0] * len(v))
                    tot[k] = [a + b / batches for a, b in zip(tot[k], v)]
                else:
                    tot[k] = tot.get(k, 0.0) + v / batches
    d.train()
    return tot


def engine_check(args, mdir, device):
    """The exported stages in the engine: eval_dspark on a few prompts with both drafters on
    the engine's taps (token agreement, logit error), the PyTorch target's taps against the
    engine's, and the engine's own speculative decoder."""
    import eval_dspark as EV
    dsx = args.dsx or EV.DSX
    if not os.path.exists(dsx):
        log("engine check skipped: no %s" % dsx)
        return None
    val = os.path.join(args.data, "val.bin") if args.data else None
    argv = ["--model", mdir, "--prompts", str(args.check_prompts), "--prompt-len", str(args.check_prompt_len),
            "--gen-len", str(args.check_gen_len), "--compare", "--engine-live", "--precise", "--device", str(device),
            "--dsx", dsx, "--target", "engine" if args.golden_case else "torch"]
    argv += ["--ids", val] if val and os.path.exists(val) else ["--random"]
    log("engine check: eval_dspark " + " ".join(argv))
    return EV.main(argv)


def fmt(v):
    return " ".join("%.3f" % x for x in v)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", dest="target_dir",
                    help="checkpoint dir of the trained target (default train/out/target/model when present)")
    ap.add_argument("--golden-case", help="train on the golden DSpark case's one prompt (stand-in target)")
    ap.add_argument("--data", help="dir with train.bin / val.bin (uint16 token ids; default train/out/data)")
    ap.add_argument("--cmap", help="Engram compressed token map (safetensors 'cmap'; default: the target dir's "
                                   "engram_cmap.safetensors)")
    ap.add_argument("--out", default=os.path.join(_HERE, "out", "dspark"))
    ap.add_argument("--steps", type=int, default=3000)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--max-minutes", type=float, default=3.0, help="safety stop of the training loop")
    ap.add_argument("--batch", type=int, default=16, help="sequences per step")
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--anchors", type=int, default=256, help="anchors (blocks) per sequence")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--warmup", type=int, default=50)
    ap.add_argument("--weight-decay", type=float, default=0.0)
    ap.add_argument("--clip", type=float, default=1.0)
    ap.add_argument("--bias-rate", type=float, default=1e-3, help="router bias balancing rate")
    ap.add_argument("--init", choices=["target", "random", "checkpoint"], default="target",
                    help="stages from the target's last layers, random, or the target dir's mtp.* tensors")
    ap.add_argument("--ce-label", choices=["argmax", "data"], default="argmax")
    ap.add_argument("--stages", type=int, default=3)
    ap.add_argument("--block-size", type=int, default=5)
    ap.add_argument("--markov-rank", type=int, default=0, help="0: the target config's or 64")
    ap.add_argument("--experts", type=int, default=0, help="stage routed experts (0: config or target's)")
    ap.add_argument("--top-k", type=int, default=0)
    ap.add_argument("--tap-layers", default="", help="comma list (default: the config's or the last 3 layers)")
    ap.add_argument("--noise-token", type=int, default=None)
    ap.add_argument("--log-every", type=int, default=25)
    ap.add_argument("--eval-batches", type=int, default=4)
    ap.add_argument("--no-fake-quant", action="store_true", help="train without the weight fake-quantizers")
    ap.add_argument("--no-tf32", action="store_true",
                    help="no TF32 products on CUDA (TF32 is exact for the quantized linears: QA8'd activations "
                         "and FP8 / FP4 weights have <= 4 significant bits)")
    ap.add_argument("--target-bf16", type=int, default=None,
                    help="the frozen target's products on bf16 operands (model.set_matmul_bf16; default 1 on cuda, "
                         "as the target was trained)")
    ap.add_argument("--no-export", action="store_true")
    ap.add_argument("--check", action="store_true", help="after the export: the engine check (eval_dspark --compare)")
    ap.add_argument("--check-prompts", type=int, default=4)
    ap.add_argument("--check-prompt-len", type=int, default=64)
    ap.add_argument("--check-gen-len", type=int, default=32)
    ap.add_argument("--dsx", default=None, help="the dsx binary of the engine check (default build-cpu/dsx)")
    ap.add_argument("--smoke", action="store_true", help="seconds on the CPU: every code path on the golden case")
    args = ap.parse_args(argv)

    if args.smoke:
        if not args.target_dir and not args.golden_case:
            if _have_target_model():
                args.target_dir = GOLDEN_TARGET
                args.cmap = args.cmap or GOLDEN_CMAP
            else:
                args.golden_case = GOLDEN_CASE
        args.device = "cpu"
        args.batch = min(args.batch, 1)
        args.seq_len = min(args.seq_len, 80)
        args.check = True
        args.check_prompts, args.check_prompt_len, args.check_gen_len = 2, 24, 12
        args.steps = min(args.steps, 4)
        args.anchors = min(args.anchors, 24)
        args.log_every = 2
        args.warmup = 2
        args.eval_batches = 1
        if args.out == os.path.join(_HERE, "out", "dspark"):
            args.out = os.path.join(_HERE, "out", "dspark-smoke")
    if not args.smoke and not args.target_dir and not args.golden_case and os.path.isdir(DEFAULT_TARGET):
        args.target_dir = DEFAULT_TARGET
    if not args.smoke and args.target_dir and not args.golden_case and not args.data and os.path.isdir(DEFAULT_DATA):
        args.data = DEFAULT_DATA
    if not args.target_dir and not args.golden_case:
        ap.error("--target DIR (and --data DIR) or --golden-case DIR / --smoke")

    torch.manual_seed(args.seed)
    device = torch.device(args.device)
    if device.type == "cuda" and not args.no_tf32:
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    if device.type == "cpu":
        torch.set_num_threads(max(1, min(2, torch.get_num_threads())))
    gen = torch.Generator().manual_seed(args.seed)

    if args.golden_case:
        target = GoldenTarget(args.golden_case, device)
        args.target_dir = args.golden_case
        args.batch, args.seq_len = 1, target.seq_len
        val_target = target
    else:
        if args.smoke and not args.data:
            args.data = make_random_data(args.out, DS.load_config(args.target_dir), args.seed)
        if not args.data:
            ap.error("--data DIR is required with --target")
        taps = drafter_text_config(DS.load_config(args.target_dir), args)["dspark_target_layer_ids"]
        if args.target_bf16 is None:
            args.target_bf16 = int(device.type == "cuda")
        if args.target_bf16:
            import model as TM
            TM.set_matmul_bf16(True)
        target = ModelTarget(args.target_dir, os.path.join(args.data, "train.bin"), device, taps, args.cmap)
        val_file = os.path.join(args.data, "val.bin")
        val_target = target.with_data(val_file) if os.path.exists(val_file) else target

    d, tcfg, copied = build_drafter(target, args, device)
    d.fake_quant_weights = not args.no_fake_quant
    d.train()
    c = d.cfg
    n_params = sum(p.numel() for p in d.parameters())
    log("dspark: %d stages, block %d, window %d, taps %s, noise %d, markov rank %d, experts %d top-%d, "
        "%.2fM parameters, init %s (%d tensors from the target)" % (
            c.n_stages, c.block_size, c.window, c.target_layers, c.noise_id, c.markov_rank, c.n_experts, c.top_k,
            n_params / 1e6, args.init, len(copied)))
    log("train: device %s, batch %d x %d tokens, %d anchors / sequence, steps %d, max %.1f min, lr %g, seed %d" % (
        device, args.batch, args.seq_len, args.anchors, args.steps, args.max_minutes, args.lr, args.seed))

    # the target's taps must be those of the configured layers
    ids0, logits0, taps0 = target.batch(gen, 1, min(args.seq_len, 64) if not args.golden_case else args.seq_len)
    if taps0.shape[-1] != c.n_taps * c.hidden:
        raise SystemExit("target taps are %d wide, the drafter expects %d (%d layers %s)" % (
            taps0.shape[-1], c.n_taps * c.hidden, c.n_taps, c.target_layers))

    opt = torch.optim.AdamW(d.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=args.weight_decay)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "settings.json"), "w") as f:
        json.dump({"args": vars(args), "dspark_config": {k: tcfg[k] for k in tcfg if k.startswith("dspark")},
                   "torch": torch.__version__}, f, indent=1)
    t0 = time.time()
    step = 0
    rows_seen = 0
    hist = []
    while step < args.steps:
        if (time.time() - t0) / 60.0 > args.max_minutes:
            log("max-minutes reached at step %d" % step)
            break
        ids, logits, taps = target.batch(gen, args.batch, args.seq_len)
        n = sample_anchors(gen, ids.shape[0], ids.shape[1], args.anchors, c.block_size, device)
        progress = max(step / max(1, args.steps), (time.time() - t0) / 60.0 / max(args.max_minutes, 1e-9))
        for gp in opt.param_groups:
            gp["lr"] = lr_at(step, progress, args.lr, args.warmup)
        loss, s = dspark_loss(d, ids, logits, taps, n, args.ce_label, with_stats=(step % args.log_every == 0))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if args.clip > 0:
            torch.nn.utils.clip_grad_norm_(d.parameters(), args.clip)
        opt.step()
        DS.update_router_bias(d, args.bias_rate)
        rows_seen += n.numel() * c.block_size
        if s:
            el = time.time() - t0
            hist.append(dict(step=step, elapsed=el, **s))
            log("step %d/%d loss %.4f (ce %.3f l1 %.3f bce %.3f) acc %s tf-tokens/cycle %.3f conf %s "
                "| %.0f block rows/s, %.0fs" % (step, args.steps, s["loss"], s["ce"], s["l1"], s["bce"], fmt(s["acc"]),
                                                s["tf_tokens_per_cycle"], fmt(s["conf_mean"]), rows_seen / max(el, 1e-9),
                                                el))
        step += 1
    train_s = time.time() - t0
    ev = evaluate(d, val_target, torch.Generator().manual_seed(args.seed + 1), args, args.eval_batches, device)
    log("val (teacher-forced): loss %.4f acc %s tokens/cycle %.3f conf %s" % (
        ev["loss"], fmt(ev["acc"]), ev["tf_tokens_per_cycle"], fmt(ev["conf_mean"])))
    ckpt = os.path.join(args.out, "dspark.pt")
    torch.save({"state": {k: v.detach().cpu() for k, v in d.state_dict().items()}, "text_config": tcfg,
                "args": vars(args), "steps": step}, ckpt)
    summary = {"steps": step, "train_seconds": train_s, "val": ev, "history": hist, "checkpoint": ckpt}
    if not args.no_export:
        mdir = os.path.join(args.out, "model")
        d.eval()
        DS.write_model_with_stages(args.target_dir, mdir, d, cmap_file=args.cmap)
        # the export is what was trained: re-load and compare one batch's forward
        d2 = DS.load_drafter(mdir, device=device)
        with torch.no_grad():
            ids, logits, taps = val_target.batch(torch.Generator().manual_seed(7), 1, args.seq_len)
            n = sample_anchors(torch.Generator().manual_seed(7), 1, ids.shape[1], 8, c.block_size, device)
            la, _ = dspark_loss(d, ids, logits, taps, n, args.ce_label)
            lb, _ = dspark_loss(d2, ids, logits, taps, n, args.ce_label)
            la2, _ = dspark_loss(d, ids, logits, taps, n, args.ce_label)
        summary["export"] = {"dir": mdir, "loss_trained": float(la), "loss_exported": float(lb),
                             "loss_trained_repeat": float(la2)}
        log("exported %s: loss %.6f trained (fake-quantized) vs %.6f re-loaded (%s)" % (
            mdir, float(la), float(lb), "equal" if float(la) == float(lb) else
            "DIFFERENT; the trained forward repeated: %.6f" % float(la2)))
        if args.check:
            summary["check"] = engine_check(args, mdir, device)
    with open(os.path.join(args.out, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
    log("done: %d steps in %.1fs; %s" % (step, train_s, args.out))
    return summary


if __name__ == "__main__":
    main()
