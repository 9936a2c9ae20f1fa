"""What every report page and figure follows: alt text, legends off the data, no log axis over a
few percent, long text never cut (nvfp4lab.plots, nvfp4lab.report.pages, studies.tables), and
the sentences computed from the data (02's epilogue range, 04's ranks)."""

from __future__ import annotations

import base64

import nbformat
import pytest

matplotlib = pytest.importorskip("matplotlib")
matplotlib.use("Agg")
pd = pytest.importorskip("pandas")

import matplotlib.pyplot as plt  # noqa: E402

from nvfp4lab import plots  # noqa: E402
from nvfp4lab.report import pages  # noqa: E402
from nvfp4lab.studies import bias as bias_study  # noqa: E402
from nvfp4lab.studies import number_formats as fs  # noqa: E402
from nvfp4lab.studies import tables  # noqa: E402

# a 1×1 transparent PNG
PNG = base64.b64encode(bytes.fromhex(
    "89504e470d0a1a0a0000000d49484452000000010000000108060000001f15c489"
    "0000000d49444154789c6360000002000154a24f5d0000000049454e44ae426082")).decode()


@pytest.fixture(autouse=True)
def _close_figures():
    yield
    plt.close("all")


def test_alt_text_names_the_titles_and_axes() -> None:
    fig, (top, bottom) = plt.subplots(2)
    fig.suptitle("Two panels")
    top.set(title="error", ylabel="NMSE (unitless)", xlabel="layer")
    bottom.set(ylabel="ratio\n(log)")
    assert plots.alt_text(fig) == (
        "Figure: Two panels. error (y: NMSE (unitless); x: layer). y: ratio (log)")
    assert plots.alt_text(plt.figure()) == "Figure without a title"


def test_install_alt_text_adds_the_alt_to_the_png_output() -> None:
    from IPython.core.interactiveshell import InteractiveShell
    from matplotlib.figure import Figure

    shell = InteractiveShell.instance()
    try:
        png = shell.display_formatter.formatters["image/png"]
        png.for_type(Figure, lambda fig: PNG)  # what the inline backend registers
        fig, _ax = plots.new_figure("Title", "x (s)", "y (m)")
        assert plots.install_alt_text() and plots.install_alt_text()  # the second: no-op
        data, metadata = shell.display_formatter.format(fig)
        assert data["image/png"] == PNG
        assert metadata == {"image/png": {"alt": "Figure: Title (y: y (m); x: x (s))"}}
    finally:
        InteractiveShell.clear_instance()


def test_install_alt_text_outside_ipython_does_nothing() -> None:
    assert plots.install_alt_text() is False


def test_pages_write_each_figures_alt_and_let_wide_outputs_scroll(tmp_path) -> None:
    nb = nbformat.v4.new_notebook()
    cell = nbformat.v4.new_code_cell("")
    cell.outputs = [
        nbformat.v4.new_output("display_data", data={"image/png": PNG, "text/plain": "<Figure>"},
                               metadata={"image/png": {"alt": 'Figure: "a" < b'}}),
        nbformat.v4.new_output("display_data", data={"image/png": PNG, "text/plain": "<Figure>"}),
    ]
    nb.cells.append(cell)
    page = pages.render_html(nb, tmp_path / "p.html", "t").read_text(encoding="utf-8")
    alts = _img_alts(page)
    # the second has none: nbconvert's placeholder, which the browser test refuses
    assert alts == ['Figure: "a" < b', "No description has been provided for this image"]
    assert ".jp-OutputArea-output { display: block; flex: 1 1 auto; min-width: 0; " \
           "overflow-x: auto; }" in page
    assert pages.external_urls(page) == []


def _img_alts(page: str) -> list[str | None]:
    from html.parser import HTMLParser

    alts: list[str | None] = []

    class Images(HTMLParser):
        def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
            if tag == "img":
                alts.append(dict(attrs).get("alt"))

    Images().feed(page)
    return alts


def test_legend_outside_sits_right_of_the_axes() -> None:
    fig, ax = plots.new_figure("t", "x (s)", "y (m)")
    ax.plot([0, 1], [0, 1], label="a line")
    legend = plots.legend_outside(ax)
    fig.canvas.draw()
    assert legend.get_window_extent().x0 >= ax.get_window_extent().x1


