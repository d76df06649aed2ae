"""Model builders: every named size has the documented shape; small ones run forward and backward."""

import pytest
import torch

from sparsetrain.models.builders import MODEL_SIZES, build_config, build_model

EXPECTED = {  # (layers, hidden, heads) from the brief, restated here so a typo in MODEL_SIZES is caught
    ("bert", "tiny"): (2, 128, 2),
    ("bert", "mini"): (4, 256, 4),
    ("bert", "small"): (4, 512, 8),
    ("bert", "medium"): (8, 512, 8),
    ("bert", "base"): (12, 768, 12),
    ("bert", "large"): (24, 1024, 16),
    ("vit", "tiny"): (12, 192, 3),
    ("vit", "small"): (12, 384, 6),
    ("vit", "base"): (12, 768, 12),
    ("vit", "large"): (24, 1024, 16),
}


@pytest.mark.parametrize("arch,size", sorted(EXPECTED))
def test_every_size_has_the_documented_config(arch, size):
    assert size in MODEL_SIZES[arch]
    config = build_config(arch, size, vocab_size=1000, seq_len=256, image_size=64, patch_size=8)
    layers, hidden, heads = EXPECTED[(arch, size)]
    assert (config.num_hidden_layers, config.hidden_size, config.num_attention_heads) == (
        layers,
        hidden,
        heads,
    )
    assert config.intermediate_size == 4 * hidden
    if arch == "bert":
        assert config.vocab_size == 1000 and config.max_position_embeddings >= 256
    else:
        assert (config.image_size, config.patch_size, config.num_labels) == (64, 8, 10)


def test_sizes_table_matches_the_documented_set():
    assert {(a, s) for a in MODEL_SIZES for s in MODEL_SIZES[a]} == set(EXPECTED)


@pytest.mark.parametrize("size", ["tiny", "mini"])
def test_bert_forward_backward(size):
    model = build_model("bert", size, vocab_size=300, seq_len=32)
    layers, hidden, _ = EXPECTED[("bert", size)]
    assert len(model.bert.encoder.layer) == layers and model.bert.embeddings.word_embeddings.weight.shape == (
        300,
        hidden,
    )
    ids = torch.randint(5, 300, (2, 32))
    out = model(input_ids=ids, attention_mask=torch.ones_like(ids), labels=ids)
    assert out.logits.shape == (2, 32, 300) and torch.isfinite(out.loss)
    out.loss.backward()
    assert model.bert.encoder.layer[0].intermediate.dense.weight.grad.abs().sum() > 0


@pytest.mark.parametrize(
    "arch,size", [("bert", "small"), ("bert", "medium"), ("vit", "tiny"), ("vit", "small")]
)
def test_mid_sizes_instantiate_with_the_right_layers(arch, size):
    layers, hidden, _ = EXPECTED[(arch, size)]
    model = build_model(arch, size, vocab_size=100, seq_len=16, image_size=32, patch_size=8)
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear) and m.out_features == 4 * hidden]
    assert len(linears) == layers  # one MLP up-projection per layer
    assert all(m.in_features == hidden for m in linears)


def test_vit_forward_backward_with_overrides():
    model = build_model("vit", "tiny", image_size=32, patch_size=8, num_labels=7, num_hidden_layers=1)
    assert model.config.num_hidden_layers == 1 and model.config.hidden_size == 192
    out = model(pixel_values=torch.randn(3, 3, 32, 32), labels=torch.tensor([0, 3, 6]))
    assert out.logits.shape == (3, 7) and torch.isfinite(out.loss)
    out.loss.backward()
    assert model.classifier.weight.grad.abs().sum() > 0


def test_attn_implementation_reaches_the_model():
    model = build_model("bert", "tiny", vocab_size=100, seq_len=16, attn_implementation="sdpa")
    assert model.config._attn_implementation == "sdpa"
    eager = build_model("bert", "tiny", vocab_size=100, seq_len=16)
    eager.load_state_dict(model.state_dict())
    model.eval(), eager.eval()
    ids = torch.randint(5, 100, (2, 16))
    torch.testing.assert_close(model(input_ids=ids).logits, eager(input_ids=ids).logits, atol=1e-4, rtol=1e-4)


