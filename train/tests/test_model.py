"""Tests of the PyTorch V4.1 model, its quantizers and its export (issue 24, part T).

    /usr/bin/python3 -m unittest discover -s train/tests        (from the repo root)

Skips cleanly without torch, without the goldens, or without build-cpu/dsx.
"""
import json
import os
import shutil
import sys
import tempfile
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
TRAIN = os.path.dirname(HERE)
REPO = os.path.dirname(TRAIN)
sys.path.insert(0, TRAIN)

try:
    import numpy as np
    import torch
    HAVE_TORCH = True
except ImportError:  # pragma: no cover
    HAVE_TORCH = False

_GOLDEN_ROOT = os.environ.get("DSX_GOLDEN_DIR") or os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "..", "shared", "golden"))  # DSX_GOLDEN_DIR or ../shared/golden beside the repo
GOLDEN = os.path.join(_GOLDEN_ROOT, "deepseek_v41_tiny")
GOLDEN_DSPARK = os.path.join(_GOLDEN_ROOT, "deepseek_v41_dspark_tiny")
GOLDEN_TOK = os.path.join(_GOLDEN_ROOT, "tokenizer/tokenizer-v41.json")
GOLDEN_CMAP = os.path.join(_GOLDEN_ROOT, "tokenizer/engram-cmap-v41.safetensors")
DSX = os.environ.get("DSX", os.path.join(REPO, "build-cpu", "dsx"))
HAVE_GOLDEN = os.path.exists(os.path.join(GOLDEN, "golden.safetensors"))

if HAVE_TORCH:
    torch.set_num_threads(1)
    import check_golden as CG
    import export as EX
    import model as M
    import quant as Q
    import st


def smoke_config(vocab=512):
    import train_target as TT
    tok = {"len": vocab, "added": {}}
    c = TT.build_config(os.path.join(TRAIN, "configs", "smoke.json"), tok, 99092, vocab)
    return M.Config(c)


# ---------------------------------------------------------------------------------------
# an independent scalar reference of the two minifloat grids (float64, brute force)

def _grid(kind):
    vals = []
    if kind == "e4m3":
        for b in range(128):
            e, m = (b >> 3) & 15, b & 7
            if b == 0x7F:
                continue
            vals.append((m * 2.0 ** -9 if e == 0 else (1 + m / 8.0) * 2.0 ** (e - 7), b))
    else:
        for c, v in enumerate([0, 0.5, 1, 1.5, 2, 3, 4, 6]):
            vals.append((float(v), c))
    return vals


def _ref_round(x, kind):
    """nearest grid value, ties to the even code (float64 arithmetic)."""
    grid = _grid(kind)
    a = abs(x)
    best = min(grid, key=lambda vc: (abs(vc[0] - a), vc[1] & 1))
    return np.copysign(best[0], x)


def _ref_pow2ceil(v):
    e = np.ceil(np.log2(np.float64(v)))
    # exact check instead of trusting log2 near powers of two
    p = 2.0 ** e
    if p / 2 >= v:
        p /= 2
    if p < v:
        p *= 2
    return p


