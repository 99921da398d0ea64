"""The spec language, the frontend and classify: what each shipped spec is recognised as."""
import pytest

from qla_compiler.passes.classify import classify
from qla_compiler.passes.frontend import load_spec
from qla_compiler.specs import path

EXPECTED = {
    # spec: (inputs, decay, delta, write coefficient)
    "gdn": (("q", "k", "v", "g", "beta"), "gate", True, "beta"),
    "delta_net": (("q", "k", "v", "beta"), "none", True, "beta"),
    "simple_gla": (("q", "k", "v", "g"), "gate", False, "1"),
    "retnet": (("q", "k", "v"), "head_constant", False, "1"),
    "linear_attn": (("q", "k", "v"), "none", False, "1"),
    "gla": (("q", "k", "v", "g"), "key_gate", False, "1"),
    "kda": (("q", "k", "v", "g", "beta"), "key_gate", True, "beta"),
}


@pytest.mark.parametrize("name", EXPECTED)
def test_classify_shipped_specs(name):
    ir = classify(load_spec(path(name)))
    inputs, decay, delta, write = EXPECTED[name]
    assert ir.input_names == inputs
    st = ir.structure
    assert (st.decay, st.delta, str(st.write_coeff)) == (decay, delta, write)
    assert (st.write_key, st.write_value, st.query) == ("k", "v", "q")
    if delta:
        assert str(st.delta_coeff) == "beta"


@pytest.mark.parametrize("name", EXPECTED)
def test_specs_are_short(name):
    lines = [ln for ln in path(name).read_text().splitlines() if ln.strip()]
    assert len(lines) <= 15


def test_recurrence_prints_step_and_structure():
    text = str(classify(load_spec(path("gdn"))))
    assert "recurrence gdn" in text
    assert "exp(g)" in text and "beta·k·vᵀ" in text
    assert "A_t = exp(g)·(I − beta·k·kᵀ)" in text


def test_retnet_constants_follow_the_paper():
    ir = load_spec(path("retnet"))
    (gamma,) = ir.constants
    assert gamma.values(3) == [1 - 2 ** -5, 1 - 2 ** -6, 1 - 2 ** -7]


def test_recurrence_typesets_in_notebooks():
    html = classify(load_spec(path("gdn")))._repr_html_()
    assert html.startswith("<pre>recurrence gdn")
    assert "$$ S_t = " in html and "S_{t-1}" in html and "e^{g}" in html and "S_{t}^{T} q" in html
