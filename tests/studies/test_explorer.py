"""nvfp4lab.studies.explorer: the output dicts and the VBox plumbing every explorer shares."""

from __future__ import annotations

import ipywidgets
import nbformat
import pandas as pd

from nvfp4lab.studies.explorer import (
    BUSY_TEXT,
    busy_output,
    explorer,
    stream_output,
    table_output,
    text_output,
)
from tests.studies import widgets as W


def test_stream_output_is_a_valid_stream_with_one_trailing_newline() -> None:
    for text, want in (("a", "a\n"), ("a\n\n", "a\n"), ("", "\n"), ("x\ny", "x\ny\n")):
        out = stream_output(text)
        assert out == {"output_type": "stream", "name": "stdout", "text": want}
        nbformat.validate(_notebook(out))
    assert stream_output("oops", "stderr")["name"] == "stderr"


def test_table_output_formats_floats_in_text_and_html() -> None:
    frame = pd.DataFrame({"nmse": [0.0090412345, 1.5e-7], "n": [3, 4]}, index=["nvfp4", "bf16"])
    out = table_output(frame)
    nbformat.validate(_notebook(out))
    text, page = out["data"]["text/plain"], out["data"]["text/html"]
    assert text.splitlines()[1].split() == ["nvfp4", "0.009041", "3"]  # 4 significant digits
    assert text.splitlines()[2].split() == ["bf16", "1.5e-07", "4"]
    assert "<td>0.009041</td>" in page and "<td>1.5e-07</td>" in page and "<table" in page
    assert "0.0090412" not in text + page
    wide = table_output(frame, "{:.2f}")["data"]["text/plain"]
    assert wide.splitlines()[1].split() == ["nvfp4", "0.01", "3"]


def _notebook(output: dict) -> nbformat.NotebookNode:
    nb = nbformat.v4.new_notebook()
    cell = nbformat.v4.new_code_cell("")
    cell.outputs = [nbformat.from_dict(output)]
    nb.cells.append(cell)
    return nb


def test_explorer_renders_now_and_on_every_change() -> None:
    a = ipywidgets.IntSlider(value=2, min=0, max=10, description="a")
    b = ipywidgets.IntSlider(value=3, min=0, max=10, description="b")
    calls = []

    def render() -> tuple[dict, ...]:
        calls.append((a.value, b.value))
        return (stream_output(f"{a.value} / {b.value} = {a.value / b.value:.3f}"),)

    box = explorer(ipywidgets, [a, b], render)
    assert isinstance(box, ipywidgets.VBox)
    assert box.children[:2] == (a, b) and isinstance(box.children[2], ipywidgets.Output)
    assert W.text(box) == "2 / 3 = 0.667\n" and calls == [(2, 3)]
    W.control(box, "a").value = 9
    assert W.text(box) == "9 / 3 = 3.000\n"
    # a failing render is shown on stderr, not raised into the widget callback
    W.control(box, "b").value = 0
    (shown,) = box.children[-1].outputs
    assert shown["name"] == "stderr" and shown["text"] == "ZeroDivisionError: division by zero\n"
    W.control(box, "b").value = 4  # and the explorer recovers
    assert W.text(box) == "9 / 4 = 2.250\n"
    assert calls == [(2, 3), (9, 3), (9, 0), (9, 4)]


def test_every_described_control_shows_its_whole_label() -> None:
    # the default description width (~80 px) cut "block scale s" to "block scal…"
    a = ipywidgets.FloatSlider(description="log10 |x| scale")
    b = ipywidgets.Dropdown(options=["x", "y"], description="block scale s")
    box = explorer(ipywidgets, [a, b], lambda: (stream_output("ok"),))
    assert [c.style.description_width for c in box.children[:2]] == ["initial", "initial"]


def test_a_dropdown_is_as_wide_as_its_longest_option() -> None:
    # in the fixed 300 px, "VLLM_USE_NVFP4_CT_EMULATIONS=1" showed as "VLLM_USE_NVFP4_CT_EMULATIO"
    # (tests/browser/test_lab.py measures it in JupyterLab)
    a = ipywidgets.FloatSlider(description="a")
    b = ipywidgets.Dropdown(options=["default", "VLLM_USE_NVFP4_CT_EMULATIONS=1"],
                            description="scenario")
    box = explorer(ipywidgets, [a, b], lambda: (stream_output("ok"),))
    assert (b.layout.width, b.layout.min_width) == (
        "max-content", "var(--jp-widgets-inline-width)")
    assert (a.layout.width, a.layout.min_width) == (None, None)  # sliders keep their width
    assert box.children[1] is b


def test_a_displayed_explorer_carries_a_static_snapshot() -> None:
    # viewers without a kernel or saved widget state (nbconvert HTML, nbviewer) show the
    # richest non-widget type: the snapshot, not "VBox(children=...)"
    a = ipywidgets.IntSlider(value=2, min=0, max=10, description="a")
    frame = pd.DataFrame({"v": [1.5]}, index=["r"])
    box = explorer(ipywidgets, [a], lambda: (stream_output(f"a is {a.value}"),
                                             table_output(frame)))
    bundle = box._repr_mimebundle_()
    assert "application/vnd.jupyter.widget-view+json" in bundle
    assert "VBox" not in bundle["text/plain"]
    assert "a = 2" in bundle["text/plain"] and "a is 2" in bundle["text/plain"]
    assert "<pre>a is 2</pre>" in bundle["text/html"] and "<table" in bundle["text/html"]
    a.value = 7
    assert "a is 7" in box._repr_mimebundle_()["text/html"]


def test_text_output_wraps_at_spaces_only_and_names_what_it_shows() -> None:
    out = text_output("NMSE 9.968e-01 | 126 tokens <x>\n", "Layer 0.key: every format")
    nbformat.validate(_notebook(out))
    assert out["data"]["text/plain"] == "NMSE 9.968e-01 | 126 tokens <x>\n"
    page = out["data"]["text/html"]
    assert page.startswith('<p class="nvfp4lab-output-title"><strong>Layer 0.key: every format'
                           "</strong></p><pre ")
    # JupyterLab's own CSS says word-break: break-all; the inline style wins
    assert "word-break: normal" in page and "white-space: pre-wrap" in page
    assert "126 tokens &lt;x&gt;</pre>" in page
    assert "<strong>µs per layer</strong>" in table_output(
        pd.DataFrame({"v": [1.0]}), title="µs per layer")["data"]["text/html"]


def test_a_slow_render_clears_the_output_and_shows_it_is_busy() -> None:
    import time

    a = ipywidgets.IntSlider(value=0, min=0, max=10, description="a")
    seen_during: list[tuple] = []
    box = None

    def render() -> tuple[dict, ...]:
        if a.value == 5:  # slow: the old result must not stay on screen meanwhile
            time.sleep(0.4)
            seen_during.append(tuple(box.children[-1].outputs))
        return (text_output(f"a = {a.value}", "a"),)

    box = explorer(ipywidgets, [a], render, busy_after_s=0.05)
    history: list[tuple] = []
    box.children[-1].observe(lambda ch: history.append(ch["new"]), names="outputs")
    a.value = 1  # fast: straight from the old result to the new one
    assert [W.text_of(h) for h in history] == ["a = 1\n"]
    a.value = 5
    assert seen_during == [(busy_output(),)] and BUSY_TEXT in W.text_of(seen_during[0])
    assert W.text(box) == "a = 5\n"
    time.sleep(0.1)  # the timer of the slow render is done: nothing overwrites the result
    assert W.text(box) == "a = 5\n"