@unittest.skipUnless(HAVE_TORCH, "torch missing")
class TestQuantIndependent(unittest.TestCase):
    def test_minifloat_rounding(self):
        rng = np.random.default_rng(5)
        grid8 = np.array([v for v, _ in _grid("e4m3")])
        mids = (grid8[1:] + grid8[:-1]) / 2  # exact ties
        xs = np.concatenate([rng.uniform(-448, 448, 3000), rng.uniform(-0.03, 0.03, 2000), mids, -mids,
                             grid8, 2.0 ** -np.arange(6, 12)]).astype(np.float32)
        got = Q.e4m3_rne(torch.from_numpy(xs)).numpy()
        want = np.array([_ref_round(float(x), "e4m3") for x in xs], dtype=np.float32)
        np.testing.assert_array_equal(got, want)
        xs = np.concatenate([rng.uniform(-6, 6, 3000), np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])]) \
            .astype(np.float32)
        xs = np.concatenate([xs, -xs])
        got = Q.e2m1_rne(torch.from_numpy(xs)).numpy()
        want = np.array([_ref_round(float(x), "e2m1") for x in xs], dtype=np.float32)
        np.testing.assert_array_equal(got, want)

    def test_qa8_and_cache_quantizers(self):
        rng = np.random.default_rng(7)
        rows = [rng.normal(0, 1, 64), rng.normal(0, 1e-6, 64), np.zeros(64), rng.normal(0, 3e4, 64),
                np.array([448.0 * 2.0 ** -7] + [0.1] * 63)]  # amax/448 exactly a power of two
        x = np.stack(rows).astype(np.float32)
        for fn, block, lo, div, kind, scale_kind in ((Q.qa8, 32, 1e-4, 448.0, "e4m3", "p2"),
                                                     (Q.fq4_e8, 32, 6 * 2.0 ** -126, 6.0, "e2m1", "p2"),
                                                     (Q.fq4_e4, 16, 6 * 2.0 ** -9, 6.0, "e2m1", "e4m3")):
            got = fn(torch.from_numpy(x), block).numpy()
            want = np.zeros_like(x)
            for r in range(x.shape[0]):
                for b0 in range(0, x.shape[1], block):
                    blk = x[r, b0:b0 + block].astype(np.float64)
                    a = max(np.abs(blk).max(), lo)
                    if scale_kind == "p2":
                        s = _ref_pow2ceil(np.float32(a) * np.float32(1.0 / div))
                    else:
                        s = _ref_round(float(np.float32(np.float32(a) / np.float32(div))), "e4m3")
                    vmax = 448.0 if kind == "e4m3" else 6.0
                    for i, v in enumerate(blk):
                        q = float(np.float32(np.float32(v) / np.float32(s)))
                        want[r, b0 + i] = _ref_round(min(max(q, -vmax), vmax), kind) * s
            np.testing.assert_array_equal(got, want, err_msg=fn.__name__)

    def test_ste_gradient_is_identity(self):
        x = torch.randn(4, 64, requires_grad=True)
        (Q.qa8_ste(x) * torch.arange(64.0)).sum().backward()
        self.assertTrue(torch.equal(x.grad, torch.arange(64.0).expand(4, 64)))


@unittest.skipUnless(HAVE_TORCH and HAVE_GOLDEN, "torch or goldens missing")
class TestQuantGoldenBytes(unittest.TestCase):
    def test_reencode_golden_tensors(self):
        """dequantize every FP8 / MXFP4 / Engram-table tensor of the golden checkpoint and
        re-encode it with the stored scales: the bytes must come back; the project's own
        scale rule must reproduce the same values (fake-quant is idempotent on them)."""
        p = os.path.join(GOLDEN, "model.safetensors")
        t, _ = st.read_safetensors(p)
        h = st.read_header(p)
        n = {"fp8": 0, "fp4": 0, "rows": 0}
        for k, v in t.items():
            if not k.endswith(".weight"):
                continue
            dt, sk = h[k]["dtype"], k[:-7] + ".scale"
            if dt == "F8_E4M3" and ".engram.embed." in k:
                w = Q.e8m0_rows_dequantize(v, t[sk])
                c, s = Q.e8m0_rows_quantize(w, scale_bytes=t[sk])
                fake, kind = Q.e8m0_rows_fake(w), "rows"
            elif dt == "F8_E4M3":
                w = Q.fp8_block_dequantize(v, t[sk])
                c, s = Q.fp8_block_quantize(w, scale_bytes=t[sk])
                fake, kind = Q.fp8_block_fake(w), "fp8"
            elif dt == "I8":
                w = Q.mxfp4_dequantize(v, t[sk])
                c, s = Q.mxfp4_quantize(w, scale_bytes=t[sk])
                fake, kind = Q.mxfp4_fake(w), "fp4"
            else:
                continue
            self.assertTrue(torch.equal(c, v), k)
            self.assertTrue(torch.equal(s, t[sk]), k)
            self.assertTrue(torch.equal(fake, w), k)
            n[kind] += 1
        self.assertEqual(n, {"fp8": 78, "fp4": 432, "rows": 2})

    def test_own_scale_rule_roundtrip(self):
        torch.manual_seed(0)
        w = torch.randn(64, 96) * torch.logspace(-3, 1, 96)
        c, s = Q.fp8_block_quantize(w)
        self.assertTrue(torch.equal(Q.fp8_block_dequantize(c, s), Q.fp8_block_fake(w)))
        p, s4 = Q.mxfp4_quantize(w)
        self.assertTrue(torch.equal(Q.mxfp4_dequantize(p, s4), Q.mxfp4_fake(w)))
        f = Q.mxfp4_fake(w)
        self.assertTrue(torch.equal(Q.mxfp4_fake(f), f))
        self.assertTrue(torch.equal(Q.fp8_block_fake(Q.fp8_block_fake(w)), Q.fp8_block_fake(w)))


