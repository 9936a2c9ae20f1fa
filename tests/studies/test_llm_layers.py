"""studies.llm_layers on a seeded tiny Llama: against direct computations and a naive loop."""

from __future__ import annotations

import math

import pytest
import torch

from nvfp4lab import fake_quantize, metrics
from nvfp4lab.execution.kv_cache import fake_quantize_kv
from nvfp4lab.studies import llm_layers as ll
from tests.execution.test_attention import IDS, _post_rope_qkv, tiny_llama


def test_short_names() -> None:
    assert ll.short_name("model.layers.3.self_attn.q_proj") == "3.q_proj"
    assert ll.short_name("lm_head") == "lm_head"


def test_channel_outliers_find_the_loud_channel() -> None:
    x = torch.randn(256, 64, generator=torch.Generator().manual_seed(0))
    x[:, 17] *= 40.0
    top, ratio, crest = ll.channel_outliers(x)
    rms = x.double().pow(2).mean(0).sqrt()
    assert top == 17 and ratio == pytest.approx(float(rms[17] / rms.median()))
    assert crest == pytest.approx(float(x.abs().max() / x.double().pow(2).mean().sqrt()))


def _naive_effect(q, k, v, k_hat, v_hat, head: int) -> tuple[float, float]:
    group = q.shape[0] // k.shape[0]
    kv = head // group
    d, t = q.shape[-1], q.shape[1]
    kls, out, out_hat = [], [], []
    for i in range(t):
        s = [float(q[head, i].double() @ k[kv, j].double()) / math.sqrt(d) for j in range(i + 1)]
        s_hat = [float(q[head, i].double() @ k_hat[kv, j].double()) / math.sqrt(d)
                 for j in range(i + 1)]
        p = torch.tensor(s, dtype=torch.float64).softmax(0)
        p_hat = torch.tensor(s_hat, dtype=torch.float64).softmax(0)
        kls.append(float((p * (p.log() - p_hat.log())).sum()))
        out.append(p @ v[kv, : i + 1].double())
        out_hat.append(p_hat @ v_hat[kv, : i + 1].double())
    o, o_hat = torch.stack(out), torch.stack(out_hat)
    return sum(kls) / t, float((o - o_hat).pow(2).sum() / o.pow(2).sum())


def test_attention_effect_equals_a_naive_loop() -> None:
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(n, 12, 16, generator=g) * 2 for n in (4, 2, 2))
    k_hat, v_hat = (fake_quantize_kv(z, "nvfp4", 1.0) for z in (k, v))
    kl, err = ll.attention_effect(q, k, v, k_hat, v_hat)
    for head in range(4):
        want_kl, want_err = _naive_effect(q, k, v, k_hat, v_hat, head)
        assert float(kl[head]) == pytest.approx(want_kl, rel=1e-9, abs=1e-15)
        assert float(err[head]) == pytest.approx(want_err, rel=1e-9)
    same_kl, same_err = ll.attention_effect(q, k, v, k, v)
    assert torch.equal(same_kl, torch.zeros(4, dtype=torch.float64))
    assert torch.equal(same_err, torch.zeros(4, dtype=torch.float64))


def test_kv_rows_measure_the_post_rope_k_and_v() -> None:
    model = tiny_llama()
    rows = ll.kv_rows(model, IDS[:1])
    expected = _post_rope_qkv(model, IDS[:1])
    assert len(rows) == 2 * 2 * 3  # layers x KV heads x kinds
    for row in rows:
        _, k, v = (z[0] for z in expected[row["layer"]])
        h = row["kv_head"]
        k_hat = fake_quantize_kv(k[h], row["kind"], 1.0)
        assert row["k_nmse"] == pytest.approx(metrics.nmse(k[h], k_hat), rel=1e-5)
        assert row["v_nmse"] == metrics.nmse(v[h], fake_quantize_kv(v[h], row["kind"], 1.0))
    by_kind = {kind: [r for r in rows if r["kind"] == kind] for kind in ("fp8", "nvfp4")}
    assert max(r["k_nmse"] for r in by_kind["fp8"]) < min(r["k_nmse"] for r in by_kind["nvfp4"])
    assert all(r["score_kl"] > 0 and r["output_nmse"] > 0 for r in rows)


def test_linear_rows_against_direct_measurements() -> None:
    model = tiny_llama()
    seen: dict[str, torch.Tensor] = {}
    handles = [m.register_forward_pre_hook(lambda mod, a, n=n: seen.setdefault(n, a[0]))
               for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    with torch.no_grad():
        model(IDS[:1], use_cache=False)
    for h in handles:
        h.remove()
    rows = ll.linear_rows(model, IDS[:1])
    assert [r["layer"] for r in rows] == [n for n in seen if n != "lm_head"]
    for row in rows:
        w = model.get_submodule(row["layer"]).weight.detach()
        x = seen[row["layer"]]
        assert row["weight_nmse"] == metrics.nmse(w, fake_quantize(w))
        assert row["activation_nmse"] == metrics.nmse(x, fake_quantize(x))
        assert row["top_channel"] == int(x.reshape(-1, x.shape[-1]).pow(2).mean(0).argmax())
