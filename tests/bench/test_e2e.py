"""``sparsetrain bench e2e``: arguments, the table's ratios and the update-cost estimate on hand-written run
directories, the kernel classifier, the profiled-steps wrapper on a tiny CPU run, and one smoke run through the
real CLI."""
import json
import subprocess
import sys

import pytest
import torch

from sparsetrain.bench import BENCHES, e2e
from sparsetrain.bench import _e2e_breakdown as bd
from sparsetrain.bench import _e2e_report as e2e_report
from sparsetrain.bench import _e2e_runs as e2e_runs
from sparsetrain.bench import _e2e_variants as e2e_variants
from sparsetrain.training.metrics import update_cost


# ---- arguments and overrides --------------------------------------------------------------------------
def test_defaults_and_recipe_map():
    args = e2e.parse_args([])
    assert [v.name for v in args.variant_list] == ["dense", "static_b64", "static_b16", "dynamic_b16"]
    assert args.modes == ["eager", "graph", "compiled"] and args.batch == 256 and args.seq == 128
    assert args.breakdown == ["dense", "static_b16"] and not args.keep and "e2e" in BENCHES

    args = e2e.parse_args(["--recipe-map", "dense=quickstart:sparsity=dense trainer=cpu_small",
                           "--recipe-map", "tiny=quickstart", "--variants", "dense,tiny", "--modes", "eager",
                           "--extra", "+model.attention_probs_dropout_prob=0.0 trainer.seed=1", "--breakdown", "none"])
    Variant = e2e_variants.Variant
    assert args.variant_list == [Variant("dense", "quickstart", ("sparsity=dense", "trainer=cpu_small")),
                                 Variant("tiny", "quickstart")]
    assert args.modes == ["eager"] and args.breakdown == []
    assert args.extra == ["+model.attention_probs_dropout_prob=0.0", "trainer.seed=1"]
    large = e2e.parse_args(["--model", "bert_large"])
    assert large.batch == 256 and [v.recipe for v in large.variant_list] == [
        "bert_large_dense", "bert_large_static", "bert_large_static", "bert_large_dynamic"]
    vit_large = e2e.parse_args(["--model", "vit_large"])
    assert vit_large.batch == 128 and [v.recipe for v in vit_large.variant_list] == [
        "vit_large_dense", "vit_large_static", "vit_large_static", "vit_large_dynamic", "vit_24_sparse_then_dense"]
    vit = e2e.parse_args(["--model", "vit"])
    assert vit.batch == 256 and [v.recipe for v in vit.variant_list][:3] == ["vit_base_dense", "vit_base_static",
                                                                             "vit_base_static"]


@pytest.mark.parametrize("argv", [["--variants", "dense,nope"], ["--modes", "eager,fast"],
                                  ["--recipe-map", "no_recipe"], ["--steps", "0"], ["--repeat", "0"]])
def test_bad_arguments_exit(argv):
    with pytest.raises(SystemExit):
        e2e.parse_args(argv)


def test_run_overrides_merge_by_key():
    args = e2e.parse_args(["--steps", "80", "--extra", "trainer.max_steps=90 +model.x=1"])
    facts = {"text": True, "dynamic": True, "has_interval": True, "start": 0.0, "end": 1.0}
    v = e2e_variants.Variant("d", "bert_phase1_dynamic", ("trainer=cpu_small",))
    ov = e2e_variants.run_overrides(v, "graph", args, facts)
    assert ov[0] == "recipe=bert_phase1_dynamic"
    assert "trainer=cpu_small" in ov and "trainer=gpu" not in ov          # the variant's group replaces the bench's
    assert "trainer.max_steps=90" in ov and "trainer.max_steps=80" not in ov  # --extra comes last
    assert {"trainer.cuda_graph=true", "data.seq_len=128", "+model.x=1", "sparsity.scheduler.interval=null",
            "sparsity.scheduler.num_updates=4"} <= set(ov)
    eager = e2e_variants.run_overrides(e2e_variants.Variant("s", "vit_digits"), "eager", args, {"text": False})
    assert "trainer.cuda_graph=false" in eager and not any("seq_len" in o or "num_updates" in o for o in eager)
    assert "trainer.compile=false" in eager and "trainer.compile=false" in ov
    compiled = e2e_variants.run_overrides(v, "compiled", args, facts)
    assert {"trainer.cuda_graph=true", "trainer.compile=true"} <= set(compiled)


