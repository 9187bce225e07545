#!/usr/bin/env python3
"""Model files in the shape of a transformer, and the loaders inference engines run on them.

Written for `larder-bench models` (bench/README.md); tests may use it as well. Needs the
`safetensors` and `numpy` packages (`bench/setup` installs both in bench/.venv).

    loaders.py generate --out DIR --size SIZE [--shards N] [--seed S]
        Writes DIR/single/model.safetensors, and the same tensors split into N (8) shards:
        DIR/sharded/model-0000K-of-0000N.safetensors with DIR/sharded/model.safetensors.index.json
        ({"metadata": {"total_size": ...}, "weight_map": {tensor: shard file}}), as Hugging Face
        writes a sharded checkpoint. SIZE is bytes, or a number with KiB, MiB or GiB; the files
        come within one layer of it. The bytes are a function of the seed (0) and the tensor's
        name, so two runs with the same arguments write the same files. Prints one JSON line:
        layers, hidden size, tensor count and tensor bytes.

    loaders.py load LOADER PATH [--rank R --world W] [--compare DIR] [--ready]
        Loads PATH as LOADER does, copies every tensor's bytes out of what the library returns
        (as a loader copies them to the device), and prints one JSON line: loader, rank, world,
        tensors, bytes (of the tensors loaded), seconds, cpu_seconds (this process's, for the
        load). LOADER is one of:
          keys       safe_open(PATH, framework="np"), then get_tensor(k) for k in f.keys(): vLLM's
                     default iterator;
          tp         rank R of W tensor-parallel ranks (run W processes): safe_open, then
                     get_slice(k) for each key, keeping the rank's part of every 2-D tensor
                     (o_proj and down_proj, row-parallel, split along dim 1; every other 2-D
                     tensor along dim 0) and the whole of every 1-D tensor;
          load-file  safetensors.numpy.load_file(PATH), as transformers loads a checkpoint;
          sharded    PATH is a model.safetensors.index.json: each shard it names, in sorted
                     order, loaded in key order as `keys` does.
        --compare DIR  checks each loaded tensor (or rank's part) against the same one loaded
                     the same way from DIR/NAME, NAME being each file's own name (a reference
                     copy of the files): dtype, shape and every byte. On a mismatch it names the
                     file and the tensor on standard error and exits 1.
        --ready      prints "ready" once the imports are done and waits for a line on standard
                     input before loading, so that several ranks start together and the time of
                     starting Python is not counted.
"""

import argparse
import functools
import json
import math
import os
import sys
import time

import numpy as np
from safetensors import safe_open
from safetensors.numpy import load_file, save_file

# Row-parallel layers take their input split: their weights are split along dim 1.
ROW_PARALLEL = ("o_proj", "down_proj")
INDEX = "model.safetensors.index.json"


