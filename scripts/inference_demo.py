"""Sparse vs dense Llama-style model on the GPU: scoring (prefill) and greedy generation speed.

The model is built from a config with RANDOM weights (nothing is downloaded), and every linear of its decoder
layers is magnitude-pruned to --sparsity; the numbers say how fast, not how good. The sparse model is a copy
of the dense twin converted with ``sparsetrain.inference.to_inference(mode="compressed")``; both run in the
same process.

    PYTHONUNBUFFERED=1 python scripts/inference_demo.py --out $OUT                # 8 layers, 4096 / 14336
    PYTHONUNBUFFERED=1 python scripts/inference_demo.py --layers 2 --out $OUT     # quick check

Measures (medians of several runs, CUDA-synchronized wall time):
- scoring: one forward over [batch, prompt] tokens (more than 64 tokens per call: the sparse layers expand
  their weights to dense and call cuBLAS, so this shows the cost of that path);
- generation: ``model.generate`` greedy, ``--new-tokens`` tokens per sequence (includes the Python and launch
  overhead of Hugging Face's loop, which is the same for both models);
- decode-step linears: the 7 x layers linear layers of one decode step replayed from a CUDA graph (the part
  the compressed format changes, without Python overhead).
Writes ``inference_demo.json`` under --out and prints a table last.
"""
from __future__ import annotations

import argparse
import copy
import datetime
import json
import os
import statistics
import sys
import time

import torch
from torch import nn

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from sparsetrain.inference import SparseInferenceLinear, to_inference  # noqa: E402


def magnitude_prune_(model: nn.Module, sparsity: float) -> None:
    """Zeros the smallest-|w| fraction `sparsity` of every decoder-layer linear (per layer)."""
    with torch.no_grad():
        for name, m in model.named_modules():
            if isinstance(m, nn.Linear) and ".layers." in f".{name}.":
                w = m.weight
                k = max(1, int(sparsity * w.numel()))
                threshold = w.abs().flatten().float().kthvalue(k).values
                w.masked_fill_(w.abs() <= threshold.to(w.dtype), 0)


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(fn, reps: int) -> float:
    """Median seconds of `reps` runs after one warm-up."""
    fn()
    sync()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def graph_time_ms(fn, reps: int = 20) -> float:
    """Milliseconds per replay of fn captured in a CUDA graph (plain timing in a CPU smoke run)."""
    if not torch.cuda.is_available():
        return timed(fn, reps) * 1e3
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, stream=s):  # same stream as the warm-up: the split-K workspace already exists
        fn()
    import triton.testing
    return triton.testing.do_bench(g.replay, warmup=25, rep=200, return_mode="median")


def model_bytes(model: nn.Module) -> int:
    tensors = {t.data_ptr(): t for t in list(model.parameters()) + list(model.buffers())}
    return sum(t.numel() * t.element_size() for t in tensors.values())


