"""The one YAML reader behind config, upcycle config, thresholds and shadow configs."""

import pytest

from kite.errors import BadInput
from kite.yaml_model import parse_yaml


def test_lines_floats_and_lists(tmp_path):
    data, lines = parse_yaml(tmp_path / "x.yaml", "a:\n  rate: 1e-3\n  items:\n    - 1\n    - b: 2\n")
    assert data == {"a": {"rate": 0.001, "items": [1, {"b": 2}]}}  # 1e-3 is a float (YAML 1.2)
    assert lines == {"a": 1, "a.rate": 2, "a.items": 3, "a.items.0": 4, "a.items.1": 5, "a.items.1.b": 5}


def test_a_key_set_twice_names_both_lines(tmp_path):
    with pytest.raises(BadInput, match=r"x.yaml:3:3: a.k is set twice \(first on line 2\)"):
        parse_yaml(tmp_path / "x.yaml", "a:\n  k: 1\n  k: 2\n")
    # the same key in two list items is not a duplicate
    parse_yaml(tmp_path / "x.yaml", "rules:\n  - name: a\n  - name: b\n")


def test_syntax_error_has_line_and_column(tmp_path):
    with pytest.raises(BadInput, match=r"x.yaml:2:\d+: YAML syntax error"):
        parse_yaml(tmp_path / "x.yaml", "a: [1,\nb: }\n")
