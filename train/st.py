"""Minimal safetensors reader / writer (no dependency on the `safetensors` package).

File layout: 8-byte little-endian header length N, N bytes of JSON header
({name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {str: str}}),
then the raw little-endian data (offsets relative to the end of the header).

API (stable; other modules import it):

    read_safetensors(path) -> (tensors, metadata)
        tensors: dict name -> torch.Tensor in the *storage* dtype:
          F32 / F16 / BF16 / F64 / I16 / I32 / I64 / BOOL as the matching torch dtype,
          F8_E4M3 / F8_E8M0 / U8 / I8 as torch.uint8 raw bytes with the stored shape
          (I8 of packed FP4 experts is raw bytes, not int8 numbers).
        metadata: the "__metadata__" dict ({} if absent).
    read_header(path) -> dict name -> {"dtype", "shape", "data_offsets"} (no data read)
    write_safetensors(path, tensors, metadata=None)
        tensors: dict name -> torch.Tensor (dtype inferred: float32 F32, bfloat16 BF16,
          float16 F16, float64 F64, int64 I64, int32 I32, int16 I16, int8 I8, uint8 U8,
          bool BOOL) or (dtype_str, shape, bytes) for explicit storage dtypes such as
          ("F8_E4M3", [n, k], b) / ("F8_E8M0", ...) / ("I8", ...).
"""
import json
import os
import struct

import numpy as np
import torch

# storage dtype -> (numpy dtype used to read, torch dtype returned, bytes per element)
_READ = {
    "F32": (np.float32, None, 4),
    "F64": (np.float64, None, 8),
    "F16": (np.float16, None, 2),
    "BF16": (np.int16, torch.bfloat16, 2),
    "I64": (np.int64, None, 8),
    "I32": (np.int32, None, 4),
    "I16": (np.int16, None, 2),
    "BOOL": (np.bool_, None, 1),
    "U8": (np.uint8, None, 1),
    "I8": (np.uint8, None, 1),
    "F8_E4M3": (np.uint8, None, 1),
    "F8_E8M0": (np.uint8, None, 1),
}

_TORCH_TO_ST = {
    torch.float32: "F32",
    torch.float64: "F64",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}

_ELEM = {"F32": 4, "F64": 8, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1,
         "BOOL": 1, "F8_E4M3": 1, "F8_E8M0": 1}


def checkpoint_files(model_dir):
    """The safetensors files of a checkpoint directory, as names inside it: the shards of
    model.safetensors.index.json (sorted), or model.safetensors."""
    idx = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.exists(idx):
        with open(idx) as f:
            return sorted(set(json.load(f)["weight_map"].values()))
    return ["model.safetensors"]


def read_header(path):
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        h = json.loads(f.read(n).decode("utf-8"))
    return h


def read_safetensors(path):
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        h = json.loads(f.read(n).decode("utf-8"))
        data = f.read()
    meta = h.pop("__metadata__", None) or {}
    out = {}
    for name, info in h.items():
        dt = info["dtype"]
        if dt not in _READ:
            raise ValueError("%s: tensor %s has unsupported dtype %s" % (path, name, dt))
        npdt, tdt, es = _READ[dt]
        b, e = info["data_offsets"]
        shape = [int(s) for s in info["shape"]]
        numel = 1
        for s in shape:
            numel *= s
        if e - b != numel * es:
            raise ValueError("%s: tensor %s: %d bytes for shape %s dtype %s" % (path, name, e - b, shape, dt))
        arr = np.frombuffer(data, dtype=npdt, count=numel, offset=b).copy().reshape(shape)
        t = torch.from_numpy(arr)
        if tdt is not None:
            t = t.view(tdt)
        out[name] = t
    return out, meta


def _tensor_bytes(t):
    t = t.detach().cpu().contiguous()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().tobytes()
    return t.numpy().tobytes()


def write_safetensors(path, tensors, metadata=None):
    entries = []
    for name in sorted(tensors):
        v = tensors[name]
        if isinstance(v, torch.Tensor):
            if v.dtype not in _TORCH_TO_ST:
                raise ValueError("tensor %s: unsupported torch dtype %s" % (name, v.dtype))
            dt, shape, raw = _TORCH_TO_ST[v.dtype], list(v.shape), _tensor_bytes(v)
        else:
            dt, shape, raw = v
            shape = [int(s) for s in shape]
            raw = bytes(raw)
            numel = 1
            for s in shape:
                numel *= s
            if dt not in _ELEM or len(raw) != numel * _ELEM[dt]:
                raise ValueError("tensor %s: %d bytes for dtype %s shape %s" % (name, len(raw), dt, shape))
        entries.append((name, dt, shape, raw))
    header = {}
    off = 0
    for name, dt, shape, raw in entries:
        header[name] = {"dtype": dt, "shape": shape, "data_offsets": [off, off + len(raw)]}
        off += len(raw)
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    hb = json.dumps(header, separators=(",", ":")).encode("utf-8")
    hb += b" " * ((8 - len(hb) % 8) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(hb)))
        f.write(hb)
        for _, _, _, raw in entries:
            f.write(raw)