def test_bad_arguments():
    with pytest.raises(ValueError, match=r"sizes: \['tiny', 'mini', 'small', 'medium', 'base', 'large'\]"):
        build_model("bert", "huge", vocab_size=100)
    with pytest.raises(ValueError, match="vocab_size"):
        build_model("bert", "tiny")
    with pytest.raises(ValueError, match="arch"):
        build_model("gpt", "tiny")
    with pytest.raises(ValueError, match="num_hidden_layer"):
        build_model("bert", "tiny", vocab_size=100, num_hidden_layer=1)  # misspelt override
    with pytest.raises(ValueError, match="patch_size"):
        build_model("vit", "tiny", image_size=30, patch_size=16)
    with pytest.raises(ValueError, match="max_position_embeddings"):
        build_config("bert", "tiny", vocab_size=100, seq_len=128, max_position_embeddings=64)
    with pytest.raises(ValueError, match="name_or_path"):
        build_model("hf")
    with pytest.raises(ValueError, match="task"):
        build_model("hf", name_or_path="some/model", task="translation")


def test_vit_sdpa_builds_no_attention_mask_for_unpadded_images(monkeypatch):
    """A ViT built with "sdpa" attends without a mask when no padding mask is given, even where transformers would
    materialise an all-True one (while torch.compile traces or a CUDA graph is captured): the mask function is not
    reached. Same logits as eager attention; a real padding mask still becomes the [B, 1, S, S] mask."""
    from transformers import masking_utils

    from sparsetrain.models.builders import UNPADDED_SDPA

    torch.manual_seed(0)
    sdpa = build_model("vit", "tiny", image_size=32, patch_size=16, num_labels=10, attn_implementation="sdpa").eval()
    eager = build_model("vit", "tiny", image_size=32, patch_size=16, num_labels=10, attn_implementation="eager")
    eager.load_state_dict(sdpa.state_dict())
    x = torch.randn(3, 3, 32, 32)
    assert sdpa.config._attn_implementation == UNPADDED_SDPA
    assert "_attn_implementation" not in sdpa.config.to_dict()          # not saved with the config
    assert torch.allclose(sdpa(pixel_values=x).logits, eager.eval()(pixel_values=x).logits, atol=1e-5)

    emb = torch.randn(2, 5, sdpa.config.hidden_size)
    pad = torch.ones(2, 5, dtype=torch.long)
    pad[1, 3:] = 0
    built = masking_utils.create_bidirectional_mask(config=sdpa.config, inputs_embeds=emb, attention_mask=pad)
    assert built.shape == (2, 1, 5, 5) and not built[1, 0, 0, 3:].any() and built[0].all()

    # what tracing or capture does: transformers may not look at the mask's values, so it cannot skip it
    monkeypatch.setattr(masking_utils, "_ignore_bidirectional_mask_sdpa", lambda *args, **kwargs: False)
    plain = build_config("vit", "tiny", image_size=32, patch_size=16, num_labels=10, attn_implementation="eager")
    plain._attn_implementation = "sdpa"
    full = masking_utils.create_bidirectional_mask(config=plain, inputs_embeds=emb, attention_mask=None)
    assert full is not None and full.shape == (2, 1, 5, 5) and full.all()     # plain "sdpa": the all-True mask
    assert masking_utils.create_bidirectional_mask(config=sdpa.config, inputs_embeds=emb, attention_mask=None) is None