@unittest.skipUnless(HAVE_TORCH and HAVE_GOLDEN, "torch or goldens missing")
class TestGolden(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.rep = CG.check_case(GOLDEN, GOLDEN_CMAP, GOLDEN_DSPARK)

    def test_prefill_and_incremental_rows(self):
        r = self.rep
        # leading-rows rule of the golden README §6 / `dsx golden`: rows within 1e-3 up to
        # the first QA8 rounding flip, at least 35 % (and T0 + 8 for the incremental rows)
        self.assertTrue(r["prefill"]["ok"], r["prefill"])
        self.assertTrue(r["incremental"]["ok"], r["incremental"])
        # the engine's CPU f32 path reaches 107 leading rows on this case; so must this model
        self.assertGreaterEqual(r["prefill"]["leading"], 107)
        self.assertTrue(r["engram_ids_equal"])
        self.assertTrue(r["engram_token_map_equal"])

    def test_decisions(self):
        same, tot = map(int, self.rep["decisions_equal_all_rows"].split("/"))
        self.assertGreater(tot, 0)
        self.assertGreaterEqual(same / tot, 0.99)

    def test_taps(self):
        if "taps" not in self.rep:
            self.skipTest("no DSpark golden taps")
        t = self.rep["taps"]
        self.assertEqual(t["shape"][2], 3)
        self.assertGreaterEqual(t["leading_within_1e-5"], self.rep["prefill"]["leading"])


@unittest.skipUnless(HAVE_TORCH, "torch missing")
class TestModelProperties(unittest.TestCase):
    def setUp(self):
        torch.manual_seed(3)
        self.cfg = smoke_config()
        self.m = M.V41Model(self.cfg).eval()

    def test_causal_and_batched(self):
        V = self.cfg.vocab_size
        g = torch.Generator().manual_seed(1)
        ids = torch.randint(3, V, (2, 80), generator=g)
        with torch.no_grad():
            a = self.m(ids)
            b = ids.clone()
            b[:, 50:] = torch.randint(3, V, (2, 30), generator=g)
            lb = self.m(b)
            single = self.m(ids[1:2])
        self.assertTrue(torch.allclose(a[:, :50], lb[:, :50], rtol=0, atol=1e-5))
        self.assertFalse(torch.allclose(a[:, 50:], lb[:, 50:]))
        self.assertTrue(torch.allclose(a[1:2], single, rtol=0, atol=1e-5))

    def test_blocked_window_attention_matches_dense(self):
        """the chunked window + selection attention equals a plain masked softmax."""
        g = torch.Generator().manual_seed(2)
        B, T, H, d, W, Tc, k = 2, 37, 3, 32, 8, 18, 5
        q = torch.randn(B, T, H, d, generator=g)
        kv = torch.randn(B, T, d, generator=g)
        comp = torch.randn(B, Tc, d, generator=g)
        sink = torch.randn(H, generator=g)
        idx = torch.randint(0, Tc, (B, T, k), generator=g)
        valid = torch.rand(B, T, k, generator=g) > 0.3
        o = M.window_sparse_attention(q, kv, sink, W, comp, idx, valid)
        t = torch.arange(T)
        wm = (t[None, :] <= t[:, None]) & (t[None, :] > t[:, None] - W)
        sel = comp[torch.arange(B)[:, None, None], idx]
        ref = M.sink_attention(q, sink, kv, wm[None].expand(B, T, T), sel, valid)
        self.assertTrue(torch.allclose(o, ref, atol=1e-5))
        dm = torch.rand(B, T, Tc, generator=g) > 0.5
        o2 = M.window_sparse_attention(q, kv, sink, W, comp, dense_mask=dm)
        ref2 = M.sink_attention(q, sink, kv, wm[None].expand(B, T, T),
                                comp[:, None].expand(B, T, Tc, d), dm)
        self.assertTrue(torch.allclose(o2, ref2, atol=1e-5))

    def test_taps_definition(self):
        ids = torch.randint(3, self.cfg.vocab_size, (1, 40))
        hooks = {}
        targets = self.cfg.dspark_target_layers
        for l in targets:
            def pre_hook(mod, inp, l=l):
                hooks[l] = inp[0].mean(2)
            self.m.layers[l].register_forward_pre_hook(pre_hook)
        with torch.no_grad():
            _, taps = self.m(ids, want_taps=True)
        self.assertEqual(list(taps.shape), [1, 40, len(targets), self.cfg.hidden])
        for i, l in enumerate(targets):
            self.assertTrue(torch.equal(taps[:, :, i], hooks[l]))

    def test_training_step(self):
        """a training forward/backward: the indexer gets gradients only from the
        distillation loss, the backbone only from the LM loss."""
        m = self.m.train()
        ids = torch.randint(3, self.cfg.vocab_size, (2, 48))
        lg = m(ids[:, :-1])
        ce = torch.nn.functional.cross_entropy(lg.reshape(-1, lg.shape[-1]), ids[:, 1:].reshape(-1))
        self.assertGreater(float(m.index_loss), 0.0)
        ce.backward(retain_graph=True)
        idx_params = [n for n, _ in m.named_parameters() if ".indexer." in n]
        self.assertTrue(idx_params)
        for n, p in m.named_parameters():
            if ".indexer." in n:
                self.assertTrue(p.grad is None or float(p.grad.abs().sum()) == 0.0, n)
        m.zero_grad()
        m.index_loss.backward()
        got = [n for n, p in m.named_parameters() if p.grad is not None and float(p.grad.abs().sum()) > 0]
        self.assertTrue(all(".indexer." in n for n in got), got)
        self.assertTrue(any(".indexer.wk." in n for n in got))
        m.update_router_bias(1e-3)
        self.assertGreater(float(m.layers[0].ffn.gate.bias.abs().sum()), 0.0)


@unittest.skipUnless(HAVE_TORCH and HAVE_GOLDEN, "torch or goldens missing")
class TestExport(unittest.TestCase):
    def test_golden_roundtrip(self):
        """load the golden checkpoint, export it, load the export: every parameter equal,
        the same tensor names / dtypes / shapes and config keys as the release layout."""
        cm = st.read_safetensors(GOLDEN_CMAP)[0]["cmap"]
        m = M.V41Model.from_pretrained(GOLDEN, cmap=cm)
        d = tempfile.mkdtemp()
        try:
            EX.export(m, d, os.path.join(GOLDEN, "tokenizer.json"))
            m2 = M.V41Model.from_pretrained(d)
            p1, p2 = dict(m.state_dict()), dict(m2.state_dict())
            self.assertEqual(sorted(p1), sorted(p2))
            for k in p1:
                self.assertTrue(torch.equal(p1[k], p2[k]), k)
            h1 = st.read_header(os.path.join(GOLDEN, "model.safetensors"))
            h2 = st.read_header(os.path.join(d, "model.safetensors"))
            h1.pop("__metadata__", None)
            h2.pop("__metadata__", None)
            self.assertEqual({k: (v["dtype"], v["shape"]) for k, v in h1.items()},
                             {k: (v["dtype"], v["shape"]) for k, v in h2.items()})
            with open(os.path.join(GOLDEN, "config.json")) as f:
                c1 = json.load(f)
            with open(os.path.join(d, "config.json")) as f:
                c2 = json.load(f)
            self.assertEqual(c1, c2)
        finally:
            shutil.rmtree(d)

    @unittest.skipUnless(os.path.exists(DSX), "build-cpu/dsx missing")
    def test_export_engine_agreement(self):
        """a random small model (the golden tiny's random weights) and a briefly trained one
        (three training steps from it): exported by export.py, loaded back in PyTorch and
        run by the engine (prefill, and the decode path from row 100).

        Random tiny models are chaotic: between two f32 implementations one QA8 rounding
        (or top-k / routing near-tie) eventually flips and the following rows diverge
        (golden README §6; the golden prompt itself flips at row 107 between any two of
        the reference, the engine and this model). So the rule here is float-noise agreement
        up to the first flip: the leading rows within 1e-3 must number at least 32 (the
        window of 16 has wrapped, top-k selects 8 of more rows, candidate blocks restrict
        the re-index layer) and agree to float noise (<= 1e-5). An export or engine bug
        shows from the first rows on. The issue's bar (every row <= 1e-3, perplexity
        within 0.5 %) is what check_engine reports for the trained model."""
        import check_engine as CE
        cm = st.read_safetensors(GOLDEN_CMAP)[0]["cmap"]
        m = M.V41Model.from_pretrained(GOLDEN, cmap=cm)
        toks = np.random.default_rng(4).integers(3, m.cfg.vocab_size, 200)
        d = tempfile.mkdtemp()

        def agree(rep):
            return rep["leading_rows_per_window"][0] >= 32 and rep["max_rel_l2_leading"] <= 1e-5

        try:
            EX.export(m, d, GOLDEN_TOK)
            for dec in (None, 100):
                rep = CE.check(d, toks, dsx=DSX, n_windows=1, seq=192, threads=1, decode_from=dec)
                self.assertTrue(agree(rep), rep)
            torch.manual_seed(0)
            opt = torch.optim.AdamW(m.parameters(), lr=1e-4)
            m.train()
            for _ in range(3):
                x = torch.as_tensor(toks[None, :129])
                lg = m(x[:, :-1])
                loss = torch.nn.functional.cross_entropy(lg[0], x[0, 1:]) + m.index_loss
                opt.zero_grad()
                loss.backward()
                opt.step()
                m.update_router_bias(1e-3)
            m.eval()
            EX.export(m, d, GOLDEN_TOK)
            # what was trained is what was exported: the reloaded checkpoint computes the
            # same logits bit for bit
            x = torch.as_tensor(toks[None, :192])
            with torch.no_grad():
                self.assertTrue(torch.equal(m(x), M.V41Model.from_pretrained(d).eval()(x)))
            rep2 = CE.check(d, toks, dsx=DSX, n_windows=1, seq=192, threads=1)
            # the trained weights are chaotic again (first flip at row 22): float noise up to
            # the flip, at least the first 16 rows (window wrap, top-k selection)
            self.assertGreaterEqual(rep2["leading_rows_per_window"][0], 16, rep2)
            self.assertLessEqual(rep2["max_rel_l2_leading"], 1e-5, rep2)
            self.assertNotEqual(rep["nll_torch"], rep2["nll_torch"])
        finally:
            shutil.rmtree(d)

if __name__ == "__main__":
    unittest.main()
