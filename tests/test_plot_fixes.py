"""The report plots say what the records say: weights outside [0, 1] on a scale that shows them, the
gradient's error where it failed, unstable times marked, legends whole and readable."""

from __future__ import annotations

import json
from pathlib import Path

import matplotlib
import numpy as np
import pandas as pd
import pytest

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.colors import PowerNorm, SymLogNorm  # noqa: E402

from experiments.report import frontier_section, model_section, plots, pretrained_section, task_section  # noqa: E402

STORES = Path(__file__).resolve().parents[1] / "results" / "cpu"


def _store(name: str) -> pd.DataFrame:
    path = STORES / name / "report" / "store.parquet"
    if not path.exists():
        pytest.skip(f"no committed store {path}")
    return pd.read_parquet(path)


@pytest.fixture
def kept(monkeypatch: pytest.MonkeyPatch) -> list[plt.Figure]:
    """The figures the plots save, kept open for inspection instead of written."""
    figs: list[plt.Figure] = []

    def keep(fig: plt.Figure, path: object, *a: object, **k: object) -> Path:
        figs.append(fig)
        return Path(str(path))

    monkeypatch.setattr(plots, "_save", keep)
    monkeypatch.setattr(task_section, "save_figure", keep)
    yield figs
    plt.close("all")


def _texts(fig: plt.Figure) -> list[str]:
    return [t.get_text() for ax in fig.axes for t in ax.texts]


# ------------------------------------------------------------------------------- attention weights
def test_weight_norm_in_range_is_the_power_scale() -> None:
    norm = plots._weight_norm(np.array([[0.0, 0.25], [0.75, 1.0]]))
    assert isinstance(norm, PowerNorm) and (norm.vmin, norm.vmax) == (0, 1)


def test_weight_norm_out_of_range_is_centred_and_clips_nothing() -> None:
    w = np.array([[-8.8, 0.0], [0.5, 26.5]])
    norm = plots._weight_norm(w)
    assert isinstance(norm, SymLogNorm)
    assert (norm.vmin, norm.vmax) == (-26.5, 26.5)  # symmetric: 0 is the middle colour
    assert float(norm(0.0)) == pytest.approx(0.5)
    scaled = np.asarray(norm(w))
    assert scaled.min() >= 0 and scaled.max() <= 1  # every weight inside the colour range: none clipped
    assert float(norm(-8.8)) < 0.5 < float(norm(0.5)) < float(norm(26.5))


