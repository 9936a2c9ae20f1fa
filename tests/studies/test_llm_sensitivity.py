"""studies/llm_sensitivity.py and llm_search.py on tiny decoders: the tail runner equal to the
whole-model pass bit for bit, direct sensitivity equal to token_fidelity of the model with the
layer swapped, the proxy against its definition, the Dask run equal to the in-process one (real
``dask scheduler`` / ``dask worker`` processes), the search against brute force, measured mixes,
and the study's ``--search`` hook."""

from __future__ import annotations

import copy
import itertools
import math
from pathlib import Path

import pytest
import torch

from nvfp4lab.execution import quantize_model
from nvfp4lab.execution.gptq_model import collect_hessians
from nvfp4lab.execution.mixed import (
    apply_mix,
    effective_bits,
    fused_units,
    layer_bits,
    quantizable_linears,
    quantize_layer,
    set_layer,
)
from nvfp4lab.studies import llm
from nvfp4lab.studies.llm_search import (
    Mix,
    best_mix,
    fewest_bits,
    frontier,
    measure_mix,
    plot_frontier,
    save_search,
    search_path,
    within_budget,
)
from nvfp4lab.studies.llm_sensitivity import (
    LayerSensitivity,
    SensitivityTable,
    TailRunner,
    plot_sensitivity,
    proxy_score,
    sensitivity,
    spearman,
)
from nvfp4lab.vocab import LayerFormat
from tests.processes import dask_cluster
from tests.tiny_decoders import tiny_model

DOWN = "model.layers.1.mlp.down_proj"


@pytest.fixture(scope="module")
def setup() -> tuple[torch.nn.Module, llm.ReferenceRun, list[dict[str, torch.Tensor]]]:
    model = tiny_model("llama", seed=3)
    ids = torch.randint(4, 200, (130,), generator=torch.Generator().manual_seed(0))
    run = llm.reference_run(model, ids, context=32, batch_size=2, progress=False)
    rows = torch.randint(4, 200, (4, 24), generator=torch.Generator().manual_seed(1))
    batches = [{"input_ids": rows[i : i + 2], "attention_mask": torch.ones_like(rows[i : i + 2])}
               for i in (0, 2)]
    return model, run, batches


@pytest.mark.parametrize("arch", ["llama", "gemma2"])
def test_the_tail_is_the_whole_model_bit_for_bit(arch: str) -> None:
    model = tiny_model(arch, seed=2)
    ids = torch.randint(4, 200, (70,), generator=torch.Generator().manual_seed(2))
    run = llm.reference_run(model, ids, context=24, batch_size=2, progress=False)
    tail = TailRunner(model, run)
    # Gemma 2's run keeps the model to run it again (soft-capped head): the runner copies it
    assert (tail.model is model) == (arch == "llama")
    model = tail.model
    for name in ("model.layers.0.self_attn.v_proj", DOWN):
        layer = quantize_layer(quantizable_linears(model)[name], "nvfp4-rtn")
        old = set_layer(model, name, layer)
        try:
            for b in range(len(run.batches)):
                whole = llm._forward(model, run.input_ids(b))
                assert torch.equal(tail.logits(tail.block_of(name), b), whole)
            if arch == "llama":  # it did change (the tiny Gemma 2's norms hide this layer)
                assert not torch.equal(whole, run.logits(len(run.batches) - 1))
        finally:
            set_layer(model, name, old)


def test_direct_sensitivity_is_token_fidelity_of_the_swapped_model(setup) -> None:
    model, run, batches = setup
    names = ["model.layers.0.self_attn.q_proj", DOWN]
    table = sensitivity(model, run, formats=["nvfp4-rtn", "fp8", "mxfp4", "nvfp4-gptq", "bf16"],
                        layers=names, calibration=batches, progress=False)
    assert table.layers == names and table.formats == ["nvfp4-rtn", "fp8", "mxfp4",
                                                       "nvfp4-gptq", "bf16"]
    assert table.tokens == run.tokens
    for name in names:
        for fmt in ("nvfp4-rtn", "fp8", "mxfp4"):
            copy_ = copy.deepcopy(model)
            linear = quantizable_linears(copy_)[name]
            if fmt == "nvfp4-rtn" and name == names[0]:  # q shares k/v's global scale
                quantize_model(copy_, backend="w4a16", ignore=[
                    n for n in quantizable_linears(copy_) if n not in
                    {f"model.layers.0.self_attn.{p}_proj" for p in "qkv"}] + ["lm_head"])
                for p in "kv":
                    set_layer(copy_, f"model.layers.0.self_attn.{p}_proj",
                              quantizable_linears(model)[f"model.layers.0.self_attn.{p}_proj"])
            else:
                set_layer(copy_, name, quantize_layer(linear, fmt))
            want = llm.token_fidelity(run, copy_, progress=False)
            row = table.row(name, fmt)
            assert (row.kld, row.kld_lo, row.kld_hi) == (want.kld_mean, *want.kld_ci95)
        assert table.kld(name, "bf16") == 0.0 and table.row(name, "bf16").bits == 16
    # GPTQ of down_proj alone: quantize_model's GPTQ of that one layer on the float model
    alone = copy.deepcopy(model)
    quantize_model(alone, backend="w4a16", method="gptq", calibration=batches,
                   ignore=[n for n in quantizable_linears(model) if n != DOWN] + ["lm_head"])
    want = llm.token_fidelity(run, alone, progress=False)
    assert table.kld(DOWN, "nvfp4-gptq") == want.kld_mean
    # the model is left as it was
    assert all(type(m) is torch.nn.Linear for m in quantizable_linears(model).values())
    assert len(quantizable_linears(model)) == 14


