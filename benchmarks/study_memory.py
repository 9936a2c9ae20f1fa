"""Peak memory and time of the LLM study run block by block (``studies.llm_streamed``) on a model
larger than the bound: a seeded random Llama of about 1.2 B parameters, 2.4 GB of bf16 on disk.

    nice python benchmarks/study_memory.py [--dir DIR] [--layers 24] [--tokens 1000]
                                           [--compare] [--keep]

The model (hidden 2048, ``--layers`` decoder layers, intermediate 5632, 32 query / 4 KV heads,
vocabulary 32000, untied head; every Linear and embedding N(0, 0.02), norms 1) is written shard
by shard, each tensor drawn from its own seeded generator, so the writer never holds more than
one shard of four layers. The text: the first ``--tokens`` tokens of the corpus's evaluation
part (CPython's pydoc topics) tokenized by SmolLM2's tokenizer, whose ids (0..49151) are taken
modulo the model's vocabulary of 32000 (the model is random: any ids serve); calibration: 4
windows of 256 tokens of the calibration part, the same way.

Each configuration (W4A16 RTN, W4A16 GPTQ, KV nvfp4) runs in a fresh subprocess: the streamed
reference, then the configuration, both block by block in bf16; reported per configuration: the
child's peak RSS (``VmHWM``: its own address space's high-water mark), the reference's seconds
and the configuration's. ``--compare`` also runs the in-memory path (``from_pretrained`` in bf16,
``reference_run``, ``config_row``) in one more subprocess and says whether every row is equal
(all but the time and memory fields). Everything is written under ``--dir`` (removed at the end
unless ``--keep``). Not a test: it takes minutes.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

HIDDEN, INTERMEDIATE, HEADS, KV_HEADS, VOCAB = 2048, 5632, 32, 4, 32000
KV = HIDDEN // HEADS * KV_HEADS
#: leaf -> shape of the tensors of one decoder layer, in checkpoint order.
LAYER = {
    "input_layernorm.weight": (HIDDEN,),
    "self_attn.q_proj.weight": (HIDDEN, HIDDEN), "self_attn.k_proj.weight": (KV, HIDDEN),
    "self_attn.v_proj.weight": (KV, HIDDEN), "self_attn.o_proj.weight": (HIDDEN, HIDDEN),
    "post_attention_layernorm.weight": (HIDDEN,),
    "mlp.gate_proj.weight": (INTERMEDIATE, HIDDEN), "mlp.up_proj.weight": (INTERMEDIATE, HIDDEN),
    "mlp.down_proj.weight": (HIDDEN, INTERMEDIATE),
}
LAYERS_PER_SHARD = 4
CONFIGS = ("W4A16 RTN", "W4A16 GPTQ", "KV nvfp4")
MEASURED = ("build_seconds", "peak_rss_mb")
SEED = 1234


def _config(layers: int) -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=INTERMEDIATE,
        num_hidden_layers=layers, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS,
        max_position_embeddings=4096, tie_word_embeddings=False, dtype="bfloat16",
    )


def _tensor(name: str, shape: tuple[int, ...], index: int) -> torch.Tensor:
    """Tensor ``index`` of the model: norms 1, everything else N(0, 0.02) from a generator
    seeded with ``SEED + index``, in bf16."""
    if name.endswith("norm.weight"):
        return torch.ones(shape, dtype=torch.bfloat16)
    generator = torch.Generator().manual_seed(SEED + index)
    return (torch.randn(shape, generator=generator) * 0.02).to(torch.bfloat16)


def write_model(folder: Path, layers: int) -> int:
    """The random Llama as sharded bf16 safetensors with its index and config.json; returns
    its parameter count."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    _config(layers).save_pretrained(folder)
    plan: list[list[tuple[str, tuple[int, ...]]]] = [
        [("model.embed_tokens.weight", (VOCAB, HIDDEN))]]
    for start in range(0, layers, LAYERS_PER_SHARD):
        plan.append([(f"model.layers.{i}.{leaf}", shape)
                     for i in range(start, min(start + LAYERS_PER_SHARD, layers))
                     for leaf, shape in LAYER.items()])
    plan.append([("model.norm.weight", (HIDDEN,)), ("lm_head.weight", (VOCAB, HIDDEN))])
    weight_map: dict[str, str] = {}
    total = count = index = 0
    for number, entries in enumerate(plan, 1):
        file = f"model-{number:05d}-of-{len(plan):05d}.safetensors"
        shard = {}
        for name, shape in entries:
            shard[name] = _tensor(name, shape, index)
            index += 1
            count += math.prod(shape)
            total += 2 * math.prod(shape)
            weight_map[name] = file
        save_file(shard, str(folder / file), metadata={"format": "pt"})
        del shard
    index_file = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index_file, indent=2))
    return count


def write_inputs(folder: Path, tokens: int) -> None:
    """The evaluation ids and the calibration batches (ids modulo VOCAB) into ``inputs.pt``."""
    from nvfp4lab import corpus
    from nvfp4lab.models import smollm2_tokenizer
    from nvfp4lab.vocab import CorpusPart

    tokenizer = smollm2_tokenizer()
    ids = corpus.token_ids(tokenizer, corpus.pydoc_text(CorpusPart.EVALUATION))[:tokens] % VOCAB
    calibration = corpus.calibration_batches(tokenizer, samples=4, length=256, batch_size=4)
    for batch in calibration:
        batch["input_ids"] = batch["input_ids"] % VOCAB
    torch.save({"ids": ids, "calibration": calibration}, folder / "inputs.pt")