def test_auto_updates_fall_inside_windows_with_update_free_windows_left():
    n = e2e_variants.auto_updates(80, 10)
    ups = e2e_variants.update_steps(n, 80)
    assert ups == [16, 32, 48, 64]
    windows = {(u - 1) // 10 for u in ups}
    assert all(u > 10 and (u + 2 - 1) // 10 == (u - 1) // 10 for u in ups)  # update, eager step, re-capture
    assert len(windows) == 4 and 8 - 1 - len(windows) == 3


def test_recipe_facts_read_the_unmodified_recipe():
    f = e2e_variants.recipe_facts(e2e_variants.Variant("d", "bert_phase1_dynamic"))
    assert f["dynamic"] and f["recipe_steps"] == 100000 and f["recipe_num_updates"] == 160
    assert f["recipe_interval"] == 100000 / 160 and f["text"]
    assert not e2e_variants.recipe_facts(e2e_variants.Variant("s", "bert_static"))["dynamic"]
    v = e2e_variants.Variant("v", "vit_24_sparse_then_dense", ("sparsity=dense",))
    assert not e2e_variants.recipe_facts(v)["text"]


# ---- the table, on hand-written run directories ---------------------------------------------------------
def fake_run(path, window_s, peak=None, updates=(), captures=0, eager=80, items=1000, flops=None, choices=None):
    """A run dir of 8 windows of 10 steps; ``window_s[i]`` seconds for window i."""
    path.mkdir(parents=True)
    rows, elapsed = [], 0.0
    for i, sec in enumerate(window_s):
        elapsed += sec
        row = {"step": 10 * (i + 1), "loss": 1.0, "tokens_per_s": 10 * items / sec, "elapsed_s": elapsed}
        if peak is not None:
            row["peak_mem_gb"] = peak * (i + 1) / len(window_s)
        rows.append(row)
    rows += [{"step": u, "event": "mask_update", "pruned": 5, "regrown": 5} for u in updates]
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    rates = sorted(r["tokens_per_s"] for r in rows if "tokens_per_s" in r)
    (path / "summary.json").write_text(json.dumps({
        "status": "finished", "tokens_per_s": rates[len(rates) // 2], "step_mode": "cuda_graph" if captures else
        "eager", "graph_captures": captures, "graph_replays": 80 - eager, "eager_steps": eager,
        "capture_s": 0.1, "wall_s": elapsed, "flops_per_step_sparse": flops,
        **({"kernel_choices": choices} if choices is not None else {})}))
    return path


def test_table_ratios_and_update_cost(tmp_path):
    def run(name, mode, window_s, peak, **kw):
        extra = {k: kw.pop(k) for k in ("dynamic", "recipe_interval", "items_per_step") if k in kw}
        return {"variant": name, "mode": mode, **extra,
                **e2e_runs.read_run(fake_run(tmp_path / f"{name}-{mode}", window_s, peak, **kw))}

    # update windows (2, 4, 5, 7) take 0.5 s more than the 1.0 s of update-free ones; window 1 is warm-up
    dyn = [5.0, 1.5, 1.0, 1.5, 1.5, 1.0, 1.5, 1.0]
    runs = [run("dense", "eager", [4.0] + [2.0] * 7, 10.0),
            run("dense", "graph", [4.0] + [1.0] * 7, 12.0, captures=1, eager=1, flops=3e12, items_per_step=500),
            run("static", "eager", [4.0] + [1.6] * 7, 5.0), run("static", "graph", [4.0] + [0.5] * 7, 6.0, captures=1,
                                                                eager=1, choices={"cuda": 7, "dense": 5}),
            run("dyn", "graph", dyn, 6.0, updates=[16, 32, 48, 64], captures=5, eager=9, dynamic=True,
                recipe_interval=625.0),
            {"variant": "broken", "mode": "graph", "error": "CUDA out of memory"}]
    rows = {(r["variant"], r["mode"]): r for r in e2e_report.build_table(runs, gemm_tflops=600.0)}
    # 10,000 tokens/s of 500-token steps of 3e12 FLOPs: 60 TFLOP/s, 10% of the GEMM rate; no count: no column
    assert rows["dense", "graph"]["model_tflops"] == pytest.approx(60.0)
    assert rows["dense", "graph"]["of_gemm"] == pytest.approx(0.1)
    assert "model_tflops" not in rows["dense", "eager"] and "of_gemm" not in rows["static", "graph"]
    assert rows["dense", "graph"]["peak_gb"] == 12.0 and rows["dense", "graph"]["windows"][0] == [10, 10, 4.0]
    assert rows["static", "eager"]["x_dense"] == pytest.approx(2.0 / 1.6)        # same mode
    assert rows["static", "eager"]["x_dense_best"] == pytest.approx(1.0 / 1.6)   # dense's fastest mode (graph)
    assert rows["static", "graph"]["x_dense"] == pytest.approx(2.0)
    assert rows["static", "graph"]["x_dense_mem"] == pytest.approx(0.5)
    up = rows["dyn", "graph"]["update"]
    assert up["update_s"] == pytest.approx(0.5) and up["clean_step_s"] == pytest.approx(0.1)
    assert (up["update_windows"], up["clean_windows"]) == (4, 3)
    assert up["amortised_pct"] == pytest.approx(100 * 0.5 / (625 * 0.1))
    # a full-length run: the update-free rate (10,000 tokens/s, as dense graph's) with 0.5 s per 625 steps
    assert rows["dyn", "graph"]["x_dense_at_interval"] == pytest.approx(1 / (1 + 0.5 / (625 * 0.1)))
    assert rows["dyn", "graph"]["x_dense"] < 0.9   # the benchmark's own run, updating every 16 steps
    assert "update" not in rows["static", "graph"] and "x_dense_at_interval" not in rows["static", "graph"]

    text = e2e_report.format_table(list(rows.values()))
    assert "error: CUDA out of memory" in text and "0.80% /625" in text and "500.0" in text
    assert text.splitlines()[0].split()[-3:] == ["x", "dense", "run"]
    assert [ln.split()[-1] for ln in text.splitlines() if ln.startswith("dyn")] == ["0.992"]
    assert [ln.split()[:2] for ln in text.splitlines()[2:]][2] == ["static", "eager"]
    # on cuBLAS: of the tuned block-sparse products, those the dense fallback runs; "-" for a run without any
    head = [c.strip() for c in text.splitlines()[0].split("  ") if c.strip()]
    cells = {tuple(ln.split()[:2]): ln.split() for ln in text.splitlines()[2:] if "error" not in ln}
    assert cells["static", "graph"][head.index("on cuBLAS")] == "5/12"
    assert cells["dense", "graph"][head.index("on cuBLAS")] == "-"


def test_rounds_take_each_ratio_within_its_round_and_show_mean_and_range():
    """--repeat: a ratio is taken against the baseline of its own round (a GPU whose clock drifts slows dense and
    sparse of one round alike), then averaged over the rounds; peaks are the largest; a failed round is left out."""
    def run(variant, rnd, rate, peak, **kw):
        return {"variant": variant, "mode": "compiled", "round": rnd, "rate": rate, "peak_gb": peak,
                "rate_key": "tokens_per_s", **kw}

    runs = [run("dense", 1, 100.0, 10.0), run("sparse", 1, 130.0, 8.0),
            run("dense", 2, 90.0, 10.0), run("sparse", 2, 108.0, 8.5),    # the GPU 10% slower in round 2
            run("dense", 3, 95.0, 10.0), {"variant": "sparse", "mode": "compiled", "round": 3, "error": "OOM"}]
    rows = {r["variant"]: r for r in e2e_report.build_table(runs)}
    sparse = rows["sparse"]
    assert sparse["x_dense"] == pytest.approx((1.3 + 1.2) / 2)          # not 119 / 95 from the pooled rates
    assert sparse["x_dense_range"] == pytest.approx((1.2, 1.3))
    assert sparse["rate"] == pytest.approx(119.0) and sparse["peak_gb"] == 8.5
    assert (sparse["rounds"], sparse["rounds_failed"]) == (2, 1)
    assert sparse["x_dense_mem"] == pytest.approx((0.8 + 0.85) / 2)
    assert rows["dense"]["rounds"] == 3 and rows["dense"]["x_dense_range"] == (1.0, 1.0)
    text = e2e_report.format_table(list(rows.values()))
    head = [c.strip() for c in text.splitlines()[0].split("  ") if c.strip()]
    cells = {ln.split()[0]: ln.split() for ln in text.splitlines()[2:]}
    assert head[4] == "x dense range" and cells["sparse"][4] == "1.200-1.300" and cells["sparse"][5] == "(2)"
    # one round: no range column, the rows as they were
    one = e2e_report.build_table([dict(r, round=1) for r in runs[:2]])
    assert "rounds" not in one[1] and "x dense range" not in e2e_report.format_table(one)


def test_rounds_run_every_variant_before_the_next_round(tmp_path, monkeypatch):
    calls = []

    def train_run(self, variant, mode, facts, index, rnd=1):
        calls.append((variant.name, rnd, index))
        return {"variant": variant.name, "mode": mode, "round": rnd, "rate": 1.0}

    monkeypatch.setattr(e2e_runs.Bench, "train_run", train_run)
    monkeypatch.setattr(e2e_runs, "recipe_facts", lambda v: {})
    monkeypatch.setattr(e2e_runs, "_env", lambda: {})
    args = e2e.parse_args(["--variants", "dense,static_b16", "--modes", "eager", "--repeat", "2", "--breakdown",
                           "none", "--out", str(tmp_path)])
    rows = e2e_runs.Bench(args, []).run()
    assert calls == [("dense", 1, "[1/4]"), ("static_b16", 1, "[2/4]"), ("dense", 2, "[3/4]"),
                     ("static_b16", 2, "[4/4]")]
    assert [(r["variant"], r["rounds"]) for r in rows] == [("dense", 2), ("static_b16", 2)]


def test_plot_shows_a_dynamic_variant_at_the_recipe_interval(tmp_path, monkeypatch):
    import matplotlib.axes

    drawn = []
    real_bar = matplotlib.axes.Axes.bar
    monkeypatch.setattr(matplotlib.axes.Axes, "bar", lambda self, xs, vals, *a, **k: drawn.append(list(vals))
                        or real_bar(self, xs, vals, *a, **k))
    rows = [{"variant": "dense", "mode": "compiled", "x_dense_best": 1.0},
            {"variant": "dyn", "mode": "compiled", "x_dense_best": 0.8, "x_dense_at_interval": 1.12}]
    e2e_report.plot(rows, str(tmp_path / "p.png"), "t")
    assert drawn == [[1.0, 1.12]] and (tmp_path / "p.png").stat().st_size > 5_000


def test_peak_is_the_steady_state_footprint_beside_the_startup_windows(tmp_path):
    """peak GB: the largest per-window `reserved_gb` outside the startup window (the kernel tuner's candidates,
    compile and capture there); startup GB: the startup window's. Runs logged before the per-window figure,
    or with only a startup window, fall back to the largest `peak_mem_gb`; so do rows resumed from an old results
    file, which lack the startup peak (shown as -)."""
    run = fake_run(tmp_path / "new", [4.0, 1.0, 1.0, 1.0])
    window_peaks = [9.0, 5.0, 5.5, 5.25]   # GiB held per window; the cumulative allocated peak: 3.0 throughout
    rows = [json.loads(ln) for ln in (run / "metrics.jsonl").read_text().splitlines()]
    for i, (row, peak) in enumerate(zip(rows, window_peaks, strict=True)):
        row.update(reserved_gb=peak, peak_mem_gb=3.0)
    rows[0]["startup"] = True
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    new = e2e_runs.read_run(run)
    assert (new["peak_gb"], new["startup_peak_gb"]) == (5.5, 9.0)

    old = e2e_runs.read_run(fake_run(tmp_path / "old", [4.0, 1.0, 1.0, 1.0], peak=8.0))   # peak_mem_gb only
    assert (old["peak_gb"], old["startup_peak_gb"]) == (8.0, 8.0)
    one = fake_run(tmp_path / "one", [4.0])                                         # a single (startup) window
    (one / "metrics.jsonl").write_text(json.dumps({"step": 10, "loss": 1.0, "tokens_per_s": 2500.0, "elapsed_s": 4.0,
                                                   "peak_mem_gb": 7.0, "reserved_gb": 7.5, "startup": True}))
    single = e2e_runs.read_run(one)
    assert (single["peak_gb"], single["startup_peak_gb"]) == (7.0, 7.5)
    assert e2e_runs.read_run(fake_run(tmp_path / "cpu", [4.0, 1.0]))["peak_gb"] is None

    resumed = {k: v for k, v in old.items() if k != "startup_peak_gb"}
    table = e2e_report.build_table([{"variant": "dense", "mode": "graph", **resumed},
                                    {"variant": "sparse", "mode": "graph", **new}])
    assert table[1]["x_dense_mem"] == pytest.approx(5.5 / 8.0) and table[1]["startup_peak_gb"] == 9.0
    lines = e2e_report.format_table(table).splitlines()
    head = [c.strip() for c in lines[0].split("  ") if c.strip()]
    assert head[head.index("x mem") + 1] == "startup GB"
    dense, sparse = (dict(zip(head, ln.split(), strict=True)) for ln in lines[2:])
    assert (dense["peak GB"], dense["startup GB"]) == ("8.00", "-")
    assert (sparse["peak GB"], sparse["x mem"], sparse["startup GB"]) == ("5.50", "0.688", "9.00")


def test_steady_rate_takes_update_free_windows_and_spreads_updates_over_the_recipe_interval(tmp_path):
    """A short run's update-heavy schedule does not set its throughput: the clean windows' rate, and that rate
    with one update's cost spread over the recipe's own interval."""
    # 1000 tokens per step (fake_run's items); update windows (2, 4, 5, 7) 0.5 s slower than the 1.0 s clean ones
    run = e2e_runs.read_run(fake_run(tmp_path / "dyn", [5.0, 1.5, 1.0, 1.5, 1.5, 1.0, 1.5, 1.0],
                                     updates=[16, 32, 48, 64]))
    st = e2e_report.steady_rate(run, interval=625.0)
    assert st["clean_rate"] == pytest.approx(10_000.0)         # windows 3, 6, 8: 10 steps of 1000 tokens per 1.0 s
    assert st["update_s"] == pytest.approx(0.5)
    assert st["rate_at_interval"] == pytest.approx(10_000.0 / (1 + 0.5 / (625 * 0.1)))
    assert e2e_report.steady_rate(run, interval=None)["rate_at_interval"] == pytest.approx(10_000.0)
    static = e2e_runs.read_run(fake_run(tmp_path / "static", [5.0] + [2.0] * 7))
    assert e2e_report.steady_rate(static, None) == {"clean_rate": pytest.approx(5000.0),
                                                    "rate_at_interval": pytest.approx(5000.0), "interval": None}
    assert e2e_report.steady_rate(e2e_runs.read_run(fake_run(tmp_path / "short", [5.0])), None) is None


def test_update_cost_leaves_out_warmup_and_aftermath_windows():
    windows = [[10, 10, 9.0], [20, 10, 1.3], [30, 10, 1.2], [40, 10, 1.0], [50, 10, 1.0]]
    # update at 20 (end of window 2): its eager step and re-capture land in window 3, which counts for neither
    cost = update_cost(windows, [20])
    assert (cost["update_windows"], cost["clean_windows"]) == (1, 2)
    assert cost["update_s"] == pytest.approx(0.3)
    assert update_cost(windows, []) is None and update_cost(windows[:2], [15]) is None


# ---- the breakdown --------------------------------------------------------------------------------------
@pytest.mark.parametrize("name,category", [
    ("nvjet_tst_128x256_64x4_1x2_h_bz_coopA_NTN", "linears"),
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1", "linears"),
    ("void cutlass::Kernel2<cutlass_80_tensorop_bf16_s16816gemm_relu_bf16_64x64_64x4_tn_align8>", "linears"),
    ("ampere_bf16_s16816gemm_bf16_128x128_ldg8_f2f_stages_32x5_tn", "linears"),
    ("void bs_dds_kernel<true, 16, 64, 4, 3>(Args)", "block-sparse"),
    ("bs_dw_kernel", "block-sparse"),
    ("dense_x_blocksparse_tma_kernel", "block-sparse"),
    ("sampled_grad_kernel", "block-sparse"),
    ("void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<64, 128, 128, 4>>", "attention"),
    ("fmha_cutlassB_bf16_aligned_64x64_k64_sm80", "attention"),
    ("cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_3_64x64x64", "attention"),
    ("void at::native::(anonymous namespace)::efficient_attention_backward<float>", "attention"),
    ("void at::native::(anonymous namespace)::fused_adamw_kernel", "optimizer"),
    ("void at::native::multi_tensor_apply_kernel<at::native::TensorListMetadata<4>, FusedAdamMathFunctor>",
     "optimizer"),
    ("void at::native::(anonymous namespace)::multi_tensor_apply_kernel<TensorListMetadata<1>, LpNormFunctor<float>>",
     "optimizer"),  # the foreach gradient-norm of the clip
    ("void splitKreduce_kernel<32, 16, int, float, __nv_bfloat16, float, __nv_bfloat16, true>", "linears"),
    ("void cublasLt::epilogue::impl::globalKernel<8, 32, float, float, __nv_bfloat16>", "linears"),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::GeluCUDAKernelImpl>", "elementwise"),
    ("void at::native::(anonymous namespace)::vectorized_layer_norm_kernel<c10::BFloat16>", "elementwise"),
    ("Memcpy HtoD (Pinned -> Device)", "elementwise"),
])
def test_classify_kernel(name, category):
    assert bd.classify_kernel(name) == category


def test_breakdown_per_step_and_host_gaps():
    kernels = [("nvjet_a", 3000.0), ("bs_dds_kernel", 1500.0), ("flash_fwd", 600.0), ("fused_adamw", 300.0),
               ("layer_norm", 600.0)]
    b = bd.breakdown(kernels, wall_s=0.009, steps=3)
    assert b["ms_per_step"] == pytest.approx({"block-sparse": 0.5, "attention": 0.2, "linears": 1.0,
                                              "optimizer": 0.1, "elementwise": 0.2})
    assert b["kernels_ms"] == pytest.approx(2.0) and b["wall_ms"] == pytest.approx(3.0)
    assert b["host_gaps_ms"] == pytest.approx(1.0) and b["top_kernels"][0][:2] == ["nvjet_a", 1.0]
    text = bd.format_breakdown({"dense-eager": {**b, "head_flops_share": 0.12}, "x-graph": {"error": "boom"}})
    assert "12.0%" in text and "error: boom" in text
    # the largest TOP_KERNELS kernels by name, a kernel launched several times summed (a ViT-B 2:4 step's mask
    # kernel was not among the 15 the JSON used to list)
    many = [(f"k{i:02d}", 100.0 + i) for i in range(60)] + [("k00", 1000.0)]
    top = bd.breakdown(many, wall_s=1.0, steps=1)["top_kernels"]
    assert len(top) == bd.TOP_KERNELS == 50 and top[0][:2] == ["k00", 1.1]
    assert [t[0] for t in top[1:3]] == ["k59", "k58"] and top[-1][0] == "k11"


def test_profiled_train_profiles_whole_loop_iterations(tmp_path, monkeypatch):
    """A tiny in-process CPU run: start() before step 2, stop() before step 5, the wrapper removed afterwards."""
    from sparsetrain.config import build_run, compose
    from sparsetrain.training.step import TrainStep

    original, real_eager, calls = TrainStep.__call__, TrainStep._eager, []

    def eager(self, batches):
        calls.append("step")
        return real_eager(self, batches)

    monkeypatch.setattr(TrainStep, "_eager", eager)
    spec = build_run(compose(["recipe=quickstart", "trainer.max_steps=5", "trainer.batch_size=4", "data.seq_len=32",
                              "trainer.eval_every=0", "trainer.log_every=5", "logger=quiet", "logger.plot=false",
                              "trainer.cuda_graph=false"]))
    info = bd.profiled_train(spec, tmp_path / "run", 2, 3, lambda: calls.append("start"),
                             lambda: calls.append("stop"))
    assert info == {"steps": 3, "calls": 5}
    assert calls == ["step", "start", "step", "step", "step", "stop", "step"]
    assert TrainStep.__call__ is original
    with pytest.raises(RuntimeError, match="before step 9"):
        bd.profiled_train(build_run(compose(["recipe=quickstart", "trainer.max_steps=2", "trainer.batch_size=4",
                                             "data.seq_len=32", "trainer.eval_every=0", "logger=quiet",
                                             "logger.plot=false"])),
                          tmp_path / "run2", 6, 3, lambda: None, lambda: None)


def test_step_counts_give_the_head_share_and_the_floor_on_a_known_card():
    overrides = ["recipe=quickstart", "sparsity=dense", "data.seq_len=64"]
    counts = bd.step_counts(overrides, "NVIDIA H200")
    assert 0.05 < counts["head_flops_share"] < 0.6 and counts["floor_card"] == "NVIDIA H200"
    assert set(counts["floor_ms"]) == set(bd.CATEGORIES) and counts["floor_ms"]["linears"] > 0
    assert counts["floor_ms"]["block-sparse"] == 0                    # dense: no block-sparse work
    other = bd.step_counts(overrides, "NVIDIA A100-SXM4-80GB")
    assert other["floor_ms"] is None and other["head_flops_share"] == counts["head_flops_share"]


def test_breakdown_prints_the_floor_under_a_run_on_a_known_card():
    b = bd.breakdown([("nvjet_a", 3000.0), ("layer_norm", 600.0)], wall_s=0.006, steps=3)
    floor = dict.fromkeys(bd.CATEGORIES, 0.1) | {"linears": 0.5}
    text = bd.format_breakdown({"dense-graph": {**b, "head_flops_share": 0.1, "floor_ms": floor,
                                                "floor_card": "NVIDIA H200"}})
    lines = text.splitlines()
    floor_row = next(x.split() for x in lines if x.startswith("  floor"))
    times_row = next(x.split() for x in lines if x.startswith("  x floor"))
    assert floor_row[-2:] == ["NVIDIA", "H200"] and float(floor_row[-3]) == pytest.approx(0.9)
    assert times_row[2 + 2] == "2.0" and times_row[-1] == "2.2"   # linears 1.0 / 0.5; wall 2.0 / 0.9


# ---- the real thing -------------------------------------------------------------------------------------
def test_module_is_cheap_to_import():
    code = ("import sys, sparsetrain; a = set(sys.modules); import sparsetrain.bench.e2e; "
            "print(sorted(set(sys.modules) - a))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == ("['sparsetrain.bench', 'sparsetrain.bench._child', 'sparsetrain.bench._e2e_breakdown', "
                           "'sparsetrain.bench._e2e_report', 'sparsetrain.bench._e2e_runs', "
                           "'sparsetrain.bench._e2e_variants', 'sparsetrain.bench._gpu_clock', 'sparsetrain.bench.e2e']")


def test_stop_signal_saves_finished_runs_and_exits_128_plus_signal(tmp_path, monkeypatch, capsys):
    import signal

    from sparsetrain.bench._child import Stopped

    def stopped_run(self):
        self.done["dense-eager"] = {"key": "[]", "result": {"variant": "dense"}}  # one finished run
        raise Stopped(signal.SIGTERM)

    monkeypatch.setattr(e2e_runs.Bench, "run", stopped_run)
    rc = e2e.main(["--variants", "dense", "--modes", "eager", "--out", str(tmp_path)])
    err = capsys.readouterr().err
    assert rc == 128 + signal.SIGTERM
    assert "stopped by SIGTERM" in err and f"--out {tmp_path} --resume" in err
    assert "dense-eager" in json.loads((tmp_path / e2e_runs.RESULTS_FILE).read_text())["done"]


def test_smoke_two_variants_through_the_cli(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")
    out, js, png = tmp_path / "runs", tmp_path / "e2e.json", tmp_path / "e2e.png"
    rc = e2e.main(["--model", "bert", "--recipe-map", "dense=quickstart:sparsity=dense trainer=cpu_small",
                   "--recipe-map", "static_b16=quickstart:sparsity=static sparsity.block=16 trainer=cpu_small",
                   "--variants", "dense,static_b16", "--modes", "eager,graph", "--steps", "3", "--log-every", "1",
                   "--batch", "8", "--seq", "32", "--out", str(out), "--json", str(js), "--plot", str(png)])
    text = capsys.readouterr().out
    assert rc == 0, text
    if not torch.cuda.is_available():
        assert "graph mode needs a CUDA GPU; skipped" in text
        assert "breakdown needs a CUDA GPU" in text
    table = text.split("==== end-to-end training throughput ====")[1]
    rows = {tuple(ln.split()[:2]): ln.split() for ln in table.splitlines()[3:] if ln.startswith(("dense", "static"))}
    assert rows["dense", "eager"][3] == "1.000" and float(rows["static_b16", "eager"][3]) > 0
    saved = json.loads(js.read_text())
    static = next(r for r in saved["table"] if r["variant"] == "static_b16" and r["mode"] == "eager")
    assert static["x_dense"] > 0 and static["eager_steps"] == 3 and static["rate_key"] == "tokens_per_s"
    assert png.stat().st_size > 5_000
    assert not (out / "dense-eager").exists()   # run dirs are removed once read (no --keep)


@pytest.mark.gpu
def test_gpu_graph_mode_and_breakdown(tmp_path, capsys):
    js = tmp_path / "e2e.json"
    rc = e2e.main(["--recipe-map", "dense=quickstart:sparsity=dense",
                   "--recipe-map", "static_b16=quickstart:sparsity=static sparsity.block=16 sparsity.format=block",
                   "--variants", "dense,static_b16", "--steps", "12", "--log-every", "4", "--batch", "16",
                   "--seq", "64", "--profile-at", "3", "--modes", "eager,graph",   # compiled: tests/training
                   "--out", str(tmp_path / "runs"), "--json", str(js)])
    assert rc == 0, capsys.readouterr().out
    saved = json.loads(js.read_text())
    graph = [r for r in saved["table"] if r["mode"] == "graph"]
    assert len(graph) == 2 and all(r["graph_captures"] >= 1 and r["peak_gb"] > 0 for r in graph)
    for name in ("dense-eager", "dense-graph", "static_b16-eager", "static_b16-graph"):
        b = saved["breakdown"][name]
        assert b["kernels_ms"] > 0 and b["ms_per_step"]["linears"] + b["ms_per_step"]["block-sparse"] > 0
        assert 0 < b["head_flops_share"] < 1
    assert saved["breakdown"]["static_b16-eager"]["ms_per_step"]["block-sparse"] > 0


def test_a_run_whose_measured_windows_differ_is_named_under_the_table():
    # the windows of the ViT-B/16 2:4 run of 2026-11-29 (H200): its last window held the switch to dense at the final
    # step (83.8 against 91.2 ms a step); dense's windows of the same round differ by 1.9%
    semi24 = {"variant": "semi24", "mode": "compiled", "round": 2, "updates": [],
              "windows": [[10, 10, 6.4789], [20, 10, 0.8422], [30, 10, 0.9110]]}
    dense = {"variant": "dense", "mode": "compiled", "round": 2, "updates": [],
             "windows": [[10, 10, 5.5521], [20, 10, 0.8081], [30, 10, 0.8184]]}
    # a dynamic run's update windows are not compared (their cost is the update column's)
    dynamic = {"variant": "dyn", "mode": "compiled", "updates": [25],
               "windows": [[10, 10, 5.0], [20, 10, 0.80], [30, 10, 1.60]]}
    lines = e2e_report.uneven_windows([semi24, dense, dynamic])
    assert len(lines) == 1 and lines[0].startswith("uneven windows: semi24 compiled round 2:")
    assert "to step 20: 84.2" in lines[0] and "to step 30: 91.1" in lines[0]