def test_the_proxy_is_the_mean_squared_output_error(setup) -> None:
    model, _, batches = setup
    linear = quantizable_linears(model)[DOWN]
    layer = quantize_layer(linear, "mxfp4")
    inputs: list[torch.Tensor] = []
    handle = linear.register_forward_pre_hook(lambda m, a: inputs.append(a[0].detach()))
    with torch.no_grad():
        for batch in batches:
            model(**batch)
    handle.remove()
    x = torch.cat([i.reshape(-1, i.shape[-1]) for i in inputs]).double()
    error = x @ (layer.dequantized_weight().double() - linear.weight.double()).T
    want = float((error**2).sum(-1).mean().detach())
    hessian = collect_hessians(model, [DOWN], batches)[DOWN].matrix()
    assert proxy_score(linear, layer, hessian) == pytest.approx(want, rel=1e-9)
    assert proxy_score(linear, linear, hessian) == 0.0


def test_spearman_against_hand_computed_ranks() -> None:
    assert spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    # ranks (1, 2.5, 2.5, 4) and (1, 2, 3, 4), centred: r = 4.5 / sqrt(4.5 * 5)
    assert spearman([1, 5, 5, 9], [1, 2, 3, 4]) == pytest.approx(4.5 / math.sqrt(4.5 * 5))
    assert math.isnan(spearman([1, 1], [1, 2]))
    with pytest.raises(ValueError, match="one length"):
        spearman([1], [1, 2])


def test_sensitivity_on_a_dask_cluster_equals_in_process(setup, tmp_path: Path,
                                                         capfd: pytest.CaptureFixture[str]) -> None:
    model, run, batches = setup
    names = ["model.layers.0.mlp.gate_proj", DOWN]
    here = sensitivity(model, run, formats=["nvfp4-gptq", "fp8"], layers=names,
                       calibration=batches)
    with dask_cluster(tmp_path / "dask", workers=2) as address:
        there = sensitivity(model, run, formats=["nvfp4-gptq", "fp8"], layers=names,
                            calibration=batches, client=address)
    key = [(r.layer, r.format, r.kld, r.kld_lo, r.kld_hi, r.proxy, r.bits) for r in here.rows]
    assert [(r.layer, r.format, r.kld, r.kld_lo, r.kld_hi, r.proxy, r.bits)
            for r in there.rows] == key
    err = capfd.readouterr().err
    assert "[4/4]" in err and "(on the cluster)" in err and f"{DOWN} fp8: mean KLD" in err


def test_refusals(setup) -> None:
    model, run, _ = setup
    with pytest.raises(ValueError, match="unknown layer format 'int4'"):
        sensitivity(model, run, formats=["int4"], progress=False)
    with pytest.raises(ValueError, match="'lm_head' is not a quantizable Linear inside"):
        sensitivity(model, run, layers=["lm_head"], progress=False)
    with pytest.raises(ValueError, match="does not give the reference run's logits"):
        TailRunner(tiny_model("llama", seed=4), run)
    with pytest.raises(KeyError, match="was not measured"):
        SensitivityTable(()).row("x", "fp8")


