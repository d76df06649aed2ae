"""The BERT-base MLM training step of ``sparsetrain bench blocksparse --sections bert``: dense vs every encoder
linear (72) 90% sparse in ``b x b`` blocks (bf16 autocast, fused AdamW, 64 x 128 tokens), eager and optionally
replayed from one CUDA graph."""
from __future__ import annotations

import traceback
from collections.abc import Callable

import torch

from sparsetrain.bench._timing import cuda_ms, kernel_profile
from sparsetrain.kernels.blocksparse.tuner import dense_fallback_report

DEV = "cuda"


def state_bytes(module: torch.nn.Module, opt: torch.optim.Optimizer) -> dict:
    """Bytes of the parameters, the optimizer state and the buffers (block metadata) of ``module``."""
    params = sum(p.numel() * p.element_size() for p in module.parameters())
    state = sum(t.numel() * t.element_size() for s in opt.state.values() for t in s.values() if torch.is_tensor(t))
    bufs = sum(t.numel() * t.element_size() for t in module.buffers())
    return {"params": params, "adam_state": state, "buffers": bufs, "total": params + state + bufs}


def _graphed_step_ms(model, ids, labels, n: int, profile_label: str | None, say) -> tuple[float, float, float, dict]:
    """The whole step (bf16-autocast forward, backward, fused capturable AdamW) replayed from one CUDA graph:
    the GPU-side step time without the host's per-op work. Returns (ms per replay, the last replay's loss, ms of
    the same step run eagerly, the replays' kernel profile when ``profile_label`` is given). The autocast cache
    is off, as capture needs."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True, capturable=True)

    def body():
        with torch.autocast("cuda", dtype=torch.bfloat16, cache_enabled=False):
            loss = model(input_ids=ids, labels=labels).loss
        loss.backward()
        opt.step()
        return loss

    def eager():
        opt.zero_grad(set_to_none=True)
        body()

    for _ in range(3):
        eager()
    eager_ms = cuda_ms(eager, n)[0]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            opt.zero_grad(set_to_none=True)
            body()
    torch.cuda.current_stream().wait_stream(side)
    opt.zero_grad(set_to_none=True)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_loss = body()
    for _ in range(3):
        graph.replay()
    ms = cuda_ms(graph.replay, n)[0]
    prof = kernel_profile(graph.replay, profile_label, say) if profile_label else None
    return ms, static_loss.item(), eager_ms, prof


def _model(kind: str):
    from transformers import BertConfig, BertForMaskedLM

    from sparsetrain.nn import SparseLinear

    torch.manual_seed(0)
    cfg = BertConfig()
    model = BertForMaskedLM(cfg).to(DEV).train()
    if kind != "dense":
        block = int(kind.split("_")[0][len("block"):])
        for name, mod in list(model.named_modules()):
            for child_name, child in list(mod.named_children()):
                if isinstance(child, torch.nn.Linear) and ".encoder.layer." in f"{name}.{child_name}":
                    setattr(mod, child_name, SparseLinear.from_dense(child, density=0.1, block=block,
                                                                     format="block"))
    return model, cfg.vocab_size


def sec_bert(args, say: Callable[[str], None]) -> dict:
    from sparsetrain.nn import SparseLinear

    out: dict = {}
    seen = {r["key"] for r in dense_fallback_report()}  # products tuned by earlier sections are not this one's
    B, S, n = 64, 128, 20
    kinds = ["dense"] + [f"block{b}_d0.1" for b in (int(v) for v in args.bert_blocks.split(","))]
    for kind in kinds:
        torch.cuda.empty_cache()
        model, vocab = _model(kind)
        n_swapped = sum(isinstance(m, SparseLinear) for m in model.modules())
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
        ids = torch.randint(0, vocab, (B, S), device=DEV)
        labels = ids.masked_fill(torch.rand(B, S, device=DEV) > 0.15, -100)

        def step(model=model, opt=opt, ids=ids, labels=labels):
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(input_ids=ids, labels=labels).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            return loss

        for _ in range(5):
            step()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        ms, loss = cuda_ms(step, n)
        peak = torch.cuda.max_memory_allocated()
        st = state_bytes(model, opt)
        if args.bert_profile:  # where the step's GPU time goes
            out.setdefault("profile", {})[kind] = kernel_profile(step, f"bert {kind}", say)
        if args.bert_graph:
            loss = loss.detach()  # an eager autograd graph kept alive would pin AccumulateGrad to the eager stream
            try:
                graph_ms, graph_loss, same_eager_ms, _ = _graphed_step_ms(
                    model, ids, labels, n, f"bert {kind} graph" if args.bert_profile else None, say)
            except Exception as e:  # noqa: BLE001 - the eager numbers of this section still stand
                traceback.print_exc()
                say(f"bert {kind}: CUDA-graph capture FAILED: {e!r}"[:300])
                args.bert_graph = False
            else:
                out.setdefault("graph_ms", {})[kind] = graph_ms
                out.setdefault("graph_settings_eager_ms", {})[kind] = same_eager_ms
                say(f"bert {kind}: whole step replayed from one CUDA graph: {graph_ms:.2f} ms/step (loss "
                    f"{graph_loss:.3f}); the same step eagerly (no autocast cache, capturable AdamW): "
                    f"{same_eager_ms:.2f} ms")
        fallback = [r for r in dense_fallback_report() if r["key"] not in seen]
        seen.update(r["key"] for r in fallback)
        out[kind] = {"step_ms": ms, "tokens_per_s": B * S / (ms * 1e-3), "peak_bytes": peak,
                     "loss": loss.item(), "swapped_linears": n_swapped, **st, "dense_fallback": fallback}
        if fallback:
            say(f"bert {kind}: dense fallback chosen for {sum(r['chosen'] == 'dense' for r in fallback)} of "
                f"{len(fallback)} tuned products")
        say(f"bert {kind}: {ms:.2f} ms/step, {B * S / (ms * 1e-3):,.0f} tok/s, peak {peak / 2**30:.2f} GiB, "
            f"params+adam {st['total'] / 2**20:.0f} MiB, loss {loss.item():.3f}, swapped {n_swapped}")
        del model, opt, step
    d = out["dense"]
    for kind in kinds[1:]:
        s = out[kind]
        r = out[f"ratio_{kind}"] = {"tokens_per_s": s["tokens_per_s"] / d["tokens_per_s"],
                                    "peak": s["peak_bytes"] / d["peak_bytes"], "params_adam": s["total"] / d["total"]}
        if args.bert_graph:
            r["graph_tokens_per_s"] = out["graph_ms"]["dense"] / out["graph_ms"][kind]
        say(f"bert ratio {kind}/dense: tokens/s {r['tokens_per_s']:.2f}x"
            + (f" (from a CUDA graph {r['graph_tokens_per_s']:.2f}x)" if args.bert_graph else "")
            + f", peak memory {r['peak']:.2f}x, params+adam {r['params_adam']:.2f}x")
    return out
