"""``sparsetrain bench semi24 --sections models``: the recipes' ViT linears timed by the dispatch's own timer
(injected here), each mode against F.linear and the mode the dispatch would choose."""
import pytest

from sparsetrain.bench import semi24


def test_models_section_times_each_shape_once_and_names_the_dispatch_choice():
    calls = []

    def fake_timer(k, n, bias, tokens, w_dtype, dtype, device, modes, rep_ms):
        calls.append((tokens, k, n))
        wide = max(k, n) >= 5120
        near = (k, n) == (1024, 4096)          # 2:4 ahead of masked dense by less than the 2% margin
        return {"24": 1.0 if wide else 1.19 if near else 1.5, "24fwd": 1.3, "dense": 1.2, "linear": 1.1}

    out = semi24.models(time_modes=fake_timer)
    assert calls == [(50432, 768, 768), (50432, 768, 3072), (50432, 3072, 768), (25216, 1024, 1024),
                     (25216, 1024, 4096), (25216, 4096, 1024), (16448, 1280, 1280), (16448, 1280, 5120),
                     (16448, 5120, 1280)]
    assert out["vit_h14 1280->5120"]["choice"] == "24" and out["vit_h14 5120->1280"]["choice"] == "24"
    assert out["vit_l16 1024->4096"]["choice"] == "dense"            # within the margin: masked dense
    assert out["vit_b16 768->3072"]["choice"] == "dense"
    assert out["vit_h14 1280->5120"]["x_linear_24"] == pytest.approx(1.1)
    assert out["vit_b16 768->768"]["x_linear_dense"] == pytest.approx(1.1 / 1.2)
    text = semi24.table({"models": out})
    assert "| vit_h14, 16448 | 1280->5120 | 1.100 | 1.100x | 0.846x | 0.917x | 24 |" in text