def _synthetic(model: torch.nn.Module, seed: int) -> SensitivityTable:
    """Random per-layer KLDs (nvfp4-gptq above fp8, mxfp4 above both), as if measured."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for name, linear in quantizable_linears(model).items():
        base = float(torch.rand((), generator=g)) ** 3
        for fmt, scale in (("mxfp4", 3.0), ("nvfp4-gptq", 1.0), ("fp8", 0.02)):
            rows.append(LayerSensitivity(name, fmt, base * scale, 0, 0, base, linear.weight.numel(),
                                         0.0))
    return SensitivityTable(tuple(rows))


@pytest.mark.parametrize("seed", [0, 1])
def test_the_search_path_is_pareto_optimal_against_brute_force(seed: int) -> None:
    model = tiny_model("llama")
    table = _synthetic(model, seed)
    formats = ["mxfp4", "fp8", "bf16"] if seed else ["nvfp4-gptq", "fp8", "bf16"]
    path = search_path(table, model, formats=formats)
    assert path[0].counts() == {formats[0]: 14} and path[-1].counts() == {"bf16": 14}
    assert all(a.bits < b.bits and a.predicted >= b.predicted for a, b in itertools.pairwise(path))
    units = fused_units(table.layers)
    weights = {n: m.weight.numel() for n, m in quantizable_linears(model).items()}
    total = sum(weights.values())
    cost = [[sum(layer_bits(f, *quantizable_linears(model)[n].weight.shape) * weights[n]
                 for n in unit) / total for f in formats] for unit in units]
    kld = [[sum(table.kld(n, f) for n in unit) for f in formats] for unit in units]
    every = [(sum(cost[u][i] for u, i in enumerate(choice)),
              sum(kld[u][i] for u, i in enumerate(choice)))
             for choice in itertools.product(range(len(formats)), repeat=len(units))]
    uniform = dict.fromkeys(table.layers, "fp8")
    assert effective_bits(model, uniform) == pytest.approx(
        sum(cost[u][formats.index("fp8")] for u in range(len(units))), rel=1e-12)
    for point in path:
        assert point.predicted == pytest.approx(sum(table.kld(n, f)
                                                    for n, f in point.formats.items()))
        dominated = [e for e in every if e[0] <= point.bits + 1e-12
                     and e[1] < point.predicted - 1e-12]
        assert not dominated, (point.describe(), dominated[:3])
    chosen = within_budget(path, 5.0)
    assert chosen.bits <= 5.0 and path[path.index(chosen) + 1].bits > 5.0
    best = best_mix(table, model, 5.0, formats=formats)  # skips steps that do not fit
    assert best.bits <= 5.0 and best.predicted <= chosen.predicted
    fits = [e for e in every if e[0] <= 5.0 + 1e-12]
    assert best.predicted <= 1.5 * min(e[1] for e in fits) + 1e-12  # near the true optimum
    with pytest.raises(ValueError, match=r"no mix fits 4 bits per weight: the cheapest takes 4\."):
        within_budget(path, 4.0)
    with pytest.raises(ValueError, match="unknown layer format 'int4'"):
        search_path(table, model, formats=["int4"])
    with pytest.raises(ValueError, match="the sensitivity table has no nvfp4-rtn rows"):
        search_path(table, model, formats=["nvfp4-rtn"])


def test_measured_mixes_frontier_and_files(setup, tmp_path: Path) -> None:
    model, run, batches = setup
    table = sensitivity(model, run, formats=["nvfp4-gptq", "fp8"], calibration=batches,
                        progress=False)
    assert len(table.rows) == 28 and -1.0 <= table.rank_correlation("fp8") <= 1.0
    formats = ["nvfp4-gptq", "fp8", "bf16"]  # as measured (not the default search formats)
    path = search_path(table, model, formats=formats)
    assert path[0].counts() == {"nvfp4-gptq": 14}
    points = frontier(model, run, table, (4.0, 5.0, 6.0), batches, formats=formats)
    assert [p.label for p in points] == ["mixed (search, 5 bits)", "mixed (search, 6 bits)"]
    assert points[0].mix.formats == best_mix(table, model, 5.0, formats=formats).formats
    assert 4.5 < points[0].mix.bits <= 5.0 < points[1].mix.bits <= 6.0
    built = copy.deepcopy(model)
    apply_mix(built, points[0].mix.formats, calibration=batches)
    assert points[0].fidelity.kld_mean == llm.token_fidelity(run, built, progress=False).kld_mean
    uniform = measure_mix(model, run, path[0], batches, label="uniform")
    assert points[0].fidelity.kld_mean < uniform.fidelity.kld_mean  # FP8 / BF16 layers help
    target = points[0].fidelity.kld_mean
    best = fewest_bits(model, run, path, target, batches)
    assert best is not None and best.fidelity.kld_mean <= target
    written = save_search(tmp_path, table, points, points[0], first_windows=2)
    assert [p.name for p in written] == ["sensitivity.csv", "frontier.csv", "mix.json"]
    back = SensitivityTable.read_csv(tmp_path / "sensitivity.csv")
    assert [(r.layer, r.format, r.kld) for r in back.rows] == [
        (r.layer, str(r.format), r.kld) for r in table.rows]
    import matplotlib.pyplot as plt

    from nvfp4lab.plots import STYLE_PATH

    with plt.style.context(str(STYLE_PATH)):  # the pages' style (its layout engine)
        for fig in (plot_sensitivity(table),
                    plot_frontier(points, uniform=[("W4A16 GPTQ", 4.5, uniform.fidelity)])):
            fig.savefig(tmp_path / "figure.png")
            plt.close(fig)
    assert isinstance(path[0], Mix) and LayerFormat.FP8 in set(path[-1].formats.values()) | {
        LayerFormat.FP8}


def test_the_study_with_a_search(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    """``nvfp4lab study MODEL --search bits=5.0``: one more row, the files beside study.csv,
    refusals in one line."""
    from nvfp4lab.cli import main as cli_main
    from nvfp4lab.studies import llm_study
    from tests.studies.test_llm_study import write_text
    from tests.tiny_decoders import save_hf_cache, tiny_tokenizer

    model = save_hf_cache(tiny_model("llama", seed=1), tiny_tokenizer(), tmp_path / "hub",
                          repo_id="tiny-org/tiny-llama")
    text = write_text(tmp_path / "notes.md")
    formats = ["nvfp4-mr-gptq", "fp8-w8a16", "bf16"]
    result = llm_study.study(model, text=text, configs=["w4a16-gptq"], tokens=64, context=32,
                             samples=2, search=5.0, search_formats=formats, progress=False)
    labels = [r["label"] for r in result.rows()]
    assert labels == ["W4A16 GPTQ", "mixed (search, 5 bits)"] * 2
    mixed = result.evaluation[-1]
    assert mixed.fidelity.kld_mean == result.search.chosen.fidelity.kld_mean or (
        mixed.fidelity.windows == result.plan.eval_windows)
    assert result.search.chosen.mix.bits <= 5.0
    assert len(result.search.table.rows) == 28  # 14 Linears in nvfp4-mr-gptq and fp8-w8a16
    assert set(result.search.chosen.mix.formats.values()) <= set(formats)
    assert result.plan.search_formats == tuple(formats)
    result.save(tmp_path)
    assert {"sensitivity.csv", "frontier.csv", "mix.json"} <= {p.name for p in tmp_path.iterdir()}
    with pytest.raises(ValueError, match="--search bits=-1"):
        llm_study.plan_study(model, text=text, search=-1, tokens=64, context=32)
    for kwargs, words in (({"search_formats": ["fp8"]}, "--search-formats needs --search"),
                          ({"search": 5.0, "search_formats": ["int3"]}, "'int3'"),
                          ({"search": 5.0, "search_formats": ["bf16"]}, "at least one quantized"),
                          ({"search": 5.0, "search_formats": "fp8-w8a16,bf16"},
                           r"bits=5 is below what the formats fp8-w8a16,bf16 can reach \(8.00"),
                          ({"search": 4.4}, r"below what the formats nvfp4-mr-gptq")):
        with pytest.raises(ValueError, match=words):
            llm_study.plan_study(model, text=text, tokens=64, context=32, **kwargs)
    with pytest.raises(SystemExit) as stopped:  # argparse's one line, exit status 2
        cli_main(["study", str(model), "--search", "5"])
    assert stopped.value.code == 2 and "write bits=B" in capfd.readouterr().err
    assert cli_main(["study", str(model), "--search", "bits=5", "--search-formats", "fp8,int3",
                     "--tokens", "64", "--context", "32"]) == 2
    err = capfd.readouterr().err
    assert "int3" in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_progress_line_shows_an_interval_only_where_there_is_one() -> None:
    from nvfp4lab.studies import llm_sensitivity as ls

    one = ls.LayerSensitivity("model.layers.0.mlp.down_proj", "fp8", 0.00123, math.nan, math.nan,
                              4.5, 64, 8.5, 0.4)
    two = ls.LayerSensitivity("model.layers.0.mlp.down_proj", "fp8", 0.00123, 0.001, 0.0015,
                              4.5, 64, 8.5, 0.4)
    assert ls._line(one, 3, 10) == ("[3/10] model.layers.0.mlp.down_proj fp8: mean KLD 0.00123, "
                                    "proxy 4.5, 0.4 s")
    assert "(95 % 0.001 to 0.0015)" in ls._line(two, 3, 10) and "nan" not in ls._line(one, 3, 10)
