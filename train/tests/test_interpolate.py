"""train/interpolate.py on the golden DSpark case's checkpoint (backbone + mtp.* stages):
alpha 0 and 1 give back each checkpoint's values, alpha 0.5 of A and A/2 gives 0.75 A as
each storage format rounds it (computed here with the fake quantizers, not through the
script's quantize / dequantize path), and mismatched checkpoints are refused.

    /usr/bin/python3 -m unittest train.tests.test_interpolate   (or discover -s train/tests)
"""
import json
import os
import shutil
import sys
import tempfile
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
TRAIN = os.path.dirname(HERE)
sys.path.insert(0, TRAIN)

try:
    import torch
    HAVE_TORCH = True
except ImportError:  # pragma: no cover
    HAVE_TORCH = False

_GOLDEN_ROOT = os.environ.get("DSX_GOLDEN_DIR") or os.path.normpath(os.path.join(TRAIN, "..", "..", "shared", "golden"))
CASE = os.path.join(_GOLDEN_ROOT, "deepseek_v41_dspark_tiny")
HAVE_CASE = os.path.exists(os.path.join(CASE, "model.safetensors"))

if HAVE_TORCH:
    torch.set_num_threads(1)
    import interpolate as I
    import model as M
    import quant as Q
    import st as ST


def _halved(a_dir, out_dir):
    """A copy of a_dir whose every weight is half A's (exact in every format: the scales halve)."""
    os.makedirs(out_dir)
    for f in os.listdir(a_dir):
        if f != "model.safetensors":
            shutil.copyfile(os.path.join(a_dir, f), os.path.join(out_dir, f))
    hdr = ST.read_header(os.path.join(a_dir, "model.safetensors"))
    raw, _ = ST.read_safetensors(os.path.join(a_dir, "model.safetensors"))
    vals = M.load_checkpoint_tensors(a_dir)
    out = {}
    for name, v in vals.items():
        dt = hdr[name]["dtype"]
        w = v * 0.5
        if dt in ("BF16", "F32"):
            out[name] = w.to(torch.bfloat16) if dt == "BF16" else w
            continue
        sname = name[:-len(".weight")] + ".scale"
        if dt == "I8":
            c, s = Q.mxfp4_quantize(w)
        elif ".engram.embed." in name:
            c, s = Q.e8m0_rows_quantize(w, w.shape[1] // raw[sname].shape[1])
        else:
            c, s = Q.fp8_block_quantize(w, 32)
        out[name] = (dt, list(c.shape), c.numpy().tobytes())
        out[sname] = ("F8_E8M0", list(s.shape), s.numpy().tobytes())
    ST.write_safetensors(os.path.join(out_dir, "model.safetensors"), out, {"format": "pt"})


def _fake(name, dtype, w, scale_cols):
    """w rounded as its storage format stores it (the fake quantizers)."""
    if dtype == "F32":
        return w
    if dtype == "BF16":
        return w.to(torch.bfloat16).float()
    if dtype == "I8":
        return Q.mxfp4_fake(w)
    if ".engram.embed." in name:
        return Q.e8m0_rows_fake(w, w.shape[1] // scale_cols)
    return Q.fp8_block_fake(w, 32)


@unittest.skipUnless(HAVE_TORCH and HAVE_CASE, "torch or the golden DSpark case missing")
class InterpolateTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.mkdtemp(prefix="dsx-interp-")
        cls.a = CASE
        cls.b = os.path.join(cls.tmp, "half")
        _halved(cls.a, cls.b)
        cls.va = M.load_checkpoint_tensors(cls.a)
        cls.vb = M.load_checkpoint_tensors(cls.b)
        cls.hdr = ST.read_header(os.path.join(cls.a, "model.safetensors"))

    @classmethod
    def tearDownClass(cls):
        shutil.rmtree(cls.tmp, ignore_errors=True)

    def _run(self, alpha, name):
        out = os.path.join(self.tmp, name)
        I.interpolate(self.a, self.b, alpha, out)
        return out, M.load_checkpoint_tensors(out)

    def test_inventory_has_stages_and_every_format(self):
        dts = {v["dtype"] for k, v in self.hdr.items() if k != "__metadata__"}
        self.assertTrue({"F8_E4M3", "I8", "BF16", "F32"} <= dts, dts)
        self.assertTrue(any(k.startswith("mtp.") for k in self.va))
        self.assertTrue(any(".engram.embed." in k for k in self.va))

    def test_endpoints_give_each_checkpoint(self):
        for alpha, ref in ((0.0, self.va), (1.0, self.vb)):
            out, v = self._run(alpha, "end%g" % alpha)
            self.assertEqual(set(v), set(ref))
            for k in ref:
                self.assertTrue(torch.equal(v[k], ref[k]), "alpha %g: %s" % (alpha, k))
            h = ST.read_header(os.path.join(out, "model.safetensors"))
            for k, e in self.hdr.items():
                if k != "__metadata__":
                    self.assertEqual((h[k]["dtype"], h[k]["shape"]), (e["dtype"], e["shape"]), k)
            with open(os.path.join(out, "config.json")) as f, open(os.path.join(self.b, "config.json")) as g:
                self.assertEqual(json.load(f), json.load(g))

    def test_midpoint_is_the_rounded_mix(self):
        _, v = self._run(0.5, "mid")
        raw, _ = ST.read_safetensors(os.path.join(self.a, "model.safetensors"))
        changed = 0
        for k, a in self.va.items():
            dt = self.hdr[k]["dtype"]
            sname = k[:-len(".weight")] + ".scale"
            want = _fake(k, dt, 0.75 * a, raw[sname].shape[1] if sname in raw else 1)
            self.assertTrue(torch.equal(v[k], want), k)
            changed += not torch.equal(want, a)
        self.assertGreater(changed, len(self.va) // 2)

    def test_mismatched_checkpoints_are_refused(self):
        other = os.path.join(self.tmp, "other")
        shutil.copytree(self.b, other)
        t, _ = ST.read_safetensors(os.path.join(other, "model.safetensors"))
        drop = sorted(k for k in t if k.startswith("mtp."))[0]
        hdr = ST.read_header(os.path.join(other, "model.safetensors"))
        keep = {k: (hdr[k]["dtype"], hdr[k]["shape"], ST._tensor_bytes(x)) for k, x in t.items() if k != drop}
        ST.write_safetensors(os.path.join(other, "model.safetensors"), keep, {"format": "pt"})
        with self.assertRaisesRegex(ValueError, "different tensors"):
            I.interpolate(self.a, other, 0.5, os.path.join(self.tmp, "x"))
        with open(os.path.join(other, "tokenizer.json"), "a") as f:
            f.write(" ")
        with self.assertRaisesRegex(ValueError, "tokenizer.json differs"):
            I.interpolate(self.a, other, 0.5, os.path.join(self.tmp, "y"))
        with self.assertRaisesRegex(ValueError, "alpha"):
            I.interpolate(self.a, self.b, 1.5, os.path.join(self.tmp, "z"))


if __name__ == "__main__":
    unittest.main()
