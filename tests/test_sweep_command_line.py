"""run.py's command line: bad values, variant names and globs, plugins, and unusable folders refused
in one line before any measurement."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import variants
from experiments.records.records import read_records
from experiments.sweep.hydra_nodes import register_hydra_pieces
from experiments.sweep.preflight import preflight

from .helpers import sweep_overrides
from .test_runner import ROOT, SMALL, run_sweep


def test_bad_value_is_one_line_error_before_work(tmp_path):
    cmd = [sys.executable, "run.py", "seq_len=0", f"records_dir={tmp_path}"]
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert p.returncode == 1
    assert p.stderr.strip() == "error: seq_len must be > 0, got 0"
    assert not list(tmp_path.glob("*.json"))


def _install_plugin(root: Path) -> None:
    """A third-party package on the path with an ``attnbench.variants`` entry point (a dist-info
    folder next to it is what pip would leave) and no YAML in this repo."""
    (root / "myplug").mkdir()
    (root / "myplug" / "__init__.py").write_text(
        "from variants import register\n"
        "from variants.naive import NaiveAttention\n\n"
        "@register('myplug_attn')\n"
        "class MyPlugAttention(NaiveAttention):\n"
        "    def __init__(self, temperature: float = 1.0, tag: str = 'x') -> None:\n"
        "        super().__init__()\n"
        "        self.temperature, self.tag = temperature, tag\n"
    )
    dist = root / "myplug-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: myplug\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text("[attnbench.variants]\nmyplug_attn = myplug\n")


def test_entry_point_plugin_is_a_variant_choice_with_knobs(tmp_path):
    _install_plugin(tmp_path)
    small = [f"{k}={v}" for k, v in SMALL.items()]
    cmd = [
        sys.executable,
        "run.py",
        "-m",
        "variant=glob(myplug*)",  # the glob sees the plugin's generated config node
        "variant.temperature=2.0",  # a knob without '+'
        *sweep_overrides(*small),
        f"records_dir={tmp_path / 'records'}",
        f"hydra.sweep.dir={tmp_path / 'sweep'}",
        "report=false",
    ]
    env = dict(os.environ, PYTHONPATH=f"{tmp_path}{os.pathsep}{ROOT}")
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)
    assert p.returncode == 0, p.stderr[-2000:]
    (rec,) = read_records(tmp_path / "records")
    assert rec["status"] == "ok" and rec["variant_name"] == "myplug_attn"
    assert rec["config"]["variant"]["temperature"] == 2.0
    # which version of the plugin ran: it shares this repository's commit with the plugin's other versions
    assert rec["env"]["variant_package"] == "myplug 0.1"
    bad = subprocess.run(
        [sys.executable, "run.py", "variant=myplug_attn", "variant.temprature=2", f"records_dir={tmp_path}"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert bad.returncode == 1
    assert bad.stderr.strip() == "error: unknown knob 'temprature' for myplug_attn; knobs: temperature, tag"


def test_a_plugin_that_registers_nothing_under_its_name_says_so(tmp_path):
    """An entry point naming a module that forgot @register (or registered another name): without a
    word the variant was just 'unknown', as if the plugin were not installed."""
    (tmp_path / "forgetful.py").write_text(
        "from variants.naive import NaiveAttention\n\nclass Mine(NaiveAttention):\n    pass\n"
    )
    dist = tmp_path / "forgetful-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: forgetful\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text("[attnbench.variants]\nforgot = forgetful\n")
    env = dict(os.environ, PYTHONPATH=f"{tmp_path}{os.pathsep}{ROOT}")
    code = "import variants; print('forgot' in variants.available())"
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, env=env)
    assert p.stdout.strip() == "False"
    assert "plugin 'forgot' (forgetful) loaded but registered no variant named 'forgot'" in p.stderr


@pytest.mark.parametrize("name", ["", "a,b", "my attn", "x=1"])
def test_a_variant_name_a_command_line_cannot_say_is_refused(name):
    with pytest.raises(ValueError, match="letters, digits"):
        variants.register(name)


def test_a_variant_returning_the_wrong_shape_is_named_in_one_line():
    """A third party's _attend returning (B, Nq, H, Dv), or None: one line naming the class and the
    shape it owed, not a torch error about tensor sizes further on."""
    from variants.naive import NaiveAttention

    class Transposed(NaiveAttention):
        def _attend(self, q, k, v, **kw):
            return super()._attend(q, k, v, **kw).transpose(1, 2)

    class Forgot(NaiveAttention):
        def _attend(self, q, k, v, **kw):
            return None

    q = torch.randn(1, 8, 16, 4)
    with pytest.raises(TypeError, match=r"Transposed._attend returned \(1, 16, 8, 4\); expected a tensor"):
        Transposed()(q, q, q)
    with pytest.raises(
        TypeError, match=r"Forgot._attend returned NoneType; expected a tensor \(B, H, Nq, Dv\)"
    ):
        Forgot()(q, q, q)


def test_a_subclass_of_a_registered_variant_is_labelled_by_its_own_class():
    from experiments.sweep.checks import variant_label
    from tests.faulty import CrashingAttention

    assert variant_label(CrashingAttention) == "tests.faulty.CrashingAttention"
    assert variant_label(variants.get("naive")) == "naive"


@pytest.mark.parametrize(
    "args,message",
    [
        (
            ["variant=nosuch"],
            f"error: unknown variant 'nosuch'; known variants: {', '.join(variants.available())}; "
            "knob presets: frontier/local_window_w16, ",  # the presets in conf/variant/*/, sorted
        ),
        (["dtype=fp8"], "error: dtype=fp8: expected one of float32, float64, bfloat16, float16"),
        (
            ["variant=local_window", "variant.windo=3"],
            "error: unknown knob 'windo' for local_window; knobs: ",
        ),
        (
            ["variant=local_window", "variant.window=16.0"],
            "error: local_window knob window must be int, got 16.0",
        ),
        (["causal=true", "kv_len=512"], "error: causal=true needs kv_len >= seq_len (or null)"),
        (["heads=8", "kv_heads=3"], "error: kv_heads must divide heads, got heads=8, kv_heads=3"),
        # a setting no job reads: refused, whether or not Hydra was told to add it
        (["seqlen=64"], "error: unknown setting 'seqlen' in 'seqlen=64'; did you mean seq_len or seed?"),
        (["+seqlen=64"], "error: unknown setting 'seqlen' in '+seqlen=64'; did you mean seq_len"),
        (["window=16"], "error: unknown setting 'window' in 'window=16'; did you mean variant.window?"),
        # a sweep's jobs are checked before Hydra launches any: no banner, no sweep folder
        (["-m", "seq_len=64,0"], "error: seq_len must be > 0, got 0"),
        (["timeout_s=nan"], "error: timeout_s must be a finite number > 0, got nan"),
        (["settle_s=inf"], "error: settle_s must be a finite number >= 0"),
        (["-m", "variant=local_window", "variant.window=-5"], "error: window must be >= 0"),
        (["-m", "variant=naive,sdpa", "padding=0.5,1.5"], "error: padding must be in [0, 1), got 1.5"),
        # a named sweep or task that does not exist: one line, not Hydra's page of search paths
        (["-m", "experiment=nosuch"], "error: unknown experiment 'nosuch'; known: causal, cross, decode,"),
        # a named sweep is a sweep: as a single run it would measure one job of defaults, exit 0
        (["experiment=quick"], "error: experiment=quick sweeps variant, seq_len, mode: run it with -m"),
        (["-m", "experiment=quick,scaling"], "error: experiment=quick,scaling: one named sweep at a time"),
        # Hydra's own multi-line errors, as one line: a value of the wrong type, a launcher misspelt
        (["seq_len=abc"], "error: seq_len=abc: Value 'abc' of type 'str' could not be converted to Integer"),
        (["-m", "batch=1,x"], "error: batch=x: Value 'x' of type 'str' could not be converted to Integer"),
        (
            ["-m", "hydra/launcher=jobilb"],
            "error: hydra/launcher=jobilb: no such option; available: basic, joblib, slurm,",
        ),
        (["+task=nosuch"], "error: unknown task 'nosuch'; known: copy, recall, reverse (conf/task/)"),
        (["task=copy"], "error: task=...: nothing chose a task to override; add one with +task=<name>"),
        # a key the chosen model, task or encoder does not have: the one it likely meant
        (
            ["-m", "experiment=llama", "model.hiden=64"],
            "error: Could not override 'model.hiden'.: Key 'hiden' is not in struct; did you mean "
            "model.hidden?",
        ),
        # a list value is one value, not sweep syntax: it is checked too (Hydra's five lines before)
        (
            ["-m", "experiment=pretrained", "pretrained.full_layer=[2,4]"],
            "error: Could not override 'pretrained.full_layer'.: Key 'full_layer' is not in struct; did you "
            "mean pretrained.full_layers?",
        ),
        # settings a task or model job would ignore, or that would label its record wrongly
        (["+task=recall", "task.steps=0"], "error: task.steps must be an integer >= 1, got 0"),
        (
            ["+task=recall", "seq_len=128", "heads=3"],
            "error: task jobs build their own attention calls: heads=3",
        ),
        (["-m", "experiment=llama", "model.layers=0"], "error: model.layers must be an integer >= 1, got 0"),
        (["-m", "experiment=llama", "model.kv_heads=3"], "error: model.kv_heads must divide model.heads"),
        (
            ["-m", "experiment=llama", "model.new_tokens=1"],
            "error: model.new_tokens must be an integer >= 2, got 1",
        ),
        (
            ["-m", "experiment=llama", "seq_len=128"],
            "error: seq_len=128 but a model job prefills model.prefill_len",
        ),
    ],
)
def test_input_that_can_never_run_is_one_line_before_work(tmp_path, args, message, capsys):
    # the checks run.py passes its command line through before Hydra launches anything, called here
    # (a run.py process per case took 13 s each in the suite); test_run_py_checks_its_command_line_first
    # runs some of them through run.py itself
    with pytest.raises(SystemExit) as exit_:
        preflight(["run.py", *args, f"records_dir={tmp_path}", f"hydra.sweep.dir={tmp_path / 'sweep'}"])
    out, err = capsys.readouterr()
    assert exit_.value.code == 1
    assert len(err.strip().splitlines()) == 1 and err.startswith(message), err
    assert out == ""
    assert not list(tmp_path.glob("*.json")) and not (tmp_path / "sweep").exists()


@pytest.mark.parametrize(
    "args,message",
    [
        (["variant=local_window", "variant.windo=3"], "error: unknown knob 'windo' for local_window"),
        (["-m", "seq_len=64,0"], "error: seq_len must be > 0, got 0"),
        (["-m", "hydra/launcher=jobilb"], "error: hydra/launcher=jobilb: no such option; available: basic,"),
    ],
    ids=["knob", "sweep", "hydra"],
)
def test_run_py_checks_its_command_line_first(tmp_path, args, message):
    # the wiring: one line, exit 1, no banner, no sweep folder, no record
    p = subprocess.run(
        [sys.executable, "run.py", *args, f"records_dir={tmp_path}", f"hydra.sweep.dir={tmp_path / 'sweep'}"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 1
    assert len(p.stderr.strip().splitlines()) == 1 and p.stderr.startswith(message), p.stderr
    assert p.stdout == ""  # no "Launching" banner, no "sweep finished"
    assert not list(tmp_path.glob("*.json")) and not (tmp_path / "sweep").exists()


@pytest.mark.parametrize(
    "args",
    [
        ["-m", "hydra/launcher=joblib", "hydra.launcher.n_jobs=2", "variant=naive,sdpa"],
        ["-m", "hydra/sweeper=optuna", "hydra.sweeper.params.seq_len=choice(32,64)"],
        ["hydra/job_logging=disabled", "hydra.job.chdir=true", "seq_len=32"],
        ["hydra.searchpath=[file:///nonexistent]", "hydra/launcher=elsewhere"],  # Hydra's to find
    ],
    ids=["joblib", "optuna", "logging", "searchpath"],
)
def test_hydra_s_own_options_pass_the_preflight(args):
    """The one-line refusals must not refuse what Hydra takes: its launchers, sweepers and settings
    (a group option from another config folder is Hydra's to find)."""

    register_hydra_pieces()
    assert preflight(["run.py", *args])[1:] == args


def test_a_sweep_that_matches_no_job_fails_in_one_line(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:  # checked before Hydra launches anything
        preflight(["run.py", "-m", "variant=glob(zzz*)", f"hydra.sweep.dir={tmp_path / 'sweep'}"])
    out, err = capsys.readouterr()
    assert exit_.value.code == 1 and out == ""
    assert err.startswith("error: 'variant=glob(zzz*)' matches no variant; known variants: additive")
    assert len(err.strip().splitlines()) == 1 and not (tmp_path / "sweep").exists()
    # a glob with an exclude list is Hydra's to expand: the sweep's end says it launched nothing
    p = run_sweep(tmp_path, "variant=glob(*,exclude=*)")
    assert p.returncode == 1
    assert p.stderr.strip() == (
        "the sweep launched no job: 'variant=glob(*,exclude=*)' matched nothing: exit code 1"
    )
    assert "records listed" not in p.stdout and not (tmp_path / "sweep").exists()


@pytest.mark.parametrize(
    "glob,says",
    [
        # Hydra reads a second argument as an exclude: this ran local_window alone, without a word
        ("glob(local*,sparse)", "glob's second argument excludes, and sparse takes away nothing local* "
         "matched; for several patterns give one "
         "list: 'variant=glob([local*,sparse])'"),
        ("glob(*,exclude=[spars])", "exclude spars takes away nothing * matched"),
        ("glob([zzz*,yyy])", "matches no variant"),
        ("glob([local*,sparse])", None),
        ("glob(*,exclude=[spars*])", None),
    ],
)  # fmt: skip
def test_a_variant_glob_that_cannot_mean_what_it_says_is_refused_before_launch(glob, says, capsys):

    argv = ["run.py", "-m", f"variant={glob}", "seq_len=64"]
    if says is None:
        assert preflight(argv) == argv
        return
    with pytest.raises(SystemExit):
        preflight(argv)
    assert capsys.readouterr().err.strip() == f"error: 'variant={glob}'" + (
        f": {says}" if "matches" not in says else f" {says}; known variants: " + ", ".join(variants.builtin())
    )


def test_a_sweep_over_records_dir_is_refused_before_launch(capsys):
    """The sweep locked and checked ./outputs/records while its jobs wrote unlocked into a and b."""

    with pytest.raises(SystemExit):
        preflight(["run.py", "-m", "records_dir=/tmp/a,/tmp/b", "seq_len=64"])
    assert capsys.readouterr().err.strip() == (
        "error: records_dir=/tmp/a,/tmp/b: a sweep writes one records_dir, which it locks; run one sweep "
        "per folder"
    )
    argv = ["run.py", "-m", "records_dir=/tmp/a", "variant=sdpa", "seq_len=64"]
    assert preflight(argv) == argv


@pytest.mark.parametrize(
    "argv,says",
    [
        (["causal=yes"], "causal=yes: expected true or false"),
        (["-m", "causal=false,2"], "causal=2: expected true or false"),
        (["extra.tag=a"],
         "extra.tag=a: extra holds tags of your own; add one with a +: +extra.<tag>=<value>"),
        (["variant=sdpa,naive"],
         "variant=sdpa,naive: a comma list is a sweep; run it with -m "
         "(python run.py -m ... variant=sdpa,naive)"),
        (["-m", "+experiment=quick"],
         "+experiment=quick: experiment is a setting already; write experiment=quick"),
        (["-m", "variant=sdpa", "--cfg", "job"],
         "--cfg prints a config and runs nothing: drop -m (python run.py --cfg job ...)"),
    ],
)  # fmt: skip
def test_command_lines_hydra_answers_with_a_page_get_one_line(argv, says, capsys):

    with pytest.raises(SystemExit):
        preflight(["run.py", *argv])
    assert capsys.readouterr().err.strip() == f"error: {says}"


def test_booleans_and_tags_as_meant_pass_the_preflight():

    for argv in (
        ["run.py", "causal=True", "+extra.tag=a"],
        ["run.py", "-m", "causal=true,false", "seq_len=64"],
    ):
        assert preflight(argv) == argv


def test_a_second_sweep_into_a_busy_records_dir_is_refused_before_work(tmp_path):
    from experiments.records import records_lock

    records = tmp_path / "records"
    records.mkdir()
    # another sweep holds the folder: a real process, holding the real lock
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time; from pathlib import Path\n"
            "from experiments.records.records_lock import acquire\n"
            f"acquire(Path({str(records)!r}), Path('elsewhere')); print('held', flush=True); time.sleep(120)",
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        p = run_sweep(tmp_path, "variant=naive", *[f"{k}={v}" for k, v in SMALL.items()])
        assert p.returncode == 1
        (line,) = p.stderr.strip().splitlines()
        assert line.startswith(f"error: records_dir {records} is in use by another sweep (pid {holder.pid}")
        assert not list(records.glob("*.json"))
    finally:
        holder.kill()
        holder.wait()
    # once the holder is gone (however it ended) the folder is free: no stale lock
    p = run_sweep(tmp_path, "variant=naive", *[f"{k}={v}" for k, v in SMALL.items()])
    assert p.returncode == 0, p.stderr[-2000:]
    assert len(read_records(records)) == 1
    assert records_lock.LOCK_NAME not in [p.name for p in records.glob("*.json")]


@pytest.mark.parametrize(
    "kind, args",
    [("a file", ["-m", "variant=naive,sdpa"]), ("under a file", ["variant=naive"])],
    ids=["a file, a sweep", "under a file, a single run"],
)
def test_an_unusable_records_dir_is_one_line_before_any_measurement(tmp_path, kind, args):
    """A sweep checks its records_dir when it starts, a single run in its job: each path once, each
    with one of the two ways a folder is unusable (the check is one function, records_lock's)."""
    blocker = tmp_path / "blocker"
    blocker.write_text("not a folder")
    target = blocker if kind == "a file" else blocker / "records"
    cmd = [sys.executable, "run.py", *args, *[f"{k}={v}" for k, v in SMALL.items()]]
    cmd += [f"records_dir={target}", f"hydra.sweep.dir={tmp_path / 'sweep'}", f"hydra.run.dir={tmp_path}/run"]
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert p.returncode == 1
    (line,) = p.stderr.strip().splitlines()
    assert line.startswith(f"error: records_dir {target} ")
    assert "[naive" not in p.stdout  # nothing was measured


def test_a_hydra_output_folder_that_cannot_be_made_is_one_line_before_work(tmp_path, capsys):
    """Checked by run.py's preflight: the three cases in this process, the first also through run.py."""
    blocker = tmp_path / "blocker"
    blocker.write_text("not a folder")
    small = [f"{k}={v}" for k, v in SMALL.items()]
    cases = [
        (["-m", "variant=naive"], "hydra.sweep.dir", blocker / "sweep", "Not a directory"),
        (["variant=naive"], "hydra.run.dir", blocker / "run", "Not a directory"),
        (["-m", "variant=naive"], "hydra.sweep.dir", blocker, "it is a file, not a folder"),
    ]
    for i, (args, setting, target, why) in enumerate(cases):
        argv = ["run.py", *args, *small, f"records_dir={tmp_path / 'records'}", f"{setting}={target}"]
        with pytest.raises(SystemExit) as exit_:
            preflight(argv)
        assert exit_.value.code == 1 and capsys.readouterr().err.strip() == (
            f"error: {setting} {target} cannot be created: {why}"
        )
        if i == 0:
            p = subprocess.run([sys.executable, *argv], cwd=ROOT, capture_output=True, text=True, timeout=300)
            assert p.returncode == 1, p.stderr[-2000:]
            assert p.stderr.strip() == f"error: {setting} {target} cannot be created: {why}"
            assert "[naive" not in p.stdout  # nothing was measured
    # a folder that can be made is left for Hydra to make, as it was
    from experiments.sweep.preflight import check_output_dir

    check_output_dir([f"hydra.sweep.dir={tmp_path / 'a' / 'b'}"], multirun=True)
    assert not (tmp_path / "a").exists()
