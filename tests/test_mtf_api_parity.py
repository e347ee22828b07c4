"""tools/mtf_api_parity.py: the coverage it computes is consistent, meets 95% where reached, and its
signature rule is right on small examples."""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("mtf_api_parity", ROOT / "tools" / "mtf_api_parity.py")
parity = importlib.util.module_from_spec(spec)
spec.loader.exec_module(parity)

#: every module must reach the issue's 95% (mtf.layers reached it when the meshtorch.transformer work added
#: the attention masks, weights_nonzero and embedding)
AT_TARGET = ["mtf", "mtf.layers", "mtf.optimize", "mtf.beam_search"]


@pytest.fixture(scope="module")
def report():
    return parity.compare()


def test_report_is_consistent_with_the_data(report):
    api = parity.load_api()
    for module, r in report.items():
        names = api["modules"][module]
        excluded = {n for n, e in names.items() if "excluded" in e}
        assert set(r["excluded"]) == excluded
        assert set(r["present_names"]) | set(r["missing"]) == set(names) - excluded
        assert not set(r["present_names"]) & set(r["missing"])
        assert r["total"] == len(names) - len(excluded) and r["present"] == len(r["present_names"])
        assert all(why for why in r["missing"].values()) and all(why for why in r["excluded"].values())


@pytest.mark.parametrize("module", AT_TARGET)
def test_coverage_reaches_95_percent(report, module):
    assert report[module]["coverage"] >= 0.95, report[module]["missing"]


def test_data_was_generated_from_mesh_tensorflow_0_1_21():
    api = parity.load_api()
    assert api["version"] == "0.1.21" and set(api["modules"]) == {"mtf", "mtf.layers", "mtf.optimize",
                                                                   "mtf.beam_search"}
    einsum = api["modules"]["mtf"]["einsum"]["params"]
    assert [p["name"] for p in einsum] == ["xs", "output_shape", "reduced_dims", "name"]
    assert api["modules"]["mtf"]["pow"]["alias_of"] == "mtf_pow"


def _f_ok(x1, x2, output_shape=None, name=None, extra=3):
    return x1


def _f_renamed(x, y, output_shape=None, name=None):
    return x


def _f_default(x1, x2, output_shape=1.0, name=None):
    return x1


def _f_required_extra(x1, x2, output_shape=None, name=None, more=None, *, must):
    return x1


PARAMS = [{"name": "x1", "kind": "positional"}, {"name": "x2", "kind": "positional"},
          {"name": "output_shape", "kind": "positional", "default": "None"},
          {"name": "name", "kind": "positional", "default": "'add'"}]


def test_signature_rule():
    assert parity.signature_problems(_f_ok, PARAMS) == []
    assert any("x1" in p for p in parity.signature_problems(_f_renamed, PARAMS))
    assert any("defaults to 1.0" in p for p in parity.signature_problems(_f_default, PARAMS))
    assert any("must" in p for p in parity.signature_problems(_f_required_extra, PARAMS))
    assert parity.signature_problems(_f_ok, PARAMS + [{"name": "kw", "kind": "var_keyword"}]) == []
    assert parity.signature_problems(_f_ok, [{"name": "a", "kind": "var_positional"}]) != []


def test_cli_prints_coverage_per_module(capsys):
    # --json through the tool's main in this process (one interpreter start fewer), the text report as a command
    assert parity.main(["--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert set(data) == {"mtf", "mtf.layers", "mtf.optimize", "mtf.beam_search"}
    text = subprocess.run([sys.executable, str(ROOT / "tools" / "mtf_api_parity.py")], capture_output=True,
                          text=True, check=True).stdout
    assert text.splitlines()[0].startswith("mtf: ")
