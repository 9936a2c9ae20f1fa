"""Peak memory of ``nvfp4lab audit`` and ``nvfp4lab convert`` on a checkpoint larger than a
typical process: Llama-3-8B shapes, several shards, about 2.7 GB.

    python benchmarks/audit_memory.py [--dir /tmp/nvfp4lab-audit-bench] [--layers 5] [--keep]

The checkpoint (compressed-tensors NVFP4, seeded) holds the bf16 embedding and lm_head of
Llama-3-8B ([128256, 4096], 1.05 GB each, the largest tensors) and ``--layers`` decoder layers
of its shapes (q/o 4096x4096, k/v 1024x4096, gate/up 14336x4096, down 4096x14336), quantized by
nvfp4lab with shared q/k/v and gate/up scales, in shards of at most about 1.1 GB with an index.
Each command runs in a fresh subprocess; reported per run: wall time, the peak RSS of the
largest single process (``getrusage(RUSAGE_CHILDREN).ru_maxrss`` in a wrapper, so workers are
counted too) and the peak of the summed RSS of the process tree (sampled from /proc every
20 ms). Everything is written under ``--dir`` (removed at the end unless ``--keep``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch

HIDDEN, INTERMEDIATE, VOCAB, KV = 4096, 14336, 128256, 1024
SHAPES = {  # leaf -> (N, K)
    "self_attn.q_proj": (HIDDEN, HIDDEN), "self_attn.k_proj": (KV, HIDDEN),
    "self_attn.v_proj": (KV, HIDDEN), "self_attn.o_proj": (HIDDEN, HIDDEN),
    "mlp.gate_proj": (INTERMEDIATE, HIDDEN), "mlp.up_proj": (INTERMEDIATE, HIDDEN),
    "mlp.down_proj": (HIDDEN, INTERMEDIATE),
}
GROUPS = (("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
          ("mlp.gate_proj", "mlp.up_proj"), ("self_attn.o_proj",), ("mlp.down_proj",))
SHARD_BYTES = 1_100_000_000
GB = 1e9


def _layer_tensors(index: int, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """One decoder layer: bf16 weights ~ N(0, 0.02) with per-row spread, quantized."""
    import nvfp4lab

    out: dict[str, torch.Tensor] = {}
    prefix = f"model.layers.{index}."
    for group in GROUPS:
        weights = {}
        for leaf in group:
            n, k = SHAPES[leaf]
            rows = torch.exp(torch.randn(n, 1, generator=gen) * 0.3) * 0.02
            weights[leaf] = (torch.randn(n, k, generator=gen) * rows).to(torch.bfloat16)
        amax = max(float(w.abs().max()) for w in weights.values())
        for leaf, w in weights.items():
            q = nvfp4lab.quantize(w, 2688.0 / amax)
            out[f"{prefix}{leaf}.weight_packed"] = q.packed
            out[f"{prefix}{leaf}.weight_scale"] = q.scales
            out[f"{prefix}{leaf}.weight_global_scale"] = q.global_scale
        del weights
    for norm in ("input_layernorm", "post_attention_layernorm"):
        out[f"{prefix}{norm}.weight"] = torch.ones(HIDDEN, dtype=torch.bfloat16)
    return out


def _write_config(folder: Path, layers: int) -> None:
    from compressed_tensors.compressors import ModelCompressor

    from nvfp4lab import checkpoint

    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "dtype": "bfloat16",
              "hidden_size": HIDDEN, "intermediate_size": INTERMEDIATE, "vocab_size": VOCAB,
              "num_hidden_layers": layers, "num_attention_heads": 32, "num_key_value_heads": 8}
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    quant = checkpoint.quantization_config("NVFP4A16", ignore=["lm_head"])
    ModelCompressor(quantization_config=quant).update_config(str(folder))


def generate(folder: Path, layers: int, seed: int) -> int:
    """Write the checkpoint; returns its size in bytes."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True)
    gen = torch.Generator().manual_seed(seed)
    parts = [{"model.embed_tokens.weight": (torch.randn(VOCAB, HIDDEN, generator=gen) * 0.02)
              .to(torch.bfloat16)}]
    size = 0
    for i in range(layers):
        tensors = _layer_tensors(i, gen)
        nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
        if size + nbytes > SHARD_BYTES or len(parts) == 1:
            parts.append({})
            size = 0
        parts[-1].update(tensors)
        size += nbytes
    parts.append({"model.norm.weight": torch.ones(HIDDEN, dtype=torch.bfloat16),
                  "lm_head.weight": (torch.randn(VOCAB, HIDDEN, generator=gen) * 0.02)
                  .to(torch.bfloat16)})
    weight_map, total = {}, 0
    for j, part in enumerate(parts):
        name = f"model-{j + 1:05d}-of-{len(parts):05d}.safetensors"
        save_file(part, str(folder / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, name))
        total += sum(t.numel() * t.element_size() for t in part.values())
        parts[j] = {}
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    _write_config(folder, layers)
    return sum(p.stat().st_size for p in folder.iterdir())