def test_log_if_wide_keeps_a_narrow_range_linear() -> None:
    _fig, ax = plots.new_figure("t", "x (s)", "y (m)")
    assert plots.log_if_wide(ax, [8.85e-3, 9.03e-3]) is False and ax.get_yscale() == "linear"
    assert plots.log_if_wide(ax, [1e-3, 0.0, 1e-2]) is True and ax.get_yscale() == "log"
    assert plots.log_if_wide(ax, [1.0, 2.0], axis="x", span=2.0) and ax.get_xscale() == "log"
    with pytest.raises(ValueError, match="axis='z'"):
        plots.log_if_wide(ax, [1.0], axis="z")


def test_with_notes_numbers_each_distinct_string_once() -> None:
    long_a, long_b = "a" * 40, "b" * 40
    frame = pd.DataFrame({"gpu": ["B200", "H100", "L4"], "source": [long_a, long_b, long_a],
                          "short": ["x", "", None]})
    table, notes = tables.with_notes(frame)
    assert notes == [long_a, long_b]
    assert table["source"].tolist() == ["[1]", "[2]", "[1]"]
    assert table["gpu"].tolist() == ["B200", "H100", "L4"]  # short strings are left alone
    assert frame["source"].tolist() == [long_a, long_b, long_a]  # the input is not changed
    table, notes = tables.with_notes(frame, ["short"])
    assert notes == ["x"] and table["short"].tolist()[:2] == ["[1]", ""]
    with pytest.raises(KeyError, match=r"no column \['reason'\]"):
        tables.with_notes(frame, ["reason"])


def test_full_text_keeps_every_character() -> None:
    text = "E2M1, E4M3 scale per 16 along K, FP32 tensor scale amax/(6·448) " * 3
    frame = pd.DataFrame({"bits": [4.5], "definition": [text]}, index=["nvfp4"])
    with pd.option_context("display.max_colwidth", 20):
        page = tables.full_text(frame).to_html()
    assert text.strip() in page and "text-align: left" in page and ">4.5<" in page
    assert text.strip()[:20] + "..." not in page
    with pytest.raises(ValueError, match=r"float_format='\{:\.4q\}'"):
        tables.full_text(frame, float_format="{:.4q}")
    notes = tables.notes_frame(["first note", "second"]).to_html()
    assert "[2]" in notes and "second" in notes


def _row(dtype_scale: float, rel: float, nmse: float, mode: str = "output") -> dict:
    return {"backend": "emulation", "mode": mode, "bias_scale": dtype_scale,
            "epilogue_rel_rms": rel, "nmse": nmse}


def test_epilogue_summary_is_computed_from_the_rows() -> None:
    rows = [_row(0.0, 0.0, 0.04), _row(1.0, 1e-3, 1e-4), _row(30.0, 2e-3, 4e-6),
            _row(1.0, 5.0, 1.0, mode="dropped")]
    # ratios sqrt(nmse) / rel: 1e-2 / 1e-3 = 10, 2e-3 / 2e-3 = 1; scale 0 and "dropped" left out
    assert bias_study.epilogue_summary({"bfloat16": rows}) == (
        "Epilogue order, measured: bfloat16: 1.0e-03 to 2.0e-03 of RMS(y), 1× to 10× below the "
        "NVFP4 error at the same bias.")
    assert bias_study.epilogue_summary({"bfloat16": rows[:1]}) == "no emulation rows with a bias"


def test_errors_equal_to_the_shown_digits_share_a_rank() -> None:
    rows = [{"label": label, "distribution": "N", "nmse": v}
            for label, v in (("a", 0.009180000001), ("b", 0.00918), ("c", 0.0076), ("d", 0.02))]
    assert {k: v["N"] for k, v in fs.rank_table(rows).items()} == {"c": 1, "a": 2, "b": 2, "d": 4}


def test_kld_comparison_says_only_what_the_intervals_allow() -> None:
    from nvfp4lab.studies import llm_llama_cpp as llc

    naive = {"label": "naive", "kld_mean": 0.25, "kld_lo": 0.235, "kld_hi": 0.262,
             "weight_nmse": 0.009}
    scaled = {"label": "scaled", "kld_mean": 0.27, "kld_lo": 0.241, "kld_hi": 0.298,
              "weight_nmse": 0.0090045}
    assert llc.kld_comparison([naive, scaled]) == (
        "Mean KLD (nats/token) with 95 % intervals: naive 0.2500 [0.2350, 0.2620]; scaled "
        "0.2700 [0.2410, 0.2980]. Every pair of intervals overlaps: on this model and text the "
        "configurations are not told apart by KLD; their weight NMSEs differ by 0.1 %.")
    apart = dict(scaled, kld_lo=0.263)
    assert "Scaled is measurably worse than naive;" in llc.kld_comparison([apart, naive])
    assert llc.kld_comparison([]) == "no configurations"