def test_plot_weights_draws_unnormalised_panels_on_their_own_scale(
    kept: list[plt.Figure], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    soft, raw = object(), object()
    weights = {id(soft): np.full((16, 16), 1 / 16), id(raw): np.linspace(-2, 3, 256).reshape(16, 16)}
    monkeypatch.setattr(plots, "_example_variants", lambda: [("softmax", soft), ("no softmax", raw)])
    monkeypatch.setattr(plots, "attention_weights", lambda var, x, *setting: weights[id(var)])
    plots.plot_weights(pd.DataFrame(), tmp_path)
    fig = kept[0]
    panels = {ax.get_title().split("\n")[0]: ax for ax in fig.axes if ax.get_images()}
    assert set(panels) == {"softmax", "no softmax"}
    inside, outside = panels["softmax"], panels["no softmax"]
    assert "unnormalised" not in inside.get_title()
    assert "unnormalised, range -2..3" in outside.get_title()
    assert isinstance(inside.get_images()[0].norm, PowerNorm)
    assert inside.get_images()[0].get_cmap().name == "viridis"
    image = outside.get_images()[0]
    assert isinstance(image.norm, SymLogNorm) and image.get_cmap().name == "RdBu_r"
    assert (image.norm.vmin, image.norm.vmax) == (-3, 3)
    # its own colorbar, beside it, besides the shared one of the [0, 1] panels
    assert [bar.get_ylabel() for bar in outside.child_axes] == [
        "effective weight\n(symmetric log, 0 = white)"
    ]
    assert not inside.child_axes
    assert "attention weight (power scale)" in [ax.get_ylabel() for ax in fig.axes]


def test_grid_rows_grow_with_title_lines() -> None:
    short, _ = plots._grid(4, title_lines=2)
    tall, _ = plots._grid(4, title_lines=6)
    assert tall.get_figheight() > short.get_figheight()
    plt.close("all")


# ------------------------------------------------------------------------------- accuracy heatmap
def test_accuracy_heatmap_shows_the_failed_gradient(kept: list[plt.Figure], tmp_path: Path) -> None:
    df = _store("scaling")
    i = df[(df["mode"] == "fwd_bwd") & (df["variant"] == "sdpa") & (df["seq_len"] == 1024)].index[0]
    df.loc[i, "grad_rel_err"] = 0.5  # the gradient 50% off: its check failed, the forward's did not
    df.loc[i, "valid"] = False
    plots.plot_accuracy(df, tmp_path)
    fig = kept[0]
    by_title = {ax.get_title(): ax for ax in fig.axes if ax.get_title()}
    grad = [ax for t, ax in by_title.items() if "fwd_bwd" in t and t.endswith("gradient vs float64 oracle")]
    fwd = [ax for t, ax in by_title.items() if "fwd_bwd" in t and t.endswith(": vs float64 oracle")]
    assert len(grad) == 1 and len(fwd) == 1
    grad_texts = [t.get_text() for t in grad[0].texts]
    assert "FAIL\n5.0e-01" in grad_texts  # the figure that failed, in its own panel
    fwd_texts = [t.get_text() for t in fwd[0].texts]
    assert any(t.endswith("grad FAIL") for t in fwd_texts)  # the forward's figure, and what failed
    assert not any(t.startswith("FAIL") for t in fwd_texts)  # not the forward's error called failed
    # no gradient panel for forward-only groups
    assert not any("· fwd:" in t and "gradient" in t for t in by_title)


def test_accuracy_heatmap_shows_the_decoding_step(kept: list[plt.Figure], tmp_path: Path) -> None:
    """The step's own check (records since 2026-11-28) gets its panel, of the variants that step; a
    check the job skipped (performer's oracle over the budget at 128k keys) says so, not "n/a"."""
    df = _store("decode_state")
    i = df[(df["variant"] == "linear") & (df["seq_len"] == 1) & (df["kv_len"] == 1024)].index[0]
    df.loc[i, "step_rel_err"] = 0.5  # the step 50% off: its check failed, the forward's did not
    df.loc[i, "valid"] = False
    plots.plot_accuracy(df, tmp_path)
    by_title = {ax.get_title(): ax for ax in kept[0].axes if ax.get_title()}
    steps = [ax for t, ax in by_title.items() if t.endswith("decoding step vs float64 oracle")]
    assert len(steps) == 2  # one per query length
    one = [
        ax
        for t, ax in by_title.items()
        if "seq_len=1:" in t and t.endswith("decoding step vs float64 oracle")
    ]
    labels = [t.get_text() for t in one[0].get_yticklabels()]
    assert labels == ["linear", "performer", "retention"]  # not sdpa or local_window: no step
    texts = [t.get_text() for t in one[0].texts]
    assert "FAIL\n5.0e-01" in texts and "not\nchecked" in texts
    fwd = [ax for t, ax in by_title.items() if t.endswith("seq_len=1: vs float64 oracle")]
    assert any(t.get_text().endswith("step FAIL") for t in fwd[0].texts)  # the forward's cell names it


def test_accuracy_heatmap_writes_a_one_row_panels_variant_across(
    kept: list[plt.Figure], tmp_path: Path
) -> None:
    """A panel of one variant (the step of a store where one variant steps) names it horizontally;
    seaborn turned it vertical, where it ran over the panel's edge."""
    df = _store("decode_state")
    plots.plot_accuracy(df[df["variant"].isin(["sdpa", "linear"])], tmp_path)
    steps = [ax for ax in kept[0].axes if ax.get_title().endswith("decoding step vs float64 oracle")]
    assert steps
    for ax in steps:
        labels = ax.get_yticklabels()
        assert [t.get_text() for t in labels] == ["linear"]
        assert all(t.get_rotation() == 0 for t in labels)


def test_failed_check_names_the_figure_over_its_tolerance() -> None:
    row = pd.Series({"dtype": "float32", "out_rel_err": 5.7e-7, "grad_rel_err": 0.5})
    assert plots._failed_check(row) == "grad_rel_err"
    row = pd.Series({"dtype": "float32", "out_rel_err": 0.3, "grad_rel_err": np.nan})
    assert plots._failed_check(row) == "out_rel_err"
    # the worst row's error alone over the tolerance (late causal rows lost): still the output's check
    row = pd.Series(
        {"dtype": "bfloat16", "out_rel_err": 0.037, "out_row_rel_err": 1.0, "grad_rel_err": np.nan}
    )
    assert plots._failed_check(row) == "out_rel_err"
    # a decoding step's output wrong, the forward's right: the step is named
    row = pd.Series({"dtype": "float32", "out_rel_err": 2e-7, "step_rel_err": 0.6, "step_row_rel_err": 0.9})
    assert plots._failed_check(row) == "step_rel_err"
    assert plots.FAILED_WHAT["step_rel_err"] == "step"


# ------------------------------------------------------------------------------- unstable marks
def test_unstable_times_get_their_own_mark(kept: list[plt.Figure], tmp_path: Path) -> None:
    df = _store("documents")
    # two records' times marked unstable, as a noisy run leaves some (the committed run was quiet)
    df.loc[df.index[[3, 20]], "fwd_unstable"] = True
    usable = plots._usable_rows(df)
    assert usable["unstable"].sum() == 2
    plots.plot_time(df, tmp_path)
    fig = kept[0]
    labels = [t.get_text() for leg in fig.legends for t in leg.get_texts()]
    assert any(lab.startswith("unstable") for lab in labels)
    squares = [
        c
        for ax in fig.axes
        for c in ax.collections
        if len(c.get_offsets()) and np.allclose(c.get_edgecolor()[0][:3], [0.45] * 3)
    ]
    assert sum(len(c.get_offsets()) for c in squares) == int(usable["unstable"].sum())


# ------------------------------------------------------------------------------- model context
def test_model_context_legend_whole_and_labels_without_mix_fields(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    df = _store("llama_mix")
    rows = df[df["kind"] == "model"] if "kind" in df else df
    seen: dict[str, object] = {}
    orig = plt.Figure.savefig

    def spy(self: plt.Figure, *a: object, **k: object) -> object:
        seen["labels"] = [t.get_text() for t in self.legends[0].get_texts()]
        seen["bbox_inches"] = k.get("bbox_inches")
        return orig(self, *a, **k)

    monkeypatch.setattr(plt.Figure, "savefig", spy)
    assert model_section.plot_context(rows, tmp_path / "model_context.png") is not None
    assert seen["bbox_inches"] == "tight"  # the legend below the panels stays in the file
    labels = seen["labels"]
    assert labels and not any(f in lab for lab in labels for f in model_section._MIX)
    assert not any("nan" in lab for lab in labels)


# ------------------------------------------------------------------------------- recall vs distance
def test_recall_vs_distance_facets_by_task(kept: list[plt.Figure], tmp_path: Path) -> None:
    df = _store("recall_frontier")
    task_section.plot_recall_vs_distance(df, tmp_path / "recall_vs_distance.png")
    fig = kept[0]
    rows = task_section.task_rows(df)
    rows = rows[(rows["task_name"] == "recall") & (rows["status"] == "ok")]
    panels = [ax for ax in fig.axes if ax.get_visible()]
    assert len(panels) == rows.groupby(["task_label", "seq_len"]).ngroups
    assert all(len(ax.get_lines()) <= rows["variant_label"].nunique() + 2 for ax in panels)
    assert len(fig.legends) == 1  # one legend for the figure, a line per variant, and how coinciding
    labels = [t.get_text() for t in fig.legends[0].get_texts()]  # lines are drawn where some do
    assert len([lab for lab in labels if "lines that coincide" not in lab]) == rows["variant_label"].nunique()
    assert fig._suptitle is not None and "Associative recall" in fig._suptitle.get_text()


# ------------------------------------------------------------------------------- smaller fixes
def test_trained_attention_titles_name_the_seed_of_their_accuracy(
    kept: list[plt.Figure], tmp_path: Path
) -> None:
    df = _store("recall_frontier")
    task_section.plot_trained_attention(df, tmp_path / "trained_attention.png")
    titles = [ax.get_title() for ax in kept[0].axes if ax.get_images()]
    assert titles and all("seed 0 acc " in t.replace("\n", " ") for t in titles)


def test_memory_and_state_plots_show_coinciding_lines(kept: list[plt.Figure], tmp_path: Path) -> None:
    df = _store("decode_state")
    plots.plot_state(df, tmp_path)
    ax = [a for a in kept[0].axes if a.get_lines()][0]
    assert ax.get_yscale() == "log"  # log y with the log x, whether or not it spans decades
    lines = [ln for ln in ax.get_lines() if ln.get_marker() not in ("", "None", None)]
    assert all(ln.get_markerfacecolor() == "none" for ln in lines)  # hollow: one under another shows
    sizes = {ln.get_label(): ln.get_markersize() for ln in lines}
    ordered = [sizes[n] for n in sorted(sizes)]
    assert ordered == sorted(ordered, reverse=True) and ordered[0] > ordered[-1]


# ------------------------------------------------------------------------------- coinciding lines
def _panel_lines(fig: plt.Figure) -> list[list[plt.Line2D]]:
    """Each panel's data lines (those with markers), in drawing order."""
    return [
        [ln for ln in ax.get_lines() if ln.get_marker() not in ("", "None", None)]
        for ax in fig.axes
        if ax.get_lines()
    ]


def _same_data(a: plt.Line2D, b: plt.Line2D) -> bool:
    xa, ya, xb, yb = (np.asarray(v, float) for v in (*a.get_data(), *b.get_data()))  # (pandas: objects)
    return len(xa) == len(xb) and np.allclose(xa, xb) and np.allclose(ya, yb)


def test_lines_within_a_log_axis_line_width_take_turns(kept: list[plt.Figure], tmp_path: Path) -> None:
    """On the 3.5-decade decode plot linear's step (0.262-0.276 ms) and local_window's forward
    (0.264-0.271) are 3-5% apart, over the fixed 3%: one hid the other. The tolerance is now a share
    of the axis's decades (8% there)."""
    df = _store("decode_state")
    plots.plot_decode(df, tmp_path)
    one_query = _panel_lines(kept[0])[0]  # the seq_len=1 panel
    style = {ln.get_label().split(",")[0]: ln.get_linestyle() for ln in one_query}  # "linear, Nq=1"
    assert style["linear"] == "-" and style["local_window"] == "--"
    assert style["sdpa"] == style["retention"] == "-"
    assert plots.log_axis_rtol(pd.Series([1.0, 10.0])) == plots.COINCIDE_RTOL  # one decade: the floor
    assert plots.log_axis_rtol(pd.Series([1.0, 10.0**4])) == pytest.approx(10**0.04 - 1)


def test_identical_memory_series_take_turns_in_dashes(kept: list[plt.Figure], tmp_path: Path) -> None:
    df = _store("scaling")
    # naive's peak is 2x or more every other variant's at every length: only its twins meet it
    naive = df[df["variant"] == "naive"]
    twins = [naive.assign(variant=f"naive_twin{i}", variant_key=f"naive_twin{i}") for i in (1, 2)]
    plots.plot_memory(pd.concat([df, *twins], ignore_index=True), tmp_path)
    fig = kept[0]
    for lines in _panel_lines(fig):
        same = [ln for ln in lines if ln.get_label().startswith("naive")]
        assert len(same) == 3 and all(_same_data(same[0], ln) for ln in same)
        # the first drawn stays solid, the ones drawn over it are dashed, each its own share of the period
        assert [ln.get_linestyle() for ln in same] == ["-", "--", "--"]
        offsets = {ln._unscaled_dash_pattern[0] for ln in same[1:]}
        assert len(offsets) == 2
        # lines that coincide with no other stay solid (performer: 12% or more from every other line)
        alone = [ln for ln in lines if ln.get_label() == "performer"]
        assert alone and alone[0].get_linestyle() == "-"
    labels = [t.get_text() for leg in fig.legends for t in leg.get_texts()]
    assert any("lines that coincide" in lab for lab in labels)


def test_identical_state_series_do_not_hide_each_other(kept: list[plt.Figure], tmp_path: Path) -> None:
    df = _store("decode_state")
    # a second variant with retention's state (two per-query-head states of one size, say)
    twin = df[df["variant"] == "retention"].assign(variant="retention_twin", variant_key="retention_twin")
    plots.plot_state(pd.concat([df, twin], ignore_index=True), tmp_path)
    pairs = 0
    for lines in _panel_lines(kept[0]):
        for i, a in enumerate(lines):
            for b in lines[i + 1 :]:
                if _same_data(a, b):  # a K/V cache and a window's, say: one line, both colours
                    pairs += 1
                    assert (a.get_linestyle(), b.get_linestyle()) != ("-", "-")
    assert pairs > 0


def test_coinciding_styles_leave_distinct_lines_solid() -> None:
    x = pd.Series([1024.0, 2048.0, 4096.0])
    near = pd.Series([10.0, 20.0, 40.0]) * (1 + plots.COINCIDE_RTOL / 2)
    styles = plots.coinciding_styles(
        [(x, pd.Series([10.0, 20.0, 40.0])), (x, pd.Series([1.0, 2.0, 4.0])), (x, near)]
    )
    assert styles[0] == "-" and styles[1] == "-" and styles[2] != "-"
    # a single shared length is no shared segment: markers tell those apart
    assert plots.coinciding_styles([(x, pd.Series([1.0, 2.0, 4.0])), (x, pd.Series([1.0, 5.0, 9.0]))]) == [
        "-",
        "-",
    ]


def test_coinciding_styles_on_a_linear_axis_use_an_absolute_tolerance() -> None:
    # accuracies in %: 97 and 100 are 3% apart but 3 points of a 104-point axis (several line widths)
    x = [16, 32, 48]
    high, near_high, low, near_low = [100.0] * 3, [97.0] * 3, [20.0, 20.0, 20.0], [20.5, 20.5, 20.5]
    lines = [(x, high), (x, near_high), (x, low), (x, near_low)]
    assert plots.coinciding_styles(lines)[1] != "-"  # relative: 97 ~ 100, 20.5 ~ 20 (2.5%)
    styles = plots.coinciding_styles(lines, rtol=0.0, atol=plots.COINCIDE_SPAN * 104)
    assert styles[:3] == ["-", "-", "-"] and styles[3] != "-"  # absolute: 1.04 points


# ------------------------------------------------------------------------------- decode marks
GPU_DECODE = Path(__file__).resolve().parents[1] / "results" / "gpu" / "h100" / "decode"


def _squares(fig: plt.Figure) -> np.ndarray:
    """The points that got the gray square (unstable) mark, as (x, y) rows."""
    pts = [
        c.get_offsets()
        for ax in fig.axes
        for c in ax.collections
        if len(c.get_offsets()) and np.allclose(c.get_edgecolor()[0][:3], [0.45] * 3)
    ]
    return np.concatenate([np.asarray(p, float) for p in pts]) if pts else np.empty((0, 2))


def test_decode_graph_times_carry_the_graphs_own_unstable_flag(
    kept: list[plt.Figure], tmp_path: Path
) -> None:
    path = GPU_DECODE / "report" / "store.parquet"
    if not path.exists():
        pytest.skip(f"no committed store {path}")
    df = pd.read_parquet(path)
    rows = plots.decode_rows(plots._usable_rows(df))
    assert rows["graph_ms_per_token"].notna().all()  # every point drawn is a CUDA-graph time
    assert rows["unstable"].sum() > 0  # the eager forward's runs never settled for some
    assert not rows["fwd_graph_unstable"].map(plots.is_true).any()  # the graph's did
    plots.plot_decode(df, tmp_path)
    assert len(_squares(kept[0])) == 0  # the eager forward's flag is not the drawn figure's
    labels = [t.get_text() for leg in kept[0].legends for t in leg.get_texts()]
    assert not any(lab.startswith("unstable") for lab in labels)

    # and the graph's own flag, where the records carry it, is marked, on the graph's time
    i = rows.index[0]
    df = df.assign(fwd_unstable=False)
    df.loc[i, "fwd_graph_unstable"] = True
    plots.plot_decode(df, tmp_path)
    squares = _squares(kept[1])
    assert len(squares) == 1
    drawn = [rows.loc[i, "kv_len"], rows.loc[i, "graph_ms_per_token"]]  # at the graph's time
    assert list(squares[0]) == pytest.approx(drawn)


def test_decode_without_graph_marks_the_step_or_forward(kept: list[plt.Figure], tmp_path: Path) -> None:
    df = _store("decode_state")
    # the committed run was quiet (no figure unstable): flag a state variant's step and sdpa's forward
    one_query = df["seq_len"] == 1
    step_row = df.index[(df["variant"] == "linear") & one_query][0]
    fwd_row, other_sdpa = df.index[(df["variant"] == "sdpa") & one_query][:2]
    df.loc[step_row, "step_unstable"] = True
    df.loc[fwd_row, "fwd_unstable"] = True
    df.loc[other_sdpa, "step_unstable"] = True  # not its drawn figure: sdpa decodes by its forward
    rows = plots.decode_rows(plots._usable_rows(df))
    assert rows["graph_ms_per_token"].isna().all()
    assert int(rows["unstable"].sum()) == 2
    plots.plot_decode(df, tmp_path)
    assert len(_squares(kept[0])) == 2


# ------------------------------------------------------------------------------- symlog colorbar
def test_symlog_colorbar_ticks_are_few_and_apart(
    kept: list[plt.Figure], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    raw = object()
    monkeypatch.setattr(plots, "_example_variants", lambda: [("no softmax", raw)])
    monkeypatch.setattr(plots, "attention_weights", lambda *a: np.linspace(-2, 27.3, 256).reshape(16, 16))
    plots.plot_weights(pd.DataFrame(), tmp_path)
    fig = kept[0]
    fig.canvas.draw()
    (panel,) = [ax for ax in fig.axes if ax.get_images()]
    norm = panel.get_images()[0].norm
    (bar,) = panel.child_axes
    ticks = [t for t in bar.get_yticks() if -27.3 <= t <= 27.3]
    labels = [t.get_text() for t in bar.get_yticklabels() if t.get_text()]
    assert 5 <= len(ticks) <= 7 and len(labels) == len(ticks)
    assert 0 in ticks and ticks[0] == pytest.approx(-27.3) and ticks[-1] == pytest.approx(27.3)
    assert ticks == pytest.approx([-t for t in reversed(ticks)])  # symmetric about 0
    # no two labels crowd each other: at least a tenth of the bar apart (the old ones sat at 0, ±1e-3)
    assert np.diff(np.asarray(norm(ticks))).min() >= 0.1
    assert labels == ["−27", "−1", "−0.1", "0", "0.1", "1", "27"]  # compact, no 10^k mathtext
    assert not bar.yaxis.get_minorticklocs().size


# ------------------------------------------------------------------------------- coinciding lines elsewhere
def _data_lines(ax: plt.Axes) -> list[plt.Line2D]:
    """``ax``'s data lines: with markers and a line (not an error bar's caps, not a window's rule)."""
    return [
        ln
        for ln in ax.get_lines()
        if ln.get_marker() not in ("", "None", None) and ln.get_linestyle() not in ("None", "", " ")
    ]


def _identical_pairs_not_both_solid(fig: plt.Figure) -> int:
    """How many pairs of a panel's data lines draw the same points; fails where both of such a pair are
    solid (the one drawn last would hide the other)."""
    pairs = 0
    for ax in fig.axes:
        lines = _data_lines(ax)
        for i, a in enumerate(lines):
            for b in lines[i + 1 :]:
                if _same_data(a, b):
                    pairs += 1
                    styles = (a.get_linestyle(), b.get_linestyle())
                    assert styles != ("-", "-"), (a.get_label(), b.get_label())
    return pairs


def _legend_lines(fig: plt.Figure) -> list[tuple[str, object]]:
    """(label, handle) of every legend of ``fig`` (the figure's and the panels')."""
    legends = [*fig.legends, *(ax.get_legend() for ax in fig.axes if ax.get_legend() is not None)]
    return [
        (t.get_text(), h) for leg in legends for t, h in zip(leg.get_texts(), leg.legend_handles, strict=True)
    ]


def _legend_says_lines_coincide(fig: plt.Figure) -> None:
    """The legend names the dashes, and draws every other line it names solid, whatever a panel drew."""
    entries = _legend_lines(fig)
    assert any("lines that coincide" in label for label, _ in entries)
    for label, h in entries:
        if "lines that coincide" not in label and isinstance(h, plt.Line2D) and h.get_linestyle() != "None":
            assert h.get_linestyle() == "-", label


@pytest.fixture
def drawn(monkeypatch: pytest.MonkeyPatch) -> list[plt.Figure]:
    """The figures that section plots save with ``Figure.savefig`` (no file written)."""
    figs: list[plt.Figure] = []
    monkeypatch.setattr(plt.Figure, "savefig", lambda self, *a, **k: figs.append(self))
    yield figs
    plt.close("all")


def test_recall_vs_distance_lines_that_coincide_take_turns(kept: list[plt.Figure], tmp_path: Path) -> None:
    df = _store("recall_frontier")
    recall = df[(df["kind"] == "task") & (df["variant"] == "sdpa")]
    twin = recall.assign(variant="sdpa_twin", variant_name="sdpa_twin", variant_key="sdpa_twin")
    task_section.plot_recall_vs_distance(pd.concat([df, twin], ignore_index=True), tmp_path / "r.png")
    fig = kept[0]
    panels = [ax for ax in fig.axes if ax.get_visible()]
    assert _identical_pairs_not_both_solid(fig) >= len(panels)  # sdpa and its twin, in every panel
    _legend_says_lines_coincide(fig)


def test_recall_frontier_lines_that_coincide_take_turns(drawn: list[plt.Figure], tmp_path: Path) -> None:
    table = frontier_section.frontier_table(_store("recall_frontier"))
    twin = table[table["variant_name"] == "deltanet"].assign(variant_name="deltanet_twin")
    frontier_section.plot_frontier(pd.concat([table, twin], ignore_index=True), tmp_path / "f.png")
    fig = drawn[0]
    assert _identical_pairs_not_both_solid(fig) >= 3  # the twins, in each number of pairs' panel
    _legend_says_lines_coincide(fig)


def test_model_context_lines_that_coincide_take_turns(drawn: list[plt.Figure], tmp_path: Path) -> None:
    df = _store("llama_mix")
    rows = df[df["kind"] == "model"]
    assert model_section.plot_context(rows, tmp_path / "model_context.png") is not None
    fig = drawn[0]
    # from the records: lines (variant and model) whose K/V bytes are the same at every prompt length
    # (a window's cache and exact attention's in a plain Llama keep the same bytes, say)
    ok = rows[rows["status"] == "ok"]
    ok = ok.assign(_line=ok["variant"] + ok["model"].map(_model_but_length), _n=ok["model"].map(_length))
    expected = 0
    for col in ("kv_bytes_kept", "kv_bytes_read_per_step"):
        curves = pd.Series(
            {line: tuple(sorted(zip(g["_n"], g[col], strict=True))) for line, g in ok.groupby("_line")}
        )
        curves = curves[curves.map(len) >= 2]  # a line of one point is not drawn
        expected += sum(n * (n - 1) // 2 for n in curves.value_counts())
    assert expected > 0
    assert _identical_pairs_not_both_solid(fig) >= expected
    _legend_says_lines_coincide(fig)


def _length(model: str) -> int:
    return int(json.loads(model)["prefill_len"])


def _model_but_length(model: str) -> str:
    return json.dumps({k: v for k, v in json.loads(model).items() if k != "prefill_len"}, sort_keys=True)


def test_token_mass_lines_that_coincide_take_turns(drawn: list[plt.Figure], tmp_path: Path) -> None:
    df = _store("pretrained")
    rows = pretrained_section.pretrained_rows(df)
    rows = rows[rows["seq_len"] == rows["seq_len"].max()]
    twin = rows[rows["variant"] == "axial"].assign(variant="axial_twin")
    pretrained_section.plot_token_mass(pd.concat([rows, twin]), "t", tmp_path / "m.png")
    fig = drawn[0]
    assert _identical_pairs_not_both_solid(fig) == 1
    _legend_says_lines_coincide(fig)


def test_token_mass_layers_count_from_0_as_full_layers_does(drawn: list[plt.Figure], tmp_path: Path) -> None:
    """The plot counted layers from 1 while pretrained.full_layers and the tables count from 0."""
    rows = pretrained_section.pretrained_rows(_store("pretrained"))
    pretrained_section.plot_token_mass(rows, "t", tmp_path / "m.png")
    for ax in drawn[0].axes[:3]:
        assert "from 0" in ax.get_xlabel()
        assert all(
            list(line.get_xdata()) == list(range(6)) for line in ax.get_lines() if len(line.get_xdata())
        )


def test_pretrained_frontier_points_at_one_place_share_a_circle(
    drawn: list[plt.Figure], tmp_path: Path
) -> None:
    df = _store("pretrained")
    rows = pretrained_section.pretrained_rows(df)
    rows = rows[rows["status"] == "ok"]
    pretrained_section.plot_frontier(rows, "t", tmp_path / "f.png")
    fig = drawn[0]
    # the records' own: exact variants keep every pair at cosine 1, one place of the lower panels
    exact = rows[np.isclose(rows["kept_pairs"], 1.0) & np.isclose(rows["cosine_mean"], 1.0)]
    lower = [ax for ax in fig.axes if ax.get_xlabel() == "share of pairs kept"]
    assert len(lower) == rows["seq_len"].nunique() and exact.groupby("seq_len").size().min() >= 2
    for ax, (_, here) in zip(lower, exact.groupby("seq_len"), strict=True):
        at = [c for c in ax.collections if np.allclose(c.get_offsets(), [[1.0, 1.0]])]
        assert len(at) == len(here)
        paths = [c.get_paths()[0].vertices for c in at]
        # each variant its own sector of the circle: no marker the same as (and hidden by) another
        assert all(not np.array_equal(a, b) for i, a in enumerate(paths) for b in paths[i + 1 :])
        colours = {tuple(np.round(c.get_edgecolor()[0], 6)) for c in at}
        assert len(colours) == len(here)
    labels = [t.get_text() for leg in fig.legends for t in leg.get_texts()]
    assert any("variants at one point" in lab for lab in labels)


def test_the_patterns_plot_draws_what_ran_with_its_knobs_at_its_length():
    """patterns.png drew every registered variant at its example knobs at N=48 whatever the store held
    (a sweep of one plugin variant showed twenty others'): it draws each variant that ran, with the
    knobs it ran with and its causal setting, at the longest length that ran (at most 1024); the whole
    registry only when nothing ran."""
    import variants
    from experiments.records import store
    from experiments.records.records import config_hash
    from experiments.report.plots import pattern_panels

    from .test_compare import record

    recs = []
    for n, causal in ((256, False), (2048, False), (2048, True)):
        rec = record(n, 10.0, 0.1)
        rec["config"]["variant"] = {"_target_": "variants.local_window.LocalWindowAttention", "window": 4}
        rec["config"]["causal"] = causal
        rec["config_hash"] = config_hash(rec["config"])
        rec["variant_name"] = "local_window"
        recs.append(rec)
    failed = record(512, 10.0, 0.1)  # naive, which did not run: no panel
    failed["status"] = "oom"
    n, which, panels = pattern_panels(store.to_frame([*recs, failed]))
    assert (n, which) == (1024, "the variants that ran, with their knobs; they ran up to N = 2048")
    assert [(title, causal) for title, _, causal in panels] == [
        ("local_window(window=4)", False),
        ("local_window(window=4)", True),
    ]
    assert int(panels[0][1].pattern(n, n, False).sum()) == n * 9 - 2 * (1 + 2 + 3 + 4)  # the band, at N
    n, which, panels = pattern_panels(store.to_frame(recs[:1]))
    assert (n, which) == (256, "the variants that ran, with their knobs")
    n, which, panels = pattern_panels(store.to_frame([failed]))
    assert (
        n == 48 and which.startswith("every registered variant") and len(panels) == len(variants.available())
    )


@pytest.mark.parametrize(
    "store, unit",
    [("scaling", " GFLOP/s"), ("../gpu/h100/gpu_fwd_bf16", " TFLOP/s")],
)
def test_the_gemm_line_is_labelled_in_its_unit(store, unit, kept):
    """An H100's GEMM line read "GEMM, same sweep: 6.79e+05": in the axis' GFLOP/s, without a unit.
    It says its rate in G or T as its size asks, as the tables do."""
    plots.plot_gflops(_store(store), Path("unused"))
    (fig,) = kept
    gemm = [t for t in _texts(fig) if t.startswith("GEMM, same sweep: ")]
    assert gemm and all(t.endswith(unit) and "e+" not in t for t in gemm), gemm
