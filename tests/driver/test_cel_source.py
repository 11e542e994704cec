"""driver.cel.source: token-level checks and rewrites that leave string literals alone."""

from __future__ import annotations

import pytest

from gpu_dra.driver.cel.source import (
    default_unknown_domains,
    fold_literal_calls,
    tokens,
    undefined_device_fields,
)

DEFAULTED = ".orValue(dyn({}))"


@pytest.mark.parametrize(
    ("expression", "expected"),
    [
        ("device.attributes['a.io'].x", f"device.attributes[?'a.io']{DEFAULTED}.x"),
        ('device.capacity["a.io"].m', f'device.capacity[?"a.io"]{DEFAULTED}.m'),
        ("device . attributes [ k ] .x", f"device . attributes [? k ]{DEFAULTED} .x"),
        ("device.attributes[d[0]].x", f"device.attributes[?d[0]]{DEFAULTED}.x"),
        ("device.attributes.foo.x", f'device.attributes[?"foo"]{DEFAULTED}.x'),
        ("device.attributes[?'a'].orValue({})", "device.attributes[?'a'].orValue({})"),
        ("'a' in device.attributes", "'a' in device.attributes"),
        ("device.attributes.exists(d, d == 'x')", "device.attributes.exists(d, d == 'x')"),
        ("x.device.attributes['a']", "x.device.attributes['a']"),
        ("'device.attributes[\"a\"]' == s", "'device.attributes[\"a\"]' == s"),
        ("r'''device.attributes['a']''' == s", "r'''device.attributes['a']''' == s"),
        ("s == 'x' // device.attributes['a']", "s == 'x' // device.attributes['a']"),
    ],
)
def test_unknown_domain_rewrite(expression, expected):
    assert default_unknown_domains(expression) == expected


def test_unterminated_string_is_left_to_the_engine():
    assert default_unknown_domains("device.attributes['a") == "device.attributes['a"


def test_undefined_device_fields_reports_the_dot_position():
    assert undefined_device_fields("device.vendor == 'x' && device.driver == ''") == [("vendor", 6)]
    assert undefined_device_fields("'device.vendor' == x.device.vendor") == []


def test_tokens_handle_escapes_and_prefixes():
    texts = [t.text for t in tokens(r"""b"\"x" + R"a\" == '''it's''' // c""")]
    assert texts == [r'b"\"x"', "+", r'R"a\"', "==", "'''it's'''"]


def test_literal_calls_fold_only_plain_literals():
    def fold(name: str, text: str, normalize: bool | None) -> str:
        return f"<{name}:{text}:{normalize}>"

    expression = (
        "quantity('1') + semver(\"2\", true) + quantity('\\n') + x.quantity('3') + quantity(y)"
    )
    assert fold_literal_calls(expression, fold) == (
        "<quantity:1:None> + <semver:2:True> + quantity('\\n') + x.quantity('3') + quantity(y)"
    )
