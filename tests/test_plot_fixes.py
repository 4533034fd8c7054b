"""The report plots say what the records say: weights outside [0, 1] on a scale that shows them, the
gradient's error where it failed, unstable times marked, legends whole and readable."""

from __future__ import annotations

from pathlib import Path

import matplotlib
import numpy as np
import pandas as pd
import pytest

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.colors import PowerNorm, SymLogNorm  # noqa: E402

from experiments.report import model_section, plots, task_section  # noqa: E402

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


def test_failed_check_names_the_figure_over_its_tolerance() -> None:
    row = pd.Series({"dtype": "float32", "out_rel_err": 5.7e-7, "grad_rel_err": 0.5})
    assert plots._failed_check(row) == "grad_rel_err"
    row = pd.Series({"dtype": "float32", "out_rel_err": 0.3, "grad_rel_err": np.nan})
    assert plots._failed_check(row) == "out_rel_err"


# ------------------------------------------------------------------------------- unstable marks
def test_unstable_times_get_their_own_mark(kept: list[plt.Figure], tmp_path: Path) -> None:
    df = _store("documents")
    usable = plots._usable_rows(df)
    assert usable["unstable"].sum() > 0
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
    assert len(fig.legends) == 1  # one legend for the figure, a line per variant
    assert len(fig.legends[0].get_texts()) == rows["variant_label"].nunique()
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
