"""The graph of one steady-state decode step of a static batch: what the compiled step takes and
returns, and its nodes by primitive, before and after `mx.compile` (the tape `mx.async_eval`
encodes, one kernel launch per node on CUDA). Runs with whichever mlxfun is first on the path, so
two trees can be compared (`gpu.sh`'s AB_REF layout, or commit 7fbc90b's flat package):

    python benchmarks/step_graph.py --layers 2 --vocab 8192 --json /tmp/ours.json
    (cd .ab/ref && PYTHONPATH=$PWD python ../../benchmarks/step_graph.py ... --json /tmp/ref.json)
    python benchmarks/step_graph.py --compare /tmp/ours.json /tmp/ref.json

On the CPU `--stub-kernels` traces mlxfun's CUDA paths (`kernels.available` forced, each custom
kernel launch and each `mx.fast` norm or rope, which the CPU decomposes at once, one `Depends`
node over `ErfInv(Full)` stand-ins; nothing is evaluated), so the GPU step's structure can be
counted without a GPU: its nodes are about `compiled.nodes - stand_ins`. Node counts do not
depend on the rows (the unevaluated per-row settings are counted apart); per layer they are
linear, so two layer counts extrapolate.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import os
import re
import sys
import tempfile

import mlx.core as mx

try:  # the package in folders
    from mlxfun.bench.models import SHAPES, random_model
    from mlxfun.engine import step as stepmod
    from mlxfun.engine.core import Engine
except ImportError:  # commit 7fbc90b's flat package
    from mlxfun import step as stepmod
    from mlxfun.bench import SHAPES, random_model
    from mlxfun.engine import Engine


def leaves(tree, prefix=""):
    """(path, leaf) of an argument tree; NamedTuples by field name."""
    if hasattr(tree, "_fields"):
        for f, v in zip(tree._fields, tree):
            yield from leaves(v, f"{prefix}.{f}" if prefix else f)
    elif isinstance(tree, (list, tuple)):
        for i, v in enumerate(tree):
            yield from leaves(v, f"{prefix}[{i}]")
    else:
        yield prefix, tree


def arrays(tree) -> list[tuple[str, mx.array]]:
    return [(p, a) for p, a in leaves(tree) if isinstance(a, mx.array)]


def dot_of(outputs: list[mx.array], names: dict[str, mx.array]) -> str:
    with tempfile.NamedTemporaryFile("r", suffix=".dot") as f:
        mx.export_to_dot(f.name, *outputs, **names)
        return f.read()


def count(text: str) -> dict:
    """Nodes by primitive, and the evaluated arrays the graph reads: named inputs and the rest
    (constants captured in the trace)."""
    prims = collections.Counter(re.findall(r'\[label ="([^"]+)", shape=rectangle\]', text))
    sources = re.findall(r'rank=source; "([^"]+)"', text)
    return {"nodes": sum(prims.values()), "by_primitive": dict(sorted(prims.items())),
            "inputs_read": sum(s.startswith("in:") for s in sources),
            "constants": sum(not s.startswith("in:") for s in sources)}


def unevaluated(a: mx.array) -> bool:
    return "shape=rectangle" in dot_of([a], {})


def stub_kernels() -> None:
    """mlxfun's CUDA paths traced on any device: never evaluate what this makes."""
    try:
        from mlxfun.kernels import attention as kernels
    except ImportError:
        from mlxfun import kernels
    kernels.available = lambda dtype: dtype in (mx.float16, mx.bfloat16)

    def stand_in(inputs: list, shapes: list, dtypes: list) -> list[mx.array]:
        return mx.depends([mx.erfinv(mx.zeros(s, d)) for s, d in zip(shapes, dtypes)],
                          [a for a in inputs if isinstance(a, mx.array)])

    def cuda_kernel(name, input_names, output_names, source, **_):
        def launch(inputs, output_shapes, output_dtypes, **__):
            return stand_in(list(inputs), output_shapes, output_dtypes)
        return launch
    mx.fast.cuda_kernel = cuda_kernel

    # MLX's fast ops are one node on a GPU; on the CPU they build their fallback's graph at once.
    def one_node(x, *args, **kw):
        return stand_in([x, *args, *kw.values()], [x.shape], [x.dtype])[0]
    mx.fast.rms_norm = mx.fast.rope = mx.fast.layer_norm = one_node