def _tree_rss(pid: int) -> int:
    """Summed VmRSS (bytes) of ``pid`` and its descendants, from /proc."""
    total, stack = 0, [pid]
    while stack:
        p = stack.pop()
        try:
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1]) * 1024
            for task in Path(f"/proc/{p}/task").iterdir():
                stack += [int(c) for c in (task / "children").read_text().split()]
        except (OSError, ValueError):
            continue
    return total


WRAPPER = ("import json, resource, subprocess, sys; r = subprocess.run(sys.argv[1:]); "
           "print(json.dumps({'rc': r.returncode, 'maxrss': "
           "resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024}))")


def measure(args: list[str]) -> dict[str, float]:
    """Run ``args`` under the wrapper; wall time, peak single-process RSS, peak tree RSS."""
    start = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-c", WRAPPER, *args], stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True)
    peak = 0
    while proc.poll() is None:
        peak = max(peak, _tree_rss(proc.pid))
        time.sleep(0.02)
    wall = time.perf_counter() - start
    result = json.loads(proc.stdout.read().strip().splitlines()[-1])
    return {"rc": result["rc"], "wall_s": wall, "peak_process_gb": result["maxrss"] / GB,
            "peak_tree_gb": peak / GB}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", default="/tmp/nvfp4lab-audit-bench", type=Path)
    parser.add_argument("--layers", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--keep", action="store_true", help="keep the generated checkpoints")
    args = parser.parse_args()
    if args.dir.exists():
        print(f"audit_memory: {args.dir} exists; pass another --dir or remove it", file=sys.stderr)
        return 2
    free = shutil.disk_usage(args.dir.parent if args.dir.parent.exists() else "/").free
    need = 2 * (2.1e9 + args.layers * 0.123e9) + 1e9
    if free < need:
        print(f"audit_memory: {free / GB:.1f} GB free under {args.dir.parent}, {need / GB:.1f} GB "
              "needed (two checkpoints); pass another --dir", file=sys.stderr)
        return 2
    ckpt = args.dir / "ct"
    t0 = time.perf_counter()
    size = generate(ckpt, args.layers, args.seed)
    print(f"checkpoint: {size / GB:.2f} GB in {len(list(ckpt.glob('*.safetensors')))} shards, "
          f"largest tensor 1.05 GB (bf16 embedding), generated in {time.perf_counter() - t0:.0f} s")
    nv = [sys.executable, "-m", "nvfp4lab"]
    runs = {"interpreter (import nvfp4lab.checkpoint)":
            [sys.executable, "-c", "import nvfp4lab.checkpoint"]}
    for workers in (0, 1, 2):
        runs[f"audit --workers {workers}"] = [*nv, "audit", str(ckpt), "--workers", str(workers)]
    for workers in (0, 2):
        runs[f"convert --workers {workers}"] = [*nv, "convert", str(ckpt),
                                                str(args.dir / f"mo{workers}"), "--format",
                                                "modelopt", "--workers", str(workers)]
    runs["audit (ModelOpt copy) --workers 2"] = [*nv, "audit", str(args.dir / "mo2"),
                                                 "--workers", "2"]
    print(f"{'command':42} {'rc':>3} {'wall s':>7} {'peak process GB':>16} {'peak tree GB':>13}")
    for name, command in runs.items():
        r = measure(command)
        print(f"{name:42} {r['rc']:>3} {r['wall_s']:7.1f} {r['peak_process_gb']:16.3f} "
              f"{r['peak_tree_gb']:13.3f}", flush=True)
    if not args.keep:
        shutil.rmtree(args.dir)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TQDM_DISABLE", "1")
    sys.exit(main())
