"""driver.cel.source: token-level checks and rewrites that leave string literals alone."""

from __future__ import annotations

import pytest

from gpu_dra.driver.cel.source import (
    bare_device_path_type,
    capacity_literal_comparisons,
    default_unknown_domains,
    fold_literal_calls,
    native_comparisons,
    regex_literals,
    tokens,
    typed_device_fields,
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


@pytest.mark.parametrize(
    ("expression", "expected"),
    [
        ("a.b['c'].d.compareTo(quantity('1')) > 0", "<a.b['c'].d|compareTo|quantity|1> > 0"),
        ("!g.v.isLessThan(semver('1.0.0', true))", "!<g.v|isLessThan|semver|1.0.0>"),
        ('x[y[0]].isGreaterThan(quantity("2"))', "<x[y[0]]|isGreaterThan|quantity|2>"),
        ("f(x).compareTo(quantity('1'))", "f(x).compareTo(quantity('1'))"),
        ("a.f(x).compareTo(quantity('1'))", "a.f(x).compareTo(quantity('1'))"),
        ("x.?y.compareTo(quantity('1'))", "x.?y.compareTo(quantity('1'))"),
        ("a.compareTo(quantity(s))", "a.compareTo(quantity(s))"),
        ("a.compareTo(b)", "a.compareTo(b)"),
        ("a.sign(quantity('1'))", "a.sign(quantity('1'))"),
    ],
)
def test_native_comparisons_rewrite_only_plain_paths_against_literals(expression, expected):
    def rewrite(
        receiver: str, method: str, function: str, text: str, normalize: bool | None
    ) -> str:
        return f"<{receiver}|{method}|{function}|{text}>"

    assert native_comparisons(expression, rewrite) == expected


@pytest.mark.parametrize(
    ("expression", "found"),
    [
        ("device.capacity['d'].memory == 5", [("==", "int", 28)]),
        ("1.5 < device.capacity['d']['x'] && true", [("<", "double", 4)]),
        (
            "device.capacity['d'].x != 'a' || device.capacity['d'].y > 2u",
            [("!=", "string", 23), (">", "uint", 56)],
        ),
        ("device.capacity['d'].x == quantity('1')", []),
        ("device.capacity['d'].x.compareTo(quantity('1')) == 0", []),
        ("device.capacity['d'] == {}", []),
        ("device.attributes['d'].x == 5", []),
        ("'device.capacity[\"d\"].x == 5' == ''", []),
    ],
)
def test_capacity_literal_comparisons(expression, found):
    assert capacity_literal_comparisons(expression) == found


def test_regex_literals_are_the_string_arguments_of_matches():
    expression = "g.p.matches('[') && 'a'.matches(\"b\") && g.q.matches(g.r) && matches('x', 'y')"
    assert regex_literals(expression) == [("'['", 12), ('"b"', 32)]


@pytest.mark.parametrize(
    ("expression", "kind"),
    [
        ("device.driver", "string"),
        ("((device.driver))", "string"),
        ("device.capacity['d'].memory", "kubernetes.Quantity"),
        ("(device.capacity['d']['memory'])", "kubernetes.Quantity"),
        ("device.attributes['d'].x", None),
        ("device.allowMultipleAllocations", None),
        ("device.driver == 'x'", None),
        ("(device.driver) == (device.driver)", None),
        ("device.capacity['d']", None),
    ],
)
def test_bare_device_path_type(expression, kind):
    assert bare_device_path_type(expression) == kind


@pytest.mark.parametrize(
    ("expression", "expected"),
    [
        ("device.attributes['m'] >= 1", "device_attributes['m'] >= 1"),
        (
            "device.driver == 'a' && device.capacity['d'].m == quantity('1')",
            "device_driver == 'a' && device_capacity['d'].m == quantity('1')",
        ),
        ("device.allowMultipleAllocations", "device_allowMultipleAllocations"),
        # has() needs a field selection; strings, spaced dots and unknown fields stay
        ("has(device.driver) && 'device.driver' == x", None),
        ("device . driver == 'a'", None),
        ("device.vendor == 'a'", None),
        # a rebound device: renaming would change what the name means
        ("[1].all(device, device.driver == 1)", None),
        ("cel.bind(device, 1, device.driver)", None),
        ("'unterminated", None),
    ],
)
def test_typed_device_fields_renames_fields_in_place(expression, expected):
    renamed = typed_device_fields(expression)
    assert renamed == expected
    if renamed is not None:
        assert len(renamed) == len(expression)