def measure(args) -> dict:
    shape = SHAPES[args.shape]
    # Per-layer tuples (windows, ...) emptied: the config refills them for the layers kept.
    per_layer = {f.name: () for f in dataclasses.fields(shape)
                 if isinstance(getattr(shape, f.name), tuple) and len(getattr(shape, f.name)) == shape.num_layers}
    config = dataclasses.replace(shape, num_layers=args.layers or shape.num_layers,
                                 vocab_size=args.vocab or shape.vocab_size, **per_layer)
    model = random_model(config, getattr(mx, args.dtype))
    engine = Engine(model, args.rows)
    for i in range(args.rows):
        engine.add([(i * 7 + j) % (config.vocab_size - 1) + 1 for j in range(args.prompt)],
                   max_tokens=args.warm + 8, ignore_eos=True)
    for _ in range(args.warm):
        engine.step()
    if args.stub_kernels:
        stub_kernels()
    fn, call = engine.next_decode()  # the compiled step and its arguments, as the next step takes them
    mode = engine._roster_of.mode
    res = {"mlxfun": os.path.dirname(sys.modules["mlxfun"].__file__), "device": str(mx.default_device()),
           "shape": args.shape, "layers": config.num_layers, "vocab": config.vocab_size, "rows": args.rows,
           "dtype": args.dtype, "mode": repr(mode), "stub_kernels": args.stub_kernels, "arguments": {}}
    names = {}
    for name, tree in zip(("params", "state", "settings"), call):
        found = arrays(tree)
        fresh = [p for p, a in found if unevaluated(a)]
        res["arguments"][name] = {"arrays": len(found), "unevaluated": len(fresh), "unevaluated_paths": fresh[:8],
                                  "none": sum(v is None for _, v in leaves(tree)),
                                  "bytes": sum(a.nbytes for _, a in found)}
        names.update({f"in:{name}.{p}": a for p, a in found if p not in fresh})
    out = stepmod.decode_step(engine.config, mode, *call)  # the function the compiled step wraps
    outs = arrays(out)
    res["outputs"] = {"arrays": len(outs), "paths": [p for p, _ in outs],
                      "passed_through": [p for p, a in outs if any(a is b for b in names.values())]}
    res["uncompiled"] = count(dot_of([a for _, a in outs], names))
    del out, outs
    # The compiled step's outputs hold its tape (simplified, fused). A stub traces afresh: the
    # engine's own step was traced on this device's paths.
    compiled = mx.compile(lambda *a: stepmod.decode_step(engine.config, mode, *a)) if args.stub_kernels else fn
    out = compiled(*call)
    res["compiled"] = count(dot_of([a for _, a in arrays(out)], names))
    if args.stub_kernels:
        res["compiled"]["stand_ins"] = sum(res["compiled"]["by_primitive"].get(k, 0) for k in ("ErfInv", "Full"))
    res["async_eval_arrays"] = len(arrays(out[0])) + len(arrays(engine.runner.state if hasattr(engine, "runner")
                                                                 else engine.state))
    del out, call
    return res


def compare(a: dict, b: dict) -> None:
    for key in ("mlxfun", "device", "mode", "layers", "rows"):
        print(f"{key:12s} {a.get(key)!s:50.50s} {b.get(key)!s:.50s}")
    for name in a["arguments"]:
        x, y = a["arguments"][name], b["arguments"][name]
        print(f"arg {name:8s} arrays {x['arrays']} / {y['arrays']}, unevaluated {x['unevaluated']} / "
              f"{y['unevaluated']}, None {x['none']} / {y['none']}")
    print(f"outputs      {a['outputs']['arrays']} / {b['outputs']['arrays']}")
    for stage in ("uncompiled", "compiled"):
        x, y = a[stage], b[stage]
        print(f"{stage:10s} nodes {x['nodes']} / {y['nodes']}, inputs read {x['inputs_read']} / {y['inputs_read']}, "
              f"constants {x['constants']} / {y['constants']}")
        for prim in sorted(set(x["by_primitive"]) | set(y["by_primitive"])):
            m, n = x["by_primitive"].get(prim, 0), y["by_primitive"].get(prim, 0)
            if m != n:
                print(f"  {prim}: {m} / {n}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", choices=sorted(SHAPES), default="1B")
    p.add_argument("--layers", type=int, default=2, help="0: the shape's")
    p.add_argument("--vocab", type=int, default=8192, help="0: the shape's")
    p.add_argument("--rows", type=int, default=8)
    p.add_argument("--prompt", type=int, default=16)
    p.add_argument("--warm", type=int, default=4, help="decode steps before the one measured")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--stub-kernels", action="store_true", help="trace mlxfun's CUDA paths (see above)")
    p.add_argument("--json", default="")
    p.add_argument("--compare", nargs=2, metavar=("A", "B"), help="two --json files: what differs")
    args = p.parse_args()
    if args.compare:
        compare(*(json.load(open(f)) for f in args.compare))
        return 0
    res = measure(args)
    text = json.dumps(res, indent=1)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
