"""Export a V41Model to an official V4.1 checkpoint directory (what dsx loads).

    export(model, out_dir, tokenizer_json, extra_tensors=None, extra_config=None,
           cmap=None, metadata=None) -> out_dir

writes
  out_dir/config.json        the release layout (composite: architectures, model_type,
                             dtype, bos/eos/pad, image_token_id, quantization_config,
                             text_config with every key, vision_config with 0 layers),
                             model.cfg.raw with extra_config merged into text_config
                             (S's DSpark exporter passes num_nextn_predict_layers,
                             compress_ratios with the stage entries, dspark_* keys)
  out_dir/model.safetensors  official names; FP8 e4m3 + F8_E8M0 32x32 tile scales for the
                             FP8 matrices, MXFP4 (I8 packed, low nibble first) + F8_E8M0
                             1x32 scales for routed experts, F8_E4M3 rows + F8_E8M0 scales
                             for Engram tables, BF16 / F32 where the release keeps them;
                             plus extra_tensors (e.g. mtp.*) as given
  out_dir/tokenizer.json     copied
  out_dir/engram_cmap.safetensors  (if the model has Engram layers and cmap is known) the
                             compressed token map used in training ("cmap" I32, "n_keys"
                             I32 [1]); the engine derives its own from tokenizer.json, this
                             copy lets V41Model.from_pretrained(out_dir) use the same map

The quantized bytes come from exactly the functions the training forward fake-quantizes
with (quant.py), so dequantizing the file gives back the forward's weights bit for bit.

Helper for other exporters: tensor_entries(name, w, fmt) -> {name: entry, [scale name: entry]}
with fmt in BF16 / F32 / FP8 / FP4 / ROWS8 (entry = torch tensor or (dtype, shape, bytes)).
"""
import copy
import json
import os
import shutil
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

import quant as Q  # noqa: E402
import st  # noqa: E402


def _raw(t):
    return t.detach().cpu().contiguous().numpy().tobytes()


def tensor_entries(name, w, fmt):
    w = w.detach().float().cpu()
    if fmt == "BF16":
        return {name: w.to(torch.bfloat16)}
    if fmt == "F32":
        return {name: w.contiguous()}
    if not name.endswith(".weight"):
        raise ValueError("%s: quantized tensors are named *.weight" % name)
    sname = name[:-len(".weight")] + ".scale"
    if fmt == "FP8":
        c, s = Q.fp8_block_quantize(w, 32)
        return {name: ("F8_E4M3", list(c.shape), _raw(c)), sname: ("F8_E8M0", list(s.shape), _raw(s))}
    if fmt == "FP4":
        c, s = Q.mxfp4_quantize(w)
        return {name: ("I8", list(c.shape), _raw(c)), sname: ("F8_E8M0", list(s.shape), _raw(s))}
    if fmt == "ROWS8":
        c, s = Q.e8m0_rows_quantize(w, 32)
        return {name: ("F8_E4M3", list(c.shape), _raw(c)), sname: ("F8_E8M0", list(s.shape), _raw(s))}
    raise ValueError("%s: unknown storage format %s" % (name, fmt))


def model_tensors(model):
    own = dict(model.named_parameters())
    own.update(dict(model.named_buffers()))
    out = {}
    for name, fmt in sorted(model.storage_formats().items()):
        out.update(tensor_entries(name, own[name], fmt))
    return out


def config_json(model, extra_config=None):
    raw = copy.deepcopy(model.cfg.raw)
    if "text_config" not in raw:
        raise ValueError("the model's config is not the composite release layout (no text_config)")
    if extra_config:
        raw["text_config"].update(copy.deepcopy(extra_config))
    return raw


def export(model, out_dir, tokenizer_json, extra_tensors=None, extra_config=None, cmap=None, metadata=None):
    os.makedirs(out_dir, exist_ok=True)
    tensors = model_tensors(model)
    if extra_tensors:
        clash = sorted(set(tensors) & set(extra_tensors))
        if clash:
            raise ValueError("extra tensors clash with the backbone: %s" % clash[:5])
        tensors.update(extra_tensors)
    meta = {"format": "pt"}
    if metadata:
        meta.update({str(k): str(v) for k, v in metadata.items()})
    st.write_safetensors(os.path.join(out_dir, "model.safetensors"), tensors, meta)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config_json(model, extra_config), f, indent=2)
        f.write("\n")
    if tokenizer_json:
        shutil.copyfile(tokenizer_json, os.path.join(out_dir, "tokenizer.json"))
    if model.cfg.engram_layers:
        c = cmap if cmap is not None else model.cmap
        c = torch.as_tensor(c).to(torch.int32).cpu()
        n_keys = model.cfg.engram_compressed_vocab
        st.write_safetensors(os.path.join(out_dir, "engram_cmap.safetensors"),
                             {"cmap": c, "n_keys": torch.tensor([n_keys], dtype=torch.int32)},
                             {"n_keys": n_keys})
    return out_dir