@pytest.mark.parametrize("backend", ["sdpa_cudnn", "sdpa_flash", "sdpa_efficient"])
def test_a_vit_can_put_one_sdpa_kernel_first(backend):
    """``attn_implementation=sdpa_cudnn`` (flash, efficient): the unpadded SDPA attention with that kernel first on
    CUDA; the same logits as plain "sdpa" (on the CPU it is plain "sdpa"), for a ViT and a BERT; refused for
    pretrained models and unknown names, naming the key."""
    from sparsetrain.models.builders import UNPADDED_SDPA, check_model_args

    torch.manual_seed(0)
    plain = build_model("vit", "tiny", image_size=32, patch_size=16, num_labels=10, attn_implementation="sdpa").eval()
    first = build_model("vit", "tiny", image_size=32, patch_size=16, num_labels=10, attn_implementation=backend)
    first.load_state_dict(plain.state_dict())
    assert first.config._attn_implementation.startswith(UNPADDED_SDPA + "_")
    assert "_attn_implementation" not in first.config.to_dict()
    x = torch.randn(3, 3, 32, 32)
    expected = plain(pixel_values=x).logits
    assert torch.equal(first.eval()(pixel_values=x).logits, expected)
    if backend != "sdpa_cudnn":   # one BERT is enough: the wrapper is the same for each kernel (the compiled graph
        return                    # with the kernel first: test_gpu_sdpa_cudnn_runs_cudnn_attention_in_the_compiled_vit)
    for arch, value in (("hf", backend), ("vit", "sdpa_math"), ("bert", "sdpa_math")):
        with pytest.raises(ValueError, match="^attn_implementation"):
            check_model_args(arch, "tiny", name_or_path="some/model", attn_implementation=value)
    # BERT takes them too (its recipes put cuDNN first: configs/speed/bert_base.yaml)
    check_model_args("bert", "tiny", attn_implementation=backend)
    bert = build_model("bert", "tiny", vocab_size=100, seq_len=16, attn_implementation="sdpa").eval()
    bert_first = build_model("bert", "tiny", vocab_size=100, seq_len=16, attn_implementation=backend).eval()
    bert_first.load_state_dict(bert.state_dict())
    ids, where = torch.randint(0, 100, (2, 16)), torch.tensor([[1, 5], [2, 9]])
    assert bert_first.config._attn_implementation.startswith(UNPADDED_SDPA + "_")
    assert torch.equal(bert_first(ids, masked_positions=where).logits, bert(ids, masked_positions=where).logits)
    assert torch.allclose(bert_first(ids).logits, bert(ids).logits, atol=1e-6)       # the plain MLM path too


@pytest.mark.gpu
def test_gpu_sdpa_cudnn_runs_cudnn_attention_in_the_compiled_vit():
    """On a GPU, ``sdpa_cudnn`` reaches the compiled ViT's graph: its profile lists cuDNN's attention kernels and
    not the flash ones; its logits and gradients match plain "sdpa"'s (bf16 tolerance)."""
    from torch.profiler import ProfilerActivity, profile

    torch.manual_seed(0)
    kw = dict(image_size=224, patch_size=16, num_labels=10)
    plain = build_model("vit", "tiny", attn_implementation="sdpa", **kw).cuda()
    first = build_model("vit", "tiny", attn_implementation="sdpa_cudnn", **kw).cuda()
    first.load_state_dict(plain.state_dict())
    x = torch.randn(8, 3, 224, 224, device="cuda")
    outs = {}
    for name, model in (("plain", plain), ("cudnn", first)):
        step = torch.compile(model)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            step(pixel_values=x).logits.float().sum().backward()     # compile
        model.zero_grad()
        with profile(activities=[ProfilerActivity.CUDA]) as prof, torch.autocast("cuda", dtype=torch.bfloat16):
            logits = step(pixel_values=x).logits.float()
            logits.sum().backward()
        kernels = " ".join(e.key for e in prof.key_averages()).lower()
        outs[name] = (logits.detach(), model.vit.embeddings.patch_embeddings.projection.weight.grad.clone(), kernels)
    assert "cudnn" in outs["cudnn"][2] and "flash_fwd" not in outs["cudnn"][2]
    torch.testing.assert_close(outs["cudnn"][0], outs["plain"][0], atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(outs["cudnn"][1], outs["plain"][1], atol=5e-2, rtol=5e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", ["CUDNN_ATTENTION", "FLASH_ATTENTION"])
def test_gpu_attention_dropout_draws_new_masks_at_every_cuda_graph_replay(kernel):
    """BERT's recipes train with attention dropout inside a CUDA graph: each replay of the captured SDPA must draw
    a new dropout mask (the generator's offset advanced per replay), not repeat the captured one."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    torch.manual_seed(0)
    q, k, v = (torch.randn(4, 2, 128, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))

    def attend():
        with sdpa_kernel([getattr(SDPBackend, kernel)]):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, dropout_p=0.5)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        attend()                                            # warm-up outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = attend()
    replays = []
    for _ in range(2):
        graph.replay()
        torch.cuda.synchronize()
        replays.append(out.clone())
    with sdpa_kernel([getattr(SDPBackend, kernel)]):
        undropped = torch.nn.functional.scaled_dot_product_attention(q, k, v)
    assert not torch.equal(replays[0], replays[1])
    assert not torch.allclose(replays[0], undropped, atol=1e-2)
