"""Sparse inference: swap pruned ``nn.Linear`` layers for compressed ones; save and load compressed models.

Example (a magnitude-pruned Llama built from its config; nothing is downloaded)::

    model, swaps = to_inference(model, mode="compressed")  # Linear -> SparseInferenceLinear where sparse
    save_sparse(model, "out/sparse")                        # bitmaps + values + the dense rest + config.json
    model2 = load_sparse(lambda: LlamaForCausalLM(config), "out/sparse")
    export_hf(plain_model_with_zeros, "out/hf")             # save_pretrained, zeros included

Compressed layers go through :func:`sparsetrain.kernels.spmm.spmm_infer`: up to 64 tokens per call run
the compressed kernel; more tokens (prefill) expand the weight to a transient dense matrix and call cuBLAS.
``mode="auto"`` (the default of :func:`to_inference`) compresses only above the measured break-even sparsity
(``BREAK_EVEN_SPARSITY``); on the H200 no sparsity beat cuBLAS on every shape (CUDA kernel: 0.78-1.05x at
N = 16), so "auto" keeps weights dense and ``mode="compressed"`` is the memory-saving choice
(docs/history/inference.md).
"""
from sparsetrain.inference.checkpoint import FORMAT_VERSION, export_hf, load_sparse, save_sparse
from sparsetrain.inference.convert import LayerSwap, to_dense_linears, to_inference
from sparsetrain.inference.linear import MODES, SparseInferenceLinear, weight_sparsity

__all__ = ["FORMAT_VERSION", "MODES", "LayerSwap", "SparseInferenceLinear", "export_hf", "load_sparse", "save_sparse",
           "to_dense_linears", "to_inference", "weight_sparsity"]