def decode_linears(model: nn.Module) -> list[nn.Module]:
    return [m for name, m in model.named_modules()
            if isinstance(m, (nn.Linear, SparseInferenceLinear)) and ".layers." in f".{name}."]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--intermediate", type=int, default=14336)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--sparsity", type=float, default=0.8)
    ap.add_argument("--fmt", default="auto", choices=["auto", "bitmap", "csl", "pair"],
                    help="compressed format of the sparse model's linears (see sparsetrain.kernels.spmm)")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--prompt", type=int, default=512, help="tokens per sequence for scoring")
    ap.add_argument("--gen-prompt", type=int, default=16, help="prompt tokens before generation")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()

    from transformers import LlamaConfig, LlamaForCausalLM

    dev = "cuda" if torch.cuda.is_available() else "cpu"  # cpu: smoke run under TRITON_INTERPRET=1 only
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
                         num_hidden_layers=args.layers, num_attention_heads=args.heads,
                         num_key_value_heads=args.kv_heads, max_position_embeddings=4096)
    t0 = time.perf_counter()
    dtype = torch.float16 if dev == "cuda" else torch.float32
    torch.set_default_dtype(dtype)
    with torch.device(dev):
        dense = LlamaForCausalLM(config).eval()
    torch.set_default_dtype(torch.float32)
    magnitude_prune_(dense, args.sparsity)
    build_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    sparse = copy.deepcopy(dense)
    with torch.no_grad():
        sparse, swaps = to_inference(sparse, min_sparsity=0.5, mode="compressed", fmt=args.fmt)
    sync()
    convert_s = time.perf_counter() - t0
    dense_lin_bytes = sum(s.dense_bytes for s in swaps)
    sparse_lin_bytes = sum(s.stored_bytes for s in swaps)
    print(f"built in {build_s:.1f}s, converted {len(swaps)} linears in {convert_s:.1f}s; "
          f"linear weights {dense_lin_bytes / 2**30:.2f} GiB dense -> {sparse_lin_bytes / 2**30:.2f} GiB")

    result = {"device": torch.cuda.get_device_name(0) if dev == "cuda" else "cpu",
              "date": datetime.date.today().isoformat(),
              "torch": torch.__version__, "args": vars(args), "weights": "random, magnitude-pruned",
              "swapped_linears": len(swaps), "compressed_linears": sum(s.compressed for s in swaps),
              "linear_GiB_dense": dense_lin_bytes / 2**30, "linear_GiB_sparse": sparse_lin_bytes / 2**30,
              "model_GiB_dense": model_bytes(dense) / 2**30, "model_GiB_sparse": model_bytes(sparse) / 2**30}
    g = torch.Generator(device=dev).manual_seed(1)
    with torch.no_grad():
        # scoring (prefill)
        ids = torch.randint(0, args.vocab, (args.batch, args.prompt), device=dev, generator=g)
        for tag, model in (("dense", dense), ("sparse", sparse)):
            t = timed(lambda model=model: model(ids, use_cache=False), args.reps)
            result[f"score_{tag}_tok_s"] = args.batch * args.prompt / t
        logits_d = dense(ids[:, :32], use_cache=False).logits.float()
        logits_s = sparse(ids[:, :32], use_cache=False).logits.float()
        result["logits_rel_err_32_tokens"] = float((logits_s - logits_d).norm() / logits_d.norm())
        # greedy generation
        prompt = ids[:, :args.gen_prompt]
        gen_kw = dict(max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, do_sample=False,
                      pad_token_id=0)
        outs = {}
        for tag, model in (("dense", dense), ("sparse", sparse)):
            outs[tag] = model.generate(prompt, **gen_kw)
            t = timed(lambda model=model: model.generate(prompt, **gen_kw), args.reps)
            result[f"gen_{tag}_tok_s"] = args.batch * args.new_tokens / t
        new_d, new_s = outs["dense"][:, args.gen_prompt:], outs["sparse"][:, args.gen_prompt:]
        result["greedy_tokens_equal_fraction"] = float((new_d == new_s).float().mean())
        # decode-step linears from a CUDA graph (N = batch tokens per linear)
        for tag, model in (("dense", dense), ("sparse", sparse)):
            layers = decode_linears(model)
            xs = [torch.randn(args.batch, lay.in_features, device=dev, dtype=dtype) for lay in layers]
            result[f"step_linears_{tag}_ms"] = graph_time_ms(
                lambda layers=layers, xs=xs: [lay(x) for lay, x in zip(layers, xs, strict=True)])
    for key in ("score", "gen"):
        result[f"{key}_speedup"] = result[f"{key}_sparse_tok_s"] / result[f"{key}_dense_tok_s"]
    result["step_linears_speedup"] = result["step_linears_dense_ms"] / result["step_linears_sparse_ms"]
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "inference_demo.json"), "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps(result, indent=1))
    print("\n| measure | dense | sparse | sparse/dense |\n|---|---|---|---|")
    print(f"| model weights GiB | {result['model_GiB_dense']:.2f} | {result['model_GiB_sparse']:.2f} | "
          f"{result['model_GiB_sparse'] / result['model_GiB_dense']:.2f}x |")
    print(f"| scoring tok/s ({args.batch}x{args.prompt}) | {result['score_dense_tok_s']:.0f} | "
          f"{result['score_sparse_tok_s']:.0f} | {result['score_speedup']:.2f}x |")
    print(f"| greedy generation tok/s (batch {args.batch}) | {result['gen_dense_tok_s']:.1f} | "
          f"{result['gen_sparse_tok_s']:.1f} | {result['gen_speedup']:.2f}x |")
    print(f"| decode-step linears, CUDA graph, ms | {result['step_linears_dense_ms']:.3f} | "
          f"{result['step_linears_sparse_ms']:.3f} | {result['step_linears_speedup']:.2f}x |")


if __name__ == "__main__":
    main()