def _inputs(folder: Path) -> tuple[torch.Tensor, list[dict[str, torch.Tensor]]]:
    data = torch.load(folder / "inputs.pt")
    return data["ids"], data["calibration"]


def _peak_mb() -> float:
    """This process's peak RSS, MiB: ``VmHWM`` of its own address space. Not ``ru_maxrss``:
    Linux carries the forked parent's resident size into it across ``exec``, so a child of a
    parent that has just written the model reported the parent's 1.4 GB for every
    configuration."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024  # kB
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # kB on Linux


def child_streamed(folder: Path, label: str) -> dict[str, Any]:
    """The streamed reference and configuration ``label`` in this process."""
    from nvfp4lab.studies import llm_configs, llm_streamed

    config = {c.label: c for c in llm_configs.configurations()}[label]
    ids, calibration = _inputs(folder)
    start = time.perf_counter()
    streamed = llm_streamed.StreamedModel(folder)
    run = llm_streamed.streamed_reference(streamed, ids)
    middle = time.perf_counter()
    row = llm_streamed.streamed_config_row(streamed, run, config, calibration)
    end = time.perf_counter()
    return {"row": row, "reference_seconds": middle - start, "config_seconds": end - middle,
            "peak_rss_mb": _peak_mb(), "dtype": str(streamed.dtype)}


def child_in_memory(folder: Path) -> dict[str, Any]:
    """The in-memory path in bf16: the whole model loaded, each configuration built from it."""
    from transformers import AutoModelForCausalLM

    from nvfp4lab.studies import llm, llm_configs

    ids, calibration = _inputs(folder)
    start = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16,
                                                 local_files_only=True).eval()
    run = llm.reference_run(model, ids)
    configs = {c.label: c for c in llm_configs.configurations()}
    rows = {label: llm_configs.config_row(model, run, configs[label], calibration)
            for label in CONFIGS}
    return {"rows": rows, "seconds": time.perf_counter() - start, "peak_rss_mb": _peak_mb()}


def _run_child(args: list[str]) -> dict[str, Any]:
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    out = subprocess.run([sys.executable, __file__, *args], env=env, check=True,
                         stdout=subprocess.PIPE, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def _equal_rows(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    """The fields (time and memory aside) where rows ``a`` and ``b`` differ."""
    def same(x: Any, y: Any) -> bool:
        return x == y or (isinstance(x, float) and isinstance(y, float)
                          and math.isnan(x) and math.isnan(y))

    return [k for k in a if k not in MEASURED and not same(a[k], b.get(k))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", type=Path, default=None)
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--tokens", type=int, default=1000)
    parser.add_argument("--compare", action="store_true")
    parser.add_argument("--keep", action="store_true")
    parser.add_argument("--child", nargs=2, metavar=("FOLDER", "CONFIG"), help=argparse.SUPPRESS)
    parser.add_argument("--child-memory", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child_streamed(Path(args.child[0]), args.child[1])))
        return
    if args.child_memory:
        print(json.dumps(child_in_memory(args.child_memory)))
        return
    root = args.dir or Path(tempfile.mkdtemp(prefix="nvfp4lab-study-bench-"))
    folder = root / "random-llama"
    try:
        start = time.perf_counter()
        params = write_model(folder, args.layers)
        write_inputs(folder, args.tokens)
        size = sum(f.stat().st_size for f in folder.glob("*.safetensors"))
        print(f"model: random Llama, {params:,} parameters, {args.layers} layers, "
              f"{size / 1e9:.2f} GB bf16 on disk in {len(list(folder.glob('*.safetensors')))} "
              f"shards (written in {time.perf_counter() - start:.0f} s); text: "
              f"{args.tokens} tokens", flush=True)
        streamed = {}
        for label in CONFIGS:
            result = _run_child(["--child", str(folder), label])
            streamed[label] = result
            row = result["row"]
            print(f"{label:>12}: peak RSS {result['peak_rss_mb']:.0f} MiB | reference "
                  f"{result['reference_seconds']:.0f} s, configuration "
                  f"{result['config_seconds']:.0f} s (build {row['build_seconds']:.0f} s) | "
                  f"mean KLD {row['kld_mean']:.5f}, top-1 {row['top1_agreement']:.4f}, "
                  f"{row['tokens']} tokens ({result['dtype']})", flush=True)
        if args.compare:
            memory = _run_child(["--child-memory", str(folder)])
            print(f"in memory (bf16): peak RSS {memory['peak_rss_mb']:.0f} MiB, "
                  f"{memory['seconds']:.0f} s for the reference and the "
                  f"{len(CONFIGS)} configurations")
            for label in CONFIGS:
                diff = _equal_rows(memory["rows"][label], streamed[label]["row"])
                print(f"{label:>12}: streamed == in memory: "
                      f"{'yes' if not diff else 'NO, ' + ', '.join(diff)}")
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