def parse_size(text):
    units = {"KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}
    for suffix, factor in units.items():
        if text.endswith(suffix):
            return int(float(text[: -len(suffix)]) * factor)
    return int(text)


def layer_tensors(i, hidden, inter):
    """(name, dtype, shape) of layer i. Every fourth layer is quantized as some checkpoints
    ship their MLP: int8 gate/up with F32 scales, 4-bit down packed two to a byte (U8) with F16
    scales. The rest is F16 weights and F32 norms."""
    p = f"model.layers.{i}"
    kv = hidden // 4  # grouped-query attention: a quarter of the heads for keys and values
    out = [
        (f"{p}.input_layernorm.weight", np.float32, (hidden,)),
        (f"{p}.self_attn.q_proj.weight", np.float16, (hidden, hidden)),
        (f"{p}.self_attn.k_proj.weight", np.float16, (kv, hidden)),
        (f"{p}.self_attn.v_proj.weight", np.float16, (kv, hidden)),
        (f"{p}.self_attn.o_proj.weight", np.float16, (hidden, hidden)),
        (f"{p}.post_attention_layernorm.weight", np.float32, (hidden,)),
    ]
    if i % 4 == 3:
        out += [
            (f"{p}.mlp.gate_proj.weight", np.int8, (inter, hidden)),
            (f"{p}.mlp.gate_proj.weight_scale", np.float32, (inter,)),
            (f"{p}.mlp.up_proj.weight", np.int8, (inter, hidden)),
            (f"{p}.mlp.up_proj.weight_scale", np.float32, (inter,)),
            (f"{p}.mlp.down_proj.weight", np.uint8, (hidden, inter // 2)),
            (f"{p}.mlp.down_proj.weight_scale", np.float16, (hidden,)),
        ]
    else:
        out += [
            (f"{p}.mlp.gate_proj.weight", np.float16, (inter, hidden)),
            (f"{p}.mlp.up_proj.weight", np.float16, (inter, hidden)),
            (f"{p}.mlp.down_proj.weight", np.float16, (hidden, inter)),
        ]
    return out


def nbytes(spec):
    _, dtype, shape = spec
    return math.prod(shape) * np.dtype(dtype).itemsize


def model_tensors(size):
    """The tensors of a Llama-shaped model of about `size` bytes, in module order: the hidden
    size from the size (a vocabulary of 8 x hidden, an MLP of 8/3 x hidden), then as many layers
    as fit. Every split dimension divides by 4 (tensor-parallel ranks 2 and 4)."""
    hidden = max(64, round(math.sqrt(size / (2 * 184)) / 64) * 64)
    inter = max(64, round(hidden * 8 / 3 / 64) * 64)
    vocab = 8 * hidden
    head = [("model.embed_tokens.weight", np.float16, (vocab, hidden))]
    tail = [
        ("model.norm.weight", np.float32, (hidden,)),
        ("lm_head.weight", np.float16, (vocab, hidden)),
    ]
    fixed = sum(map(nbytes, head + tail))
    layers = []
    total = fixed
    while True:
        layer = layer_tensors(len(layers), hidden, inter)
        grown = total + sum(map(nbytes, layer))
        if layers and grown > size:
            break
        layers.append(layer)
        total = grown
    tensors = head + [t for layer in layers for t in layer] + tail
    return tensors, {"layers": len(layers), "hidden": hidden, "intermediate": inter, "vocab": vocab}


def tensor(spec, seed):
    """The tensor's bytes: a function of the seed and its name."""
    name, dtype, shape = spec
    rng = np.random.default_rng([seed, *name.encode()])
    return np.frombuffer(rng.bytes(nbytes(spec)), dtype=dtype).reshape(shape)


def split_shards(tensors, shards):
    """Tensors in order, cut into `shards` non-empty runs of about equal bytes."""
    total = sum(map(nbytes, tensors))
    groups = [[] for _ in range(shards)]
    k, done = 0, 0
    for i, spec in enumerate(tensors):
        # On to the next shard once this one holds its share, or once the tensors left are
        # only enough for one in each shard after it.
        full = done >= (k + 1) * total / shards or len(tensors) - i <= shards - 1 - k
        if groups[k] and k < shards - 1 and full:
            k += 1
        groups[k].append(spec)
        done += nbytes(spec)
    return groups


def generate(args):
    size = parse_size(args.size)
    tensors, shape = model_tensors(size)
    if len(tensors) < args.shards:
        sys.exit(f"a model of {size} bytes has {len(tensors)} tensors, fewer than {args.shards} shards")
    single = os.path.join(args.out, "single")
    sharded = os.path.join(args.out, "sharded")
    os.makedirs(single, exist_ok=True)
    os.makedirs(sharded, exist_ok=True)
    save_file(
        {spec[0]: tensor(spec, args.seed) for spec in tensors},
        os.path.join(single, "model.safetensors"),
        metadata={"format": "np"},
    )
    weight_map = {}
    groups = split_shards(tensors, args.shards)
    for k, group in enumerate(groups):
        name = f"model-{k + 1:05d}-of-{args.shards:05d}.safetensors"
        save_file(
            {spec[0]: tensor(spec, args.seed) for spec in group},
            os.path.join(sharded, name),
            metadata={"format": "np"},
        )
        weight_map.update({spec[0]: name for spec in group})
    total = sum(map(nbytes, tensors))
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    with open(os.path.join(sharded, INDEX), "w") as f:
        json.dump(index, f, indent=2)
        f.write("\n")
    print(json.dumps({**shape, "tensors": len(tensors), "tensor_bytes": total}))


class Sink:
    """Where loaded tensors go: their bytes are copied into one reusable buffer, as a loader
    copies them to the device, so that no byte of a lazily mapped file is left unread."""

    def __init__(self, compare):
        self.compare = compare
        self.buffer = np.empty(0, dtype=np.uint8)
        self.tensors = 0
        self.bytes = 0

    def take(self, path, name, array, reference):
        flat = np.ascontiguousarray(array).reshape(-1).view(np.uint8)
        if flat.size > self.buffer.size:
            self.buffer = np.empty(flat.size, dtype=np.uint8)
        self.buffer[: flat.size] = flat
        self.tensors += 1
        self.bytes += flat.size
        if self.compare is not None:
            expected = reference(os.path.join(self.compare, os.path.basename(path)))
            same = (
                expected.dtype == array.dtype
                and expected.shape == array.shape
                and np.array_equal(np.ascontiguousarray(expected).reshape(-1).view(np.uint8), flat)
            )
            if not same:
                sys.exit(f"{path}: tensor {name} differs from the reference copy in {self.compare}")


def rank_slice(name, view, rank, world):
    """The part of a tensor (a safe_open slice) that tensor-parallel rank `rank` of `world`
    loads."""
    shape = view.get_shape()
    if len(shape) != 2:
        return view[:]
    dim = 1 if any(part in name for part in ROW_PARALLEL) else 0
    step = shape[dim] // world
    part = slice(rank * step, (rank + 1) * step)
    return view[part] if dim == 0 else view[:, part]


def load_keys(path, sink):
    with safe_open(path, framework="np") as f:
        for k in f.keys():

            def reference(other, k=k):
                with safe_open(other, framework="np") as r:
                    return r.get_tensor(k)

            sink.take(path, k, f.get_tensor(k), reference)


def load_rank(path, sink, rank, world):
    with safe_open(path, framework="np") as f:
        for k in f.keys():

            def reference(other, k=k):
                with safe_open(other, framework="np") as r:
                    return rank_slice(k, r.get_slice(k), rank, world)

            sink.take(path, k, rank_slice(k, f.get_slice(k), rank, world), reference)


def load_whole(path, sink):
    # With --compare, the reference file is loaded once, not once per tensor.
    reference = functools.lru_cache(maxsize=1)(load_file)
    for k, array in load_file(path).items():
        sink.take(path, k, array, lambda other, k=k: reference(other)[k])


def load_sharded(index, sink):
    with open(index) as f:
        weight_map = json.load(f)["weight_map"]
    for shard in sorted(set(weight_map.values())):
        load_keys(os.path.join(os.path.dirname(index), shard), sink)


def load(args):
    if args.loader == "tp" and not 0 <= args.rank < args.world:
        sys.exit("tp needs --rank R and --world W with 0 <= R < W")
    if args.ready:
        print("ready", flush=True)
        sys.stdin.readline()
    sink = Sink(args.compare)
    started, cpu = time.perf_counter(), time.process_time()
    if args.loader == "keys":
        load_keys(args.path, sink)
    elif args.loader == "tp":
        load_rank(args.path, sink, args.rank, args.world)
    elif args.loader == "load-file":
        load_whole(args.path, sink)
    else:
        load_sharded(args.path, sink)
    seconds, cpu = time.perf_counter() - started, time.process_time() - cpu
    print(
        json.dumps(
            {
                "loader": args.loader,
                "rank": args.rank,
                "world": args.world,
                "tensors": sink.tensors,
                "bytes": sink.bytes,
                "seconds": seconds,
                "cpu_seconds": cpu,
            }
        ),
        flush=True,
    )


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    gen = commands.add_parser("generate", help="write a model and its sharded twin")
    gen.add_argument("--out", required=True)
    gen.add_argument("--size", required=True)
    gen.add_argument("--shards", type=int, default=8)
    gen.add_argument("--seed", type=int, default=0)
    gen.set_defaults(run=generate)
    ld = commands.add_parser("load", help="load a model as an inference engine does")
    ld.add_argument("loader", choices=["keys", "tp", "load-file", "sharded"])
    ld.add_argument("path")
    ld.add_argument("--rank", type=int, default=0)
    ld.add_argument("--world", type=int, default=1)
    ld.add_argument("--compare", metavar="DIR")
    ld.add_argument("--ready", action="store_true")
    ld.set_defaults(run=load)
    args = parser.parse_args()
    args.run(args)


if __name__ == "__main__":
    main()
