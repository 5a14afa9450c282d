"""The configuration exists once: include/steptrace/config_options.def.

Fails when the struct / bindings / run_start dump (expanded from the table at build time),
the generated _core.pyi and docs/configuration.md, or the Python-only option tables
disagree with the table: names, order, defaults, documentation and the generic checks.
"""

import importlib.util
import json
import re
import sys
from pathlib import Path

import pytest

import steptrace
from steptrace import _core
from steptrace.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]


def _load_gen():
    spec = importlib.util.spec_from_file_location("gen_config", ROOT / "scripts" / "gen_config.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["gen_config"] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


gen = _load_gen()
OPTIONS = gen.parse_table()
CORE = [o for o in OPTIONS if o.core]
PYTHON = [o for o in OPTIONS if not o.core]


def _same(a, b):
    """Equal and of the same Python type (1 is not 1.0, True is not 1)."""
    return a == b and type(a) is type(b)


def test_table_parses_into_groups():
    assert len(CORE) >= 50 and len(PYTHON) >= 15
    assert {o.group for o in OPTIONS} <= set(gen.GROUPS)
    assert [o.name for o in CORE][:3] == ["log_dir", "overwrite", "run_id"]
    for o in OPTIONS:
        assert o.doc and "\n" not in o.doc, o.name


def test_generated_files_are_current():
    for path, text in gen.expected_files(OPTIONS).items():
        assert path.read_text(encoding="utf-8") == text, (
            f"{path.relative_to(ROOT)} disagrees with config_options.def; run python scripts/gen_config.py")


def test_pyi_lists_the_core_options_in_order():
    pyi = (ROOT / "python" / "steptrace" / "_core.pyi").read_text(encoding="utf-8")
    body = pyi[pyi.index("class Config:"):pyi.index("def __init__(self) -> None")]
    fields = re.findall(r"^    (\w+): (.+)$", body, re.M)
    assert fields == [(o.name, gen.PYI_TYPES[o.type]) for o in CORE]


def test_docs_list_every_option_with_its_default():
    docs = (ROOT / "docs" / "configuration.md").read_text(encoding="utf-8")
    rows = dict(re.findall(r"^\| `(\w+)` \| `(.*?)` \|", docs, re.M))
    assert list(rows) == [o.name for g in gen.GROUPS for o in OPTIONS if o.group == g]
    for o in OPTIONS:
        shown = rows[o.name]
        expected = None if shown == "None" else json.loads(shown.replace("True", "true").replace("False", "false"))
        assert expected == o.default, o.name


def test_core_config_has_the_table_fields_defaults_and_docs():
    config = _core.Config()
    attrs = [n for n in dir(_core.Config) if not n.startswith("_") and n != "validate"]
    assert sorted(attrs) == sorted(o.name for o in CORE)
    for o in CORE:
        assert _same(getattr(config, o.name), o.default), (o.name, getattr(config, o.name), o.default)
        assert _core.Config.__dict__[o.name].__doc__ == o.doc, o.name


def test_python_only_options_match_the_table():
    from steptrace import _options
    from steptrace.live import profiler
    from steptrace.cluster import CLUSTER_OPTIONS
    from steptrace.live.otlp import OTLP_OPTIONS

    assert list(_options.OPTION_GROUPS.items()) == [(o.name, o.group) for o in OPTIONS]
    for table in (_options.PYTHON_OPTIONS, profiler._PYTHON_OPTIONS):
        assert list(table) == [o.name for o in PYTHON]
        for o in PYTHON:
            assert _same(table[o.name], o.default), o.name
    # The option tables the cluster exchange and the OTLP exporter keep for themselves.
    for table in (CLUSTER_OPTIONS, OTLP_OPTIONS):
        for name, default in table.items():
            assert _same(default, _options.PYTHON_OPTIONS[name]), name
    assert sorted(CLUSTER_OPTIONS) == sorted(o.name for o in PYTHON if o.group == "cluster")
    assert sorted(profiler.ALLOWED_OPTIONS) == sorted(o.name for o in OPTIONS if o.name != "log_dir")


def test_run_start_dumps_every_core_option_in_table_order(tmp_path):
    with steptrace.Profiler(tmp_path / "run", handle_signals=False) as prof:
        with prof.step():
            pass
    run_start = json.loads((tmp_path / "run" / "rank0.jsonl").read_text().splitlines()[0])
    assert run_start["kind"] == "run_start"
    config = run_start["config"]
    dumped = [o for o in CORE if o.name not in gen.RUN_START_TOP_LEVEL]
    assert list(config) == [o.name for o in dumped]
    for o in dumped:
        if o.name in ("log_dir", "device_index", "job"):  # resolved at start (folder, device, label)
            continue
        assert _same(config[o.name], o.default), o.name
    assert config["log_dir"] == str(tmp_path / "run")
    for name in gen.RUN_START_TOP_LEVEL:
        assert name in run_start


def _bad_values(o):
    check = o.check
    m = re.fullmatch(r"range\(\s*(-?\d+)\s*,\s*(-?\d+)\s*\)", check)
    if m:
        lo, hi = int(m.group(1)), int(m.group(2))
        return [(lo - 1, f"{o.name}={lo - 1} is out of range; allowed: {lo}..{hi}"),
                (hi + 1, f"{o.name}={hi + 1} is out of range; allowed: {lo}..{hi}")]
    m = re.fullmatch(r"one_of\((.*)\)", check)
    if m:
        return [("bogus", f'{o.name}="bogus" is unknown; allowed: {m.group(1)}')]
    if check == "percent":
        return [(0.0, f"{o.name}=0 is out of range; allowed: above 0 and at most 100 (a percentage)"),
                (100.5, f"{o.name}=100.5 is out of range")]
    if check == "fraction":
        return [(0.0, f"{o.name}=0 is out of range; allowed: above 0, at most 1 (a fraction of the power limit)"),
                (1.5, f"{o.name}=1.5 is out of range")]
    if check == "positive":
        return [(0.0, f"{o.name}=0 is out of range; allowed: above 0"), (1e10, f"{o.name}=")]
    if check == "noise_floor":
        return [(-1.0, f"{o.name}=-1 is out of range; allowed: 0 or more (0 turns this part of the noise rule off)")]
    assert check == "none", f"{o.name}: unknown check {check!r}"
    return []


@pytest.mark.parametrize("option", [o for o in CORE if o.check != "none"], ids=lambda o: o.name)
def test_generic_checks_come_from_the_table(option):
    for value, message in _bad_values(option):
        config = _core.Config()
        config.log_dir = "unused"
        setattr(config, option.name, value)
        with pytest.raises(ConfigError) as info:
            config.validate()
        assert str(info.value).startswith(message), (str(info.value), message)
    config = _core.Config()
    config.log_dir = "unused"
    config.validate()  # the defaults pass
