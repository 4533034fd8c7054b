"""The registry against third-party entry points: a plugin never changes what a taken name means, and
whatever it is refused is said in one line naming the plugin and the owner of the name."""

from __future__ import annotations

import importlib
import warnings
from importlib.metadata import EntryPoint
from pathlib import Path

import pytest

import variants
from variants import registry


def _load(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, modules: dict[str, str], eps: dict[str, str]
) -> list[str]:
    """Load the entry points ``eps`` (name -> ``module`` or ``module:Class``) of modules written from
    ``modules`` (name -> source) as an installed plugin's would be, into a copy of the registry that
    the test's end throws away; returns the warnings' messages."""
    variants.available()  # the real entry points first: the copy starts from the registry as used
    for mod, source in modules.items():
        (tmp_path / f"{mod}.py").write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(registry, "_REGISTRY", dict(registry._REGISTRY))
    monkeypatch.setattr(registry, "_PROVIDERS", dict(registry._PROVIDERS))
    monkeypatch.setattr(registry, "_entry_points_loaded", False)
    monkeypatch.setattr(
        registry, "entry_points", lambda group: [EntryPoint(n, v, group) for n, v in eps.items()]
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        registry._load_entry_points()
    return [str(w.message) for w in caught]


HEADER = (
    "from variants import AttentionVariant, register\nfrom variants.naive import NaiveAttention as Base\n\n"
)


@pytest.mark.parametrize(
    "mod, body",
    [
        # its class happens to have the built-in's class name: only the name was compared
        ("hijack_by_name", '@register("naive")\nclass NaiveAttention(Base):\n    pass\n'),
        # passes itself off as the built-in class (its module and name): register() cannot tell
        (
            "hijack_posing",
            '@register("naive")\nclass NaiveAttention(Base):\n    __module__ = "variants.naive"\n',
        ),
    ],
    ids=["same_class_name", "posing_as_the_built_in"],
)
def test_a_module_plugin_cannot_replace_a_built_in(monkeypatch, tmp_path, mod, body):
    builtin = variants.get("naive")
    caught = _load(monkeypatch, tmp_path, {mod: HEADER + body}, {"my_naive": mod})
    assert registry._REGISTRY["naive"] is builtin
    mine = [m for m in caught if "'my_naive'" in m]
    assert len(mine) == 1 and "\n" not in mine[0], caught
    assert "naive" in mine[0] and "variants.naive.NaiveAttention" in mine[0]
    assert "registered no variant" not in mine[0]  # it did register one: under a taken name


def test_two_plugins_whose_classes_share_a_name_do_not_overwrite_each_other(monkeypatch, tmp_path):
    source = HEADER + '@register("shared_attn")\nclass Attention(Base):\n    pass\n'
    caught = _load(
        monkeypatch,
        tmp_path,
        {"plug_a": source, "plug_b": source},
        {"shared_attn": "plug_a", "also": "plug_b"},
    )
    assert registry._REGISTRY["shared_attn"].__module__ == "plug_a"  # the first keeps it
    assert caught == [
        "could not load attention variant plugin 'also' (plug_b): variant name 'shared_attn' is already "
        "taken by plug_a.Attention"
    ]


def test_a_class_entry_point_under_a_taken_name_is_left_out_saying_so(monkeypatch, tmp_path):
    """'naive = clash:ClashNaive' was dropped without a word (a module with the same clash warned)."""
    builtin = variants.get("naive")
    source = HEADER + "class ClashNaive(Base):\n    pass\n"
    caught = _load(monkeypatch, tmp_path, {"clash": source}, {"naive": "clash:ClashNaive"})
    assert registry._REGISTRY["naive"] is builtin
    assert caught == [
        "attention variant plugin 'naive' (clash:ClashNaive) left out: variant name 'naive' is already "
        "taken by variants.naive.NaiveAttention"
    ]


def test_a_variant_names_the_package_that_provided_it(monkeypatch, tmp_path):
    """A record says which plugin version ran (``provider``): the entry point's distribution, and for
    a built-in variant nothing (this repository's commit says which code ran)."""
    assert registry.provider("naive") is None
    _load(
        monkeypatch,
        tmp_path,
        {"mine_mod": HEADER + '@register("mine")\nclass Mine(Base):\n    pass\n'},
        {"mine": "mine_mod"},
    )
    assert registry.provider("mine") == "entry point mine_mod"  # an entry point without an installed dist
    registry.unregister("mine")
    assert registry.provider("mine") is None
    # its module imported (and registered) before the entry points were read: still the plugin's
    source = HEADER + '@register("early")\nclass Early(Base):\n    pass\n'
    (tmp_path / "early_mod.py").write_text(source)
    importlib.import_module("early_mod")
    _load(monkeypatch, tmp_path, {"early_mod": source}, {"early": "early_mod"})
    assert registry.provider("early") == "entry point early_mod"
